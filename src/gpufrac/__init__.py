"""gpufrac: memory-enforced GPU sharing for Kubernetes.

Layers, top to bottom (imports only go downwards): ``cli`` → ``local`` → ``scheduler`` / ``admission`` /
``operator`` / ``node`` / ``sim`` → ``kube`` → ``placement`` → ``contract``. ``contract`` and
``placement`` are pure: no I/O, so the scheduler service and the trace simulator run the same engine.
See docs/architecture.md.
"""

#: The version's one home: pyproject.toml reads it (``dynamic = ["version"]``), ``gpufrac --version``
#: prints it, ``gpufrac_build_info`` exports it; the chart's appVersion and the Dockerfile's image labels
#: repeat it and tests/test_version.py checks that they agree.
__version__ = "0.1.0"
