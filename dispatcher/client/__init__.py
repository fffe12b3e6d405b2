"""Python client of ``dispatcher serve`` (contracts §12, §13): jobs, results, policy
version, step control and the admission pause.

A trainer submits the rollouts of step N+1 while it consumes step N, so the
daemon is never idle between steps::

    from dispatcher.client import AsyncClient

    async def train(steps: list[list[dict]]) -> None:
        async with AsyncClient("http://rollouts:8080") as client:
            await client.submit(steps[0], job_id="step-0", num_repeats=8, policy_version=0)
            for n in range(len(steps)):
                if n + 1 < len(steps):  # queued behind step n, starts as slots free up
                    await client.submit(
                        steps[n + 1], job_id=f"step-{n + 1}", num_repeats=8, policy_version=n + 1
                    )
                results = client.results(f"step-{n}", group=True)
                async for group in results:  # a complete group as soon as it is durable
                    learn(group["task_index"], group["rows"])
                assert results.final_state == "done"
                await client.set_policy_version(n + 1)  # after the weight update

``Client`` is the same API, blocking, for trainers without an event loop
(``for group in client.results(...)``). The README's "Step control" has a
trainer loop that stops each step at N kept groups, pauses the daemon around
its weight update and reads the last step's tail as off-policy rows.

The resume contract, kept by ``results``: every line the daemon streams carries
``_ng_seq`` (a row's line number in the job's output, or a group's own
sequence number with ``group=True``), and ``after=SEQ`` resumes exactly after
it. The iterator remembers the last ``_ng_seq`` it yielded; when the connection
drops or the daemon restarts it reconnects with ``after=`` that seq, with
backoff, until ``retry_deadline_s`` passes without progress. The caller sees
every row exactly once. ``Results.last_seq`` is what to persist to resume
across processes (``results(job_id, after=last_seq)``). A 404 for a job the
stream has already read from counts as a daemon still starting (jobs are never
forgotten), not as an unknown job.

A daemon started with a token (``--api-token-file``) wants it on every call:
``AsyncClient(url, token=...)``, or ``DISPATCHER_API_TOKEN`` in the environment.
A missing or wrong token is ``Unauthorized`` (a ``ClientError``, status 401).

Every call whose repetition is harmless is retried the same way: all of them
except ``submit`` without a ``job_id`` (a retried anonymous submit could create
a second job). Errors are one type, ``ClientError(status, message)``: the
HTTP status and the daemon's one-line error, or status 503 (``http_status``
None) when no answer came within the deadline (``Unauthorized`` is the 401 of
them). They pickle: Ray carries them between processes. A daemon the client
never reached (connection refused, a name that does not resolve) is an error
after ``connect_deadline_s`` (10 s), not after the minute of retries a
restarting daemon gets.
"""

from dispatcher.client.aio import AsyncClient, Results
from dispatcher.client.blocking import BlockingResults, Client
from dispatcher.client.wire import (
    Admission,
    ClientError,
    JobStatus,
    NdjsonSplitter,
    StreamPosition,
    Unauthorized,
    error_message,
    job_path,
    results_query,
    submit_body,
)
from dispatcher.lifecycle import JobState

__all__ = [
    "Admission",
    "AsyncClient",
    "BlockingResults",
    "Client",
    "ClientError",
    "JobState",
    "JobStatus",
    "NdjsonSplitter",
    "Results",
    "StreamPosition",
    "Unauthorized",
    "error_message",
    "job_path",
    "results_query",
    "submit_body",
]
