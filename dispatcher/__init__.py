"""rollout-dispatcher: runs the rollout side of LLM reinforcement-learning jobs.

A "contracts §N" in a docstring or comment cites section N of ``docs/contracts.md``,
the files, keys, wire protocol and service API this package keeps.
"""

__version__ = "0.1.0"
