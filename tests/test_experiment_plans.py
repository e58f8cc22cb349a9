"""The reproduction plans choose their tuned settings as their documents say. No training: the
screening runs are made up."""

from __future__ import annotations

import pytest
import torch

from experiments.feddeper import plan


def screened(m: int, method: str, scores: dict[str, list[float]], study: str = "screen",
             settings_list: list[dict] | None = None) -> list[dict]:
    """A screening run per setting of ``method``'s grid (or of ``settings_list``): validation
    accuracy ``scores[name]`` at the evaluations (0.5 throughout for settings not named)."""
    runs = []
    for settings in plan.grid(method) if settings_list is None else settings_list:
        name = plan.settings_name(settings)
        values = scores.get(name, [0.5] * 20)
        runs.append({"name": f"{study}/m{m}/{method}_{name}_s0",
                     "params": dict(study=study, m=m, method=method, **settings, seed=0, rounds=200),
                     "history": [{"round": 10 * (i + 1), "val_acc": v} for i, v in enumerate(values)]})
    return runs


def test_feddeper_grids_give_every_method_the_same_budget():
    assert {method: len(plan.grid(method)) for method in plan.GRIDS} == dict.fromkeys(plan.GRIDS, 48)
    assert plan.LRS[0] == plan.PAPER_LR == 0.01 and set(plan.PROX_LRS) <= set(plan.LRS)
    for method, settings in plan.PAPER.items():  # the paper's settings are in the grids (FedProx's lr 0.01 aside)
        assert settings["lr"] == plan.PAPER_LR
        in_grid = {k: v for k, v in settings.items() if k in plan.GRIDS[method] and (method, k) != ("fedprox", "lr")}
        assert any(in_grid.items() <= s.items() for s in plan.grid(method)), method


def confirm(m: int, method: str, scores: dict[str, float]) -> list[dict]:
    """The ``confirm`` runs of ``method``'s shortlisted settings ``scores`` (name -> the validation
    accuracy of seeds 1 and 2 at every evaluation)."""
    return [{"name": f"confirm/m{m}/{method}_{name}_s{seed}", "params": dict(study="confirm", m=m, method=method, seed=seed),
             "history": [{"round": 10 * (i + 1), "val_acc": value} for i in range(20)]}
            for name, value in scores.items() for seed in plan.CONFIRM_SEEDS]


def test_feddeper_screening_ranks_on_the_mean_of_the_last_five_evaluations():
    # the best last value (0.99) has a worse last-five mean than the steadier setting
    spiky = [0.5] * 15 + [0.6, 0.6, 0.6, 0.6, 0.99]
    steady = [0.5] * 15 + [0.8] * 5
    runs = screened(5, "fedavg", {"lr0.0316_b32": spiky, "lr0.01_b10": steady})
    assert plan.shortlist(runs, 5, "fedavg") == [{"lr": 0.01, "batch": 10}, {"lr": 0.0316, "batch": 32},
                                                 {"lr": 0.01, "batch": 32}]  # ties (0.5): grid order
    assert plan.screen_score(next(r for r in runs if r["name"] == "screen/m5/fedavg_lr0.0316_b32_s0")) == pytest.approx(0.678)


def test_feddeper_choice_is_the_best_three_seed_mean_of_the_shortlist(monkeypatch, tmp_path):
    from experiments import results

    runs = screened(5, "fedavg", {"lr0.464_b64": [0.95] * 20, "lr0.316_b64": [0.94] * 20, "lr0.316_b32": [0.93] * 20})
    assert plan.shortlist(runs, 5, "fedavg") == [{"lr": 0.464, "batch": 64}, {"lr": 0.316, "batch": 64},
                                                 {"lr": 0.316, "batch": 32}]
    assert plan.tuned(runs) == {}  # waits for its confirm runs
    monkeypatch.setattr(plan, "RESULTS", tmp_path / "feddeper.json")
    results.save(plan.RESULTS, runs)
    with pytest.warns(UserWarning, match="m5/fedavg"):  # its table waits for the confirm runs
        planned = [r for r in plan.runs() if r.name.startswith("confirm/")]
    assert [r.name for r in planned] == [f"confirm/m5/fedavg_{name}_s{seed}" for name in ("lr0.464_b64", "lr0.316_b64", "lr0.316_b32")
                                         for seed in plan.CONFIRM_SEEDS]
    assert planned[0].args[-2:] == ["--trainer.limit_val_batches", "0"]
    assert planned[0].args[planned[0].args.index("--trainer.max_epochs") + 1] == str(plan.SCREEN_ROUNDS)
    # the seed-0 best diverges on seed 1: the steadier second setting wins on the three-seed mean
    diverged = confirm(5, "fedavg", {"lr0.464_b64": 0.95, "lr0.316_b64": 0.94, "lr0.316_b32": 0.93})
    diverged[0]["history"] = [{"round": 10 * (i + 1), "val_acc": 0.1} for i in range(20)]
    assert plan.tuned(runs + diverged) == {(5, "fedavg"): {"lr": 0.316, "batch": 64}}
    assert plan.tuned(runs + diverged[1:]) == {}  # one run missing
    steady = confirm(5, "fedavg", {"lr0.464_b64": 0.95, "lr0.316_b64": 0.94, "lr0.316_b32": 0.93})
    assert plan.tuned(runs + steady) == {(5, "fedavg"): {"lr": 0.464, "batch": 64}}


def test_feddeper_rate_is_searched_in_a_second_stage_with_rho_scaled():
    first = screened(5, "feddeper", {"rho0.02_lam0.7_b32": [0.8] * 20})
    assert plan.first_stage(first) == {(5, "feddeper"): dict(rho=0.02, lam=0.7, batch=32)}
    assert plan.shortlist(first, 5, "feddeper") is None  # FedDeper waits for its second stage
    second = plan.lr_stage(dict(rho=0.02, lam=0.7, batch=32))
    assert [s["lr"] for s in second] == [lr for lr in plan.LRS if 0.01 < lr < 0.5]  # rho = 2 lr < 1
    assert all(s["rho"] == pytest.approx(2 * s["lr"], rel=5e-3) and (s["lam"], s["batch"]) == (0.7, 32) for s in second)
    worse = screened(5, "feddeper", {}, "screen_lr", second)
    assert plan.shortlist(first + worse, 5, "feddeper")[0] == dict(lr=0.01, rho=0.02, lam=0.7, batch=32)
    better = screened(5, "feddeper", {"lr0.1_rho0.2_lam0.7_b32": [0.9] * 20}, "screen_lr", second)
    top = plan.shortlist(first + better, 5, "feddeper")
    assert top[:2] == [dict(lr=0.1, rho=0.2, lam=0.7, batch=32), dict(lr=0.01, rho=0.02, lam=0.7, batch=32)]
    again = confirm(5, "feddeper", {plan.settings_name(s): 0.85 for s in top})
    assert plan.tuned(first + better + again) == {(5, "feddeper"): dict(lr=0.1, rho=0.2, lam=0.7, batch=32)}


def test_feddeper_table_is_planned_only_for_complete_screenings(monkeypatch, tmp_path):
    runs = screened(5, "fedavg", {"lr0.0316_b32": [0.9] * 20}) + screened(5, "feddeper", {})[:-1]
    assert plan.shortlist(runs, 5, "fedavg")[0] == {"lr": 0.0316, "batch": 32}
    assert plan.shortlist(runs, 5, "feddeper") is None
    monkeypatch.setattr(plan, "RESULTS", tmp_path / "absent.json")  # no screening: no second stages
    monkeypatch.setattr(plan, "tuned", lambda runs=None: {(5, "fedavg"): {"lr": 0.0316, "batch": 32},
                                                (5, "feddeper"): dict(plan.PAPER["feddeper"])})
    with pytest.warns(UserWarning, match="m10/feddeper"):
        names = [r.name for r in plan.runs() if not r.name.startswith(("screen", "cnn", "n100"))]
    assert sorted(names) == sorted(
        [f"table/m5/fedavg_lr0.0316_b32_s{s}" for s in plan.SEEDS] + [f"paper/m5/fedavg_lr0.01_b64_s{s}" for s in plan.SEEDS]
        + [f"table/m5/{run}_lr0.01_rho0.03_lam0.5_b64_s{s}" for s in plan.SEEDS for run in ("feddeper", "feddeper_star")]
        # the isolation variants and their baseline, at the setting they ran at
        + [f"{study}/m5/{run}_lr0.01_rho0.04_lam0.5_b32_s{s}" for s in plan.SEEDS
           for study, run in (("table", "feddeper"), ("isolation", "gauss_seidel"), ("isolation", "reset_personal"))])


