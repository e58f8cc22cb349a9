"""The experiment sweep's recorder (``experiments/sweep.py``): what it measures of the global model."""

from __future__ import annotations

import math
import sys

import pytest
import torch

from experiments.sweep import Recorder, measures
from fl_lightning.algorithms.fedavg import FedAvg
from fl_lightning.algorithms.local_only import LocalOnly
from fl_lightning.callbacks import ClientMetrics
from tests.helpers import synthetic, tiny_client, trainer


@pytest.fixture(autouse=True)
def recorded_commit(monkeypatch):
    """The commit the sweeps of these tests record, whatever state the checkout under test is in (a
    developer's has uncommitted changes; :func:`test_a_run_refuses_uncommitted_code_and_records_its_environment`
    tests the checkout's own)."""
    monkeypatch.setenv("FL_LIGHTNING_COMMIT", "0123abc")


def test_measures_per_class_and_the_kl_dro_objective():
    losses = torch.tensor([0.5, 1.0, 2.0, 4.0, 0.1], dtype=torch.float64)
    right = torch.tensor([True, False, True, True, False])
    labels = torch.tensor([0, 0, 1, 1, 2])
    out = measures(losses, right, labels, classes=True, dro_lam=2.0)
    assert out["loss"] == pytest.approx(7.6 / 5) and out["acc"] == pytest.approx(0.6)
    assert (out["acc_class0"], out["acc_class1"], out["acc_class2"]) == (0.5, 1.0, 0.0)
    assert out["acc_balanced"] == pytest.approx(0.5) and out["acc_worst_class"] == 0.0
    assert out["kl_dro"] == pytest.approx(2.0 * math.log(sum(math.exp(v / 2.0) for v in losses.tolist()) / 5))
    # between the mean loss (lambda -> infinity) and the largest (lambda -> 0)
    assert measures(losses, right, labels, dro_lam=1e6)["kl_dro"] == pytest.approx(out["loss"], rel=1e-5)
    assert measures(losses, right, labels, dro_lam=1e-3)["kl_dro"] == pytest.approx(4.0 - 1e-3 * math.log(5), rel=1e-6)
    assert set(measures(losses, right, labels)) == {"loss", "acc"}


def test_recorder_records_the_sets_and_figures_asked_for():
    recorder = Recorder(every=2, train=False, classes=True, dro_lam=5.0)
    trainer(4, callbacks=[recorder]).fit(FedAvg(tiny_client(), clients_per_round=4, seed=0), synthetic(8))
    assert [p["round"] for p in recorder.history] == [2, 4]
    point = recorder.history[-1]
    assert {"test_acc", "test_acc_balanced", "test_acc_worst_class", "val_acc_balanced", "train_kl_dro"} <= set(point)
    assert "train_acc" not in point  # only the DRO objective of the training splits without train=True
    assert "test_acc_class0" in point and "val_acc_class0" not in point  # each class on the test set only
    assert point["test_acc_worst_class"] <= point["test_acc_balanced"]
    plain = Recorder(every=4)
    trainer(4, callbacks=[plain]).fit(FedAvg(tiny_client(), clients_per_round=4, seed=0), synthetic(8))
    assert set(plain.history[0]) == {"round", "test_loss", "test_acc", "val_loss", "val_acc"}
    assert plain.history[0]["test_acc"] == point["test_acc"]  # the same run, measured the same way


def test_an_overflowing_model_is_measured_as_it_is():
    """Losses that overflowed give a NaN or infinite mean loss and KL-DRO objective, not an error:
    the run goes on (PDSGD at lambda 1 stopped a sweep worker here)."""
    right, labels = torch.tensor([True, False, True]), torch.tensor([0, 1, 1])
    infinite = measures(torch.tensor([0.5, math.inf, 1.0], dtype=torch.float64), right, labels, dro_lam=1.0)
    undefined = measures(torch.tensor([0.5, math.nan, 1.0], dtype=torch.float64), right, labels, dro_lam=1.0)
    assert infinite["acc"] == undefined["acc"] == pytest.approx(2 / 3)
    assert infinite["kl_dro"] == math.inf and math.isnan(undefined["kl_dro"])


