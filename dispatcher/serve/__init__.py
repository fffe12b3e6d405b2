"""Service mode (contracts §12): one daemon for a whole training run, jobs over HTTP.

Reading order: ``command.py`` (``dispatcher serve``) starts a ``Daemon`` and a
``Service``; ``jobs.py`` runs each submitted job (``spec.py`` validates
the body, ``registry.py`` keeps it under the state directory so a restart
resumes it); ``groups.py`` records which tasks have every repeat final;
``results.py`` streams a job's durable rows; ``api.py`` maps the HTTP routes
onto all of it. The Python client is ``dispatcher.client``.
"""
