"""Who may use the service (contracts §14), through real sockets: `dispatcher serve` in a
subprocess, the jobs API over HTTP and both clients.

A token guards every route but /metrics and /healthz; a job's input stays
inside the input root; beyond loopback a token is required; the token is in
no log and no file of the state directory; TLS with a self-signed cert.
"""

from __future__ import annotations

import asyncio
import signal
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from dispatcher.client import AsyncClient, Client, ClientError, JobState, Unauthorized
from tests.conftest import SimAgentFactory
from tests.helpers import (
    CliProcess,
    listening_url,
    run_cli,
    self_signed,
    spawn_cli,
)

pytestmark = pytest.mark.timeout(180)

TOKEN = "t0ken-Zq8vXk2pL9"
SECRET = "do-not-echo-7f3a"


@dataclass
class Daemon:
    proc: CliProcess
    url: str


async def start_serve(state_dir: Path, agent_url: str, *flags: str, **env: str) -> Daemon:
    proc = await spawn_cli(
        "serve", "--listen", "127.0.0.1:0", "--state-dir", str(state_dir),
        "--agent", f"sim={agent_url}", "--log-format", "json", "--fsync", "never", *flags,
        env=env,
    )  # fmt: skip
    return Daemon(proc, await listening_url(proc))


async def start_tls_serve(tmp_path: Path, agent_url: str, *flags: str) -> tuple[Daemon, Path]:
    """A daemon serving HTTPS with a token, and the self-signed cert a client trusts."""
    cert, key = self_signed(tmp_path)
    daemon = await start_serve(
        tmp_path / "state", agent_url, "--tls-cert", str(cert), "--tls-key", str(key), *flags,
        DISPATCHER_API_TOKEN=TOKEN,
    )  # fmt: skip
    return daemon, cert


async def stop(daemon: Daemon) -> tuple[int, str]:
    daemon.proc.send_signal(signal.SIGTERM)
    result = await daemon.proc.wait()
    return result.returncode, result.stdout + result.stderr


def token_file(tmp_path: Path, text: str = TOKEN + "\n") -> Path:
    path = tmp_path / "api-token"
    path.write_text(text)
    path.chmod(0o600)
    return path


def task_rows(count: int) -> list[dict[str, Any]]:
    return [
        {"agent_ref": {"name": "sim"}, "responses_create_params": {"input": f"q{i}"}}
        for i in range(count)
    ]


@pytest.fixture
async def guarded(tmp_path: Path, sim_agent: SimAgentFactory) -> AsyncIterator[Daemon]:
    agent_url, _ = await sim_agent()
    daemon = await start_serve(
        tmp_path / "state", agent_url, "--api-token-file", str(token_file(tmp_path))
    )
    yield daemon
    await daemon.proc.kill()


async def get(url: str, headers: dict[str, str] | None = None) -> tuple[int, bytes, Any]:
    async with aiohttp.ClientSession() as http, http.get(url, headers=headers) as r:
        return r.status, await r.read(), r.headers


