"""``dispatcher report --html FILE``: the run over time, as one page that needs no network.

matplotlib draws each section (the whole run, per agent, per replica) as an
SVG written into the page, with its text kept as text (``svg.fonttype``
none), so the page has no script, no font and no image to fetch, and what
it says can be searched. matplotlib is the ``report`` extra: it is imported
here only, and only for ``--html``. The points are the timeline's bins
(``timeline.MAX_PICTURE_BINS`` at most), never one per row.
"""

from __future__ import annotations

import html
import io
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

from dispatcher.errors import ConfigError
from dispatcher.ops.runfiles import timestamp
from dispatcher.ops.table import utc_time
from dispatcher.ops.timeline import MAX_PICTURE_BINS, Bins, Series, Timeline, build_timeline

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from dispatcher.ops.attempts import RunRead

INSTALL_HINT = "pip install 'rollout-dispatcher[report]'"
# Finest bins of the pictures when --bin-s is not given: short runs still get a curve.
PICTURE_BIN_S = 1.0
# Lines per panel of a per-agent or per-replica section: the busiest, the rest named.
MAX_GROUPS = 8
# The manifest keeps when each hop ended to the second: finer bins would place it wrong.
HOP_MARK_MIN_BIN_S = 1.0
MAX_DOTTED_BINS = 40
PANELS = (
    "throughput (attempts finished per minute)",
    "latency (s)",
    "rollouts in flight (mean over the bin)",
    "failed attempts per minute",
)
_SVG_OPENING = re.compile(rb"\A.*?(?=<svg\b)", re.DOTALL)
_SVG_METADATA = re.compile(rb"<metadata>.*?</metadata>\s*", re.DOTALL)
_STYLE = """
body { font-family: sans-serif; color: #222; max-width: 1100px; margin: 1em auto; padding: 0 1em; }
h1 { font-size: 1.4em; } h2 { font-size: 1.15em; margin-top: 1.5em; }
svg { max-width: 100%; height: auto; display: block; }
pre { background: #f6f6f6; padding: 0.8em; overflow-x: auto; font-size: 0.85em; }
.note { color: #555; }
"""


