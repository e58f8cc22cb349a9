"""One vectorized local step of a block of clients, two ways to get the block's gradients.

``vmap(grad(loss))`` is what the batched backend does (the gradient transform inside ``vmap``,
so that ``client_step`` runs as one client's function); ``autograd.grad`` of the summed
vmapped loss gets the same per-client gradients (each client's loss depends on its own
parameters only) with one transform fewer, but needs the step split around the gradient. The
clients are the quickstart's (logistic regression 60 -> 10, batch 10), 30 to a block.

    python benchmarks/grad_transforms.py [--clients 30] [--threads 2] [--steps 400]
"""

from __future__ import annotations

import argparse
import time
from typing import Callable

import torch
import torch.nn.functional as F
from torch.func import functional_call, grad, stack_module_state, vmap

Params = dict[str, torch.Tensor]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=30)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=400)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    params, _ = stack_module_state([torch.nn.Linear(60, 10) for _ in range(args.clients)])
    shell = torch.nn.Linear(60, 10).to("meta")
    x, y = torch.randn(args.clients, 10, 60), torch.randint(0, 10, (args.clients, 10))

    def loss(p: Params, xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(functional_call(shell, p, (xb,)), yb)

    per_client_grad = vmap(grad(loss))

    def grad_in_vmap(p: Params) -> Params:
        g = per_client_grad(p, x, y)
        return {n: p[n] - 0.1 * g[n] for n in p}

    def autograd_outside(p: Params) -> Params:
        leaves = {n: t.detach().requires_grad_() for n, t in p.items()}
        grads = torch.autograd.grad(vmap(loss)(leaves, x, y).sum(), list(leaves.values()))
        with torch.no_grad():
            return {n: t - 0.1 * g for (n, t), g in zip(leaves.items(), grads)}

    a, b = grad_in_vmap(params), autograd_outside(params)
    print(f"{args.clients} clients, {args.threads} threads; largest difference of the two steps: "
          f"{max((a[n] - b[n]).abs().max().item() for n in a):.1e}")

    def ms_per_step(step: Callable[[Params], Params]) -> float:
        p = params
        for _ in range(20):
            p = step(p)
        start = time.perf_counter()
        for _ in range(args.steps):
            p = step(p)
        return (time.perf_counter() - start) / args.steps * 1e3

    for _ in range(3):  # interleaved, so that the machine's load touches both alike
        inside, outside = ms_per_step(grad_in_vmap), ms_per_step(autograd_outside)
        print(f"  vmap(grad(loss)) {inside:.3f} ms/step   autograd.grad outside vmap {outside:.3f} ms/step"
              f"   ratio {inside / outside:.2f}")


if __name__ == "__main__":
    main()