async def test_a_token_guards_the_jobs_api_and_status_not_metrics_or_healthz(
    guarded: Daemon,
) -> None:
    for path in ("/v1/jobs", "/v1/jobs/nobody", "/status"):
        for headers in (None, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
            status, body, got = await get(guarded.url + path, headers)
            assert status == 401, (path, headers, body)
            assert body.count(b"\n") == 0 and orjson.loads(body)["error"].startswith("unauth")
            assert got["WWW-Authenticate"].startswith("Bearer")
            assert TOKEN.encode() not in body
        status, body, _ = await get(guarded.url + path, {"Authorization": f"Bearer {TOKEN}"})
        assert status == (404 if path.endswith("nobody") else 200), (path, body)
    for path in ("/metrics", "/healthz"):
        status, body, _ = await get(guarded.url + path)
        assert status == 200 and TOKEN.encode() not in body


async def test_both_clients_send_the_token_and_a_401_says_so(
    guarded: Daemon, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("DISPATCHER_API_TOKEN", raising=False)
    async with AsyncClient(guarded.url, token=TOKEN) as client:
        await client.submit(task_rows(3), job_id="a", num_repeats=2)
        results = client.results("a")
        assert len([row async for row in results]) == 6
        assert results.final_state is JobState.DONE
    async with AsyncClient(guarded.url) as anonymous:
        with pytest.raises(Unauthorized) as missing:
            await anonymous.jobs()
    async with AsyncClient(guarded.url, token="wrong") as wrong:
        with pytest.raises(Unauthorized) as refused:
            await wrong.status("a")
    assert isinstance(missing.value, ClientError) and missing.value.status == 401
    assert "none was given" in str(missing.value) and "DISPATCHER_API_TOKEN" in str(missing.value)
    assert "wrong" in str(refused.value) and TOKEN not in str(refused.value)

    def blocking(token: str | None) -> JobState | None:
        with Client(guarded.url, token=token) as client:
            return client.wait("a", poll_s=0.05).state

    monkeypatch.setenv("DISPATCHER_API_TOKEN", TOKEN)
    assert await asyncio.to_thread(blocking, None) is JobState.DONE
    monkeypatch.setenv("DISPATCHER_API_TOKEN", "wrong")
    with pytest.raises(Unauthorized):
        await asyncio.to_thread(blocking, None)
    assert await asyncio.to_thread(blocking, TOKEN) is JobState.DONE

    code, output = await stop(guarded)
    assert code == 0, output[-3000:]
    assert TOKEN not in output
    files = [p for p in (tmp_path / "state").rglob("*") if p.is_file()]
    assert any(p.name == "job.json" for p in files)
    for path in files:
        assert TOKEN.encode() not in path.read_bytes(), path


async def test_a_jobs_input_must_resolve_inside_the_input_root(
    tmp_path: Path, sim_agent: SimAgentFactory
) -> None:
    agent_url, _ = await sim_agent()
    root = tmp_path / "root"
    (root / "sub").mkdir(parents=True)
    outside = tmp_path / "outside.jsonl"
    outside.write_text(orjson.dumps({"responses_create_params": {"input": SECRET}}).decode())
    (root / "link.jsonl").symlink_to(outside)
    (root / "tasks.jsonl").write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in task_rows(2)))
    (root / "no_params.jsonl").write_text(f'{{"agent_ref": {{"name": "sim"}}, "x": "{SECRET}"}}\n')
    (root / "bad.jsonl").write_bytes(
        orjson.dumps(task_rows(1)[0]) + b"\n" + orjson.dumps({"note": SECRET}) + b"\n"
    )
    daemon = await start_serve(root / "state", agent_url, "--input-root", str(root))
    refused = {
        str(outside): "input: must resolve inside the input root",
        "../outside.jsonl": "input: must resolve inside the input root",
        "sub/../../outside.jsonl": "input: must resolve inside the input root",
        "link.jsonl": "input: must resolve inside the input root",
        "state/serve.lock": "input: must resolve inside the input root",
        "no_params.jsonl": f"{root / 'no_params.jsonl'}:1: the row has no responses_create_params",
        "bad.jsonl": f"{root / 'bad.jsonl'}:2: the row has no responses_create_params",
    }
    try:
        async with aiohttp.ClientSession() as http:
            for path, message in refused.items():
                async with http.post(f"{daemon.url}/v1/jobs", json={"input": path}) as r:
                    body = await r.read()
                assert r.status == 400, (path, body)
                error = orjson.loads(body)["error"]
                assert error.startswith(message) and "\n" not in error, (path, error)
                assert SECRET.encode() not in body and str(outside).encode() not in body
            job = {"input": "tasks.jsonl", "job_id": "inside"}
            async with http.post(f"{daemon.url}/v1/jobs", json=job) as r:
                assert r.status == 201, await r.text()
            async with http.get(f"{daemon.url}/v1/jobs/inside/results?wait=true") as r:
                lines = [orjson.loads(line) async for line in r.content if line.strip()]
            assert len(lines) == 3 and lines[-1] == {"end": "done"}
            # The job reads the file it was checked against: the resolved path.
            record = orjson.loads((root / "state" / "jobs" / "inside" / "job.json").read_bytes())
            assert str(root / "tasks.jsonl") in orjson.dumps(record).decode()
    finally:
        code, output = await stop(daemon)
    assert code == 0, output[-3000:]
    assert SECRET not in output


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--listen", "0.0.0.0:0"], "--api-token-file"),
        (["--listen", "[::]:0"], "--api-token-file"),
        (["--api-token-file", "{tmp}/absent"], "--api-token-file {tmp}/absent"),
        (["--api-token-file", "{tmp}/empty"], "--api-token-file {tmp}/empty: the token is empty"),
        (["--tls-cert", "{tmp}/empty"], "--tls-cert and --tls-key go together"),
        (["--tls-cert", "{tmp}/empty", "--tls-key", "{tmp}/absent"], "--tls-key {tmp}/absent"),
        (["--tls-cert", "{tmp}/empty", "--tls-key", "{tmp}/empty"], "--tls-cert {tmp}/empty: not"),
        (["--input-root", "{tmp}/absent"], "--input-root {tmp}/absent"),
        (
            ["--max-job-bytes", str(1 << 50)],
            "--max-job-bytes 1125899906842624: Input should be less than or equal to",
        ),
        (["--max-task-line-bytes", str(1 << 40)], "--max-task-line-bytes"),
    ],
)
async def test_refused_at_start_with_exit_2_naming_the_flag(
    tmp_path: Path, flags: list[str], named: str
) -> None:
    (tmp_path / "empty").write_text("\n")
    args = [f.replace("{tmp}", str(tmp_path)) for f in flags]

    result = await run_cli(
        "serve", "--state-dir", str(tmp_path / "state"), "--agent", "sim=http://127.0.0.1:9",
        *args,
    )  # fmt: skip

    assert result.returncode == 2, result.stderr[-2000:]
    [line] = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert named.replace("{tmp}", str(tmp_path)) in line
    assert not (tmp_path / "state").exists()