def test_recorder_records_only_the_callbacks_metrics_of_a_method_without_global_model():
    """Local only has no global model: its figures are its clients' own (ClientMetrics), recorded
    at the rounds a validation ran; nothing is measured of the untrained template model."""
    recorder = Recorder(every=1, metrics=("clients_",))
    tr = trainer(1, callbacks=[ClientMetrics(), recorder], check_val_every_n_epoch=1)
    tr.fit(LocalOnly(tiny_client(), clients_per_round=6, local_steps=3, seed=0), synthetic(6))
    (point,) = recorder.history
    assert set(point) == {"round", "clients_test/acc_mean", "clients_test/acc_worst", "clients_test/acc_p10"}
    assert point["clients_test/acc_mean"] == float(tr.callback_metrics["clients_test/acc_mean"])


def test_a_run_that_diverges_is_recorded_as_such_and_loses_the_tuning(tmp_path, monkeypatch):
    """The sweep records a diverged run (the round, the error, the evaluations before) instead of
    stopping, and a tuning never chooses it, whatever its last evaluation."""
    from pathlib import Path

    from experiments import results
    from experiments.sweep import Run, fit

    config = Path(__file__).resolve().parents[1] / "configs" / "quickstart.yaml"
    monkeypatch.chdir(tmp_path)
    args = ["--config", str(config), "--model.init_args.nonfinite_updates", "raise", "--trainer.max_epochs", "4",
            "--trainer.callbacks", "[]", "--trainer.enable_checkpointing", "false"]
    calm = fit(Run("calm", args, {}, every=1), "test", object(), "abc")
    wild = fit(Run("wild", [*args, "--model.init_args.client.init_args.lr", "1e38"], {}, every=1), "test", object(), "abc")
    assert "diverged" not in calm and len(calm["history"]) == 4
    assert wild["diverged"].startswith("round ") and "NonFiniteUpdateError" in wild["diverged"]
    assert len(wild["history"]) < 4
    wild["history"] = calm["history"]  # even with the better evaluations, it is not chosen
    assert results.best_named([wild, calm], ["wild", "calm"], lambda r: -results.last(r, "test_loss")) == 1


def test_a_sweep_given_a_backend_runs_every_client_on_it_and_records_it(tmp_path, monkeypatch):
    """``--backend batched`` (how a GPU sweep runs a plan written for the sequential backend) trains
    on the batched backend, records it and the device, and gives the sequential run's figures."""
    from pathlib import Path

    from experiments.sweep import Run, fit

    config = Path(__file__).resolve().parents[1] / "configs" / "quickstart.yaml"
    monkeypatch.chdir(tmp_path)
    args = ["--config", str(config), "--trainer.max_epochs", "3", "--trainer.callbacks", "[]"]
    plain = fit(Run("plain", args, {}, every=1), "test", object(), "abc")
    batched = fit(Run("batched", args, {}, every=1), "test", object(), "abc", backend="batched")
    assert "backend" not in plain and batched["backend"] == "batched"
    assert plain["device"] == batched["device"] == "cpu" and plain["env"]["torch"] == torch.__version__
    for ours, theirs in zip(batched["history"], plain["history"], strict=True):
        assert ours.keys() == theirs.keys()
        assert ours == pytest.approx(theirs, rel=1e-4, abs=1e-5)


def test_a_run_parses_its_own_arguments_without_the_sweeps_command_line_warning(tmp_path, monkeypatch, recwarn):
    """The sweep's own arguments (``pefll --only ...``) are not the run's: LightningCLI's warning about
    arguments given both ways, once a run, is not raised, and the sweep's ``sys.argv`` is left as it was."""
    from pathlib import Path

    from experiments.sweep import Run, fit

    config = Path(__file__).resolve().parents[1] / "configs" / "quickstart.yaml"
    monkeypatch.chdir(tmp_path)
    argv = ["sweep.py", "test", "--only", "one"]
    monkeypatch.setattr("sys.argv", argv)
    fit(Run("one", ["--config", str(config), "--trainer.max_epochs", "1", "--trainer.callbacks", "[]"], {}, every=1),
        "test", object(), "abc")
    assert sys.argv == argv
    assert not [w for w in recwarn if "args parameter" in str(w.message)]


