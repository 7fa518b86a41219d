"""The node agent's NRI plugin, written in Python (REAL: the same code runs against containerd).

NRI (containerd/nri) lets a plugin adjust a container before its process exists. gpufrac's plugin
connects to the runtime's socket and injects each GPU container's enforcement (see ``gpufrac.node.inject``).

Modules, bottom to top:

- ``mux``      NRI's connection multiplexer: two logical connections over the one socket
- ``ttrpc``    ttrpc framing and unary calls (containerd's lightweight RPC) on a logical connection
- ``plugin``   the protocol: register, Configure, Synchronize, container events, reconnect with backoff
- ``handler``  gpufrac's answers: injection plan -> ``ContainerAdjustment``, the mapping store in step
- ``validator`` the second plugin, a process of its own: refuses a GPU container whose final adjustment
               lacks the agent's injection (a hung, killed or late agent); ``command`` runs it as
               ``gpufrac node-agent-validator``

The messages are NRI's own, generated at build time from api.proto of the pinned Go module
(``scripts/gen-nri-protos`` -> ``gpufrac._generated.nri``); nothing of the API is written by hand.
Tests drive this plugin only through NRI's real runtime-side adaptation (testenv/nriruntime).
"""
