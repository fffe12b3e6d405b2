"""One output row from one answer.

- ``build.py``: the agent's result plus the identity keys, or a failure row;
- ``finalize.py``: quiescence of the rollout's captures, the capture merge
  and trajectory, one serialized line;
- ``wire.py``: an answer's top-level keys read without decoding its values;
- ``offload.py`` and ``jsonworker.py``: big answers validated and merged off
  the event loop.
"""
