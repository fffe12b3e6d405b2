"""Where a run's /metrics is, told to the people and the Prometheus that look for it.

The default ``--metrics-listen auto`` binds a free port on 127.0.0.1: shards
on one node, or two runs of one user, never collide, and nothing takes
OpenTelemetry's 9464. A port nobody chose must be findable, so the endpoint
is logged (``metrics_listening``), recorded in the manifest
(``metrics_url``), shown in ``/status``, and written as a Prometheus
``file_sd_configs`` target file that Prometheus picks up by itself (see
``config/prometheus.yml``). The file is removed when the run stops serving.
"""

from __future__ import annotations

import hashlib
import ipaddress
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import structlog

log = structlog.get_logger(__name__)

AUTO = "auto"
AUTO_HOST = "127.0.0.1"
SD_SUFFIX = "_prometheus.json"


def resolve_listen(value: str) -> tuple[str, int] | None:
    """``--metrics-listen``: "auto" (a free loopback port), "HOST:PORT" or "off" (None)."""
    if value.strip().lower() == AUTO:
        return AUTO_HOST, 0
    return parse_listen(value)


def parse_listen(value: str) -> tuple[str, int] | None:
    """Parse `--metrics-listen`: "HOST:PORT" (IPv6 as "[::1]:PORT") or "off"."""
    text = value.strip()
    if text.lower() == "off":
        return None
    host, sep, port_text = text.rpartition(":")
    if not sep or not host or not port_text:
        raise ValueError(f"expected HOST:PORT or 'off' for the metrics address, got {value!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        _check_ipv6(host, value)
    elif ":" in host:
        raise ValueError(f"put an IPv6 metrics address in brackets ([::1]:9464), got {value!r}")
    if not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise ValueError(f"metrics port must be a number from 0 to 65535, got {value!r}")
    return host, int(port_text)


def _check_ipv6(host: str, value: str) -> None:
    try:
        ipaddress.IPv6Address(host)
    except ValueError:
        raise ValueError(f"not an IPv6 address in the metrics address {value!r}") from None


def sd_file_for(output: Path, sd_dir: Path | None) -> Path:
    """The target file of the run writing ``output``.

    Beside the output its stem names it; in a shared ``--metrics-sd-dir`` a
    digest of the output's full path keeps runs with the same file name
    (``runs/step-1/rollouts.jsonl``, ``runs/step-2/rollouts.jsonl``) apart.
    """
    stem = output.with_suffix("").name
    if sd_dir is None:
        return output.with_name(stem + SD_SUFFIX)
    digest = hashlib.sha256(str(output.resolve()).encode()).hexdigest()[:8]
    return sd_dir / f"{stem}-{digest}{SD_SUFFIX}"


@dataclass
class MetricsEndpoint:
    """The bound /metrics address of this run, and the target file that announces it."""

    host: str
    port: int
    sd_file: Path | None = None
    scheme: str = "http"

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}/metrics"

    @property
    def target(self) -> str:
        """HOST:PORT as Prometheus should scrape it (a wildcard bind is this host's name)."""
        host = socket.gethostname() if self.host in ("0.0.0.0", "::", "") else self.host
        host = f"[{host}]" if ":" in host else host
        return f"{host}:{self.port}"

    def publish(self, sd_file: Path, labels: dict[str, str]) -> None:
        """Write the file_sd target file (blocking); a failure is logged, never fatal."""
        body = [{"targets": [self.target], "labels": labels}]
        tmp = sd_file.with_name(f".{sd_file.name}.{os.getpid()}.tmp")
        try:
            sd_file.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_bytes(orjson.dumps(body, option=orjson.OPT_INDENT_2))
            # Prometheus rereads the file on change: it must never see half of one.
            os.replace(tmp, sd_file)
        except OSError as exc:
            log.warning("metrics_sd_file_not_written", path=str(sd_file), error=str(exc))
            return
        self.sd_file = sd_file

    def withdraw(self) -> None:
        """Remove the target file: a stopped run is no target (a kill -9 leaves it, harmless)."""
        if self.sd_file is not None:
            self.sd_file.unlink(missing_ok=True)
            self.sd_file = None


def service_labels(state_dir: Path, scheme: str) -> dict[str, str]:
    """Labels of a ``dispatcher serve`` target: its state directory names it.

    ``__scheme__`` is Prometheus's own: an HTTPS listener is scraped over HTTPS.
    """
    labels = {"state_dir": str(state_dir.resolve()), "mode": "serve"}
    if scheme != "http":
        labels["__scheme__"] = scheme
    return labels


def target_labels(manifest: dict[str, Any], output: Path, shard: str | None) -> dict[str, str]:
    """Labels that tell one run's series from another's on a shared Prometheus."""
    labels = {"run_id": str(manifest.get("run_id")), "output": str(output.resolve())}
    if shard:
        labels["shard"] = shard
    return labels
