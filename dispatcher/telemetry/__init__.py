"""Live observability: Prometheus metrics, the HTTP endpoints, logging, progress.

The daemon owns one `Metrics`; jobs call it on their completion path; the rest
are building blocks it starts and stops (`start_http_server`,
`LoopLagMonitor`, `ProgressLine`) or pure helpers (`format_progress`,
`progress_fields`, `estimate_eta_s`, `parse_listen`).
"""

from dispatcher.telemetry.lag import LoopLagMonitor
from dispatcher.telemetry.logs import (
    LogFormat,
    configure_logging,
    get_logger,
    reset_logging,
    resolve_log_format,
)
from dispatcher.telemetry.metrics import LATENCY_QUANTILES, Metrics, RateWindow
from dispatcher.telemetry.progress import (
    ProgressLine,
    estimate_eta_s,
    format_progress,
    progress_fields,
)
from dispatcher.telemetry.server import build_app, parse_listen, start_http_server

__all__ = [
    "LATENCY_QUANTILES",
    "LogFormat",
    "LoopLagMonitor",
    "Metrics",
    "ProgressLine",
    "RateWindow",
    "build_app",
    "configure_logging",
    "estimate_eta_s",
    "format_progress",
    "get_logger",
    "parse_listen",
    "progress_fields",
    "reset_logging",
    "resolve_log_format",
    "start_http_server",
]