def test_a_run_refuses_uncommitted_code_and_records_its_environment(tmp_path, monkeypatch):
    """A record names a commit that reproduces it: uncommitted changes to code, configs or experiments
    (changed, deleted or new files; ignored run output aside) are refused naming the files, changes
    elsewhere (docs) are not; ``FL_LIGHTNING_COMMIT`` (a copy of the tree on a lent machine, whose
    ``.git`` may be stale) wins. The environment names the versions, threads and the tree."""
    import subprocess

    from experiments import results

    def git(*args):
        return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path, check=True,
                              capture_output=True, text=True).stdout.strip()

    for path in ("fl_lightning/a.py", "configs/b.yaml", "experiments/c.py", "docs/d.md"):
        (tmp_path / path).parent.mkdir(exist_ok=True)
        (tmp_path / path).write_text("x\n")
    (tmp_path / ".gitignore").write_text("experiments/**/*.json\n")
    git("init", "-q")
    git("add", ".")
    git("commit", "-qm", "a")
    monkeypatch.setattr(results, "ROOT", tmp_path)
    monkeypatch.delenv("FL_LIGHTNING_COMMIT")
    head = git("rev-parse", "HEAD")
    (tmp_path / "docs/d.md").write_text("changed\n")
    (tmp_path / "experiments/run.json").write_text("{}")  # ignored run output
    assert results.commit() == head
    for change, named in [(lambda: (tmp_path / "fl_lightning/a.py").write_text("y\n"), "fl_lightning/a.py"),
                          (lambda: (tmp_path / "configs/b.yaml").unlink(), "configs/b.yaml"),
                          (lambda: (tmp_path / "experiments/new.py").write_text("z\n"), "experiments/new.py")]:
        change()
        with pytest.raises(results.UncommittedChangesError, match=rf"1 file\(s\) under fl_lightning/, experiments/, "
                                                                  rf"configs/ are not committed \({named}\)"):
            results.commit()
        git("stash", "-u", "-q")
    assert results.commit() == head
    monkeypatch.setenv("FL_LIGHTNING_COMMIT", "0123abc")
    assert results.commit() == "0123abc"
    env = results.environment()
    assert env["torch"] == torch.__version__ and env["threads"] == torch.get_num_threads()
    assert env["tree"] == "FL_LIGHTNING_COMMIT" and {"python", "lightning", "numpy", "cuda", "machine"} <= env.keys()


def test_a_sweep_stops_before_a_run_once_the_checkout_has_moved(monkeypatch):
    """A sweep's processes run the code they imported: a checkout that moved to another commit (or holds
    uncommitted code) meanwhile stops the sweep before its next run."""
    from experiments import sweep

    monkeypatch.setenv("FL_LIGHTNING_COMMIT", "def456")
    with pytest.raises(RuntimeError, match="the checkout moved from 0123abc to def456 while the sweep ran"):
        sweep.record_run(sweep.Run("r", [], {}, every=1), "test", object(), "unused.json", "0123abc")


def test_merge_parts(tmp_path):
    from experiments import results
    from experiments.sweep import merge_parts, part_path

    out = tmp_path / "r.json"
    results.save(out, [{"name": "a", "history": []}])
    results.save(part_path(out, 0), [{"name": "b", "history": []}])
    results.save(part_path(out, 1), [{"name": "a", "history": [{"round": 1}]}])  # a rerun replaces
    assert merge_parts(out) == 2 and not list(tmp_path.glob("r.part*"))
    assert {r["name"]: r["history"] for r in results.load(out)} == {"a": [{"round": 1}], "b": []}


