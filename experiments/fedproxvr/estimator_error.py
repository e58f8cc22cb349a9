"""Why SARAH falls behind in Fig. 3 as ``tau`` grows: its estimator's error along one client's local
steps, against SVRG's (``docs/results/fedproxvr.md``, section 7).

    python -m experiments.fedproxvr.estimator_error --out docs/results/fedproxvr_estimator_error.json
    python -m experiments.fedproxvr.estimator_error --aggregate --warmup 10 --out docs/results/fedproxvr_estimator_error.json
    python -m experiments.fedproxvr.estimator_error --aggregate --trajectory sarah --warm-setting beta7_tau40 \
        --settings beta7_tau40 --warmup 10 --seed 1 --out docs/results/fedproxvr_estimator_error.json
    python -m experiments.fedproxvr.estimator_error --table docs/results/fedproxvr_estimator_error.json

The global model is trained ``--warmup`` rounds of FedAvg in Fig. 3's first setting (its ``fig3`` run,
all clients, the engine; one measurement per number of rounds given). From it, client ``--client`` (default: the one of median size) runs one
round of FedProxVR's local steps for each setting of Fig. 3 (``tau``, step size ``eta``) and each
estimator, on the same batches, as the algorithm does (``w_1 = prox(w_0 - eta grad F_n(w_0))``, then
``tau`` steps ``w_{t+1} = prox(w_t - eta v_t)``), and measures at every step ``t`` against the exact local
gradient ``grad F_n(w_t)`` (a full pass over the client's training split):

* ``error``: the estimator's relative error ``||v_t - grad F_n(w_t)|| / ||grad F_n(w_t)||``;
* ``minibatch_error``: the plain minibatch gradient's, ``||g_I(w_t) - grad F_n(w_t)|| / ||grad F_n(w_t)||``
  (what the estimator corrects: variance reduction works where ``error`` is below it);
* ``loss``: the local loss ``F_n(w_t)``;
* ``drift``: ``||w_t - w_0||``, how far the client has moved from the global model;
* ``smoothness``: ``||g_I(w_t) - g_I(w_{t-1})|| / ||w_t - w_{t-1}||`` on the step's batch ``I``, what
  SARAH's recursion adds its error from; its largest value is a lower bound of the per-sample
  smoothness ``L`` of Lemma 1, so ``1 / (eta L)`` from it is an upper bound of the step-size parameter
  ``beta`` and Lemma 1's bound on SARAH's ``tau`` at that ``beta`` (eq. 13) an upper bound of the ``tau``
  the analysis covers.

``--aggregate`` measures the federation's round instead: every client's round from one global model,
for FedAvg, SVRG and SARAH, and the loss at the mean of the models sent (:func:`aggregate`); the global
model is FedAvg's after ``--warmup`` rounds, or (``--trajectory``) SVRG's or SARAH's, each in its own
``fig3`` run: whether a method's round gains less than the others' along its own trajectory too.

Pure measurement: nothing here changes how FedProxVR trains.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.func import functional_call, grad_and_value

from experiments.fedproxvr.plan import FIG2, RESULTS, runs as plan_runs
from experiments.results import commit, environment
from experiments.sweep import in_process_cli
from fl_lightning.functional.fedproxvr_theory import sarah_steps_upper_bound
from fl_lightning.functional.norms import joint_norm
from fl_lightning.functional.prox import prox_step
from fl_lightning.functional.variance_reduction import full_gradient, sarah_direction, svrg_direction

ESTIMATORS = ("svrg", "sarah")
#: the setting whose run trains the global model unless another is named (Fig. 3's first)
FIRST_SETTING = next(iter(FIG2))
#: the result file beside the document's
RESULT = RESULTS.parent / "fedproxvr_estimator_error.json"
#: the warm-up run's overrides: quiet, and on the CPU, where the measurements run (and which they record)
QUIET = ["--trainer.accelerator", "cpu", "--trainer.logger", "false", "--trainer.enable_progress_bar", "false",
         "--trainer.enable_checkpointing", "false", "--trainer.enable_model_summary", "false",
         "--data.init_args.print_summary", "false", "--trainer.limit_val_batches", "0"]

Params = dict[str, Tensor]


def norm(tensors: Sequence[Tensor]) -> float:
    """The joint Euclidean norm of ``tensors``, in float64, as a number."""
    return float(joint_norm([t.double() for t in tensors]))


def local_round(loss_grad: Callable[[Params, Any], tuple[Tensor, Params]], batches: Sequence[Any],
                chunks: Sequence[tuple[Any, int]], start: Params, estimator: str, eta: float, mu: float,
                measure: bool = True) -> tuple[dict[str, list[float]], Params]:
    """One client's round from ``start`` over ``batches`` (its ``tau`` minibatches): FedProxVR's with
    ``estimator`` ``"svrg"`` or ``"sarah"``, FedAvg's plain SGD steps with ``"sgd"`` (no full-gradient
    step; ``mu`` = 0 for FedAvg). With ``measure`` every iterate ``w_1..w_tau`` is measured against the
    full gradient over ``chunks`` (see the module's docstring). Returns the measurements and the model
    the client sends (the last iterate)."""
    names = list(start)

    def exact(params: Params) -> tuple[float, list[Tensor]]:
        losses: list[tuple[float, int]] = []

        def grad_fn(batch: Any) -> list[Tensor]:
            loss, grads = loss_grad(params, batch)
            losses.append((float(loss), len(batch[-1])))
            return [grads[n] for n in names]

        gradient = full_gradient(grad_fn, chunks)
        return sum(value * size for value, size in losses) / sum(size for _, size in losses), gradient

    def step(params: Params, direction: Sequence[Tensor]) -> Params:
        return {n: prox_step(params[n] - eta * v, start[n], eta, mu) for n, v in zip(names, direction)}

    if estimator == "sgd" and measure:
        raise ValueError("the plain SGD round (estimator 'sgd') is not measured: it has no estimator")
    out: dict[str, list[float]] = {"error": [], "minibatch_error": [], "loss": [], "drift": [], "smoothness": []}
    previous = params = start
    if estimator != "sgd":
        _, direction = exact(start)  # v_0 = grad F_n(w_0)
        anchor_direction = direction
        params = step(start, direction)
    for batch in batches:
        grads = loss_grad(params, batch)[1]
        g = [grads[n] for n in names]
        if estimator == "sarah" or measure:
            g_previous = loss_grad(previous, batch)[1]
        if estimator == "sgd":
            direction = g
        elif estimator == "svrg":
            g_start = loss_grad(start, batch)[1]
            direction = [svrg_direction(a, g_start[n], v) for a, n, v in zip(g, names, anchor_direction)]
        else:
            direction = [sarah_direction(a, g_previous[n], v) for a, n, v in zip(g, names, direction)]
        if measure:
            loss, true_gradient = exact(params)
            out["error"].append(norm([v - t for v, t in zip(direction, true_gradient)]) / norm(true_gradient))
            out["minibatch_error"].append(norm([a - t for a, t in zip(g, true_gradient)]) / norm(true_gradient))
            out["loss"].append(loss)
            out["drift"].append(norm([params[n] - start[n] for n in names]))
            out["smoothness"].append(norm([a - g_previous[n] for a, n in zip(g, names)])
                                     / norm([params[n] - previous[n] for n in names]))
        previous, params = params, step(params, direction)
    return out, params


def aggregate(warmup: int, seed: int = 0, trajectory: str = "fedavg", warm_setting: Optional[str] = None,
              settings: Optional[Sequence[str]] = None, code: Optional[str] = None) -> dict[str, Any]:
    """Every client's round from the same global model, for FedAvg (``"sgd"``), SVRG and SARAH in each of
    ``settings`` of Fig. 3 (default: all), and the sample-weighted mean of the models sent, as the server
    takes it: the pooled training loss at that mean (``global_loss``), the clients' sample-weighted mean
    loss at their own models (``local_loss``) and distance from the global model (``drift``). The global
    model is ``trajectory``'s (``fedavg``, ``svrg``, ``sarah``) after ``warmup`` rounds of its ``fig3`` run
    in ``warm_setting`` (default: the first): a method's own trajectory where it is the one measured.
    One entry of the result file's ``aggregates``, with ``code``: the commit the process imported (default:
    the checkout's now), the device (the CPU) and the process's environment."""
    code = code or commit()
    plan = plan_by_name()
    warm_setting = warm_setting or FIRST_SETTING
    net, start, data, loss_grad = warm_start(warmup, seed, trajectory, warm_setting)
    splits = [data.client_data(c) for c in range(data.num_clients)]
    chunks = [[(batch, len(batch[-1])) for batch in split.epoch_batches(1, batch_size=1000)] for split in splits]
    total = sum(len(split) for split in splits)
    weights = [len(split) / total for split in splits]

    @torch.no_grad()
    def loss_on(params: Params, client_chunks: Sequence[tuple[Any, int]]) -> float:
        total = sum(float(F.cross_entropy(functional_call(net, params, (x,)), y, reduction="sum")) for (x, y), _ in client_chunks)
        return total / sum(size for _, size in client_chunks)

    out: dict[str, Any] = {"warmup_rounds": warmup, "seed": seed, "trajectory": trajectory, "warm_setting": warm_setting,
                           "commit": code, "device": "cpu", "env": environment(),
                           "start_loss": sum(w * loss_on(start, c) for w, c in zip(weights, chunks)), "settings": {}}
    for setting in settings or FIG2:
        beta, tau, eta = FIG2[setting]
        mu = cli_mu(plan[f"fig3/{setting}/sarah_s{seed}"].args)
        rows = {}
        for estimator in ("sgd", *ESTIMATORS):
            sent = [local_round(loss_grad, list(split.step_batches(tau, torch.Generator().manual_seed(seed + c))), chunks[c],
                                start, estimator, eta, 0.0 if estimator == "sgd" else mu, measure=False)[1]
                    for c, split in enumerate(splits)]
            mean = {n: sum(w * m[n] for w, m in zip(weights, sent)) for n in start}
            rows[estimator] = {
                "global_loss": sum(w * loss_on(mean, c) for w, c in zip(weights, chunks)),
                "local_loss": sum(w * loss_on(m, c) for w, m, c in zip(weights, sent, chunks)),
                "drift": sum(w * norm([m[n] - start[n] for n in start]) for w, m in zip(weights, sent))}
        out["settings"][setting] = {"beta": beta, "tau": tau, "eta": eta, "mu": mu, **rows}
        print(f"{setting}: " + ", ".join(f"{e} global {r['global_loss']:.4f} local {r['local_loss']:.4f} "
                                         f"drift {r['drift']:.3f}" for e, r in rows.items()), flush=True)
    return out


#: the rounds' labels in the tables: estimator -> the method it is the round of
LABELS = {"sgd": "FedAvg", "fedavg": "FedAvg", "svrg": "SVRG", "sarah": "SARAH"}


def aggregate_key(entry: dict[str, Any]) -> tuple[Any, ...]:
    """What an :func:`aggregate` entry measured: its start (the trajectory, its setting, the rounds), its seed and
    its settings (entries before ``trajectory`` was recorded started from FedAvg in the first setting)."""
    return (entry.get("trajectory", "fedavg"), entry.get("warm_setting", FIRST_SETTING), entry["warmup_rounds"],
            entry["seed"], tuple(entry["settings"]))


def aggregate_table(result: dict[str, Any]) -> str:
    """The document's table of :func:`aggregate`'s entries."""
    lines = ["| global model: rounds of (setting), seed | setting | round | pooled training loss at the mean of the models "
             "sent | clients' loss at their own models | drift from the global model |", "|---|---|---|---|---|---|"]
    for a in result.get("aggregates", []):
        trajectory, warm_setting, warmup, seed, _ = aggregate_key(a)
        start = f"{warmup} of {LABELS[trajectory]} ({warm_setting}), {seed}"
        for s in a["settings"].values():
            for estimator in ("sgd", *ESTIMATORS):
                r = s[estimator]
                lines.append(f"| {start} | beta {s['beta']}, tau {s['tau']}, eta {s['eta']} | {LABELS[estimator]} | "
                             f"{a['start_loss']:.4f} -> {r['global_loss']:.4f} | {r['local_loss']:.4f} | {r['drift']:.3f} |")
    return "\n".join(lines)


def warm_start(warmup: int, seed: int, trajectory: str = "fedavg", setting: Optional[str] = None
               ) -> tuple[Any, Params, Any, Callable[[Params, Any], tuple[Tensor, Params]]]:
    """The global model after ``warmup`` rounds of ``trajectory``'s ``fig3`` run in ``setting`` (default:
    Fig. 3's first): its network, its parameters, the federation and the loss's value and gradient at
    given parameters on a batch."""
    warm = plan_by_name()[f"fig3/{setting or FIRST_SETTING}/{trajectory}_s{seed}"]
    cli = in_process_cli([*warm.args, *QUIET, "--trainer.max_epochs", str(warmup),
                          "--trainer.default_root_dir", "runs/fedproxvr/estimator_error"])
    if warmup > 0:
        cli.trainer.fit(cli.model, cli.datamodule)
    else:
        cli.datamodule.setup("fit")
    net = cli.model.client.eval()  # the CNN has no Dropout or BatchNorm: eval and train mode agree
    start = {n: p.detach().clone() for n, p in net.named_parameters()}

    def loss_grad(params: Params, batch: Any) -> tuple[Tensor, Params]:
        x, y = batch
        grads, loss = grad_and_value(lambda p: F.cross_entropy(functional_call(net, p, (x,)), y))(params)
        return loss, grads

    return net, start, cli.datamodule, loss_grad


def plan_by_name() -> dict[str, Any]:
    """The FedProxVR plan's runs by name."""
    return {run.name: run for run in plan_runs()}


def measure(warmup: int, client: Optional[int] = None, seed: int = 0) -> dict[str, Any]:
    """The module docstring's measurements after ``warmup`` rounds, one entry of the result file's
    ``measurements``."""
    plan = plan_by_name()
    net, start, data, loss_grad = warm_start(warmup, seed)
    if client is None:
        sizes = sorted((data.num_samples(c), c) for c in range(data.num_clients))
        client = sizes[len(sizes) // 2][1]
    split = data.client_data(client)
    chunks = [(batch, len(batch[-1])) for batch in split.epoch_batches(1, batch_size=1000)]

    settings = {}
    for setting, (beta, tau, eta) in FIG2.items():
        sarah = plan[f"fig3/{setting}/sarah_s{seed}"]
        mu = cli_mu(sarah.args)
        batches = list(split.step_batches(tau, torch.Generator().manual_seed(seed)))
        curves = {estimator: local_round(loss_grad, batches, chunks, start, estimator, eta, mu)[0] for estimator in ESTIMATORS}
        smoothness = max(max(c["smoothness"]) for c in curves.values())
        beta_bound = 1.0 / (eta * smoothness)
        settings[setting] = {"beta": beta, "tau": tau, "eta": eta, "mu": mu, **curves,
                             "max_smoothness": smoothness, "beta_at_most": beta_bound,
                             "sarah_tau_bound_at_most": sarah_steps_upper_bound(beta_bound)}
        print(f"{setting}: L >= {smoothness:.1f}, beta <= {beta_bound:.2f}, Lemma 1's tau bound <= "
              f"{sarah_steps_upper_bound(beta_bound):.1f} (tau = {tau}); error at the last step: "
              + ", ".join(f"{e} {curves[e]['error'][-1]:.3f}" for e in ESTIMATORS), flush=True)
    return {"warmup_rounds": warmup, "seed": seed, "client": client,
            "client_train_samples": len(split), "batch_size": split.step_batch_size, "settings": settings}


def cli_mu(args: Sequence[str]) -> float:
    """``mu`` of a FedProxVR run (its configs and overrides)."""
    cli = in_process_cli([*args, *QUIET, "--trainer.max_epochs", "0"])
    return float(cli.model.mu)


def table(result: dict[str, Any]) -> str:
    """The document's table: per warm-up, setting and estimator, the relative error at the first, middle
    and last step and its mean over the steps beside the plain minibatch gradient's, the local loss at
    the first and the last iterate, the drift from the global model at the last, and the smoothness
    bounds."""
    first = result["measurements"][0]
    lines = [f"commit {result['commit']}; client {first['client']} ({first['client_train_samples']} training samples, "
             f"B = {first['batch_size']})", "",
             "| warm-up (FedAvg rounds) | setting | estimator | error at t = 1 | at t = tau/2 | at t = tau | mean error | "
             "mean minibatch error | local loss at w_1 -> w_tau | drift at w_tau | largest step smoothness | "
             "beta at most | Lemma 1's tau bound at most |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for m in result["measurements"]:
        for s in m["settings"].values():
            for estimator in ESTIMATORS:
                c = s[estimator]
                e, mb, loss = c["error"], c["minibatch_error"], c["loss"]
                lines.append(
                    f"| {m['warmup_rounds']} | beta {s['beta']}, tau {s['tau']}, eta {s['eta']} | {estimator.upper()} | "
                    f"{e[0]:.3f} | {e[len(e) // 2 - 1]:.3f} | {e[-1]:.3f} | {sum(e) / len(e):.3f} | "
                    f"{sum(mb) / len(mb):.3f} | {loss[0]:.4f} -> {loss[-1]:.4f} | {c['drift'][-1]:.3f} | "
                    f"{s['max_smoothness']:.1f} | {s['beta_at_most']:.2f} | {s['sarah_tau_bound_at_most']:.2f} |")
    return "\n".join(lines)


def main(argv: Any = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--warmup", type=int, nargs="+", default=[10, 25],
                        help="FedAvg rounds before the measured round, one measurement each (default 10 25)")
    parser.add_argument("--client", type=int, help="the measured client (default: the one of median size)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="write the result file here (JSON)")
    parser.add_argument("--aggregate", action="store_true",
                        help="instead, every client's round and the mean of the models sent (aggregate), "
                             "added to the --out file (replacing an entry that measured the same)")
    parser.add_argument("--trajectory", choices=("fedavg", *ESTIMATORS), default="fedavg",
                        help="with --aggregate: whose fig3 run trains the global model first (default fedavg)")
    parser.add_argument("--warm-setting", choices=list(FIG2), help="with --aggregate: that run's setting (default: the first)")
    parser.add_argument("--settings", nargs="+", choices=list(FIG2), help="with --aggregate: the settings measured (default: all)")
    parser.add_argument("--table", type=Path, help="print the document's table from this result file; run nothing")
    opts = parser.parse_args(argv)
    if opts.table:
        result = json.loads(opts.table.read_text())
        print(table(result) + ("\n\n" + aggregate_table(result) if result.get("aggregates") else ""))
        return
    if min(opts.warmup) < 0:
        parser.error(f"--warmup must be >= 0, got {opts.warmup}")
    code = commit()  # what this process runs, whatever the checkout becomes while it does
    if opts.aggregate:  # added to the result file, beside its measurements
        result: dict[str, Any] = {}
        for warmup in opts.warmup:
            entry = aggregate(warmup, opts.seed, opts.trajectory, opts.warm_setting, opts.settings, code)
            # the file as it is now: another process may have added its entries since this one started
            result = json.loads(opts.out.read_text()) if opts.out and opts.out.exists() else result
            result["aggregates"] = [a for a in result.get("aggregates", []) if aggregate_key(a) != aggregate_key(entry)]
            result["aggregates"].append(entry)
            if opts.out:  # as they come
                opts.out.write_text(json.dumps(result, indent=1) + "\n")
        print(aggregate_table(result))
        return
    result = {"commit": code, "device": "cpu", "env": environment(), "measurements": []}
    for warmup in opts.warmup:
        result["measurements"].append(measure(warmup, opts.client, opts.seed))
        if opts.out:  # as they come
            opts.out.write_text(json.dumps(result, indent=1) + "\n")
    print(table(result))


if __name__ == "__main__":
    main()