def test_feddeper_rate_with_rho_kept_is_taken_only_when_it_beats_the_first_stage():
    first = screened(5, "feddeper", {"rho0.02_lam0.7_b32": [0.8] * 20})
    kept = [dict(lr=lr, rho=0.02, lam=0.7, batch=32) for lr in plan.FIXED_RHO_LRS]
    assert plan.fixed_rho_choice(first, 5) is None  # its runs are missing
    assert plan.fixed_rho_choice(first + screened(5, "feddeper", {}, "screen_lr_fixed", kept), 5) is None
    better = screened(5, "feddeper", {"lr0.1_rho0.02_lam0.7_b32": [0.9] * 20}, "screen_lr_fixed", kept)
    assert plan.fixed_rho_choice(first + better, 5) == dict(lr=0.1, rho=0.02, lam=0.7, batch=32)


def raga_screened(scores: dict[tuple[str, float], list[float]]) -> list[dict]:
    """A RAGA-plan screening run per method and step size: validation accuracy ``scores[(method,
    step)]`` at the evaluations (0.5 throughout where not given)."""
    from experiments.raga import plan as raga

    runs = []
    for method, steps in raga.STEPS.items():
        for step in steps:
            planned = raga.run("screen", method, 0, step=step, rounds=raga.SCREEN_ROUNDS)
            values = scores.get((method, step), [0.5] * 20)
            runs.append({"name": planned.name, "params": planned.params,
                         "history": [{"round": 10 * (i + 1), "val_acc": v} for i, v in enumerate(values)]})
    return runs


def test_raga_tuning_gives_every_method_the_same_budget_with_its_paper_setting():
    from experiments.raga import plan as raga

    assert {len(steps) for steps in raga.STEPS.values()} == {6}
    assert 1.0 in raga.STEPS["raga"] and 0.1 in raga.STEPS["byrdsaga"]  # RAGA's schedule as published, gamma 0.1
    # RAGA's first rates span the others' rates: lr_scale times eta^1 = 0.099
    from fl_lightning.algorithms.raga import paper_learning_rate

    first = [s * paper_learning_rate(1, raga.ROUNDS) for s in raga.STEPS["raga"]]
    assert first == pytest.approx(raga.TUNE_RATES, rel=0.02)
    assert "--model.init_args.lr_scale" in raga.run("screen", "raga", 0, step=3.16).args
    args = " ".join(raga.run("screen", "fedavg", 0, step=0.1).args)
    assert "--model.init_args.schedule constant --model.init_args.client.init_args.lr 0.1" in args


def test_raga_table_is_planned_from_the_last_five_evaluations_once_the_screening_is_complete(monkeypatch, tmp_path):
    from experiments import results
    from experiments.raga import plan as raga

    spiky = [0.5] * 15 + [0.6, 0.6, 0.6, 0.6, 0.99]
    steady = [0.5] * 15 + [0.8] * 5
    runs = raga_screened({("fedavg", 1.0): spiky, ("fedavg", 0.0316): steady, ("raga", 3.16): steady})
    assert raga.tuned(runs) == {"raga": 3.16, "fedavg": 0.0316, "rfa": 0.01, "byrdsaga": 0.01}  # ties: the smaller
    assert raga.tuned(runs[1:]) == {"fedavg": 0.0316, "rfa": 0.01, "byrdsaga": 0.01}  # RAGA's screening incomplete
    path = tmp_path / "raga.json"
    monkeypatch.setattr(raga, "RESULTS", path)
    with pytest.warns(UserWarning, match="raga"):
        assert not [r for r in raga.runs() if r.name.startswith("table")]
    results.save(path, runs)
    planned = raga.runs()
    table = [r for r in planned if r.name.startswith("table/")]
    assert len(table) == 5 * 3 * (1 + len(raga.ATTACKS) * len(raga.FRACTIONS))  # with the decoupled RAGA
    assert {"table/fedavg_lr0.0316_ipm_0.3_s2", "table/raga_slr0.948_lr0.316_ipm_0.3_s2"} <= {r.name for r in table}
    short = [r for r in planned if r.name.startswith("table200/")]  # the same runs at the screening's 200 rounds
    assert [r.name.replace("table200/", "table/") for r in short] == [r.name for r in table]
    assert {r.params["rounds"] for r in short} == {200} and {r.params["rounds"] for r in table} == {1000}
    assert [r.params["seed"] for r in short] == sorted(r.params["seed"] for r in short)  # a seed's grid, then the next


def test_raga_grid_table_has_the_papers_layout_with_each_columns_best_and_the_diverged_seeds():
    from experiments.raga import plan as raga
    from experiments.raga.report import grid_table
    from experiments.seed_stats import final

    def record(method, attack, fraction, seed, acc, **extra):
        planned = raga.run("table200", method, seed, attack=attack, fraction=fraction, rounds=200, step=0.316)
        return {"name": planned.name, "params": planned.params,
                "history": [{"round": 200, "test_acc": acc, "val_acc": acc}], **extra}

    runs = [record(m, "none", 0.0, s, base + 0.01 * s) for m, base in (("raga", 0.9), ("fedavg", 0.95)) for s in (0, 1, 2)]
    runs += [record("raga", "gaussian", 0.4, s, 0.88) for s in (0, 1, 2)]
    runs += [record("fedavg", "gaussian", 0.4, 0, 0.5), record("fedavg", "gaussian", 0.4, 1, 0.1, diverged="round 7: nan"),
             record("fedavg", "gaussian", 0.4, 2, 0.1, diverged="round 9: nan")]
    runs.append(record("raga", "gaussian", 0.1, 0, 0.99, stopped="round 50 of 200"))  # goes on later: not shown
    table = grid_table(runs, "table200", final, "final test accuracy, %").splitlines()
    assert table[0] == "| attack | method (final test accuracy, %, 200 rounds) | attack-free | 0.1 | 0.2 | 0.3 | 0.4 |"
    raga_row, fedavg_row = table[2], table[3]  # the Gaussian attack's rows
    assert raga_row == "| gaussian | RAGA | 91.00 ± 1.00 | – | – | – | **88.00 ± 0.00** |"
    assert fedavg_row == "| gaussian | FedAvg | **96.00 ± 1.00** | – | – | – | 50.00 ± 0.00 (1 seed; seeds 1, 2 diverged) |"
    assert len(table) == 2 + 2 * len(raga.ATTACKS)


def test_raga_against_the_best_baseline_pairs_seeds_and_picks_the_baseline_on_the_seeds_both_ran():
    from experiments.raga import plan as raga
    from experiments.raga.report import against_table

    def record(method, seed, acc, attack="ipm", fraction=0.4, **extra):
        server_lr, constant = (0.948, True) if method == "decoupled" else (None, False)
        planned = raga.run("table200", "raga" if method == "decoupled" else method, seed, attack=attack, fraction=fraction,
                           rounds=200, step=0.316, server_lr=server_lr, constant=constant)
        return {"name": planned.name, "params": planned.params, "history": [{"round": 200, "test_acc": acc}], **extra}

    runs = [record("raga", s, a) for s, a in ((0, 0.80), (1, 0.84), (2, 0.70))]
    runs += [record("rfa", s, a) for s, a in ((0, 0.90), (1, 0.92))]  # the best baseline on seeds 0-1
    runs += [record("fedavg", s, a) for s, a in ((0, 0.85), (1, 0.86), (2, 0.99))]  # better only with seed 2
    runs += [record("decoupled", s, 0.99) for s in (0, 1, 2)]  # not a baseline of the paper
    runs += [record("byrdsaga", 0, 0.95, stopped="round 50 of 200"), record("byrdsaga", 1, 0.97, diverged="round 3: nan")]
    runs += [record("raga", 0, 0.9, attack="alie", fraction=0.1), record("fedavg", 0, 0.8, attack="alie", fraction=0.1)]
    table = against_table(runs, "table200").splitlines()
    assert table[0] == "| attack | 0.1 | 0.2 | 0.3 | 0.4 |"
    rows = {line.split(" | ")[0][2:]: line.split(" | ")[1:] for line in table[2:]}
    assert rows.keys() == set(raga.ATTACKS)
    assert rows["ipm"][3] == "RFA: -9.00 ± 1.41 [-21.71, +3.71] |"  # seeds 0-1: -10 and -8
    assert rows["alie"][0] == "FedAvg: +10.00 (1 seed)" and rows["alie"][1] == "–"


