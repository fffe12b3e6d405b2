"""Settings: one validated model (TOML, then ``DISPATCHER_*``, then flags) in
``config.py``; the shard (``shard.py``) and the walltime budget from the job
scheduler (``walltime.py``); small argument types (``args.py``).
"""
