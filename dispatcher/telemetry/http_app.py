"""Run an aiohttp application as a command: bind, announce the URL, stop on a signal."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys

from aiohttp import web

from dispatcher.errors import ConfigError
from dispatcher.telemetry.discovery import parse_listen


def listen_address(value: str) -> tuple[str, int]:
    """``HOST:PORT`` of a server command (port 0 picks a free one); never ``off``."""
    try:
        address = parse_listen(value)
    except ValueError as exc:
        # The parser is --metrics-listen's: a server takes no 'off'.
        problem = str(exc).replace(" or 'off'", "").replace("metrics address", "address")
        raise ConfigError(f"--listen {value!r}: {problem}") from None
    if address is None:
        raise ConfigError(f"--listen {value!r}: a server needs an address, e.g. 127.0.0.1:8000")
    return address


async def start_site(app: web.Application, host: str, port: int) -> tuple[web.AppRunner, int]:
    """Start ``app`` on ``host:port`` and return the runner and the bound port."""
    # A short shutdown timeout: a simulated hang must not hold up a SIGTERM.
    runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=2.0)
    await runner.setup()
    # A deep accept queue: a dispatcher opening a thousand connections at once
    # must not hit SYN retries (a 1 s stall each) on the default of 128.
    site = web.TCPSite(runner, host, port, backlog=4096)
    try:
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    bound: int = runner.addresses[0][1]
    return runner, bound


async def serve_until_signal(app: web.Application, listen: str, name: str) -> int:
    """Serve until SIGTERM or SIGINT; print ``<name> listening on <url>`` once bound."""
    host, port = listen_address(listen)
    runner, bound = await start_site(app, host, port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    # The one line other programs wait for: it means the server accepts requests.
    sys.stdout.write(f"{name} listening on http://{host}:{bound}\n")
    sys.stdout.flush()
    try:
        await stop.wait()
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(Exception):
                loop.remove_signal_handler(sig)
        await runner.cleanup()
    return 0
