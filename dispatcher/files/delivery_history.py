"""Delivery history across hops: retries and replica health, as ``status`` and ``report`` show it.

Each hop appends what its delivery saw to the manifest's ``delivery_history``
(``run.reporting``, through ``contracts.RunManifest.ended_hop``). Its entry
is typed here once (``HopDelivery``): ``status`` and ``report`` read the
fields, not keys; this module builds a hop's entry and sums the hops.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Sequence
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr

REPLICA_FIGURES = ("sent", "delivered", "not_delivered", "probes", "opened")

Count = Annotated[StrictInt, Field(ge=0)]


class ReplicaFigures(BaseModel):
    """One replica's delivery in one hop (``replicas.Replica.view``); more keys are kept."""

    model_config = ConfigDict(extra="allow", frozen=True)

    state: StrictStr = "-"
    sent: Count = 0
    delivered: Count = 0
    not_delivered: Count = 0
    probes: Count = 0
    opened: Count = 0


class HopDelivery(BaseModel):
    """One hop's entry of the manifest's ``delivery_history``."""

    model_config = ConfigDict(extra="allow", frozen=True)

    finished_at: StrictStr | None = None
    # Per agent, retries by reason.
    retries: dict[str, dict[str, Count]] = {}
    # Per agent, per replica URL (credentials masked).
    replicas: dict[str, dict[str, ReplicaFigures]] = {}
    agents_down: list[StrictStr] = []
    local_faults: Count = 0


def history_entry(figures: dict[str, Any], finished_at: str) -> HopDelivery:
    """One hop's record, from the figures of ``Daemon.delivery_figures``."""
    return HopDelivery.model_validate(
        {
            "finished_at": finished_at,
            "retries": figures["retries"],
            "replicas": figures["replicas"],
            "agents_down": figures["agents_down"],
            "local_faults": figures["local_faults"],
        }
    )


def summarize(hops: Sequence[HopDelivery] | None) -> dict[str, Any]:
    """Totals over the recorded hops: retries by agent and reason, figures per replica."""
    hops = list(hops or [])
    retries: defaultdict[str, Counter[str]] = defaultdict(Counter)
    replicas: defaultdict[tuple[str, str], Counter[str]] = defaultdict(Counter)
    last_state: dict[tuple[str, str], str] = {}
    for hop in hops:
        for agent, reasons in hop.retries.items():
            retries[agent].update(reasons)
        for agent, urls in hop.replicas.items():
            for url, view in urls.items():
                key = (agent, url)
                replicas[key].update({k: getattr(view, k) for k in REPLICA_FIGURES})
                last_state[key] = view.state
    return {
        "hops": len(hops),
        "retries": {agent: dict(c) for agent, c in sorted(retries.items())},
        "replicas": [
            {"agent": agent, "replica": url, **dict(c), "last_state": last_state[(agent, url)]}
            for (agent, url), c in sorted(replicas.items())
        ],
        "local_faults": sum(hop.local_faults for hop in hops),
        "agents_down_last_hop": list(hops[-1].agents_down) if hops else [],
    }
