"""Live observability: Prometheus metrics, the HTTP endpoints, logging, progress.

The daemon owns one ``metrics.Metrics``; jobs call it on their completion
path; the rest are building blocks it starts and stops
(``server.start_http_server``, ``lag.LoopLagMonitor``,
``progress.ProgressLine``) or pure helpers (``progress.format_progress``,
``progress_fields``, ``estimate_eta_s``, ``discovery.parse_listen``). On a
terminal, ``logs`` adds ``console.ConsoleFolding``: failures folded by class,
retries counted on the progress line.

Import the modules, not this package's names: it imports none of them, so
that every command can configure logging (``logs``) without loading aiohttp's
server and prometheus_client, which ``status``, ``report``, ``merge`` and
``init`` never use.
"""
