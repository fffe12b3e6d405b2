"""JSON that several modules read, typed and defined here once (DESIGN A3, A5).

The failure-row keys (``_ng_failure_*``) and the other outcome keys an
agent's result may carry (``_ng_no_persist``); ``FailureKeys`` types them.
Failure rows are not models: one is built per failed attempt and read per
line when millions of rows are scanned on resume, so they stay dicts with a
``TypedDict`` for their keys.
"""

from __future__ import annotations

from typing import Any, Final, NotRequired, TypedDict

# -- failure rows (A5) and agent results (A3) -----------------------------------

FAILURE_CLASS: Final = "_ng_failure_class"
FAILURE_TYPE: Final = "_ng_failure_type"
FAILURE_MESSAGE: Final = "_ng_failure_message"
FAILURE_HTTP_STATUS: Final = "_ng_failure_http_status"
FAILURE_RESPONSE_BODY: Final = "_ng_failure_response_body"
FAILURE_TERMINAL: Final = "_ng_failure_terminal"
# A11: a rollout whose delivery deadline ran out; its row spends no attempt.
NOT_DELIVERED: Final = "_ng_failure_not_delivered"
# A3: an agent's "write nothing" (a kill-shaped interruption).
NO_PERSIST: Final = "_ng_no_persist"
# How the dispatcher saw an attempt (replica, timing), on every row it writes.
DISPATCH_KEY: Final = "_ng_dispatch"


class FailureKeys(TypedDict):
    _ng_failure_class: str
    _ng_failure_type: str
    _ng_failure_message: str
    _ng_failure_http_status: int | None
    _ng_failure_response_body: str | None
    _ng_failure_terminal: bool
    _ng_failure_not_delivered: NotRequired[bool]


FAILURE_KEYS: Final = frozenset(FailureKeys.__annotations__)


def is_terminal(row: dict[str, Any]) -> bool:
    """A failure row (or an agent's result) that must never be retried."""
    return row.get(FAILURE_TERMINAL) is True


def is_not_delivered(row: dict[str, Any]) -> bool:
    """A failure row of a rollout that never reached an agent (A11): it spends no attempt."""
    return row.get(NOT_DELIVERED) is True