# a stand-in for a sweep's slot (experiments.sweep.serve): it notes each run it is handed, takes
# LENGTHS[name] tenths of a second over it, fails on "c" and reports the others done
FAKE_SLOT = """
import os, sys, time
part, ready, log = sys.argv[1], int(sys.argv[2]), sys.argv[3]
lengths = {"long": 30, "a": 1, "b": 1, "c": 1, "d": 1}
with os.fdopen(ready, "w", buffering=1) as done:
    for line in sys.stdin:
        name = line.strip()
        with open(log, "a") as notes:
            notes.write(f"{part} {os.getpid()} {name}\\n")
        time.sleep(lengths[name] / 10)
        if name == "c":
            sys.exit(1)
        with open(log, "a") as notes:
            notes.write(f"{part} {os.getpid()} finished-{name}\\n")
        done.write(line)
with open(log, "a") as notes:
    notes.write(f"{part} {os.getpid()} exit\\n")
"""


def test_a_parallel_sweep_hands_each_run_to_the_first_free_slot(tmp_path, monkeypatch):
    """Runs go to slots as slots free up (no slot idles while runs are left, whatever their lengths),
    in plan order; a slot runs its runs in one process; a run that fails ends its slot's process, is
    reported at the end, and the slot's next run goes to a new process; a slot left without runs
    ends at once (its memory freed), not when the sweep ends."""
    from experiments import sweep

    log = tmp_path / "started.txt"
    monkeypatch.setattr(sweep, "slot_command",
                        lambda paper, part, ready, options: [sys.executable, "-c", FAKE_SLOT, str(part), str(ready), str(log)])
    with pytest.raises(SystemExit, match=r"1 of 5 runs failed: c \(exit 1"):
        sweep.run_parallel("p", ["long", "a", "b", "c", "d"], tmp_path / "r.json", jobs=2, threads=1)
    notes = [line.split() for line in log.read_text().splitlines()]
    started = [note for note in notes if note[2] in ("long", "a", "b", "c", "d")]  # in each slot, in the order handed
    slots = {slot: [name for part, _, name in started if part.endswith(f".part{slot}.json")] for slot in (0, 1)}
    assert slots == {0: ["long"], 1: ["a", "b", "c", "d"]}
    process = {name: pid for _, pid, name in started}
    assert process["a"] == process["b"] == process["c"] != process["d"]  # c's failure ended its process
    # slot 1, idle once "d" is done and nothing is left, exits before "long" ends, not at the sweep's end
    events = [(pid, what) for _, pid, what in notes if what in ("exit", "finished-long")]
    assert events == [(process["d"], "exit"), (process["long"], "finished-long"), (process["long"], "exit")]


def test_a_parallel_sweep_records_what_a_sequential_one_does(tmp_path, monkeypatch):
    """``--jobs 2`` runs the pending runs in two worker processes and merges their part files: the
    same records (evaluations, commit) as one process running them one after the other."""
    from pathlib import Path

    from experiments import results
    from experiments.sweep import main

    (tmp_path / "configs").symlink_to(Path(__file__).resolve().parents[1] / "configs")
    monkeypatch.chdir(tmp_path)
    threads = torch.get_num_threads()
    try:
        main(["quickstart", "--only", "fedavg_lr0.05_*", "--out", "sequential.json"])
    finally:
        torch.set_num_threads(threads)
    main(["quickstart", "--only", "fedavg_lr0.05_*", "--jobs", "2", "--out", "parallel.json"])
    sequential, parallel = ({r["name"]: r for r in results.load(f)} for f in ("sequential.json", "parallel.json"))
    assert sorted(parallel) == ["fedavg_lr0.05_s0", "fedavg_lr0.05_s1"] and not list(tmp_path.glob("parallel.part*.json"))
    assert not list(tmp_path.glob("runs/quickstart/*/resume"))  # recorded runs leave no checkpoint to resume from
    for name, run in sequential.items():
        assert parallel[name]["history"] == run["history"] and parallel[name]["commit"] == run["commit"]


