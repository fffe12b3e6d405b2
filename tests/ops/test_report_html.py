"""``dispatcher report --html``: the real CLI on a real run's files, then a real browser.

The run is a real ``dispatcher run`` against simulated agents (two replicas of
one agent, one of which fails half of its requests, and a second agent),
so the page draws what the dispatcher wrote. Chromium (Debian: ``apt-get
install chromium``; ``.ci/run`` installs it) lays the page out headless: the
test reads back each picture's size and text, and looks at a screenshot's
pixels. Without it those tests skip and say why.
"""

from __future__ import annotations

import asyncio
import html
import json
import re
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from dispatcher.client import AsyncClient, JobState
from dispatcher.ops.report_html import INSTALL_HINT, PANELS
from tests.conftest import SimAgentFactory
from tests.helpers import CliResult, run_cli

pytestmark = pytest.mark.timeout(180)

TASKS = 30
REPEATS = 2
BROWSERS = ("chromium", "chromium-browser", "google-chrome")
# What would make a browser fetch something: a script, a stylesheet, an image, a frame.
FETCHING_TAGS = re.compile(r"<(script|link|img|iframe|object|embed|audio|video|source)\b", re.I)
REFERENCES = re.compile(r"""\b(?:src|href|xlink:href|srcset|action)\s*=\s*["']([^"']*)""", re.I)
CSS_URLS = re.compile(r"url\(\s*['\"]?([^'\")]*)", re.I)
# matplotlib's first two colours (tab:blue, tab:orange): the curves.
CURVE_COLOURS = ((31, 119, 180), (255, 127, 14))


def run_command(tasks: Path, output: Path, math_urls: list[str], code_url: str) -> list[str]:
    return [
        "run", "--input", str(tasks), "--output", str(output),
        "--agent", f"math={','.join(math_urls)}", "--agent", f"code={code_url}",
        "--num-repeats", str(REPEATS), "--concurrency", "8", "--max-attempts", "2",
        "--metrics-listen", "off", "--log-format", "json", "--fsync", "never",
    ]  # fmt: skip


async def real_run(tmp_path: Path, sim_agent: SimAgentFactory) -> Path:
    """A finished run: agent math on two replicas (one fails half its requests), code on one."""
    steady, _ = await sim_agent(latency_s=0.02)
    flaky, _ = await sim_agent(latency_s=0.02, fail_500=0.5, seed=3)
    code, _ = await sim_agent(latency_s=0.05)
    tasks = tmp_path / "tasks.jsonl"
    agents = ["code" if i % 3 == 0 else "math" for i in range(TASKS)]
    rows = [
        {"responses_create_params": {"input": f"q{i}"}, "agent_ref": {"name": agent}}
        for i, agent in enumerate(agents)
    ]
    tasks.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    output = tmp_path / "runs" / "x.jsonl"
    result = await run_cli(*run_command(tasks, output, [steady, flaky], code))
    # 75: a rollout failed on both of its attempts; the files are what a report reads either way.
    assert result.returncode in (0, 75), result.stderr[-2000:]
    return output


async def html_report(output: Path | str, page: Path, *extra: str) -> CliResult:
    result = await run_cli("report", str(output), "--html", str(page), "--bin-s", "0.1", *extra)
    assert result.returncode == 0, result.stderr[-2000:]
    return result


def assert_loads_nothing(text: str) -> None:
    """No tag that fetches, and every reference (attribute or CSS url) inside the page."""
    assert not FETCHING_TAGS.search(text), FETCHING_TAGS.search(text)
    assert "@import" not in text
    outside = [
        r for r in REFERENCES.findall(text) + CSS_URLS.findall(text) if not r.startswith("#")
    ]
    assert not outside, outside[:5]
    assert not re.search(r"(?<![\w:])//[\w.-]+\.\w", text.replace("://", ""))  # no //host/x


def section(text: str, anchor: str) -> str:
    match = re.search(rf'<section id="{anchor}">(.*?)</section>', text, re.S)
    assert match, anchor
    return match.group(1)


