"""The paper's Fig. 1 as a table: the parameters that minimize FedProxVR's training-time bound.

Problem (23) of Dinh et al. (Sec. 4.3), solved by ``fl_lightning.functional.fedproxvr_theory.optimal_parameters``
for L = 1, lam = 0.5 (the paper's Fig. 1 setting) and a few dissimilarities sigma_bar^2.

    python -m experiments.fedproxvr.theory
"""

from __future__ import annotations

from fl_lightning.functional.fedproxvr_theory import optimal_parameters, sarah_steps_upper_bound, svrg_steps_upper_bound


def main() -> None:
    print("| sigma2 | gamma | beta* | mu* | tau* | theta* | Theta* |")
    print("|---|---|---|---|---|---|---|")
    for sigma2 in (0.0, 1.0, 4.0):
        for gamma in (1e-4, 1e-3, 1e-2, 1e-1, 1.0):
            s = optimal_parameters(gamma, sigma2=sigma2)
            print(f"| {sigma2:g} | {gamma:g} | {s.beta:.1f} | {s.mu:.1f} | {s.tau:.0f} | {s.theta:.3f} | {s.rate:.4f} |")
    print("\nLemma 1 upper bounds on tau at the experiments' beta:\n")
    print("| beta | SARAH | SVRG (tau = 10) | SVRG (tau = 20) |")
    print("|---|---|---|---|")
    for beta in (5, 7, 9, 10, 20):
        print(f"| {beta} | {sarah_steps_upper_bound(beta):.1f} | {svrg_steps_upper_bound(beta, 10):.2f} | "
              f"{svrg_steps_upper_bound(beta, 20):.2f} |")


if __name__ == "__main__":
    main()