def test_raga_difference_table_pairs_two_settings_by_seed_attack_free_and_in_every_case():
    """The decoupled RAGA minus RFA (or RAGA): paired by seed over the seeds both ran, diverged runs
    left out, attack-free on a row of its own."""
    from experiments.raga import plan as raga
    from experiments.raga.report import DECOUPLED, RFA_KEY, difference_table

    def record(method, seed, acc, attack="ipm", fraction=0.4, **extra):
        decoupled = method == "decoupled"
        planned = raga.run("table200", "raga" if decoupled else method, seed, raga.DECOUPLE[1] if decoupled else None,
                           attack, fraction, 200, step=0.316, constant=decoupled)
        return {"name": planned.name, "params": planned.params, "history": [{"round": 200, "test_acc": acc}], **extra}

    runs = [record("decoupled", s, a) for s, a in ((0, 0.50), (1, 0.60), (2, 0.10))]
    runs += [record("rfa", s, a) for s, a in ((0, 0.90), (1, 0.90))] + [record("rfa", 2, 0.9, diverged="round 3: nan")]
    runs += [record("decoupled", 0, 0.97, "none", 0.0), record("rfa", 0, 0.96, "none", 0.0)]
    table = difference_table(runs, "table200", DECOUPLED, RFA_KEY).splitlines()
    assert table[0] == "| attack | attack-free | 0.1 | 0.2 | 0.3 | 0.4 |"
    assert table[2] == "| none | +1.00 (1 seed) | | | | |"
    rows = {line.split(" | ")[0][2:]: line for line in table[3:]}
    assert rows.keys() == set(raga.ATTACKS)
    assert rows["ipm"] == "| ipm | | – | – | – | -35.00 ± 7.07 [-98.53, +28.53] |"  # seeds 0-1: -40 and -30


def test_raga_comparisons_are_made_at_the_best_validation_too_each_picking_its_own_best_baseline():
    """RAGA against the best baseline and the decoupled RAGA minus RFA, by the test accuracy at the
    best validation: each seed's figure at its validation peak, the baseline chosen on that figure
    (here FedAvg, where the final figure chooses RFA), the measure named in the first header."""
    from experiments.raga import plan as raga
    from experiments.raga.report import AT_BEST_VAL, DECOUPLED, RFA_KEY, against_table, at_best_validation, \
        difference_table

    def record(method, seed, peak, end):
        """A run whose test accuracy is ``peak`` at round 100, its validation peak, and ``end`` after round 200."""
        decoupled = method == "decoupled"
        planned = raga.run("table200", "raga" if decoupled else method, seed, raga.DECOUPLE[1] if decoupled else None,
                           "alie", 0.4, 200, step=0.316, constant=decoupled)
        return {"name": planned.name, "params": planned.params,
                "history": [{"round": 100, "test_acc": peak, "val_acc": 0.9},
                            {"round": 200, "test_acc": end, "val_acc": 0.5}]}

    runs = [record("raga", s, 0.90 + 0.01 * s, 0.80) for s in (0, 1, 2)]
    runs += [record("rfa", s, 0.70, 0.88) for s in (0, 1, 2)]  # the best baseline at the end, the worst at its peak
    runs += [record("fedavg", s, 0.85, 0.85) for s in (0, 1, 2)]
    runs += [record("decoupled", s, 0.50, 0.60) for s in (0, 1, 2)]
    final = against_table(runs, "table200").splitlines()
    best = against_table(runs, "table200", at_best_validation, AT_BEST_VAL).splitlines()
    assert final[0] == "| attack | 0.1 | 0.2 | 0.3 | 0.4 |"
    assert best[0] == "| attack (test accuracy at the best validation) | 0.1 | 0.2 | 0.3 | 0.4 |"
    assert final[4] == "| alie | – | – | – | RFA: -8.00 ± 0.00 [-8.00, -8.00] |"
    assert best[4] == "| alie | – | – | – | FedAvg: +6.00 ± 1.00 [+3.52, +8.48] |"  # seeds: +5, +6, +7
    rows = difference_table(runs, "table200", DECOUPLED, RFA_KEY, at_best_validation, AT_BEST_VAL).splitlines()
    assert rows[0] == "| attack (test accuracy at the best validation) | attack-free | 0.1 | 0.2 | 0.3 | 0.4 |"
    assert "| alie | | – | – | – | -20.00 ± 0.00 [-20.00, -20.00] |" in rows
    rows = difference_table(runs, "table200", DECOUPLED, RFA_KEY).splitlines()
    assert "| alie | | – | – | – | -28.00 ± 0.00 [-28.00, -28.00] |" in rows


def test_raga_solver_test_swaps_the_medians_iterations_beside_the_table200_runs(monkeypatch, tmp_path):
    """The solver study: RAGA (and the decoupled RAGA) at RFA's Weiszfeld iterations and RFA at RAGA's,
    each at its Table II step size, in the solver cases; its table sets each beside the setting's own
    ``table200`` run."""
    from experiments import results
    from experiments.raga import plan as raga
    from experiments.raga.report import solver_table

    path = tmp_path / "raga.json"
    monkeypatch.setattr(raga, "RESULTS", path)
    screened = raga_screened({("raga", 3.16): [0.9] * 20, ("rfa", 0.316): [0.9] * 20})
    results.save(path, screened)
    solver = [r for r in raga.runs() if r.name.startswith("solver/")]
    assert [r.name for r in solver] == [f"solver/{m}_ipm_0.4_s{s}" for s in (0, 1, 2)
                                        for m in ("raga_scale3.16_it4", "rfa_lr0.316_it100", "raga_slr0.948_lr0.316_it4")]
    assert solver[2].params["constant"] and solver[2].params["server_lr"] == 3 * 0.316
    assert " ".join(solver[1].args).count("--model.init_args.max_iter 100") == 1
    assert {r.params["rounds"] for r in solver} == {200} and solver[0].params["max_iter"] == 4

    def record(study, method, step, seed, acc, max_iter=None):
        planned = raga.run(study, method, seed, attack="ipm", fraction=0.4, rounds=200, step=step, max_iter=max_iter)
        return {"name": planned.name, "params": planned.params,
                "history": [{"round": 190, "test_acc": acc + 0.05, "val_acc": 0.9}, {"round": 200, "test_acc": acc,
                                                                                      "val_acc": 0.1}]}

    runs = screened + [record("table200", "raga", 3.16, 0, 0.3), record("solver", "raga", 3.16, 0, 0.9, max_iter=4),
                       record("table200", "rfa", 0.316, 0, 0.9), record("solver", "rfa", 0.316, 1, 0.2, max_iter=100)]
    table = solver_table(runs).splitlines()
    assert table[0] == ("| case (200 rounds) | method | Weiszfeld iterations | final: seed 0 | seed 1 | seed 2 "
                        "| at best val: seed 0 | seed 1 | seed 2 |")
    assert table[2:] == ["| ipm 0.4 | RAGA | 100 (its own) | 30.00 | – | – | 35.00 | – | – |",
                         "| ipm 0.4 | RAGA | 4 | 90.00 | – | – | 95.00 | – | – |",
                         "| ipm 0.4 | RFA | 4 (its own) | 90.00 | – | – | 95.00 | – | – |",
                         "| ipm 0.4 | RFA | 100 | – | 20.00 | – | – | 25.00 | – |",
                         "| ipm 0.4 | RAGA, decoupled (local 0.316, server 0.948) | 100 (its own) | – | – | – | – | – | – |",
                         "| ipm 0.4 | RAGA, decoupled (local 0.316, server 0.948) | 4 | – | – | – | – | – | – |"]


