"""The mathematics of federated learning as pure functions, tested without Lightning."""
