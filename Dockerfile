# One image for every gpufrac component: `gpufrac scheduler`, `gpufrac admission`, `gpufrac operator`,
# `gpufrac node-agent` (the Helm chart in deploy/helm/gpufrac sets the arguments).
#
#   docker build -t ghcr.io/gpufrac/gpufrac:0.1.0 .
#
# The NRI, CRI and kubelet (DRA plugin) protobuf messages are generated, never copied
# (scripts/gen-nri-protos, gen-cri-protos, gen-kubelet-protos): they come from the .proto files of the Go
# modules pinned in testenv/nriruntime/go.mod, in gen-cri-protos and in testenv/controlplane/go.mod, so
# the first stage needs Go (to fetch them through the Go module proxy) and grpcio-tools. Nothing of that stage but the generated package reaches the image.
#
# The two base images are build arguments. Their defaults come from Docker Hub; gpufrac's own CI reaches no
# registry and runs no daemon, so testenv/image/build.sh builds this file with buildah, passing bases it
# made from Debian's packages (python3 and pip from bookworm with mmdebstrap; the Go toolchain of the
# machine) -- docs/development.md, "The gpufrac image". Either base must provide `python` and `pip` for
# Python 3.11 on PATH (a Debian python3 also needs PIP_BREAK_SYSTEM_PACKAGES=1 in its environment).

ARG GO_IMAGE=golang:1.24-bookworm
ARG PYTHON_IMAGE=python:3.11-slim

FROM ${GO_IMAGE} AS go

FROM ${PYTHON_IMAGE} AS protos
COPY --from=go /usr/local/go /usr/local/go
ENV PATH=/usr/local/go/bin:$PATH
# googleapis-common-protos: gen-nri-protos points ttrpc's status import at its google/rpc/status.proto.
RUN pip install --no-cache-dir "grpcio-tools>=1.60,<2" "googleapis-common-protos>=1.60,<2"
WORKDIR /src
COPY testenv/nriruntime/go.mod testenv/nriruntime/go.sum testenv/nriruntime/
COPY testenv/controlplane/go.mod testenv/controlplane/go.sum testenv/controlplane/
COPY scripts/gen-nri-protos scripts/gen-cri-protos scripts/gen-kubelet-protos scripts/
COPY src/gpufrac/__init__.py src/gpufrac/__init__.py
RUN python scripts/gen-nri-protos && python scripts/gen-cri-protos && python scripts/gen-kubelet-protos

FROM ${PYTHON_IMAGE}
# The version repeats gpufrac.__version__ (its one home); tests/test_version.py checks that they agree.
LABEL org.opencontainers.image.title="gpufrac" \
      org.opencontainers.image.version="0.1.0" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.description="Memory-enforced GPU sharing for Kubernetes"
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY src/ src/
COPY --from=protos /src/src/gpufrac/_generated/ src/gpufrac/_generated/
RUN pip install --no-cache-dir . && rm -rf /src
WORKDIR /
# Unprivileged by default; the node agent's DaemonSet (rendered by the operator) runs it privileged.
USER 65532:65532
ENTRYPOINT ["gpufrac"]
CMD ["--help"]
