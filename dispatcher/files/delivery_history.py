"""Delivery history across hops: retries and replica health, as ``status`` and ``report`` show it.

Each hop appends what its delivery saw to the manifest's ``delivery_history``
(``job.Job``, through ``contracts.RunManifest.ended_hop``); this
module builds a hop's entry, sums the hops and renders them.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any

from dispatcher.files.contracts import RunManifest

REPLICA_FIGURES = ("sent", "delivered", "not_delivered", "probes", "opened")


def history_entry(figures: dict[str, Any], finished_at: str) -> dict[str, Any]:
    """One hop's record, from the figures of ``Daemon.delivery_figures``."""
    return {
        "finished_at": finished_at,
        "retries": figures["retries"],
        "replicas": figures["replicas"],
        "agents_down": figures["agents_down"],
        "local_faults": figures["local_faults"],
    }


def summarize(manifest: RunManifest | None) -> dict[str, Any]:
    """Totals over the recorded hops: retries by agent and reason, figures per replica."""
    hops = (manifest.delivery_history if manifest is not None else None) or []
    retries: defaultdict[str, Counter[str]] = defaultdict(Counter)
    replicas: defaultdict[tuple[str, str], Counter[str]] = defaultdict(Counter)
    last_state: dict[tuple[str, str], str] = {}
    for hop in hops:
        for agent, reasons in _dict(hop.get("retries")).items():
            retries[agent].update({k: v for k, v in _dict(reasons).items() if type(v) is int})
        for agent, urls in _dict(hop.get("replicas")).items():
            for url, view in _dict(urls).items():
                view = _dict(view)
                key = (agent, url)
                replicas[key].update(
                    {k: view[k] for k in REPLICA_FIGURES if type(view.get(k)) is int}
                )
                last_state[key] = str(view.get("state", "-"))
    return {
        "hops": len(hops),
        "retries": {agent: dict(c) for agent, c in sorted(retries.items())},
        "replicas": [
            {"agent": agent, "replica": url, **dict(c), "last_state": last_state[(agent, url)]}
            for (agent, url), c in sorted(replicas.items())
        ],
        "local_faults": sum(_int(h.get("local_faults")) for h in hops),
        "agents_down_last_hop": hops[-1].get("agents_down", []) if hops else [],
    }


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _int(value: Any) -> int:
    return value if type(value) is int else 0