def test_fedproxvr_table2_search_gives_each_row_the_same_grid_and_plans_the_rows_at_their_choice(monkeypatch, tmp_path):
    """Table 2's step-size search: every row over the same grid (through the authors' rates and
    1 / (beta L)), seed 0, on the batched backend at the paper's data fraction; once every run of a
    row's search has finished (a stopped one does not count), that row at its best validation rate,
    5 seeds, 1000 rounds; the search's table marks the choices made."""
    from experiments import results
    from experiments.fedproxvr import plan as fpv
    from experiments.fedproxvr.report import tune_table

    path = tmp_path / "fedproxvr.json"
    monkeypatch.setattr(fpv, "RESULTS", path)
    with pytest.warns(UserWarning, match="table1_tune"):
        search = [r for r in fpv.runs() if r.name.startswith("table2_tune/")]
    assert [r.name for r in search] == [f"table2_tune/{m}_lr{lr}_s0" for m in ("fedavg", "svrg", "sarah")
                                        for lr in fpv.TABLE2_LR_GRID]
    assert {0.0005, 0.005, 0.05} <= set(fpv.TABLE2_LR_GRID)  # the authors' MNIST and Fashion-MNIST rates, 1 / (beta L)
    args = " ".join(search[len(fpv.TABLE2_LR_GRID)].args)  # SVRG at the grid's first rate
    assert "--model.init_args.lr 0.0005 --model.init_args.beta null" in args and "client_backend batched" in args
    assert "used_fraction 0.3" in args and "--trainer.max_epochs 100" in args

    best = {"fedavg": 0.15, "svrg": 0.015, "sarah": 0.005}

    def record(r, stopped=False):
        acc = 0.9 if r.params["lr"] == best[r.params["method"]] else 0.8
        return {"name": r.name, "params": r.params, "history": [{"round": 100, "val_acc": acc}],
                **({"stopped": True} if stopped else {})}

    results.save(path, [record(r, stopped=r is search[-1]) for r in search])  # one run of SARAH's search stopped
    with pytest.warns(UserWarning):
        tuned = [r for r in fpv.runs() if r.name.startswith("table2_tuned/")]
    assert [r.name for r in tuned] == [f"table2_tuned/{m}_lr{best[m]}_s{s}" for s in range(5) for m in ("fedavg", "svrg")]
    table = tune_table(results.load(path), "table2").splitlines()
    assert table[2 + fpv.TABLE2_LR_GRID.index(0.015)] == "| 0.015 | 80.00 | **90.00** | 80.00 |"
    assert table[2 + fpv.TABLE2_LR_GRID.index(0.005)] == "| 0.005 | 80.00 | 80.00 | 90.00 |"  # SARAH: no choice yet
    results.save(path, [record(r) for r in search])
    with pytest.warns(UserWarning):
        tuned = [r for r in fpv.runs() if r.name.startswith("table2_tuned/")]
    assert [r.name for r in tuned] == [f"table2_tuned/{m}_lr{best[m]}_s{s}" for s in range(5) for m in best]
    assert {r.params["rounds"] for r in tuned} == {1000}
    table = tune_table(results.load(path), "table2").splitlines()
    assert table[0] == ("| step size | FedAvg: val acc (%) after round 100 | FedProxVR (SVRG): val acc (%) after round 100 | "
                        "FedProxVR (SARAH): val acc (%) after round 100 |")
    assert table[2 + fpv.TABLE2_LR_GRID.index(0.005)] == "| 0.005 | 80.00 | 80.00 | **90.00** |"


def test_fedproxvr_fig3_runs_fig2s_settings_on_table2s_cnn_federation(monkeypatch, tmp_path):
    """Fig. 3: each (beta, tau) setting of Fig. 2 with its step size, for each of Table 2's rows, on the
    paper's CNN federation at its data fraction, B = 64, 3 seeds, on the batched backend; the report
    groups the runs per setting, in the plan's order, and pairs each setting's rows by seed."""
    from experiments.fedproxvr import plan as fpv
    from experiments.fedproxvr.report import sections, studies

    monkeypatch.setattr(fpv, "RESULTS", tmp_path / "fedproxvr.json")
    with pytest.warns(UserWarning, match="table1_tune"):
        fig3 = [r for r in fpv.runs() if r.name.startswith("fig3/")]
    assert [r.name for r in fig3] == [f"fig3/{setting}/{m}_s{s}" for setting in fpv.FIG2 for m in fpv.TABLE2
                                      for s in range(3)]
    sarah = next(r for r in fig3 if r.name == "fig3/beta7_tau40/sarah_s1")
    args = " ".join(sarah.args)
    assert args.startswith("--config configs/fedproxvr/table2_mnist_cnn.yaml --config configs/fedproxvr/table2/sarah.yaml")
    for expected in ("used_fraction 0.3", "--model.init_args.lr 0.003 --model.init_args.beta null", "local_steps 40",
                     "--data.init_args.batch_size 64", "client_backend batched", "--seed_everything 1",
                     f"--trainer.max_epochs {fpv.FIG3_ROUNDS}"):
        assert expected in args, expected
    assert sarah.params == dict(study="fig3", setting="beta7_tau40", beta=7, tau=40, label="FedProxVR (SARAH)",
                                method="sarah", lr=0.003, seed=1, rounds=fpv.FIG3_ROUNDS)
    fedavg = " ".join(next(r for r in fig3 if r.name == "fig3/beta5_tau10/fedavg_s0").args)
    assert "--model.init_args.client.init_args.lr 0.005" in fedavg and "local_steps 10" in fedavg
    def record(r):  # SVRG 1 point above FedAvg on every seed, SARAH 2 below
        acc = 0.8 + {"fedavg": 0.0, "svrg": 0.01, "sarah": -0.02}[r.params["method"]] + 0.001 * r.params["seed"]
        return {"name": r.name, "params": r.params, "wall_s": 1.0, "summary": summary,
                "history": [{"round": k, "test_acc": acc, "val_acc": acc, "train_loss": 1.0} for k in (0, 50)]}

    summary = {"train_sizes": {"clients": 10, "total": 100}, "test_samples": 50}
    records = [record(r) for r in reversed(fig3)]  # as a parallel sweep may finish them
    grouped = studies(records)
    assert list(grouped) == [f"fig3/{setting}" for setting in fpv.FIG2]  # the plan's order, not the file's
    assert {label: len(runs) for label, runs in grouped["fig3/beta5_tau10"].items()} == {
        "FedAvg": 3, "FedProxVR (SVRG)": 3, "FedProxVR (SARAH)": 3}  # the document's row order
    report = sections(records, estimator_error=None)
    assert list(report) == list(grouped)
    differences = next(t for t in report["fig3/beta7_tau40"] if t.startswith("| difference (points)")).splitlines()
    assert differences[2].startswith("| FedProxVR (SVRG) − FedAvg | 3 | +1.00 ± 0.00 | [+1.00, +1.00] |")
    assert differences[3].startswith("| FedProxVR (SARAH) − FedAvg | 3 | -2.00 ± 0.00 |")


def feddro_runs(study_runs: list, seeds_value=lambda run: 0.5) -> list[dict]:
    """Made-up records of FedDRO-plan runs: every evaluated figure ``seeds_value(run)``."""
    keys = ["test_acc", "test_acc_balanced", "test_acc_worst_class", "val_acc_balanced", "train_acc", "train_acc_worst_class",
            "train_kl_dro",
            *(f"test_acc_class{c}" for c in range(10))]
    return [{"name": r.name, "params": r.params,
             "history": [{"round": k * r.every, **dict.fromkeys(keys, seeds_value(r))} for k in range(1, 4)]}
            for r in study_runs]