async def test_report_html_of_a_real_run_is_one_page_that_loads_nothing(
    tmp_path: Path, sim_agent: SimAgentFactory
) -> None:
    output = await real_run(tmp_path, sim_agent)
    page = tmp_path / "report.html"
    result = await html_report(output, page)
    assert "timeline from" in result.stdout and "in flight" in result.stdout
    text = page.read_text()
    assert_loads_nothing(text)
    assert text.count("<svg") == 3
    whole = section(text, "whole")
    for title in PANELS:
        assert html.escape(title) in whole
    assert "time (UTC), bins of 0.1 s" in whole
    agents = section(text, "agents")
    assert ">math<" in agents and ">code<" in agents
    replicas = section(text, "replicas")
    assert len(re.findall(r">http://127\.0\.0\.1:\d+<", replicas)) >= 3  # legend entries
    assert "agent_request_failed" in whole or "agent_run_error" in whole  # the flaky replica
    assert html.escape("timeline from") in section(text, "text")

    report = json.loads((await run_cli("report", str(output), "--json", "--bin-s", "0.1")).stdout)
    bins = report["timeline"]["bins"]
    assert report["timeline"]["bin_s"] == 0.1
    assert sum(b["finished"] for b in bins) == report["attempts"]["total"]
    assert sum(b["succeeded"] for b in bins) == report["attempts"]["successes"]
    assert max(b["in_flight"] for b in bins) <= 8.0 + 1e-9  # --concurrency 8


async def test_report_html_needs_the_report_extra(tmp_path: Path) -> None:
    hidden = tmp_path / "site"
    (hidden / "matplotlib").mkdir(parents=True)
    (hidden / "matplotlib" / "__init__.py").write_text("raise ImportError('not installed')\n")
    page = tmp_path / "report.html"
    result = await run_cli(
        "report", str(tmp_path / "x.jsonl"), "--html", str(page), env={"PYTHONPATH": str(hidden)}
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"error: report --html draws with matplotlib: {INSTALL_HINT}"
    ]
    assert not page.exists()


async def test_report_html_errors_are_one_line(tmp_path: Path, sim_agent: SimAgentFactory) -> None:
    (tmp_path / "state" / "jobs").mkdir(parents=True)
    for args, says in (
        ([str(tmp_path / "state")], "is a `dispatcher serve` state directory"),
        ([str(tmp_path / "none.jsonl")], "no run at"),
    ):
        result = await run_cli("report", *args, "--html", str(tmp_path / "r.html"))
        assert result.returncode == 2 and says in result.stderr, result.stderr
        assert len(result.stderr.strip().splitlines()) == 1
    output = await real_run(tmp_path, sim_agent)
    result = await run_cli("report", str(output), "--html", str(tmp_path / "no" / "r.html"))
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        f"error: cannot write --html {tmp_path / 'no' / 'r.html'}: No such file or directory"
    ]


# -- a `dispatcher serve` job ---------------------------------------------------------------


@pytest.fixture
async def served_job(tmp_path: Path, sim_agent: SimAgentFactory) -> AsyncIterator[Path]:
    """A `dispatcher serve` job run to its end; yields the job's folder."""
    from tests.client.test_blocking_e2e import start_daemon

    agent_url, _ = await sim_agent(latency_s=0.02)
    state = tmp_path / "state"
    daemon, url = await start_daemon(state, agent_url)
    try:
        rows = [
            {"agent_ref": {"name": "sim"}, "responses_create_params": {"input": f"q{i}"}}
            for i in range(8)
        ]
        async with AsyncClient(url) as client:
            await client.submit(rows, job_id="step-0", num_repeats=2)
            results = client.results("step-0")
            assert len([row async for row in results]) == 16
            assert results.final_state is JobState.DONE
        yield state / "jobs" / "step-0"
    finally:
        await daemon.kill()


async def test_report_html_of_a_serve_job(tmp_path: Path, served_job: Path) -> None:
    for address in (served_job, served_job / "rollouts.jsonl"):
        page = tmp_path / "job.html"
        result = await html_report(address, page)
        assert "attempts   16 (16 succeeded, 0 failed)" in result.stdout
        text = page.read_text()
        assert_loads_nothing(text)
        assert text.count("<svg") == 1  # one agent, one replica: the whole run's picture
        assert "One agent (sim)" in text


