"""Model-call capture: the recording proxy, its write claims, and the merge into rows.

``proxy`` records every model call an agent makes for a rollout, ``store`` keeps
those records durable and tells when a rollout's writes are done, and
``finalize`` waits for that moment and attaches the calls to the rollout's row
(contracts §6).
"""