def test_feddro_tuning_gives_every_method_the_papers_grid_and_plans_the_table_once_complete(monkeypatch, tmp_path):
    from experiments import results
    from experiments.feddro import plan as feddro
    from experiments.feddro import report

    tune = feddro.tune_runs()
    assert {m: [r.params["lr"] for r in tune if r.params["method"] == m] for m in feddro.METHODS} == \
        dict.fromkeys(feddro.METHODS, [0.001, 0.01, 0.05, 0.1])
    assert all(r.params["rounds"] == feddro.EPOCHS * feddro.STEPS_PER_EPOCH and r.every == feddro.STEPS_PER_EPOCH
               for r in tune)
    records = feddro_runs(tune, lambda r: 0.9 if r.params["lr"] == 0.05 else 0.5)
    assert feddro.tuned(records) == dict.fromkeys(feddro.METHODS, 0.05)
    assert feddro.tuned(records[1:]) == {m: 0.05 for m in feddro.METHODS if m != "feddro"}
    path = tmp_path / "feddro.json"
    monkeypatch.setattr(feddro, "RESULTS", path)
    with pytest.warns(UserWarning, match="feddro"):
        assert [r.params["study"] for r in feddro.runs()] == (["tune"] * len(tune) + ["centralized"] * len(feddro.LRS)
                                                              + ["beta"] * len(feddro.BETAS) * (len(feddro.LRS) - 1))
    central = [r for r in feddro.runs() if r.params["study"] == "centralized"]
    assert all(r.params["method"] == "feddro" and "--data.init_args.batch_size" in r.args for r in central)
    momenta = [r for r in feddro.runs() if r.params["study"] == "beta"]
    from pathlib import Path

    import yaml

    base = yaml.safe_load((Path(__file__).resolve().parents[1] / feddro.BASE).read_text())
    assert base["model"]["init_args"]["beta"] == feddro.CONFIG_BETA  # the beta table's row for the tuning's runs
    assert {(r.params["beta"], r.args[r.args.index("--model.init_args.beta") + 1]) for r in momenta} == {(0.1, "0.1"), (1.0, "1.0")}
    results.save(path, records)
    planned = feddro.runs()
    table = [r for r in planned if r.params["study"] == "table"]
    assert len(table) == len(feddro.SEEDS) * (3 * len(feddro.LAMS) + 2)  # FedAvg and FastDRO have no lambda
    sweep = [r for r in planned if r.params["study"] == "local_steps"]
    assert sorted({r.params["local_steps"] for r in sweep}) == list(feddro.LOCAL_STEPS)
    assert all(r.params["rounds"] == feddro.SWEEP_ROUNDS for r in sweep)
    # the report reads them: FedDRO against the baselines at its lambda, paired by seed
    done = records + feddro_runs(table + sweep, lambda r: 0.8 if r.params["method"] == "feddro" else 0.6 + 0.01 * r.params["seed"])
    tables = report.tables(done)
    assert len(tables) == 4 and "**90.00**" in tables[0]
    central_tables = report.tables(done + feddro_runs(central, lambda r: 0.95))
    assert central_tables[-1].splitlines()[-1] == "| 1 client, batch 128 | 95.00 | 95.00 | 95.00 | 95.00 |"
    assert "| FedAvg (ERM) (FedDRO λ 2) | +18.00 ± 1.58" in tables[2]
    # a diverged seed (its history stops early) is named, and left out of the figures and the pairs
    gone = next(r for r in done if r["name"] == "table/pdsgd_lr0.05_lam1_I1_s0")
    gone["diverged"], gone["history"] = "round 2110: FloatingPointError: NaN", gone["history"][:1]
    with_gone = report.tables(done)
    assert "| PDSGD (centralized), λ 1 | 0.05 | 4 (seed 0 diverged (round 2110)) | 62.50 ± 1.29" in with_gone[1]
    assert "| PDSGD (centralized), λ 1 (FedDRO λ 1) | +17.50 ± 1.29" in with_gone[2]
    # the long runs beside the comparison's seed 0, at the same drop fraction
    long = [r for r in feddro.runs() if r.params["study"] == "length"]
    assert [r.params["method"] for r in long] == list(feddro.LONG_METHODS)
    assert all(r.params["rounds"] == feddro.LONG_EPOCHS * feddro.STEPS_PER_EPOCH and "[45]" in r.args for r in long)
    length = report.tables(done + feddro_runs(long, lambda r: 0.99))[-1].splitlines()
    assert length[2:4] == ["| FedDRO, λ 2 | 20 | 80.00 | 80.00 | 80.00 | 0.8 | 80.00 |",
                           "| FedDRO, λ 2 | 60 | 99.00 | 99.00 | 99.00 | 0.99 | 99.00 |"]
    # the momentum table sets the beta runs beside the tuning's FedDRO runs (beta 0.5)
    beta_table = report.tables(done + feddro_runs(momenta, lambda r: r.params["beta"] * r.params["lr"]))[-1].splitlines()
    assert beta_table[2:5] == ["| 0.1 | 0.01 | 0.10 | 0.10 | 0.10 | 0.0010 |", "| 0.1 | 0.05 | 0.50 | 0.50 | 0.50 | 0.0050 |",
                               "| 0.1 | 0.1 | 1.00 | 1.00 | 1.00 | 0.0100 |"]
    assert beta_table[5] == "| 0.5 (the config) | 0.01 | 50.00 | 50.00 | 50.00 | 0.5000 |" and beta_table[-1].startswith("| 1 | 0.1 | 10.00 |")


def test_feddro_differences_pair_seeds_at_the_best_balanced_validation_too(monkeypatch, tmp_path):
    """FedDRO minus each baseline by the test accuracy at each run's best balanced validation, beside
    the figures after the last epoch."""
    from experiments import results
    from experiments.feddro import plan as feddro
    from experiments.feddro import report

    tuning = feddro_runs(feddro.tune_runs(), lambda r: 0.9 if r.params["lr"] == 0.05 else 0.5)
    monkeypatch.setattr(feddro, "RESULTS", tmp_path / "feddro.json")
    results.save(feddro.RESULTS, tuning)
    table = [r for r in feddro.runs() if r.params["study"] == "table"]
    done = feddro_runs(table, lambda r: 0.8 if r.params["method"] == "feddro" else 0.6 + 0.01 * r.params["seed"])
    for run in done:  # FedDRO's balanced validation peaks at its first epoch, where its test accuracy is 0.7
        if run["params"]["method"] == "feddro":
            run["history"][0].update(val_acc_balanced=0.99, test_acc=0.7)
    differences = report.differences_table(done).splitlines()
    assert differences[0] == ("| FedDRO minus (points) | train acc: mean ± std [95 % CI] | test acc | "
                              "test worst class | test acc at best val |")
    fedavg = next(line for line in differences if line.startswith("| FedAvg (ERM) (FedDRO λ 2) |"))
    assert fedavg.split(" | ")[2].startswith("+18.00 ± 1.58") and fedavg.endswith("| +8.00 ± 1.58 [+6.04, +9.96] |")


def test_feddro_paper_length_runs_are_compared_at_the_round_every_run_has_reached(monkeypatch, tmp_path):
    """Runs advanced a session at a time: the report cuts every history at the last round all of them
    reached, says which epoch that is, and pairs FedDRO with each baseline there."""
    from experiments import results
    from experiments.feddro import plan as feddro
    from experiments.feddro import report

    monkeypatch.setattr(feddro, "RESULTS", tmp_path / "feddro.json")
    results.save(feddro.RESULTS, feddro_runs(feddro.tune_runs(), lambda r: 0.9 if r.params["lr"] == 0.05 else 0.5))
    long = [r for r in feddro.runs() if r.params["study"] == "paper_length"]
    assert len(long) == len(feddro.SEEDS) * len(feddro.METHODS)
    assert all(r.params["rounds"] == feddro.PAPER_EPOCHS * feddro.STEPS_PER_EPOCH for r in long)
    done = feddro_runs(long, lambda r: 0.8 if r.params["method"] == "feddro" else 0.6 + 0.01 * r.params["seed"])
    for run in done:  # FedDRO's seed 0 has gone one evaluation further, where everything reads 0.1
        if run["params"]["method"] == "feddro" and run["params"]["seed"] == 0:
            step = run["history"][-1]["round"] - run["history"][-2]["round"]
            run["history"].append(dict(run["history"][-1], round=run["history"][-1]["round"] + step,
                                       **{k: 0.1 for k in run["history"][-1] if k != "round"}))
    caption_and_table, differences = report.tables(done)[-2:]
    last = 3 * feddro.STEPS_PER_EPOCH
    assert caption_and_table.startswith(f"epoch 3 of {feddro.PAPER_EPOCHS} (round {last})\n\n| method |")
    assert "| FedDRO, λ 2 | 0.05 | 5 | 80.00 ± 0.00 (80.00–80.00) |" in caption_and_table
    assert "| FedAvg (ERM) (FedDRO λ 2) | +18.00 ± 1.58" in differences


def test_raga_runs_use_the_batched_backend_where_the_method_allows_it():
    from experiments.raga import plan as raga
    from fl_lightning.algorithms.byrd_saga import ByrdSAGA
    from tests.helpers import synthetic, tiny_client, trainer

    with pytest.raises(ValueError, match="ByrdSAGA's first step of a round, tried at setup as the batched backend"):
        trainer(1).fit(ByrdSAGA(tiny_client(), clients_per_round=2, client_backend="batched"), synthetic(4))
    for method, step in (("raga", 1.0), ("fedavg", 0.1), ("rfa", 0.1), ("byrdsaga", 0.1)):
        args = raga.run("screen", method, 0, step=step).args
        assert ("batched" in args) == (method != "byrdsaga"), method