def test_a_stopped_run_resumes_from_its_last_evaluation_as_if_it_had_not_stopped(tmp_path, monkeypatch):
    """A run killed after its round-5 evaluation goes on from the checkpoint written there, with the
    history recorded before it: the record equals an uninterrupted run's."""
    from pathlib import Path

    from experiments.sweep import Run, fit, resume_dir

    config = Path(__file__).resolve().parents[1] / "configs" / "quickstart.yaml"
    monkeypatch.chdir(tmp_path)
    args = ["--config", str(config), "--trainer.max_epochs", "10", "--trainer.callbacks", "[]"]
    whole = fit(Run("whole", args, {}, every=5, at_start=True), "test", object(), "abc")
    measure = Recorder.measure
    measured = []

    def killed_after_round_5(self, trainer, module, round_number):
        if round_number > 5:
            raise KeyboardInterrupt  # as a session's end kills the sweep
        return measure(self, trainer, module, round_number)

    def counted(self, trainer, module, round_number):
        measured.append(round_number)
        return measure(self, trainer, module, round_number)

    monkeypatch.setattr(Recorder, "measure", killed_after_round_5)
    with pytest.raises((KeyboardInterrupt, SystemExit)):
        fit(Run("stopped", args, {}, every=5, at_start=True), "test", object(), "abc")
    assert (resume_dir("test", "stopped") / "last.ckpt").exists()
    monkeypatch.setattr(Recorder, "measure", counted)
    resumed = fit(Run("stopped", args, {}, every=5, at_start=True), "test", object(), "def")
    assert measured == [10]  # rounds 6-10 trained and measured again, not the rounds before
    assert (resumed["commit"], resumed["commits"]) == ("def", ["abc", "def"]) and "commits" not in whole
    assert [p["round"] for p in resumed["history"]] == [0, 5, 10]
    assert resumed["history"] == whole["history"]


def test_a_run_stopped_by_the_time_limit_is_recorded_as_such_and_finished_by_the_next_sweep(tmp_path, monkeypatch):
    """``--time-limit``: a run past the limit stops at its next evaluated round and is recorded as
    stopped there; runs not begun are not started; the next sweep resumes it from its checkpoint and
    replaces the record with one equal to an uninterrupted run's. A copy without git history records
    the commit it is given."""
    from pathlib import Path

    from experiments import results
    from experiments.sweep import main

    import subprocess
    import types

    from experiments import sweep

    (tmp_path / "configs").symlink_to(Path(__file__).resolve().parents[1] / "configs")
    monkeypatch.chdir(tmp_path)
    threads = torch.get_num_threads()
    try:
        main(["quickstart", "--only", "fedavg_lr0.05_s0", "--out", "whole.json"])
        monkeypatch.setattr(results, "subprocess", types.SimpleNamespace(
            run=_no_git, CalledProcessError=subprocess.CalledProcessError))
        monkeypatch.setenv("FL_LIGHTNING_COMMIT", "abc123")
        # the sweep's clock: the limit set and the first run begun at 0 s, every later reading at 100 s
        readings = iter([0.0, 0.0])
        monkeypatch.setattr(sweep, "time", types.SimpleNamespace(time=lambda: next(readings, 100.0),
                                                                 perf_counter=sweep.time.perf_counter))
        main(["quickstart", "--only", "fedavg_lr0.05_s[01]", "--time-limit", "10", "--out", "r.json"])
        monkeypatch.undo()
        monkeypatch.chdir(tmp_path)
        monkeypatch.setenv("FL_LIGHTNING_COMMIT", "0123abc")  # undone with the rest
        (stopped,) = results.load("r.json")  # s1 was not started
        assert stopped["stopped"] == "time limit, after round 5 of 10" and stopped["commit"] == "abc123"
        assert [p["round"] for p in stopped["history"]] == [5]
        main(["quickstart", "--only", "fedavg_lr0.05_s0", "--out", "r.json"])
    finally:
        torch.set_num_threads(threads)
    (finished,) = results.load("r.json")
    (whole,) = results.load("whole.json")
    assert "stopped" not in finished and finished["history"] == whole["history"]