async def test_beyond_loopback_starts_with_a_token_or_allow_unauthenticated(
    tmp_path: Path,
) -> None:
    for flags, env in (
        (["--allow-unauthenticated"], {}),
        ([], {"DISPATCHER_API_TOKEN": TOKEN}),
    ):
        daemon = await start_serve(
            tmp_path / "state", "http://127.0.0.1:9", "--listen", "0.0.0.0:0", *flags, **env
        )
        code, output = await stop(daemon)
        assert code == 0, output[-3000:]
        assert TOKEN not in output


async def test_tls_serves_https_to_a_client_that_trusts_the_cert(
    tmp_path: Path, sim_agent: SimAgentFactory
) -> None:
    agent_url, _ = await sim_agent()
    daemon, cert = await start_tls_serve(tmp_path, agent_url)
    try:
        assert daemon.url.startswith("https://127.0.0.1:")
        trust = ssl.create_default_context(cafile=str(cert))
        async with AsyncClient(daemon.url, token=TOKEN, ssl_context=trust) as client:
            await client.submit(task_rows(2), job_id="tls")
            assert len([row async for row in client.results("tls")]) == 2
        async with AsyncClient(daemon.url, ssl_context=trust) as anonymous:
            with pytest.raises(Unauthorized):
                await anonymous.jobs()
        async with AsyncClient(daemon.url, token=TOKEN, retry_deadline_s=0) as untrusting:
            with pytest.raises(ClientError, match="ertificate"):
                await untrusting.jobs()
    finally:
        code, output = await stop(daemon)
    assert code == 0, output[-3000:]
    assert TOKEN not in output


async def test_a_tls_handshake_never_finished_is_closed_after_the_header_timeout(
    tmp_path: Path, sim_agent: SimAgentFactory
) -> None:
    # asyncio bounds a server's TLS handshake by 60 s of its own: a client that
    # connects and says nothing held its connection that long, whatever the flag.
    agent_url, _ = await sim_agent()
    daemon, _ = await start_tls_serve(tmp_path, agent_url, "--header-timeout-s", "1")
    try:
        host, port = daemon.url.removeprefix("https://").split(":")
        silent = [await asyncio.open_connection(host, int(port)) for _ in range(3)]
        for reader, writer in silent:
            # Closed by the daemon: EOF, no handshake ever answered. (The bound
            # only keeps a failing test from waiting asyncio's 60 s.)
            assert await asyncio.wait_for(reader.read(), timeout=30) == b""
            writer.close()
    finally:
        code, output = await stop(daemon)
    assert code == 0, output[-3000:]


async def test_an_input_root_in_a_symlink_loop_is_one_line_that_shows_no_secret(
    tmp_path: Path,
) -> None:
    # It was a traceback with every frame's locals: the token and the agent's
    # password among them.
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")

    result = await run_cli(
        "serve", "--state-dir", str(tmp_path / "state"), "--log-format", "json",
        "--agent", f"sim=http://user:{SECRET}@127.0.0.1:9",
        "--api-token-file", str(token_file(tmp_path)), "--input-root", str(tmp_path / "a"),
    )  # fmt: skip

    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr == f"error: --input-root {tmp_path / 'a'}: a symlink loop\n"
    assert TOKEN not in result.stdout + result.stderr
    assert SECRET not in result.stdout + result.stderr