def require_matplotlib() -> None:
    """A one-line error (exit 2) naming the extra when matplotlib is not installed."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ConfigError(f"report --html draws with matplotlib: {INSTALL_HINT}") from None


@dataclass(frozen=True)
class Section:
    """One picture of the page: its heading, id and SVG (or why there is none)."""

    heading: str
    anchor: str
    svg: str
    note: str = ""


def write_page(path: Path, run: RunRead, text: str, bin_s: float | None) -> None:
    """Render the page, with the text report ``text`` in it, and put it at ``path`` whole
    (a temporary file, then a rename)."""
    timeline = build_timeline(
        run.data.attempts, bin_s or PICTURE_BIN_S, MAX_PICTURE_BINS, per_group=True
    )
    hops = [t for t in (timestamp(h.finished_at) for h in run.hops) if t is not None]
    if timeline.bins is None or timeline.bins.width_s < HOP_MARK_MIN_BIN_S:
        hops = []
    page = render_page(str(run.output), timeline, hops, text)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        temporary.write_text(page, encoding="utf-8")
        os.replace(temporary, path)
    except OSError as exc:
        temporary.unlink(missing_ok=True)
        raise ConfigError(f"cannot write --html {path}: {exc.strerror or exc}") from None


def render_page(output: str, timeline: Timeline, hop_ends: list[float], text: str) -> str:
    """The whole HTML page."""
    sections = _sections(timeline, hop_ends)
    body = [
        f"<h1>Rollouts over time: {html.escape(output)}</h1>",
        f'<p class="note">{html.escape(_summary(timeline, hop_ends))}</p>',
        *(_section_html(s) for s in sections),
        '<section id="text"><h2>The text report</h2>',
        f"<pre>{html.escape(text)}</pre></section>",
    ]
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">\n'
        f"<title>dispatcher report: {html.escape(output)}</title>\n"
        f"<style>{_STYLE}</style></head>\n<body>\n" + "\n".join(body) + "\n</body></html>\n"
    )


def _summary(timeline: Timeline, hop_ends: list[float]) -> str:
    bins = timeline.bins
    if bins is None:
        return "No attempt carries _ng_dispatch.started_at and a duration: nothing to draw."
    parts = [
        f"From {utc_time(bins.first)} to {utc_time(bins.end)}, in bins of {bins.width_s:g} s by "
        "finish time; times in UTC."
    ]
    if hop_ends:
        parts.append(f"Dotted lines: the end of each of the {len(hop_ends)} hop(s), to the second.")
    if timeline.untimed:
        parts.append(f"{timeline.untimed} attempt(s) without timing are not drawn.")
    return " ".join(parts)


def _section_html(section: Section) -> str:
    note = f'<p class="note">{html.escape(section.note)}</p>' if section.note else ""
    return (
        f'<section id="{section.anchor}"><h2>{html.escape(section.heading)}</h2>'
        f"{note}\n{section.svg}</section>"
    )


def _sections(timeline: Timeline, hop_ends: list[float]) -> list[Section]:
    bins, whole = timeline.bins, timeline.whole
    if bins is None or whole is None:
        return []
    sections = [Section("The whole run", "whole", _whole_svg(bins, whole, hop_ends))]
    for heading, anchor, groups in (
        ("Per agent", "agents", timeline.agents),
        ("Per replica", "replicas", timeline.replicas),
    ):
        if len(groups) < 2:
            named = next(iter(groups), "none")
            note = f"One {anchor[:-1]} ({named}): the whole run's pictures are its own."
            sections.append(Section(heading, anchor, "", note))
            continue
        shown = sorted(groups, key=lambda g: (-sum(groups[g].finished), g))[:MAX_GROUPS]
        left = len(groups) - len(shown)
        note = f"The {len(shown)} busiest drawn; {left} more not drawn." if left else ""
        svg = _groups_svg(bins, {g: groups[g] for g in shown}, hop_ends)
        sections.append(Section(heading, anchor, svg, note))
    return sections


# -- drawing --------------------------------------------------------------------------------


def _figure(bins: Bins, panels: Sequence[str] = PANELS) -> tuple[Figure, Sequence[Axes]]:
    from matplotlib.figure import Figure

    # Fixed margins, not a layout engine: constrained layout draws each figure twice more.
    figure = Figure(figsize=(10, 9.5))
    figure.subplots_adjust(left=0.07, right=0.78, top=0.97, bottom=0.07, hspace=0.3)
    axes = figure.subplots(len(panels), 1, sharex=True)
    for ax, panel in zip(axes, panels, strict=True):
        ax.set_title(panel, loc="left", fontsize=10)
        ax.grid(True, alpha=0.3)
    axes[-1].set_xlabel(f"time (UTC), bins of {bins.width_s:g} s")
    return figure, axes


def _times(bins: Bins) -> list[float]:
    """Each bin's middle, as the x of its point."""
    return _dates([bins.t0 + (bins.edge(i) + bins.edge(i + 1)) / 2 for i in range(bins.count)])


def _dates(unix_s: Sequence[float]) -> list[float]:
    """Unix seconds as matplotlib's date numbers (days from its epoch), for its date axis."""
    from matplotlib.dates import date2num

    days = date2num([datetime.fromtimestamp(t, UTC) for t in unix_s])  # type: ignore[no-untyped-call]
    return [float(d) for d in days]


def _per_minute(counts: Sequence[int], bins: Bins) -> list[float]:
    # Over the whole bin, also where the run began or ended inside it: a rate over the
    # few seconds of a last bin would draw a spike out of two rows.
    return [60.0 * n / bins.width_s for n in counts]


