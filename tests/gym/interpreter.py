"""One long-lived Python of the Gym venv that runs the tests' Gym-side scripts.

Each script used to be a process of its own, and most of its time was the
interpreter's start and Gym's imports (2-6 s on 2 cores, several seconds more
for `gym eval`'s). Here they are paid once: every script runs as ``python -c``
would run it (``__name__ == "__main__"``, ``sys.argv[1:]`` its arguments, its
exit status from ``SystemExit`` or an uncaught exception) in a fresh namespace
of the same interpreter, with its stdout and stderr captured.
"""

from __future__ import annotations

import contextlib
import json
import select
import subprocess
from dataclasses import dataclass
from pathlib import Path

_LOOP = r"""
import contextlib, io, json, sys, traceback

def run(code, args):
    sys.argv = ["-c", *args]
    try:
        exec(compile(code, "<gym script>", "exec"), {"__name__": "__main__"})
    except SystemExit as stop:
        return stop.code if isinstance(stop.code, int) else int(stop.code is not None)
    except BaseException:
        traceback.print_exc()
        return 1
    return 0

answers = sys.stdout
for line in sys.stdin:
    job = json.loads(line)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        returncode = run(job["code"], job["args"])
    answer = {"returncode": returncode, "stdout": out.getvalue(), "stderr": err.getvalue()}
    answers.write(json.dumps(answer) + "\n")
    answers.flush()
"""


@dataclass(frozen=True)
class ScriptResult:
    returncode: int
    stdout: str
    stderr: str


class GymInterpreter:
    """The Gym venv's Python, started once; ``run`` one script at a time."""

    def __init__(self, venv: Path, log: Path) -> None:
        self._log = log
        with log.open("wb") as stderr:
            self._popen = subprocess.Popen(
                [str(venv / "bin" / "python"), "-u", "-c", _LOOP],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=stderr,
                text=True,
                start_new_session=True,
            )

    def run(self, code: str, *args: str, timeout_s: float = 120) -> ScriptResult:
        stdin, stdout = self._popen.stdin, self._popen.stdout
        assert stdin is not None and stdout is not None
        stdin.write(json.dumps({"code": code, "args": list(args)}) + "\n")
        stdin.flush()
        # The answer is one line written at once: once readable, readline returns it whole.
        readable, _, _ = select.select([stdout], [], [], timeout_s)
        line = stdout.readline() if readable else ""
        if not line:
            self.stop()
            reason = "timed out" if not readable else "exited"
            raise AssertionError(f"the Gym interpreter {reason}:\n{self._log.read_text()[-3000:]}")
        answer = json.loads(line)
        return ScriptResult(answer["returncode"], answer["stdout"], answer["stderr"])

    def stop(self) -> None:
        stdin, stdout = self._popen.stdin, self._popen.stdout
        assert stdin is not None and stdout is not None
        with contextlib.suppress(BrokenPipeError):
            stdin.close()  # its loop ends at end of input
        try:
            self._popen.wait(15)
        except subprocess.TimeoutExpired:
            self._popen.kill()
            self._popen.wait()
        stdout.close()
