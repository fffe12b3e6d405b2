"""Service mode (contracts §12): one daemon for a whole training run, jobs over HTTP.

Reading order: ``command.py`` (``dispatcher serve``) starts a ``Daemon`` and a
``Service``; ``jobs.py`` owns the jobs (``spec.py`` validates a body,
``registry.py`` keeps it under the state directory so a restart resumes it);
``served.py`` runs a job, ``final.py`` is what a final one leaves;
``groups.py`` records which tasks have every repeat final; ``lines.py`` types
the JSON lines several modules read; ``results.py`` streams a job's durable
rows and ``sending.py`` sends them under its bounds; ``bodies.py`` bounds
request bodies; ``api.py`` maps the HTTP routes onto all of it. The Python
client is ``dispatcher.client``.
"""
