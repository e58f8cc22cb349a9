"""``python -c CODE`` and ``python -m MODULE`` for tests, without importing torch and Lightning each time.

A test that needs a process of its own (to import a module first, to kill it with SIGKILL, to see
what a command prints) used to start a fresh interpreter: about 7 s on two busy cores, nearly all
of it importing torch, torchvision, torchmetrics and Lightning. Here each such process is forked
from a server that imported those once per test process (:mod:`multiprocessing`'s forkserver with
:data:`PRELOAD`). The process is fresh where the tests look: no module of ``fl_lightning`` or of
``tests`` is imported when its command starts (checked: it fails otherwise), it has its own pid,
working folder, environment and output, and it ends with its command's exit status (``-N`` when
killed by signal ``N``).

What it shares with its server is the third-party modules' import-time state, and it ends with
``os._exit`` after its exit handlers (C++ static destructors do not run): a test of start-up or
exit itself (the malloc settings a sweep's processes start with, a gloo group closed at exit)
starts a real interpreter.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import runpy
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional, Sequence

#: the modules the server imports once: torch, and what importing ``fl_lightning`` imports of Lightning's.
#: ``pytorch_lightning`` imported makes fl_lightning choose it unless ``FL_LIGHTNING_PACKAGE`` says otherwise
#: (:mod:`fl_lightning.lightning_package`): a test of that choice takes it out of ``sys.modules`` first
PRELOAD = ["torch", "torchvision", "torchmetrics", "pytorch_lightning", "jsonargparse", "yaml"]

#: the multiprocessing context whose processes are forked from the preloaded server (also the
#: tests' two-process rank pool's, :mod:`tests.two_processes`)
CONTEXT = multiprocessing.get_context("forkserver")
CONTEXT.set_forkserver_preload(PRELOAD)


def _run(args: list[str], cwd: str, env: dict[str, str], out: str, err: str) -> None:
    """The forked process: ``python ARGS`` in ``cwd`` with ``env``, its output written to ``out`` and ``err``."""
    for fd, path in ((1, out), (2, err)):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    sys.stdout = open(1, "w", closefd=False, buffering=1)
    sys.stderr = open(2, "w", closefd=False, buffering=1)
    imported = sorted(m for m in sys.modules if m.split(".")[0] == "fl_lightning"
                      or (m.startswith("tests.") and m != __name__))
    code = 0
    try:
        if imported:
            raise RuntimeError(f"the process is not fresh: {imported} imported before its command")
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
        paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[:0] = [cwd, *paths]
        if args[0] == "-c":
            sys.argv = ["-c", *args[2:]]
            exec(compile(args[1], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
        elif args[0] == "-m":
            sys.argv = [args[1], *args[2:]]
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        else:
            raise ValueError(f"args must start with -c or -m, got {args[:1]}")
    except SystemExit as done:
        if done.code is None or isinstance(done.code, int):
            code = done.code or 0
        else:
            print(done.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001: reported as a fresh interpreter would
        import traceback

        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()  # as the interpreter's exit would; C++ static destructors do not run (os._exit)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class FreshPython:
    """``python ARGS`` (``-c CODE ...`` or ``-m MODULE ...``) started in ``cwd`` with ``env`` (default:
    this process's environment), forked from the preloaded server; its output goes to files, read
    once it has ended."""

    def __init__(self, args: Sequence[str], cwd: Optional[os.PathLike] = None,
                 env: Optional[dict[str, str]] = None) -> None:
        self._folder = tempfile.TemporaryDirectory(prefix="fresh-python-")
        self._out, self._err = (str(Path(self._folder.name) / name) for name in ("stdout", "stderr"))
        cwd = str(cwd if cwd is not None else os.getcwd())
        self._process = CONTEXT.Process(target=_run, args=(list(args), cwd, dict(env if env is not None else os.environ),
                                                             self._out, self._err), daemon=True)
        self._process.start()
        self.pid: int = self._process.pid

    def poll(self) -> Optional[int]:
        """The exit status, or None while it runs."""
        return self._process.exitcode

    def wait(self, timeout: Optional[float] = None) -> int:
        """Wait for the end (``subprocess.TimeoutExpired`` after ``timeout`` seconds) and return the status."""
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(["python", "(forked)"], timeout)
        return self._process.exitcode

    def kill(self) -> None:
        """SIGKILL it."""
        self._process.kill()

    @property
    def stdout(self) -> str:
        return Path(self._out).read_text()

    @property
    def stderr(self) -> str:
        return Path(self._err).read_text()


def run_python(args: Sequence[str], cwd: Optional[os.PathLike] = None, env: Optional[dict[str, str]] = None,
               timeout: float = 300) -> subprocess.CompletedProcess:
    """``subprocess.run([sys.executable, *args], capture_output=True, text=True)`` run as a :class:`FreshPython`."""
    process = FreshPython(args, cwd, env)
    try:
        code = process.wait(timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        raise
    return subprocess.CompletedProcess(["python", *args], code, process.stdout, process.stderr)
