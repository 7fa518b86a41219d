"""gpufrac: memory-enforced GPU sharing for Kubernetes.

Layers, top to bottom (imports only go downwards): ``cli`` → ``local`` → ``scheduler`` / ``admission`` /
``operator`` / ``node`` / ``sim`` → ``kube`` → ``placement`` → ``contract``. ``contract`` and
``placement`` are pure: no I/O, so the scheduler service and the trace simulator run the same engine.
See docs/architecture.md.
"""

__version__ = "0.1.0"
