"""Running jobs: reading order ``one_job.py`` (``dispatcher run``), ``daemon.py``,
``job.py``, ``flight.py``.

- ``daemon.py``: what every job of a process shares: the listener, signals,
  the agents' session, the pool, the commit queue, the budget, telemetry;
- ``job.py``: one output's files and state; it alone records outcomes;
- ``flight.py``: one rollout's life from its slots to its commit;
- ``prepare.py``: the lock, materialization and what earlier hops did;
- ``aggregate.py``: the end-of-run aggregate metrics file.
"""