def _style(bins: Bins) -> str:
    """A dot on each point while they are few enough to tell apart; a line alone past that."""
    return ".-" if bins.count <= MAX_DOTTED_BINS else "-"


def _whole_svg(bins: Bins, whole: Series, hop_ends: list[float]) -> str:
    figure, (rate, latency, flight, failed) = _figure(bins)
    x, style = _times(bins), _style(bins)
    rate.plot(x, _per_minute(whole.finished, bins), style, label="finished")
    rate.plot(x, _per_minute(whole.succeeded, bins), style, label="succeeded")
    latency.plot(x, _gaps(whole.p50_s), style, label="p50")
    latency.plot(x, _gaps(whole.p95_s), style, label="p95")
    flight.plot(x, whole.in_flight, style, label="in flight")
    _failure_bars(failed, x, bins, whole.failed)
    return _finish(figure, (rate, latency, flight, failed), hop_ends)


def _failure_bars(ax: Axes, x: list[float], bins: Bins, failed: dict[str, list[int]]) -> None:
    width_days = bins.width_s / 86400  # matplotlib's date axis counts days
    bottom = [0.0] * bins.count
    for cls, counts in sorted(failed.items(), key=lambda item: -sum(item[1])):
        rates = _per_minute(counts, bins)
        ax.bar(x, rates, width=width_days * 0.9, bottom=bottom, label=cls)
        bottom = [b + r for b, r in zip(bottom, rates, strict=True)]
    if not failed:
        ax.text(0.5, 0.5, "no failed attempts", transform=ax.transAxes, ha="center")


def _groups_svg(bins: Bins, groups: dict[str, Series], hop_ends: list[float]) -> str:
    panels = list(PANELS)
    panels[1] = "latency (s): p95 solid, p50 dashed"
    figure, (rate, latency, flight, failed) = _figure(bins, panels)
    x, style = _times(bins), _style(bins)
    for name, series in groups.items():
        (line,) = rate.plot(x, _per_minute(series.finished, bins), style, label=name)
        color = line.get_color()
        latency.plot(x, _gaps(series.p95_s), style, color=color, label=name)
        latency.plot(x, _gaps(series.p50_s), "--", color=color, linewidth=0.8)
        flight.plot(x, series.in_flight, style, color=color, label=name)
        failures = [sum(c[i] for c in series.failed.values()) for i in range(bins.count)]
        failed.plot(x, _per_minute(failures, bins), style, color=color, label=name)
    return _finish(figure, (rate, latency, flight, failed), hop_ends)


def _gaps(values: Sequence[float | None]) -> list[float]:
    """None (a bin where nothing finished) as NaN: a gap in the line, not a drop to 0."""
    return [float("nan") if v is None else v for v in values]


def _finish(figure: Figure, axes: Sequence[Axes], hop_ends: list[float]) -> str:
    from matplotlib.dates import AutoDateLocator, ConciseDateFormatter

    for ax in axes:
        ax.set_ylim(bottom=0)
        for end in _dates(hop_ends):
            ax.axvline(end, color="#777", linestyle=":")
        if ax.get_legend_handles_labels()[0]:
            # Beside the panel, not over its lines; replica URLs are long.
            ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    locator = AutoDateLocator(tz=UTC)  # type: ignore[no-untyped-call]
    axes[-1].xaxis.set_major_locator(locator)
    axes[-1].xaxis.set_major_formatter(ConciseDateFormatter(locator, tz=UTC))  # type: ignore[no-untyped-call]
    return _svg(figure)


def _svg(figure: Figure) -> str:
    import matplotlib

    buffer = io.BytesIO()
    # Text stays text (no glyph outlines); a fixed salt keeps the page the same for the same run.
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": "dispatcher-report"}):
        figure.savefig(buffer, format="svg", metadata={"Date": None})
    data = _SVG_METADATA.sub(b"", _SVG_OPENING.sub(b"", buffer.getvalue(), count=1))
    return data.decode("utf-8")