def test_a_round_limit_advances_every_run_to_the_same_round_and_a_later_sweep_finishes_them(tmp_path, monkeypatch):
    """``--until-round``: every run stops at its first evaluated round from that round on, recorded as
    stopped there (both runs, not only the first, as a time limit would); a sweep with the same limit
    starts none of them again; a sweep without it resumes them to records equal to uninterrupted runs'."""
    from pathlib import Path

    from experiments import results, sweep
    from experiments.sweep import main

    (tmp_path / "configs").symlink_to(Path(__file__).resolve().parents[1] / "configs")
    monkeypatch.chdir(tmp_path)
    threads = torch.get_num_threads()
    try:
        main(["quickstart", "--only", "fedavg_lr0.05_s[01]", "--out", "whole.json"])
        main(["quickstart", "--only", "fedavg_lr0.05_s[01]", "--until-round", "3", "--out", "r.json"])
        stopped = results.load("r.json")
        assert [r["stopped"] for r in stopped] == ["round limit, after round 5 of 10"] * 2
        assert [[p["round"] for p in r["history"]] for r in stopped] == [[5]] * 2
        with monkeypatch.context() as m:
            m.setattr(sweep, "record_run", lambda *a, **k: pytest.fail("a run at its round limit started again"))
            main(["quickstart", "--only", "fedavg_lr0.05_s[01]", "--until-round", "5", "--out", "r.json"])
        main(["quickstart", "--only", "fedavg_lr0.05_s[01]", "--out", "r.json"])
    finally:
        torch.set_num_threads(threads)
    finished, whole = results.load("r.json"), results.load("whole.json")
    assert [r["history"] for r in finished] == [r["history"] for r in whole]
    assert not any("stopped" in r for r in finished)


def test_a_round_limit_below_one_is_refused(capsys):
    from experiments.sweep import main

    with pytest.raises(SystemExit):
        main(["quickstart", "--until-round", "0"])
    assert "--until-round must be a round >= 1, got 0" in capsys.readouterr().err


@pytest.mark.parametrize("limits", [(None, None), (1.8e9 + 0.25, None), (None, 50), (1.8e9 + 0.25, 50)])
def test_a_parallel_sweeps_slots_get_its_limits(monkeypatch, limits):
    """A slot's command line carries the sweep's limits (``Limits.options``) and the slot parses them back
    to the same ``Limits``: a parallel sweep with ``--until-round`` stops its runs where a sequential one does."""
    from experiments import sweep

    given = sweep.Limits(*limits)
    got = []
    monkeypatch.setattr(sweep, "keep_freed_memory", lambda: None)
    monkeypatch.setattr(sweep, "serve", lambda runs, paper, plan, out, ready, limits, backend: got.append(limits))
    threads = torch.get_num_threads()
    try:
        sweep.main(["quickstart", "--serve", "3", "--out", "r.json", *given.options()])
    finally:
        torch.set_num_threads(threads)
    assert got == [given]


def test_limits_name_the_limit_reached(monkeypatch):
    from experiments import sweep

    monkeypatch.setattr(sweep.time, "time", lambda: 100.0)
    assert sweep.Limits().reason(10**6) is None
    assert sweep.Limits(until=50).reason(49) is None
    assert sweep.Limits(until=50).reason(50) == "round limit"
    assert sweep.Limits(stop_at=100.5).reason(10) is None and not sweep.Limits(stop_at=100.5).timed_out()
    assert sweep.Limits(stop_at=100.0).reason(10) == "time limit" and sweep.Limits(stop_at=100.0).timed_out()
    assert sweep.Limits(stop_at=100.0, until=10).reason(10) == "round limit"


def _no_git(*args, **kwargs):
    raise FileNotFoundError("git")


MAPPED_BLOCKS = """
import ctypes
import torch
from experiments.sweep import keep_freed_memory
class Info(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Info
def mapped_by_a_large_vector():
    before = libc.mallinfo2().hblks
    vector = torch.ones(10_000_000)  # 40 MB: above glibc's largest mmap threshold
    return libc.mallinfo2().hblks - before
print(mapped_by_a_large_vector())
keep_freed_memory()
print(mapped_by_a_large_vector())
"""


def test_a_sweep_keeps_freed_memory_in_the_heap():
    """A sweep's processes keep large allocations in the heap (reused after they are freed) instead of
    glibc's fresh memory map per allocation, which page-faults a large model's vectors every round."""
    import ctypes
    import subprocess
    from pathlib import Path

    try:
        ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):
        pytest.skip("needs glibc >= 2.33")
    out = subprocess.run([sys.executable, "-c", MAPPED_BLOCKS], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[1]).stdout.split()
    assert out[-2:] == ["1", "0"]  # the vector's own memory map, then none
