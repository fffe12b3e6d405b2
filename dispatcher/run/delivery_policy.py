"""The agent calls' deadlines and retry rules (``DeliveryPolicy``), made from the
run's settings once, when the daemon starts (``daemon.py``)."""

from __future__ import annotations

from dispatcher.delivery.adaptive import AimdPolicy
from dispatcher.delivery.limits import ResponseLimits
from dispatcher.delivery.policy import DeliveryPolicy
from dispatcher.delivery.replicas import BreakerPolicy
from dispatcher.delivery.retry import BackoffPolicy
from dispatcher.rows.offload import AnswerClassifier
from dispatcher.settings.config import RunSettings

DEFAULT_FIRST_BYTE_TIMEOUT_S = 7200.0


def delivery_policy(settings: RunSettings) -> DeliveryPolicy:
    """The agent calls' deadlines and retry rules, from the settings."""
    first_byte_s = settings.first_byte_timeout_s
    if first_byte_s is None and settings.rollout_timeout_s is None:
        # Without a rollout timeout nothing else bounds a silent agent.
        first_byte_s = DEFAULT_FIRST_BYTE_TIMEOUT_S
    return DeliveryPolicy(
        classify=AnswerClassifier(settings.offload_bytes),
        deadline_s=settings.delivery_deadline_s,
        rollout_timeout_s=settings.rollout_timeout_s,
        pause_deadlines=settings.pause_deadlines,
        first_byte_timeout_s=first_byte_s,
        limits=ResponseLimits(settings.max_response_bytes, settings.response_read_timeout_s),
        backoff=BackoffPolicy(settings.retry_backoff_base_s, settings.retry_backoff_cap_s),
        breaker=BreakerPolicy(
            settings.breaker_failures, settings.breaker_open_s, settings.breaker_open_cap_s
        ),
        replica_cap=settings.replica_concurrency,
        max_starts_per_s=settings.max_starts_per_s,
        aimd=AimdPolicy(maximum=settings.concurrency_max) if settings.adaptive else None,
    )
