"""Peak memory of `dispatcher run` facing agents whose answers are too large.

A hostile agent (in this process) answers every rollout with one of:
  small     a normal 100-byte result (the baseline)
  large     a 100 MB chunked body, 8 rollouts at once
  gzip      a ~1 MB gzip body that inflates to 1 GiB
  endless   a chunked body that never ends
and the dispatcher (a child process, default --max-response-bytes 64 MiB)
reports its peak RSS in its run summary. Prints one line per case.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
import zlib
from pathlib import Path

import orjson
from aiohttp import web

MiB = 1024 * 1024
CHUNK = b"x" * MiB


def _gzip_bomb(decompressed: int) -> bytes:
    packer = zlib.compressobj(9, zlib.DEFLATED, 31)
    zeros = b"0" * MiB
    parts = [packer.compress(b'{"pad":"')]
    parts += [packer.compress(zeros) for _ in range(decompressed // MiB)]
    parts.append(packer.compress(b'"}') + packer.flush())
    return b"".join(parts)


async def _stream(request: web.Request, total: int | None) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "application/json"})
    await response.prepare(request)
    sent = 0
    try:
        while total is None or sent < total:
            await response.write(CHUNK)
            sent += len(CHUNK)
        await response.write_eof()
    except ConnectionError:
        pass  # the dispatcher hung up at its cap: the point of the exercise
    return response


def agent_app(case: str, bomb: bytes) -> web.Application:
    async def run(request: web.Request) -> web.StreamResponse:
        await request.read()
        if case == "small":
            return web.json_response({"reward": 1.0, "note": "x" * 80})
        if case == "gzip":
            headers = {"Content-Encoding": "gzip", "Content-Type": "application/json"}
            return web.Response(body=bomb, headers=headers)
        return await _stream(request, 100 * MiB if case == "large" else None)

    app = web.Application()
    app.router.add_post("/run", run)
    return app


async def measure(case: str, rollouts: int, bomb: bytes, folder: Path) -> str:
    runner = web.AppRunner(agent_app(case, bomb), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    tasks = folder / f"{case}.jsonl"
    tasks.write_bytes(orjson.dumps({"agent_ref": {"name": "a"}, "q": 1}) + b"\n")
    args = [
        "-m", "dispatcher", "run", "--input", str(tasks),
        "--output", str(folder / case / "x.jsonl"), "--agent", f"a=http://127.0.0.1:{port}",
        "--num-repeats", str(rollouts), "--metrics-listen", "off", "--log-format", "json",
        "--fsync", "never",
    ]  # fmt: skip
    started = time.perf_counter()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, *args, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE
    )
    _, stderr = await proc.communicate()
    wall_s = time.perf_counter() - started
    await runner.cleanup()
    summary = next(
        orjson.loads(line)
        for line in stderr.splitlines()
        if line.startswith(b"{") and b'"run_summary"' in line
    )
    return (
        f"{case:8s} rollouts={rollouts} exit={proc.returncode} "
        f"outcomes={summary['outcomes']} peak_rss_mb={summary['peak_rss_mb']} "
        f"wall_s={wall_s:.1f}"
    )


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.parse_args()
    bomb = _gzip_bomb(1024 * MiB)
    print(f"gzip answer: {len(bomb) / MiB:.2f} MiB compressed, 1024 MiB decompressed")
    with tempfile.TemporaryDirectory() as tmp:
        for case, rollouts in (("small", 8), ("large", 8), ("gzip", 1), ("endless", 1)):
            print(await measure(case, rollouts, bomb, Path(tmp)), flush=True)


if __name__ == "__main__":
    asyncio.run(main())
