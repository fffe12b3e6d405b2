"""The client's exceptions pickle and carry an integer ``.status`` (contracts §12): a
trainer's typed retry budgets read it after Ray carried the error between processes."""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from typing import Any

import pytest

from dispatcher.client.gym import RolloutFailed
from dispatcher.client.wire import ClientError, Unauthorized


def failure(failure_class: str, http_status: int | None, **extra: Any) -> dict[str, Any]:
    return {
        "_ng_failure_class": failure_class,
        "_ng_failure_type": "RolloutFailed",
        "_ng_failure_message": f"{failure_class} ({http_status})",
        "_ng_failure_http_status": http_status,
        "_ng_failure_response_body": None,
        **extra,
    }


# (failure, the .status a trainer sees): the last HTTP error status, else 503 for the
# infrastructure's failure and 422 for the task's.
KINDS = [
    (failure("agent_run_error", 500), 500),
    (failure("agent_run_error", 400), 400),
    (failure("agent_request_failed", None, _ng_failure_not_delivered=True), 503),
    (failure("agent_request_failed", 503), 503),
    (failure("timeout_exceeded", None), 422),
    (failure("protocol_violation", 200), 422),
    (failure("sandbox_crashed", None), 422),
]


@pytest.mark.parametrize(("row", "status"), KINDS)
def test_a_rollout_failure_pickles_with_the_status_of_its_kind(
    row: dict[str, Any], status: int
) -> None:
    error = RolloutFailed(row)
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is RolloutFailed
    assert (again.status, again.failure, str(again)) == (status, row, str(error))


@pytest.mark.parametrize(
    "error",
    [ClientError(409, "job x exists"), ClientError(None, "no answer"), Unauthorized(401, "no")],
)
def test_a_client_error_pickles_as_it_was(error: ClientError) -> None:
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is type(error)
    assert (again.status, again.http_status, str(again)) == (
        error.status,
        error.http_status,
        str(error),
    )
    assert isinstance(again.status, int)


@pytest.fixture(scope="module")
def ray() -> Iterator[Any]:
    ray = pytest.importorskip(
        "ray", reason="the `ray` package is not installed (pip install ray; .ci/run installs it)"
    )
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        yield ray
    finally:
        ray.shutdown()


def test_a_rollout_failure_raised_in_a_ray_task_reaches_the_caller_typed(ray: Any) -> None:
    @ray.remote
    def collect(row: dict[str, Any]) -> None:
        raise RolloutFailed(row)

    for row, status in KINDS:
        with pytest.raises(RolloutFailed) as caught:
            ray.get(collect.remote(row))
        assert caught.value.status == status
        assert caught.value.failure == row


def test_errors_returned_by_a_ray_actor_keep_their_type_and_status(ray: Any) -> None:
    @ray.remote
    class Collector:
        def errors(self) -> list[ClientError]:
            return [ClientError(None, "no answer"), RolloutFailed(KINDS[0][0])]

    collector = Collector.remote()  # type: ignore[attr-defined]
    plain, failed = ray.get(collector.errors.remote())
    assert (type(plain), plain.status) == (ClientError, 503)
    assert (type(failed), failed.status, failed.failure) == (RolloutFailed, 500, KINDS[0][0])
