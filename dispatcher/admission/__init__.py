"""Admission: which rollout may start now, and which must not start at all.

- ``pool.py``: the slot pool shared by every job, served in rank order, and
  the budget's drain decision (a rollout is drained, not started, when the
  time left is under the drain margin);
- ``agent_load.py``: each agent's slots (a fixed cap or an adaptive limit)
  and what delivery saw of its health (retries, breakers, agents down);
- ``bytebudget.py``: the commit queue, bounded in count and in bytes.
"""
