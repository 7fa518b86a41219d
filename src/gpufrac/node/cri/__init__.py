"""The node agent's client of the kubelet's container runtime (CRI runtime.v1 over gRPC).

The audit needs three things only the runtime knows: which containers run now, the spec each was
created with (to compare its injected environment with what it should have), and a way to stop one so
the kubelet recreates it through a healthy create. It speaks the real CRI wire protocol with messages
generated at build time from the pinned k8s.io/cri-api module (``scripts/gen-cri-protos``).
"""
