"""Per-rollout latency: the exact tracker behind the drain margin and the
summary (``tracker.py``), and the bounded live window of quantiles (``window.py``).
"""
