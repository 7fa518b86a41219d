"""Typed Kubernetes I/O on lightkube: informers, leases, events, patches."""
