"""The scheduler service: informers -> scheduling queue -> placement engine -> binder, behind a Lease.

``service.build_service`` makes one (in-process use); ``command.scheduler`` is ``gpufrac scheduler``.
docs/scheduler.md describes its behaviour, configuration and metrics.
"""
