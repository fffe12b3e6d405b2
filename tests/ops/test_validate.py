"""`dispatcher validate`: the run's own checks and a preview of what it would run."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import SimAgentFactory
from tests.helpers import run_args, run_cli, write_tasks


def tree(path: Path) -> dict[str, tuple[int, int]]:
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in path.rglob("*")}


async def test_preview_of_a_new_run_writes_nothing(
    tmp_path: Path, sim_agent: SimAgentFactory
) -> None:
    url, _ = await sim_agent()
    tasks = write_tasks(tmp_path / "t.jsonl", 5)
    write_tasks(tasks.with_name("more.jsonl"), 2, agent="other")
    with tasks.open("ab") as f:
        f.write(tasks.with_name("more.jsonl").read_bytes())
    before = tree(tmp_path)

    result = await run_cli(
        "validate", *run_args(tasks, tmp_path / "out" / "x.jsonl", url)[1:],
        "--agent", f"other={url},{url}", "--num-repeats", '{"sim": 3, "_default": 2}',
    )  # fmt: skip

    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "7 rows, 7 tasks, 19 rollouts" in out
    assert "sim          15" in out and "other         4" in out
    assert "resume: none (a new run)" in out and "would run: 19 rollouts" in out
    assert out.count("reachable") == 3
    assert out.endswith("ok: `dispatcher run` would start (nothing was written)\n")
    assert tree(tmp_path) == before


async def test_resume_state_and_refusals(tmp_path: Path, sim_agent: SimAgentFactory) -> None:
    url, _ = await sim_agent()
    tasks = write_tasks(tmp_path / "t.jsonl", 4)
    args = run_args(tasks, tmp_path / "x.jsonl", url, "--num-repeats", "2")
    assert (await run_cli(*args)).returncode == 0
    before = tree(tmp_path)

    again = await run_cli("validate", *args[1:])
    changed = await run_cli("validate", *args[1:], "--limit", "3")

    assert again.returncode == 0, again.stdout + again.stderr
    assert "resume: hop 2 of run" in again.stdout and "8 of 8 rollouts final" in again.stdout
    assert "would run: 0 rollouts" in again.stdout
    assert changed.returncode == 2
    assert "task-affecting settings changed (limit: None -> 3)" in changed.stdout
    assert tree(tmp_path) == before


async def test_problems_exit_2_and_say_where(tmp_path: Path, sim_agent: SimAgentFactory) -> None:
    url, _ = await sim_agent()
    tasks = write_tasks(tmp_path / "t.jsonl", 2)
    with tasks.open("ab") as f:
        f.write(b"[1, 2]\n")
    dead = "http://127.0.0.1:9"  # the discard port: nothing listens there

    result = await run_cli(
        "validate", *run_args(tasks, tmp_path / "x.jsonl", url)[1:], "--agent", f"b={dead}"
    )

    assert result.returncode == 2
    assert f"{tasks}:3" in result.stdout
    assert f"problem: agent b: {dead} does not answer" in result.stdout
    assert "would not start" in result.stdout
    assert not (tmp_path / "x_manifest.json").exists()


async def test_bad_setting_is_one_line_and_exit_2(tmp_path: Path) -> None:
    result = await run_cli("validate", "--input", "t", "--output", "o", "--concurrency", "0")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith("error: config key 'concurrency'")


async def test_replica_credentials_are_masked_and_replicas_kept_apart(
    tmp_path: Path, sim_agent: SimAgentFactory
) -> None:
    url, _ = await sim_agent()
    tasks = write_tasks(tmp_path / "t.jsonl", 2)
    one = url.replace("http://", "http://user:s3cret@")
    two = url.replace("http://", "http://user:0ther@")

    result = await run_cli("validate", *run_args(tasks, tmp_path / "x.jsonl", f"{one},{two}")[1:])

    assert result.returncode == 0, result.stdout + result.stderr
    shown = url.replace("http://", "http://user:***@")
    assert f"agent sim: {shown} reachable" in result.stdout
    assert f"agent sim: {shown}#2 reachable" in result.stdout
    assert "s3cret" not in result.stdout + result.stderr
    assert "0ther" not in result.stdout + result.stderr


async def test_an_agent_flag_without_a_name_does_not_repeat_the_password(tmp_path: Path) -> None:
    tasks = write_tasks(tmp_path / "t.jsonl", 1)

    result = await run_cli(
        "validate", "--input", str(tasks), "--output", str(tmp_path / "x.jsonl"),
        "--agent", "http://user:s3cret@127.0.0.1:9",
    )  # fmt: skip

    assert result.returncode == 2
    error = result.stderr.strip().splitlines()[-1]
    assert error == "error: --agent 'http://user:***@127.0.0.1:9': expected NAME=URL[,URL...]"
    assert "s3cret" not in result.stdout + result.stderr