# -- in a real browser ----------------------------------------------------------------------


@pytest.fixture
def chromium() -> str:
    for name in BROWSERS:
        path = shutil.which(name)
        if path is not None:
            return path
    pytest.skip("no chromium on PATH to load the page in (Debian: apt-get install chromium)")


# Added to a copy of the page only: the report itself has no script. It writes what the
# browser laid out (each picture's size, its text) into the DOM that --dump-dom prints.
MEASURE = """<script>
const shown = [...document.querySelectorAll("section svg")].map(svg => {
  const box = svg.getBoundingClientRect();
  return {section: svg.closest("section").id, width: box.width, height: box.height,
          texts: [...svg.querySelectorAll("text")].map(t => t.textContent.trim())};
});
const out = document.createElement("pre");
out.id = "measured";
out.textContent = JSON.stringify(shown);
document.body.appendChild(out);
</script>"""


async def browser(chromium: str, profile: Path, *args: str) -> str:
    proc = await asyncio.create_subprocess_exec(
        chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
        f"--user-data-dir={profile}", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    stdout, stderr = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode == 0, stderr.decode()[-2000:]
    return stdout.decode()


def measured(dom: str) -> list[dict[str, Any]]:
    match = re.search(r'<pre id="measured">(.*?)</pre>', dom, re.S)
    assert match, dom[-2000:]
    shown: list[dict[str, Any]] = json.loads(html.unescape(match.group(1)))
    return shown


async def test_a_browser_draws_the_report(
    tmp_path: Path, sim_agent: SimAgentFactory, chromium: str
) -> None:
    output = await real_run(tmp_path, sim_agent)
    page = tmp_path / "report.html"
    await html_report(output, page)
    probe = tmp_path / "measured.html"
    probe.write_text(page.read_text().replace("</body>", MEASURE + "</body>"))
    dom = await browser(
        chromium, tmp_path / "profile", "--window-size=1200,900", "--dump-dom", probe.as_uri()
    )
    shown = measured(dom)
    assert [s["section"] for s in shown] == ["whole", "agents", "replicas"]
    for svg in shown:
        assert svg["width"] > 600 and svg["height"] > 500, svg["section"]
        for title in PANELS[2:]:
            assert title in svg["texts"], (svg["section"], title)
        assert "time (UTC), bins of 0.1 s" in svg["texts"]
    assert {"finished", "succeeded", "p50", "p95"} <= set(shown[0]["texts"])
    assert {"math", "code"} <= set(shown[1]["texts"])

    shot = tmp_path / "shot.png"
    await browser(
        chromium, tmp_path / "profile", "--window-size=1200,1400", f"--screenshot={shot}",
        page.as_uri(),
    )  # fmt: skip
    assert_curves_drawn(shot)


def assert_curves_drawn(shot: Path) -> None:
    """The screenshot has the curves' colours in it, hundreds of pixels of each."""
    from PIL import Image  # matplotlib's own dependency

    with Image.open(shot) as image:
        data = image.convert("RGB").tobytes()
    pixels = [tuple(data[i : i + 3]) for i in range(0, len(data), 3)]
    for colour in CURVE_COLOURS:
        near = sum(
            1 for p in pixels if all(abs(a - b) <= 12 for a, b in zip(p, colour, strict=True))
        )
        assert near > 300, (colour, near)


async def test_a_run_without_timing_gets_a_page_that_says_so(tmp_path: Path) -> None:
    output = tmp_path / "bare.jsonl"
    (tmp_path / "bare_materialized_inputs.jsonl").write_bytes(
        b'{"agent_ref": {"name": "a"}, "_ng_task_index": 0, "_ng_rollout_index": 0}\n'
    )
    output.write_bytes(
        b'{"agent_ref": {"name": "a"}, "_ng_task_index": 0, "_ng_rollout_index": 0}\n'
    )
    page = tmp_path / "bare.html"
    result = await html_report(output, page)
    assert "timeline from" not in result.stdout
    text = page.read_text()
    assert_loads_nothing(text)
    assert "<svg" not in text and "nothing to draw" in text
