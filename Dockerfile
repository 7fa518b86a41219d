# One image for every gpufrac component: `gpufrac scheduler`, `gpufrac admission`, `gpufrac operator`,
# `gpufrac node-agent` (the Helm chart in deploy/helm/gpufrac sets the arguments).
#
#   docker build -t ghcr.io/gpufrac/gpufrac:0.1.0 .
#
# The NRI and CRI protobuf messages are generated, never copied (scripts/gen-nri-protos,
# scripts/gen-cri-protos): they come from the .proto files of the Go modules pinned in
# testenv/nriruntime/go.mod and in gen-cri-protos, so the first stage needs Go (to fetch them through the
# Go module proxy) and grpcio-tools. Nothing of that stage but the generated package reaches the image.
#
# Not built or tested in gpufrac's own CI (it has no container engine); see docs/deploy.md.

FROM golang:1.24-bookworm AS go

FROM python:3.11-slim AS protos
COPY --from=go /usr/local/go /usr/local/go
ENV PATH=/usr/local/go/bin:$PATH
RUN pip install --no-cache-dir "grpcio-tools>=1.60,<2"
WORKDIR /src
COPY testenv/nriruntime/go.mod testenv/nriruntime/go.sum testenv/nriruntime/
COPY scripts/gen-nri-protos scripts/gen-cri-protos scripts/
COPY src/gpufrac/__init__.py src/gpufrac/__init__.py
RUN python scripts/gen-nri-protos && python scripts/gen-cri-protos

FROM python:3.11-slim
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
