"""Delivery: getting one rollout to an agent and its answer back.

- ``client.py``: ``POST {replica}/run``; an answer is delivered, no answer (or
  429/502/503/504) is not, and is retried within the delivery deadline;
- ``retry.py``: the backoff rule (full jitter, ``Retry-After``);
- ``replicas.py``: a circuit breaker per replica and the routing choice;
- ``adaptive.py``: per-replica adaptive concurrency and the start-rate cap;
- ``limits.py``: the bounds on an answer's size and read time;
- ``faults.py``: the dispatcher's own faults (EMFILE, ENOMEM ...), never the agent's.
"""
