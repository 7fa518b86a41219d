"""The scheduler service: informers -> scheduling queue -> booking cache (the placement engine and each
booking's state) -> binder, behind a Lease.

``service.build_service`` makes one (in-process use); ``command.scheduler`` is ``gpufrac scheduler``.
docs/scheduler.md describes its behaviour, configuration and metrics.
"""
