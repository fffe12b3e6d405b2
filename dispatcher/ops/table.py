"""Plain-text tables and number formats for the operator commands' human output."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime

# The columns of a list of a daemon's jobs: `status STATE_DIR` (from its files) and
# `jobs list` (from the running daemon) show the same table.
JOB_HEADERS = ("job", "state", "priority", "policy", "expected", "succeeded", "failed", "left")


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]], indent: int = 2) -> str:
    """Columns padded to width: figures right-aligned, text left-aligned."""
    cells = [[str(h) for h in headers], *[[_cell(v) for v in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    right = [i > 0 and all(_is_figure(row[i]) for row in rows) for i in range(len(headers))]
    pad = " " * indent
    lines = []
    for row in cells:
        parts = [
            row[i].rjust(widths[i]) if right[i] else row[i].ljust(widths[i])
            for i in range(len(widths))
        ]
        lines.append(pad + "  ".join(parts).rstrip())
    return "\n".join(lines)


def _is_figure(value: object) -> bool:
    if value is None or isinstance(value, int | float):
        return True
    return isinstance(value, str) and (value in ("", "-") or value[:1].isdigit())


def _cell(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)


def percent(part: int, whole: int) -> str:
    return f"{100.0 * part / whole:.1f}%" if whole else "-"


def ratio(part: int, whole: int) -> float | None:
    return part / whole if whole else None


def utc_time(epoch_s: float | None) -> str:
    if epoch_s is None:
        return "unknown time"
    return datetime.fromtimestamp(epoch_s, UTC).strftime("%Y-%m-%d %H:%M:%SZ")
