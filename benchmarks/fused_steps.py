"""What one compiled call of K local steps would cost: compile time and time per step.

The bare batched step of a workload of ``benchmarks/frameworks.py`` (its clients' parameters stacked,
one ``vmap(grad(loss))`` with plain SGD, each client's batch gathered from the pool by index: the
"limit" path, no engine), with K steps unrolled in one ``torch.compile``-d call, for each K asked
for. It prints, per K, the one-off compile time and the best time per step over ``--repeats`` runs of
a round's steps in calls of K: how much of a compiled step is the call (Dynamo's guards, AOT
autograd's wrappers) rather than its kernels, and what unrolling would cost in compile time.

    python benchmarks/fused_steps.py --workload a --steps-per-call 1 4 10 19 [--threads 1] [--out fused.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import frameworks  # noqa: E402  (the workloads)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default="a", choices=list(frameworks.WORKLOADS))
    parser.add_argument("--steps-per-call", type=int, nargs="+", default=[1, 4, 10], help="the K to measure")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads")
    parser.add_argument("--repeats", type=int, default=5, help="runs of a round's steps per K (the best counts)")
    parser.add_argument("--mnist", default="../shared/data", help="MNIST root (random data of its shape if absent)")
    parser.add_argument("--out", default=None, help="JSON file for the results")
    args = parser.parse_args()
    if any(k < 1 for k in args.steps_per_call):
        parser.error(f"--steps-per-call must be positive, got {args.steps_per_call}")
    os.environ[frameworks.MNIST_ENV] = os.path.abspath(args.mnist)
    torch.set_num_threads(args.threads)
    w = frameworks.WORKLOADS[args.workload]
    dm = w.datamodule()
    dm.setup("fit")
    torch.manual_seed(0)
    model = w.client()
    names = [name for name, _ in model.named_parameters()]
    start = [p.detach().expand(w.clients_per_round, *p.shape).clone() for p in model.parameters()]
    x_all, y_all = dm.pool.tensors
    steps = max(w.local_steps, max(args.steps_per_call))
    table = torch.randint(0, len(y_all), (steps, w.clients_per_round, dm.batch_size))  # the cost is the draws'

    def loss(params: list[torch.Tensor], index: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(torch.func.functional_call(model, dict(zip(names, params)), (x_all[index],)),
                               y_all[index])

    gradients = torch.func.vmap(torch.func.grad(loss))

    def local_steps(params: list[torch.Tensor], index: torch.Tensor) -> list[torch.Tensor]:
        for k in range(index.shape[0]):  # unrolled by Dynamo: K steps, one graph
            params = [p - model.lr * g for p, g in zip(params, gradients(params, index[k]))]
        return params

    results = {}
    for k in args.steps_per_call:
        torch._dynamo.reset()
        call = torch.compile(local_steps)
        began = time.perf_counter()
        call(start, table[:k])
        compile_seconds = time.perf_counter() - began
        calls = max(1, steps // k)
        best = float("inf")
        for _ in range(args.repeats):
            began = time.perf_counter()
            params = start
            for c in range(calls):
                params = call(params, table[c * k:(c + 1) * k])
            best = min(best, (time.perf_counter() - began) / (calls * k))
        results[k] = {"compile_seconds": compile_seconds, "seconds_per_step": best}
        print(f"{args.workload}, {k:3d} steps a call: compile {compile_seconds:6.1f} s, {best * 1e3:7.3f} ms a step",
              flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"workload": args.workload, "threads": args.threads, "torch": torch.__version__,
                       "steps_per_call": results}, f, indent=1)


if __name__ == "__main__":
    main()
