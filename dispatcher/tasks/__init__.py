"""Tasks: the task file streamed, validated and materialized into rollouts
(``materialize.py``), and the rollout ids and row keys (``keys.py``).
"""
