"""What a browser could send without asking is refused (contracts §14), token or not, through
raw sockets against `dispatcher serve` in a subprocess.

A web page can make a browser POST a `text/plain` body cross-origin with no
preflight, and a DNS-rebinding page reads answers under its own host name.
So the control plane takes only `application/json` bodies, refuses a foreign
`Origin`, and answers only requests whose `Host` names the listener (or a
`--allowed-host`); `/metrics` and `/healthz` stay open to GETs for scrapers
and probes.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from dispatcher.client import AsyncClient
from tests.conftest import SimAgentFactory
from tests.helpers import run_cli
from tests.serve.test_auth import Daemon, start_serve, stop, task_rows, token_file

pytestmark = pytest.mark.timeout(120)

JOB = orjson.dumps({"job_id": "page", "rows": task_rows(1)})


async def send(
    daemon: Daemon, method: str, path: str, headers: dict[str, str], body: bytes = b""
) -> tuple[int, Any]:
    """One request on a raw socket, its headers exactly these (Host included): status, JSON."""
    host, port = daemon.url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    lines = [f"{method} {path} HTTP/1.1", "Connection: close", f"Content-Length: {len(body)}"]
    lines += [f"{name}: {value}" for name, value in headers.items()]
    writer.write(("\r\n".join(lines) + "\r\n\r\n").encode() + body)
    answer = await reader.read()
    writer.close()
    head, _, payload = answer.partition(b"\r\n\r\n")
    status = int(head.split()[1])
    try:
        return status, orjson.loads(payload)
    except orjson.JSONDecodeError:
        return status, payload


@pytest.fixture(params=["open", "token"])
async def daemon(
    request: pytest.FixtureRequest, tmp_path: Path, sim_agent: SimAgentFactory
) -> AsyncIterator[Daemon]:
    agent_url, _ = await sim_agent()
    flags = ["--allowed-host", "rollouts.example.org"]
    if request.param == "token":
        flags += ["--api-token-file", str(token_file(tmp_path))]
    started = await start_serve(tmp_path / "state", agent_url, *flags)
    yield started
    await started.proc.kill()


def authorized(daemon: Daemon, tmp_path: Path, headers: dict[str, str]) -> dict[str, str]:
    token = tmp_path / "api-token"
    if token.exists():
        headers = {**headers, "Authorization": f"Bearer {token.read_text().strip()}"}
    return headers


async def test_bodies_a_browser_sends_unasked_are_refused_and_create_nothing(
    daemon: Daemon, tmp_path: Path
) -> None:
    own = daemon.url.removeprefix("http://")
    for path, body in (
        ("/v1/jobs", JOB),
        ("/v1/admission", b'{"paused": true, "ttl_s": 3600}'),
        ("/v1/policy", b'{"version": 7}'),
    ):
        for content_type in ("text/plain", "application/x-www-form-urlencoded", None):
            headers = {"Host": own, **({"Content-Type": content_type} if content_type else {})}
            status, answer = await send(
                daemon, "POST", path, authorized(daemon, tmp_path, headers), body
            )
            assert status == 415, (path, content_type, answer)
            assert "application/json" in answer["error"] and "\n" not in answer["error"]
    headers = authorized(daemon, tmp_path, {"Host": own})
    assert (await send(daemon, "GET", "/v1/jobs", headers))[1] == {"jobs": []}
    assert (await send(daemon, "GET", "/v1/policy", headers))[1] == {"version": 0}
    assert (await send(daemon, "GET", "/v1/admission", headers))[1]["paused"] is False
    assert not list((tmp_path / "state" / "jobs").iterdir())


async def test_a_foreign_origin_is_refused_even_with_a_json_body(
    daemon: Daemon, tmp_path: Path
) -> None:
    own = daemon.url.removeprefix("http://")
    json_type = {"Host": own, "Content-Type": "application/json"}
    # A page of another site, of no site, of the attacker's name, of another local port.
    origins = ("http://evil.example", "null", f"http://evil.example:{own.split(':')[1]}",
               "http://127.0.0.1:1", "http://localhost:3000")  # fmt: skip
    for origin in origins:
        headers = authorized(daemon, tmp_path, {**json_type, "Origin": origin})
        status, answer = await send(daemon, "POST", "/v1/jobs", headers, JOB)
        assert status == 403 and "Origin" in answer["error"], (origin, answer)
        status, answer = await send(daemon, "GET", "/v1/jobs", headers)
        assert status == 403, (origin, answer)
    # The page served from the listener itself is the same origin.
    headers = authorized(daemon, tmp_path, {**json_type, "Origin": f"http://{own}"})
    status, answer = await send(daemon, "POST", "/v1/jobs", headers, JOB)
    assert status == 201, answer


async def test_a_host_that_does_not_name_the_listener_reads_nothing_but_probes(
    daemon: Daemon, tmp_path: Path
) -> None:
    port = daemon.url.rsplit(":", 1)[1]
    for host in (f"rebind.evil.example:{port}", "evil.example", "localhost.evil.example"):
        headers = authorized(daemon, tmp_path, {"Host": host})
        for path in ("/v1/jobs", "/v1/policy", "/status"):
            status, answer = await send(daemon, "GET", path, headers)
            assert status == 421 and host in answer["error"], (host, path, answer)
            assert "--allowed-host" in answer["error"]
        # Scrapers and probes name the target as they found it: they stay open.
        assert (await send(daemon, "GET", "/healthz", headers))[0] == 200
        assert (await send(daemon, "GET", "/metrics", headers))[0] == 200
    # Loopback names (any port: an ssh -L tunnel) and --allowed-host are the listener's.
    names = ("127.0.0.1", f"localhost:{port}", "localhost:9999", "[::1]:9999",
             "rollouts.example.org", "ROLLOUTS.example.org:443")  # fmt: skip
    for host in names:
        headers = authorized(daemon, tmp_path, {"Host": host})
        status, answer = await send(daemon, "GET", "/v1/jobs", headers)
        assert status == 200, (host, answer)
    # No Host at all: HTTP/1.1 refuses it before any route.
    status, answer = await send(daemon, "GET", "/v1/jobs", authorized(daemon, tmp_path, {}))
    assert status == 400 and "Host" in str(answer), answer


async def test_the_projects_own_client_passes(daemon: Daemon, tmp_path: Path) -> None:
    token = tmp_path / "api-token"
    secret = token.read_text().strip() if token.exists() else None
    async with AsyncClient(daemon.url, token=secret) as client:
        await client.submit(task_rows(2), job_id="mine")
        await client.set_policy_version(3)
        await client.pause(ttl_s=60)
        await client.resume()
        assert (await client.policy_version()) == 3
    code, output = await stop(daemon)
    assert code in (0, 75), output[-2000:]


async def test_an_allowed_host_that_is_not_a_host_name_is_exit_2(tmp_path: Path) -> None:
    for value in ("http://rollouts.example.org", "rollouts.example.org/v1", "", "h:8080"):
        result = await run_cli(
            "serve", "--state-dir", str(tmp_path / "s"), "--agent", "a=http://127.0.0.1:9",
            "--allowed-host", value,
        )  # fmt: skip
        assert result.returncode == 2 and "--allowed-host" in result.stderr, result.stderr[-500:]
