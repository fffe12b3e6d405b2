"""One long-lived Python of the Gym venv that runs the tests' Gym-side scripts.

Each script used to be a process of its own, and most of its time was the
interpreter's start and Gym's imports (on 2 cores, about 2 s for a script
using Gym's models, about 6 s for a `gym eval` command). Here they are paid
once: the interpreter imports Gym, then
forks a child for every script, which runs it as ``python -c`` would
(``__name__ == "__main__"``, ``sys.argv[1:]`` its arguments, its exit status
from ``SystemExit`` or an uncaught exception, its own stdout and stderr) in a
process of its own. The fork keeps scripts apart: nothing one of them sets,
such as the global config Gym's commands resolve once a process, reaches the
next.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

# The `gym` console script's body: a Gym CLI command run through it is the command.
GYM_CLI = "import sys; from nemo_gym.cli.main import main; sys.exit(main())"

_LOOP = r"""
import json, os, sys, tempfile, traceback
# Imported once, before any fork (no thread runs yet): every child starts warm.
import anthropic.types, openai.types
import nemo_gym.base_responses_api_model, nemo_gym.cli.eval, nemo_gym.cli.main
import nemo_gym.openai_utils, nemo_gym.rollout_observability

def child(job, out, err):
    os.dup2(out.fileno(), 1)
    os.dup2(err.fileno(), 2)
    os.chdir(job["cwd"])
    sys.argv = [job["argv0"], *job["args"]]
    code = 0
    try:
        exec(compile(job["code"], "<gym script>", "exec"), {"__name__": "__main__"})
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else int(stop.code is not None)
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

answers = os.fdopen(os.dup(1), "w")  # a child's fd 1 is its own file, not this pipe
for line in sys.stdin:
    job = json.loads(line)
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        pid = os.fork()
        if pid == 0:
            child(job, out, err)
        _, status = os.waitpid(pid, 0)
        out.seek(0)
        err.seek(0)
        answer = {
            "returncode": os.waitstatus_to_exitcode(status),
            "stdout": out.read().decode(errors="replace"),
            "stderr": err.read().decode(errors="replace"),
        }
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

    def run(
        self, code: str, *args: str, cwd: Path | None = None, timeout_s: float = 120
    ) -> ScriptResult:
        """``code`` as ``python -c code args`` would run it in ``cwd``."""
        return self._ask({"code": code, "args": list(args), "argv0": "-c"}, cwd, timeout_s)

    def gym(self, *args: str, cwd: Path | None = None, timeout_s: float = 120) -> ScriptResult:
        """``gym args``, as the ``gym`` console script runs it, in ``cwd``."""
        return self._ask({"code": GYM_CLI, "args": list(args), "argv0": "gym"}, cwd, timeout_s)

    def _ask(self, job: dict[str, object], cwd: Path | None, timeout_s: float) -> ScriptResult:
        stdin, stdout = self._popen.stdin, self._popen.stdout
        assert stdin is not None and stdout is not None
        stdin.write(json.dumps({**job, "cwd": str(cwd or Path.cwd())}) + "\n")
        stdin.flush()
        # The answer is one line written at once: once readable, readline returns it whole.
        readable, _, _ = select.select([stdout], [], [], timeout_s)
        line = stdout.readline() if readable else ""
        if not line:
            self.stop(grace_s=0)
            reason = "timed out" if not readable else "exited"
            raise AssertionError(f"the Gym interpreter {reason}:\n{self._log.read_text()[-3000:]}")
        answer = json.loads(line)
        return ScriptResult(answer["returncode"], answer["stdout"], answer["stderr"])

    def stop(self, grace_s: float = 15) -> None:
        """End the loop (end of input), then kill whatever of its group is left, a
        child still running a script included."""
        stdin, stdout = self._popen.stdin, self._popen.stdout
        assert stdin is not None and stdout is not None
        with contextlib.suppress(BrokenPipeError):
            stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._popen.wait(grace_s)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self._popen.pid, signal.SIGKILL)
        self._popen.wait()
        stdout.close()
