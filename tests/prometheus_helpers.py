"""A real Prometheus server for tests, scraping one target every second.

    async with running_prometheus(f"127.0.0.1:{port}", tmp_path) as prom:
        await prom.wait_for_value("sum(dispatcher_rollouts_total)", 5)

Everything here is async because the scraped server usually runs on the
test's own event loop: a blocking wait would stall the very scrapes it waits
for. Tests skip (with the reason) when the `prometheus` binary is missing.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.helpers import free_port, wait_until

READY_TIMEOUT_S = 30.0
# Prometheus applies discovered targets on a fixed 5 s tick and then offsets
# the first scrape by up to one interval: a first value takes about 5-6 s.
VALUE_TIMEOUT_S = 30.0
# A free port can be taken between probing and binding; retry with another.
START_ATTEMPTS = 3


def require_binary(name: str) -> str:
    """Path of a Prometheus tool, or skip the test saying what to install."""
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"`{name}` not found on PATH (Debian/Ubuntu: apt-get install prometheus)")
    return path


class PrometheusServer:
    """One `prometheus` process with its own config and data directory."""

    def __init__(
        self,
        target: str,
        workdir: Path,
        *,
        scrape_interval_s: float = 1.0,
        sd_files: str | None = None,
    ) -> None:
        self.binary = require_binary("prometheus")
        self.target = target
        self.sd_files = sd_files
        self.workdir = workdir
        self.scrape_interval_s = scrape_interval_s
        self.port = 0
        self._process: subprocess.Popen[bytes] | None = None
        self._session: aiohttp.ClientSession | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.workdir / "prometheus.log"

    async def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        config = self.workdir / "prometheus.yml"
        config.write_text(self._config())
        self._session = aiohttp.ClientSession()
        try:
            await self._start_process(config)
        except BaseException:
            await self.stop()
            raise

    async def stop(self) -> None:
        await self._terminate()
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def query(self, expr: str) -> list[dict[str, Any]]:
        """Evaluate an instant query; returns the result vector (metric + value)."""
        body = await self._api("query", expr)
        if body["data"]["resultType"] != "vector":
            raise AssertionError(f"expected a vector from {expr!r}, got {body['data']}")
        result: list[dict[str, Any]] = body["data"]["result"]
        return result

    async def query_value(self, expr: str) -> float | None:
        """The value of a query that yields at most one sample; None when it yields none."""
        result = await self.query(expr)
        if not result:
            return None
        if len(result) > 1:
            raise AssertionError(f"{expr!r} returned {len(result)} series, expected one")
        return float(result[0]["value"][1])

    async def check_expression(self, expr: str) -> None:
        """Fail unless Prometheus accepts the PromQL expression."""
        await self._api("query", expr)

    async def wait_for_value(
        self, expr: str, expected: float, timeout_s: float = VALUE_TIMEOUT_S
    ) -> None:
        """Wait until `expr` evaluates to `expected` (after at least one scrape)."""
        last: list[float | None] = [None]

        async def reached() -> bool:
            last[0] = await self.query_value(expr)
            return last[0] == expected

        try:
            await wait_until(reached, timeout_s, step_s=0.25)
        except AssertionError:
            raise AssertionError(
                f"{expr} stayed {last[0]}, expected {expected}; prometheus log:\n{self.log_tail()}"
            ) from None

    def log_tail(self, lines: int = 30) -> str:
        if not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def _config(self) -> str:
        interval = f"{max(1, round(self.scrape_interval_s * 1000))}ms"
        return (
            "global:\n"
            f"  scrape_interval: {interval}\n"
            f"  scrape_timeout: {interval}\n"
            f"  evaluation_interval: {interval}\n"
            "scrape_configs:\n"
            "  - job_name: dispatcher\n" + self._targets()
        )

    def _targets(self) -> str:
        if self.sd_files is None:
            return f"    static_configs:\n      - targets: ['{self.target}']\n"
        # The daemons' own file_sd target files, as the shipped prometheus.yml reads them.
        return (
            "    file_sd_configs:\n"
            f"      - files: ['{self.sd_files}']\n"
            "        refresh_interval: 1s\n"
        )

    async def _start_process(self, config: Path) -> None:
        for _ in range(START_ATTEMPTS):
            self.port = free_port()
            self._spawn(config)
            if await self._wait_ready():
                return
            await self._terminate()
        raise RuntimeError(f"prometheus did not become ready:\n{self.log_tail()}")

    def _spawn(self, config: Path) -> None:
        data = self.workdir / f"data-{self.port}"
        with self.log_path.open("ab") as log:
            # The child keeps its own copy of the descriptor.
            self._process = subprocess.Popen(
                [
                    self.binary,
                    f"--config.file={config}",
                    f"--storage.tsdb.path={data}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                    "--log.level=warn",
                ],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
            )

    async def _wait_ready(self) -> bool:
        """True once ready; False when the process exited (most likely: port taken)."""
        ready = False

        async def settled() -> bool:
            nonlocal ready
            if self._process is None or self._process.poll() is not None:
                return True
            ready = await self._ready()
            return ready

        try:
            await wait_until(settled, READY_TIMEOUT_S, step_s=0.1)
        except AssertionError:
            return False
        return ready

    async def _ready(self) -> bool:
        assert self._session is not None
        try:
            async with self._session.get(f"{self.url}/-/ready") as response:
                return response.status == 200
        except aiohttp.ClientError:
            return False

    async def _api(self, endpoint: str, expr: str) -> dict[str, Any]:
        assert self._session is not None, "start() the server first"
        url = f"{self.url}/api/v1/{endpoint}"
        async with self._session.get(url, params={"query": expr}) as response:
            body: dict[str, Any] = await response.json()
        if body.get("status") != "success":
            raise AssertionError(f"prometheus rejected {expr!r}: {body}")
        return body

    async def _terminate(self) -> None:
        process, self._process = self._process, None
        if process is None:
            return
        process.terminate()
        try:
            await asyncio.to_thread(process.wait, 10)
        except subprocess.TimeoutExpired:
            process.kill()
            await asyncio.to_thread(process.wait)


@contextlib.asynccontextmanager
async def running_prometheus(
    target: str, workdir: Path, *, scrape_interval_s: float = 1.0, sd_files: str | None = None
) -> AsyncIterator[PrometheusServer]:
    """A started Prometheus scraping `target` ("host:port"), or the targets of the file_sd
    files `sd_files` (a glob) names; stopped on exit."""
    server = PrometheusServer(
        target, workdir, scrape_interval_s=scrape_interval_s, sd_files=sd_files
    )
    await server.start()
    try:
        yield server
    finally:
        await server.stop()
