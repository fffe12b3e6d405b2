"""A job's submission (serve/submission.py): a small body of rows is checked on the loop,
without a thread hop, once the archive's ids are known; a job_id the archive may hold
still finds its archived job (200, or 409 for another body)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from dispatcher.serve.archive import Compaction
from dispatcher.serve.jobs import Service
from tests.helpers import FakeAgent, wait_until
from tests.serve.test_archive import daemon

pytestmark = pytest.mark.timeout(120)


def bodies_thread_calls(service: Service, monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Every call handed to the bodies' thread from here on."""
    calls: list[Any] = []
    executor = service._bodies_thread
    real = executor.submit

    def counted(fn: Any, /, *args: Any, **kwargs: Any) -> Any:
        calls.append(fn)
        return real(fn, *args, **kwargs)

    monkeypatch.setattr(executor, "submit", counted)
    return calls


def compaction(service: Service) -> Compaction:
    assert service.compaction is not None
    return service.compaction


async def test_a_small_job_of_rows_is_checked_without_a_thread_hop(
    tmp_path: Path, agent: FakeAgent, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with daemon(tmp_path, agent, window=3) as api:
        await wait_until(lambda: compaction(api.service).ids.loaded)
        calls = bodies_thread_calls(api.service, monkeypatch)
        assert await api.submit("small") == 201
        assert await api.submit("small") == 200
        assert calls == []


async def test_archived_jobs_are_found_after_a_restart_new_ones_take_no_hop(
    tmp_path: Path, agent: FakeAgent, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with daemon(tmp_path, agent, window=3) as api:
        await api.run([f"j{n}" for n in range(3)])
        await wait_until(lambda: compaction(api.service).archived == 3)
        # Folded by this daemon: in its filter as the fold committed.
        assert await api.submit("j0") == 200
    async with daemon(tmp_path, agent, window=3) as api:
        await wait_until(lambda: compaction(api.service).ids.loaded)
        calls = bodies_thread_calls(api.service, monkeypatch)
        # Archived before the start: a "maybe", looked up in the index (the thread).
        assert await api.submit("j1") == 200
        assert await api.submit("j1", count=4) == 409
        assert len(calls) == 2
        # A new id the filter rules out (about 1 in 400 is a wrong "maybe", and
        # which ones changes with the process's string hash) takes no hop.
        ids = compaction(api.service).ids
        fresh = next(f"new{n}" for n in range(100) if not ids.may_hold(f"new{n}"))
        assert await api.submit(fresh) == 201
        assert len(calls) == 2
