"""rollout-dispatcher: runs the rollout side of LLM reinforcement-learning jobs."""

__version__ = "0.1.0"