def pefll_runs(study: str, method: str, lr: float, values: dict[str, float], seed: int = 0, n: int = 100) -> dict:
    """A made-up PeFLL-plan run whose figures at its last evaluation are ``values`` (0.5 before)."""
    from experiments.pefll import plan as pefll

    name = pefll.run(study, method, lr, seed, pefll.TUNE_ROUNDS, n).name
    return {"name": name, "params": dict(study=study, method=method, lr=lr, seed=seed, rounds=50, client_rounds=50,
                                         num_clients=n),
            "summary": {"seen_clients": 90 * n // 100},
            "history": [{"round": 25, **dict.fromkeys(values, 0.5)}, {"round": 50, **values}]}


def test_pefll_tuning_gives_every_method_the_same_search_and_fedavg_finetuning_its_own_choice(monkeypatch, tmp_path):
    from experiments.pefll import plan as pefll

    assert {m: len(pefll.rates(m)) for m in pefll.RATES} == dict.fromkeys(pefll.RATES, 4)
    assert all(pefll.RATES[m][1] in pefll.rates(m) for m in pefll.RATES)  # the reference rate is searched
    keys = ("clients_val/acc_mean", "finetuned_val/acc_mean")
    runs = [pefll_runs("tune", m, lr, dict.fromkeys(keys, 0.6 if lr == pefll.rates(m)[2] else 0.55))
            for m in pefll.RATES for lr in pefll.rates(m)]
    fedavg = [r for r in runs if r["params"]["method"] == "fedavg"]
    fedavg[0]["history"][-1]["finetuned_val/acc_mean"] = 0.9  # finetuning prefers the smallest rate
    chosen = pefll.tuned(runs)
    assert chosen == {"pefll": 6.32e-4, "pfedhn": 0.0316, "fedavg": 0.0316, "fedavg_ft": 0.00316, "local": 0.0316}
    assert pefll.table_settings(chosen) == [("pefll", 6.32e-4), ("pefll_nolabels", 6.32e-4), ("pfedhn", 0.0316),
                                            ("fedavg", 0.0316), ("fedavg", 0.00316), ("local", 0.0316)]
    assert "pfedhn" not in pefll.tuned([r for r in runs if r["name"] != "tune/pfedhn_lr0.01_s0"])
    monkeypatch.setattr(pefll, "RESULTS", tmp_path / "absent.json")
    with pytest.warns(UserWarning, match="not planned"):
        assert {r.name.split("/")[0] for r in pefll.runs()} == {"tune"}


def test_pefll_runs_give_every_method_the_same_client_visits():
    from experiments.pefll import plan as pefll

    def value(run, flag):
        return run.args[list(run.args).index(flag) + 1]

    pefll_run, pfedhn_run, local_run = (pefll.run("table", m, 0.01, 1, 500) for m in ("pefll", "pfedhn", "local"))
    assert value(pefll_run, "--trainer.max_epochs") == "500" and value(pfedhn_run, "--trainer.max_epochs") == "2500"
    assert (pfedhn_run.every, pefll_run.every) == (250, 50) and value(local_run, "--trainer.max_epochs") == "1"
    big = pefll.run("clients", "pfedhn", 0.01, 0, 500, 1000)
    assert value(big, "--model.init_args.embedding_dim") == "251" and value(big, "--data.init_args.num_clients") == "1000"
    assert value(big, "--trainer.max_epochs") == "25000" and "--model.init_args.clients_per_round" not in big.args
    assert value(pefll.run("clients", "fedavg", 0.01, 0, 500, 1000), "--model.init_args.clients_per_round") == "50"
    free = pefll.run("table", "pefll_nolabels", 0.01, 0, 500, 500)
    assert value(free, "--model.init_args.embedding.init_args.use_labels") == "false"
    assert value(free, "--model.init_args.embedding.init_args.descriptor_dim") == "126"


def test_pefll_report_puts_each_row_at_its_chosen_rate_and_pairs_pefll_with_it(monkeypatch):
    from experiments.pefll import plan as pefll, report

    keys = ("clients_val/acc_mean", "clients_test/acc_mean", "clients_unseen_test/acc_mean", "finetuned_val/acc_mean",
            "finetuned_test/acc_mean", "finetuned_unseen_test/acc_mean")
    runs = [pefll_runs("tune", m, lr, dict.fromkeys(keys, 0.6 if lr == pefll.rates(m)[1] else 0.5))
            for m in pefll.RATES for lr in pefll.rates(m)]
    for seed, (ours, theirs) in enumerate([(0.9, 0.8), (0.92, 0.8), (0.94, 0.83)]):
        runs.append(pefll_runs("table", "pefll", 2e-4, dict.fromkeys(keys, ours), seed))
        runs.append(pefll_runs("table", "fedavg", 0.01, {**dict.fromkeys(keys, theirs), "finetuned_test/acc_mean": 0.95,
                                                          "finetuned_unseen_test/acc_mean": 0.95}, seed))
        runs.append(pefll_runs("table", "fedavg", 0.1, dict.fromkeys(keys, 0.1), seed))  # not the chosen rate
    stopped = pefll_runs("table", "pefll", 2e-4, dict.fromkeys(keys, 0.1), 3)  # a time limit stopped it: left out
    runs.append({**stopped, "stopped": "round 25 of 50", "history": stopped["history"][:1]})
    tables = report.tables(runs)
    assert len(tables) == 3
    comparison, differences = tables[1].splitlines(), tables[2].splitlines()
    assert [line.split(" | ")[0] for line in comparison[2:]] == ["| PeFLL", "| FedAvg", "| FedAvg + 50 finetuning steps"]
    assert "92.00 ± 2.00 (90.00–94.00)" in comparison[2] and "89.0 / 89.3" in comparison[2]
    assert "81.00 ± 1.73" in comparison[3] and "95.00 ± 0.00" in comparison[4]
    assert differences[2].startswith("| FedAvg | +11.00 ± 1.00")
    assert differences[3].startswith("| FedAvg + 50 finetuning steps | -3.00 ± 2.00")


def test_pefll_differences_pair_seeds_after_the_last_round_and_at_each_runs_best_validation():
    """PeFLL minus a row at each run's round of best seen-client validation accuracy, by the row's
    own validation figure (the finetuned one for FedAvg + finetuning), beside the final difference."""
    from experiments.pefll import plan as pefll, report

    def record(method, seed, peak, end, prefix="clients"):
        """Test accuracy ``peak`` (seen) and ``peak - 0.1`` (unseen) at round 25, the validation peak,
        and ``end`` on both after round 50."""
        run = pefll_runs("table", method, pefll.rates(method)[1], {}, seed)
        names = report.keys(prefix)
        run["history"] = [{"round": 25, names[0]: 0.9, names[1]: peak, names[2]: peak - 0.1},
                          {"round": 50, names[0]: 0.5, names[1]: end, names[2]: end}]
        return run

    tuning = [pefll_runs("tune", m, lr, {"clients_val/acc_mean": 0.6 if lr == pefll.rates(m)[1] else 0.5,
                                         "finetuned_val/acc_mean": 0.6 if lr == pefll.rates(m)[1] else 0.5})
              for m in pefll.RATES for lr in pefll.rates(m)]
    runs = tuning + [record("pefll", s, 0.95 + 0.01 * s, 0.90) for s in range(3)]
    for seed in range(3):  # the global model's validation peaks after round 50, the finetuned one's at round 25
        fedavg = record("fedavg", seed, 0.80, 0.85)
        fedavg["history"][1]["clients_val/acc_mean"] = 0.95
        for at, (val, acc) in zip(fedavg["history"], ((0.9, 0.92), (0.5, 0.99))):
            at.update({"finetuned_val/acc_mean": val, "finetuned_test/acc_mean": acc,
                       "finetuned_unseen_test/acc_mean": acc})
        runs.append(fedavg)
    table = report.differences_table(runs, "table", 100).splitlines()
    assert table[0] == ("| PeFLL minus | seen, final: mean ± std [95 % CI] | unseen, final | seen, best val | "
                        "unseen, best val |")
    assert table[2] == ("| FedAvg | +5.00 ± 0.00 [+5.00, +5.00] | +5.00 ± 0.00 [+5.00, +5.00] | "
                        "+11.00 ± 1.00 [+8.52, +13.48] | +1.00 ± 1.00 [-1.48, +3.48] |")  # FedAvg after round 50
    assert table[3] == ("| FedAvg + 50 finetuning steps | -9.00 ± 0.00 [-9.00, -9.00] | "
                        "-9.00 ± 0.00 [-9.00, -9.00] | +4.00 ± 1.00 [+1.52, +6.48] | "
                        "-6.00 ± 1.00 [-8.48, -3.52] |")  # the finetuned model's validation peaks at round 25


def test_pefll_clients_tables_follow_the_table_cut_to_as_many_client_visits(monkeypatch):
    """The clients study's 100 rounds (5 visits per client) are set beside the n = 100 table's first
    100 rounds: pFedHN's server steps are cut at 5 to a round, Local only's one round is kept whole."""
    from experiments.pefll import plan as pefll, report

    assert pefll.run("clients", "pefll", 2e-4, 0, pefll.CLIENTS_ROUNDS, 500, pefll.CLIENTS_EVERY).every == 25
    pfedhn = {"params": dict(method="pfedhn", rounds=2500, client_rounds=500),
              "history": [{"round": r} for r in (250, 500, 750)]}
    assert [p["round"] for p in report.at_client_round(pfedhn, 100)["history"]] == [250, 500]
    local = {"params": dict(method="local", rounds=1, client_rounds=500), "history": [{"round": 1}]}
    assert report.at_client_round(local, 100) == local

    monkeypatch.setattr(report, "CLIENTS_ROUNDS", 25)
    keys = ("clients_val/acc_mean", "clients_test/acc_mean", "clients_unseen_test/acc_mean", "finetuned_val/acc_mean")
    runs = [pefll_runs("tune", m, lr, dict.fromkeys(keys, 0.6 if lr == pefll.rates(m)[1] else 0.5))
            for m in pefll.RATES for lr in pefll.rates(m)]
    runs += [pefll_runs(study, "pefll", 2e-4, dict.fromkeys(keys, 0.9), seed, n)
             for study, n in (("table", 100), ("clients", 500)) for seed in range(3)]
    tables = report.tables(runs)
    assert len(tables) == 4  # the tuning, then a comparison per cut; no differences with PeFLL's runs alone
    full, cut, clients = tables[1].splitlines()[2], tables[2].splitlines()[2], tables[3].splitlines()[2]
    assert "| 50 | 90.00 ± 0.00" in full and "| 25 | 50.00 ± 0.00" in cut and "| 50 | 90.00 ± 0.00" in clients
    assert "88.9 / 88.9" in clients  # the paper's figures for 450 training clients


def test_feddeper_cnn_and_n100_cells_run_the_paper_setting_and_the_transferred_tuned_one(monkeypatch, tmp_path):
    monkeypatch.setattr(plan, "RESULTS", tmp_path / "absent.json")
    monkeypatch.setattr(plan, "tuned", lambda runs=None: {(5, "fedavg"): {"lr": 0.1, "batch": 32},
                                                          (5, "scaffold"): dict(plan.PAPER["scaffold"])})
    monkeypatch.setattr(plan, "first_stage", lambda runs: {})
    with pytest.warns(UserWarning):
        planned = plan.runs()
    cnn = [r for r in planned if r.params["study"] == "cnn"]
    # the paper's setting for each method, and FedAvg's tuned one (SCAFFOLD's tuned one is the paper's)
    assert len(cnn) == 3 * (len(plan.GRIDS) + 1) and {r.params["seed"] for r in cnn} == set(plan.SEEDS)
    assert "cnn/m5/fedavg_lr0.1_b32_s1" in {r.name for r in cnn}
    assert all(r.args[1] == "configs/feddeper/mnist_cnn.yaml" and "n" not in r.params for r in cnn)
    n100 = [r for r in planned if r.params["study"] == "n100"]
    assert {r.params["m"] for r in n100} == {5, 10} and all(r.params["n"] == 100 for r in n100)
    assert len([r for r in n100 if r.params["m"] == 10]) == 3 * len(plan.GRIDS)  # m = 10 untuned: the paper's only
    assert all(r.args[r.args.index("--data.init_args.num_clients") + 1] == "100" for r in n100)


def test_feddeper_lower_rate_follows_a_diverged_table_run():
    def table_run(seed: int, final: float) -> dict:
        return {"name": f"table/m5/fedavg_lr0.316_b64_s{seed}", "params": dict(study="table", m=5, method="fedavg", lr=0.316,
                                                                                batch=64, seed=seed, rounds=500),
                "history": [{"round": 500, "test_acc": final}]}

    tuned = {"lr": 0.316, "batch": 64}
    stable = [table_run(0, 0.97), table_run(1, 0.96)]
    assert plan.lower_rate(stable, 5, "fedavg", tuned) is None
    assert plan.lower_rate(stable + [table_run(2, 0.098)], 5, "fedavg", tuned) == {"lr": 0.215, "batch": 64}  # one step down
    assert plan.lower_rate(stable + [table_run(2, 0.098)], 5, "feddeper", dict(plan.PAPER["feddeper"])) is None  # baselines only
    assert plan.lower_rate(stable + [table_run(2, 0.098)], 10, "fedavg", tuned) is None  # another cell's runs


def test_feddeper_star_factors_follow_a_diverged_feddeper_star_table_run():
    def star_run(seed: int, final: float, m: int = 10) -> dict:
        return {"name": f"table/m{m}/feddeper_star_lr0.01_rho0.05_lam0.3_b64_s{seed}",
                "params": dict(study="table", m=m, method="feddeper_star", lr=0.01, rho=0.05, lam=0.3, batch=64, seed=seed,
                               rounds=500),
                "history": [{"round": 500, "test_acc": final}]}

    tuned = dict(lr=0.01, rho=0.05, lam=0.3, batch=64)
    assert plan.star_factors([star_run(0, 0.90), star_run(1, 0.91)], 10, tuned) == []
    diverged = [star_run(0, 0.90), star_run(1, 0.19)]
    # each of rho and lambda back at the paper's value, the rest of the tuned setting kept
    assert plan.star_factors(diverged, 10, tuned) == [dict(lr=0.01, rho=0.03, lam=0.3, batch=64),
                                                      dict(lr=0.01, rho=0.05, lam=0.5, batch=64)]
    assert plan.star_factors(diverged, 10, dict(tuned, lam=0.5)) == []  # no run at that setting
    assert plan.star_factors(diverged, 5, tuned) == []  # another cell's runs
    assert plan.star_factors([star_run(0, 0.19)], 10, dict(tuned, rho=0.03)) == []  # a setting that is not the runs'


def test_feddeper_star_runs_at_the_paper_setting_where_the_tuned_one_differs(monkeypatch, tmp_path):
    monkeypatch.setattr(plan, "RESULTS", tmp_path / "absent.json")
    monkeypatch.setattr(plan, "tuned", lambda runs=None: {(10, "feddeper"): dict(lr=0.01, rho=0.05, lam=0.3, batch=64)})
    monkeypatch.setattr(plan, "first_stage", lambda runs: {})
    with pytest.warns(UserWarning):
        planned = [r for r in plan.runs() if r.params["study"] == "paper"]
    assert sorted(r.name for r in planned) == sorted(f"paper/m10/{method}_lr0.01_rho0.03_lam0.5_b64_s{s}"
                                                     for s in plan.SEEDS for method in ("feddeper", "feddeper_star"))
    star = next(r for r in planned if r.params["method"] == "feddeper_star")
    assert star.args[star.args.index("--model.init_args.local_steps") + 1] == "5"


def test_paired_differences_match_runs_by_seed_whatever_the_groups_order():
    """``seed_stats.paired`` subtracts each seed's run from the same seed's, also when the two groups
    list their seeds in different orders (a result file's order is the order runs finished)."""
    from experiments.seed_stats import final, paired

    def run(seed: int, acc: float) -> dict:
        return {"params": {"seed": seed}, "history": [{"round": 1, "test_acc": acc}]}

    ours = [run(0, 0.90), run(1, 0.80), run(2, 0.70)]
    theirs = [run(2, 0.60), run(0, 0.90), run(1, 0.75)]  # differences 0, +5, +10 points
    assert paired(ours, theirs, final) == paired(ours, sorted(theirs, key=lambda r: r["params"]["seed"]), final)
    assert paired(ours, theirs, final).startswith("+5.00 ± 5.00 ")
    assert paired(ours[:2], theirs, final).startswith("+2.50 ± 3.54 ")  # seeds 0 and 1 only


def test_fedproxvr_estimator_error_is_zero_on_full_batches_and_measured_against_the_exact_gradient():
    """The Fig. 3 diagnosis measures each estimator against the exact local gradient: with the whole
    split as every step's batch both estimators are the exact gradient; at t = 1 (both from w_0's
    minibatch gradient and v_0) they are the same direction, off the exact one on minibatches; the
    recorded loss is the split's mean loss at the iterate."""
    import torch.nn.functional as F
    from torch.func import functional_call, grad_and_value

    from experiments.fedproxvr.estimator_error import aggregate_table, local_round, table

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    x, y = torch.randn(96, 5), torch.randint(0, 3, (96,))
    start = {n: p.detach().clone() for n, p in net.named_parameters()}

    def loss_grad(params, batch):
        grads, loss = grad_and_value(lambda p: F.cross_entropy(functional_call(net, p, (batch[0],)), batch[1]))(params)
        return loss, grads

    chunks = [((x[:40], y[:40]), 40), ((x[40:], y[40:]), 56)]
    full = [(x, y)] * 6
    for estimator in ("svrg", "sarah"):
        exact, _ = local_round(loss_grad, full, chunks, start, estimator, eta=0.5, mu=0.01)
        assert max(exact["error"]) < 1e-5 and max(exact["minibatch_error"]) < 1e-5, estimator
        assert all(s > 0 for s in exact["smoothness"])
    order = torch.randperm(96, generator=torch.Generator().manual_seed(1))
    batches = [(x[order[i:i + 8]], y[order[i:i + 8]]) for i in range(0, 96, 8)]
    (svrg, svrg_sent), (sarah, sarah_sent) = (local_round(loss_grad, batches, chunks, start, e, eta=0.5, mu=0.01)
                                              for e in ("svrg", "sarah"))
    for estimator, sent in (("svrg", svrg_sent), ("sarah", sarah_sent)):  # unmeasured, the same round
        _, unmeasured = local_round(loss_grad, batches, chunks, start, estimator, eta=0.5, mu=0.01, measure=False)
        assert all(torch.equal(unmeasured[n], sent[n]) for n in sent)
    _, sgd = local_round(loss_grad, batches, chunks, start, "sgd", eta=0.5, mu=0.0, measure=False)
    plain = dict(start)
    for batch in batches:
        grads = loss_grad(plain, batch)[1]
        plain = {n: plain[n] - 0.5 * grads[n] for n in plain}
    assert all(torch.allclose(sgd[n], plain[n]) for n in plain)
    with pytest.raises(ValueError, match="not measured"):
        local_round(loss_grad, batches, chunks, start, "sgd", eta=0.5, mu=0.0)
    assert svrg["error"][0] == pytest.approx(sarah["error"][0], rel=1e-6) and svrg["error"][0] > 0.01
    assert svrg["error"][1:] != sarah["error"][1:]
    # the loss at w_1 (the full-gradient step) is the split's mean loss there
    w1 = {n: p - 0.5 * g for (n, p), g in zip(start.items(), loss_grad(start, (x, y))[1].values())}
    w1 = {n: (w1[n] + 0.5 * 0.01 * start[n]) / (1 + 0.5 * 0.01) for n in w1}
    assert svrg["loss"][0] == pytest.approx(float(loss_grad(w1, (x, y))[0]), rel=1e-5)
    result = {"commit": "c", "measurements": [{"warmup_rounds": 7, "client": 3, "client_train_samples": 96, "batch_size": 8,
              "settings": {"s": {"beta": 5, "tau": 12, "eta": 0.5, "svrg": svrg, "sarah": sarah, "max_smoothness": 2.0,
                                 "beta_at_most": 1.0, "sarah_tau_bound_at_most": 0.125}}}]}
    row = table(result).splitlines()[-1]
    assert row.startswith(f"| 7 | beta 5, tau 12, eta 0.5 | SARAH | {sarah['error'][0]:.3f} | {sarah['error'][5]:.3f} | "
                          f"{sarah['error'][-1]:.3f} | {sum(sarah['error']) / 12:.3f} |")
    assert row.endswith("| 2.0 | 1.00 | 0.12 |")
    assert table(result).splitlines()[0] == "commit c; client 3 (96 training samples, B = 8)"
    row = {"global_loss": 0.5, "local_loss": 0.25, "drift": 0.125}
    setting = {"beta": 5, "tau": 12, "eta": 0.5, "sgd": row, "svrg": row, "sarah": {**row, "drift": 0.75}}
    result["aggregates"] = [{"warmup_rounds": 7, "seed": 0, "start_loss": 1.0, "settings": {"s": setting}},
                            {"warmup_rounds": 3, "seed": 2, "trajectory": "sarah", "warm_setting": "beta7_tau40",
                             "start_loss": 2.0, "settings": {"s": setting}}]
    assert aggregate_table(result).splitlines()[2:] == [  # the first entry from before trajectories were recorded
        "| 7 of FedAvg (beta5_tau10), 0 | beta 5, tau 12, eta 0.5 | FedAvg | 1.0000 -> 0.5000 | 0.2500 | 0.125 |",
        "| 7 of FedAvg (beta5_tau10), 0 | beta 5, tau 12, eta 0.5 | SVRG | 1.0000 -> 0.5000 | 0.2500 | 0.125 |",
        "| 7 of FedAvg (beta5_tau10), 0 | beta 5, tau 12, eta 0.5 | SARAH | 1.0000 -> 0.5000 | 0.2500 | 0.750 |",
        "| 3 of SARAH (beta7_tau40), 2 | beta 5, tau 12, eta 0.5 | FedAvg | 2.0000 -> 0.5000 | 0.2500 | 0.125 |",
        "| 3 of SARAH (beta7_tau40), 2 | beta 5, tau 12, eta 0.5 | SVRG | 2.0000 -> 0.5000 | 0.2500 | 0.125 |",
        "| 3 of SARAH (beta7_tau40), 2 | beta 5, tau 12, eta 0.5 | SARAH | 2.0000 -> 0.5000 | 0.2500 | 0.750 |"]
    assert sarah["drift"][0] == pytest.approx(float(sum(((w1[n] - start[n]) ** 2).sum() for n in w1)) ** 0.5, rel=1e-5)


def test_fedproxvr_aggregates_are_added_to_the_result_file_as_it_is_when_each_ends(tmp_path, monkeypatch):
    """``estimator_error --aggregate`` keeps the file's other entries, also those another process wrote
    while it ran, and replaces the one entry that measured the same."""
    import json

    from experiments.fedproxvr import estimator_error

    out = tmp_path / "error.json"
    out.write_text(json.dumps({"commit": "c", "measurements": []}))

    def entry(warmup, seed, trajectory="fedavg", warm_setting=None, settings=None, code=None, loss=1.0):
        return {"warmup_rounds": warmup, "seed": seed, "trajectory": trajectory, "warm_setting": "beta7_tau40",
                "commit": "x", "start_loss": loss, "settings": {}}

    def meanwhile(warmup, seed, trajectory="fedavg", warm_setting=None, settings=None, code=None):
        assert code == "at start"
        other = json.loads(out.read_text())  # another process ends first
        other.setdefault("aggregates", []).append(entry(warmup, seed + 1))
        out.write_text(json.dumps(other))
        return entry(warmup, seed, trajectory)

    monkeypatch.setattr(estimator_error, "aggregate", meanwhile)
    argv = ["--aggregate", "--trajectory", "sarah", "--warm-setting", "beta7_tau40", "--warmup", "3", "--out", str(out)]
    started = []
    monkeypatch.setattr(estimator_error, "commit", lambda: started.append(1) or "at start")
    estimator_error.main(argv)
    assert started == [1]  # the commit is read once, when the process starts, and handed to each entry
    monkeypatch.setattr(estimator_error, "aggregate", lambda *a: entry(*a, loss=2.0))
    estimator_error.main(argv)  # the same measurement again: replaced
    result = json.loads(out.read_text())
    assert result["measurements"] == [] and result["commit"] == "c"
    assert [(a["trajectory"], a["seed"], a["start_loss"]) for a in result["aggregates"]] == [
        ("fedavg", 1, 1.0), ("sarah", 0, 2.0)]


def test_scaffold_with_sample_weighted_controls_weights_the_control_deltas_by_sample_count():
    """The SCAFFOLD experiment's "before" arm: after one round from c = 0, c is (|S| / N) times the
    sample-weighted mean of the sampled clients' control deltas (each client's c_i, which started at 0),
    where SCAFFOLD's own is (|S| / N) times their uniform mean."""
    from experiments.scaffold.run import SampleWeightedControlSCAFFOLD
    from fl_lightning.algorithms import SCAFFOLD
    from tests.helpers import synthetic, tiny_client, trainer

    for algorithm in (SCAFFOLD, SampleWeightedControlSCAFFOLD):
        dm = synthetic(8)
        module = algorithm(tiny_client(hidden=(8,)), clients_per_round=2, local_steps=4, seed=0)
        trainer(1).fit(module, dm)
        ran = list(module.engine.store.clients())
        sizes = torch.tensor([float(dm.num_samples(c)) for c in ran])
        controls = torch.stack([module.engine.store.get(c, "control") for c in ran])
        assert len(ran) == 2 and sizes[0] != sizes[1]
        weights = sizes / sizes.sum() if algorithm is SampleWeightedControlSCAFFOLD else torch.full((2,), 0.5)
        assert torch.allclose(module.server_control.cpu(), 2 / 8 * (weights[:, None] * controls).sum(0), atol=1e-6)
