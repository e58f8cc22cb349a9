"""The tests' forked interpreters (:mod:`tests.fresh_python`) behave as ``python -c`` / ``python -m`` would."""

from __future__ import annotations

import signal
import time

from tests.fresh_python import FreshPython, run_python


def test_a_forked_python_is_fresh_and_ends_as_its_command_does(tmp_path):
    done = run_python(["-c", "import os, sys; print(os.getcwd(), os.environ['MARK'], sys.argv[1:]);"
                       "print([m for m in sys.modules if m.split('.')[0] == 'fl_lightning'])", "a", "b"],
                      cwd=tmp_path, env={"MARK": "here"})
    assert done.returncode == 0 and done.stdout.split("\n")[:2] == [f"{tmp_path} here ['a', 'b']", "[]"]
    exited = run_python(["-c", "import atexit; atexit.register(print, 'at exit'); raise SystemExit(3)"])
    assert exited.returncode == 3 and exited.stdout == "at exit\n"
    failed = run_python(["-c", "1 / 0"])
    assert failed.returncode == 1 and "ZeroDivisionError" in failed.stderr
    (tmp_path / "hello.py").write_text("import sys\nprint('module', __name__, sys.argv[1:])\n")
    assert run_python(["-m", "hello", "x"], cwd=tmp_path).stdout == "module __main__ ['x']\n"
    sleeper = FreshPython(["-c", "import time; time.sleep(60)"])
    time.sleep(0.2)
    assert sleeper.poll() is None
    sleeper.kill()
    assert sleeper.wait(30) == -signal.SIGKILL
