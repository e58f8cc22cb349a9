"""The reference CNNs' local step with ``fl_lightning.models.pooling.MaxPool2d`` against ``nn.MaxPool2d``.

First the 2x2 max-pool layer alone, forward and backward, on feature maps of several widths,
through PyTorch's NCHW kernel and through the channels-last one (what sets the module's
thresholds for taking the latter). Then, for each model (the papers' CNNs, 1x28x28 inputs): one
SGD step (forward, backward, update) of one client, and one vectorized step of ``--clients``
clients (``vmap`` of ``grad``, the batched backend's step), each timed with both max-pools,
interleaved in one process, best of ``--repeats``; and whether the two give bitwise the same
gradients.

    python benchmarks/pooling.py [--batch 32] [--clients 10] [--threads 1] [--clock cpu]

Prints microseconds per layer call, ms per step and the speed-ups (nn.MaxPool2d / fl_lightning's).
"""

from __future__ import annotations

import argparse
import time
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap

from fl_lightning.models import CNN, FedProxVRCNN, LeNet
from fl_lightning.models.pooling import MaxPool2d, _ChannelsLastMaxPool

MODELS: dict[str, Callable[[], nn.Module]] = {
    "FedProxVR's CNN (conv 32-64, 5x5 same)": FedProxVRCNN,
    "FedDeper's MNIST CNN (conv 32-64, 3x3 same)": CNN,
    "PeFLL's LeNet (conv 16-32)": lambda: LeNet(conv_channels=(16, 32), hidden=(120, 84)),
    "RAGA's LeNet (conv 6-16)": LeNet,
}


def swap_pools(module: nn.Module, cls: type) -> None:
    """Replace every max-pool of ``module`` by ``cls`` with the same arguments, in place."""
    for name, child in module.named_children():
        if isinstance(child, nn.MaxPool2d):
            setattr(module, name, cls(child.kernel_size, child.stride, child.padding, child.dilation,
                                      child.return_indices, child.ceil_mode))
        else:
            swap_pools(child, cls)


#: the clock steps are timed with: ``time.perf_counter`` (wall) or ``time.thread_time`` (the main
#: thread's CPU time, which other processes on the machine disturb less; for one thread only)
CLOCK: Callable[[], float] = time.perf_counter


def best_ms(fn: Callable[[], object], repeats: int, number: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = CLOCK()
        for _ in range(number):
            fn()
        times.append((CLOCK() - start) / number)
    return min(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--number", type=int, default=10)
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="wall clock, or the main thread's CPU time (with --threads 1)")
    args = parser.parse_args()
    global CLOCK
    CLOCK = time.thread_time if args.clock == "cpu" else time.perf_counter
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.clients, args.batch, 1, 28, 28, generator=g)
    y = torch.randint(0, 10, (args.clients, args.batch), generator=g)
    print(f"the 2x2 max-pool, forward and backward, batch {args.batch}: microseconds, NCHW kernel / channels-last "
          f"path = speed-up ({args.clock} clock)")
    for channels in (6, 16, 32, 64):
        cells = []
        for side in (8, 14, 28):
            h = torch.randn(args.batch, channels, side, side, generator=g).relu().requires_grad_()
            out = torch.randn(args.batch, channels, side // 2, side // 2, generator=g)
            nchw = best_ms(lambda: F.max_pool2d(h, 2).backward(out), args.repeats, 10 * args.number)
            last = best_ms(lambda: _ChannelsLastMaxPool.apply(h, (2, 2), (2, 2))[0].backward(out), args.repeats,
                           10 * args.number)
            cells.append(f"{side}x{side}: {nchw * 1e3:6.0f} / {last * 1e3:6.0f} = {nchw / last:.2f}x")
        print(f"  {channels:2d} channels   " + "   ".join(cells))
    print(f"batch {args.batch}, {args.clients} clients vectorized, {args.threads} thread(s), best of {args.repeats}"
          f" x {args.number} steps, {args.clock} clock; ms per step (nn.MaxPool2d / fl_lightning's = speed-up)")
    for name, make in MODELS.items():
        torch.manual_seed(0)
        model = make()
        params = {k: v.detach() for k, v in model.named_parameters()}
        stacked = {k: v.expand(args.clients, *v.shape).clone() for k, v in params.items()}

        def loss(p: dict, xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(functional_call(model, p, (xb,)), yb)

        def one_step() -> None:
            model.zero_grad()
            loss(dict(model.named_parameters()), x[0], y[0]).backward()
            with torch.no_grad():
                for p in model.parameters():
                    p.sub_(p.grad, alpha=1e-9)  # SGD's update; a rate that keeps the weights as they are

        def vmapped_step() -> dict:
            return vmap(grad(loss))(stacked, x, y)

        grads, row = {}, []
        for cls in (nn.MaxPool2d, MaxPool2d):
            swap_pools(model, cls)
            grads[cls] = vmapped_step()
        same = all(torch.equal(grads[nn.MaxPool2d][k], grads[MaxPool2d][k]) for k in params)
        for step in (one_step, vmapped_step):
            ms = {}
            for _ in range(2):  # interleaved: native, fl_lightning's, native, fl_lightning's
                for cls in (nn.MaxPool2d, MaxPool2d):
                    swap_pools(model, cls)
                    ms[cls] = min(ms.get(cls, float("inf")), best_ms(step, args.repeats, args.number))
            row.append(f"{ms[nn.MaxPool2d]:7.2f} / {ms[MaxPool2d]:7.2f} = {ms[nn.MaxPool2d] / ms[MaxPool2d]:.2f}x")
        print(f"{name:<45} one client: {row[0]}; {args.clients} clients vmapped: {row[1]}; "
              f"gradients bitwise equal: {same}")


if __name__ == "__main__":
    main()
