"""``ng_trajectory`` and ``ng_perf``: the schema (``schema.py``), the builder
(``build.py``) and the model-call observations it reads (``observations.py``).
"""
