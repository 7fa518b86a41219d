#!/usr/bin/env bash
# Builds testenv/bin/helm: Helm's own command (helm.sh/helm/v3/cmd/helm) at the version pinned in
# go.mod, for the chart tests in tests/deploy/ (helm lint, helm template). The main package lives in
# the Helm module itself; tools.go (build tag tools) only records the dependency, so the build names
# the package instead of ".". Cached: nothing happens when the binary is newer than go.mod, go.sum,
# tools.go and this script.
#
# Usage: bash testenv/helm/build.sh [--force]
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
out="$(cd "$here/.." && pwd)/bin/helm"

if [[ "${1:-}" != "--force" && -x "$out" ]] \
    && [[ -z "$(find "$here" \( -name go.mod -o -name go.sum -o -name '*.go' -o -name build.sh \) -newer "$out" -print -quit)" ]]; then
    echo "testenv: helm is up to date ($out)"
    exit 0
fi
command -v go >/dev/null || { echo "testenv: go is not installed (needed to build $out)" >&2; exit 1; }

version="$(cd "$here" && go list -m -f '{{.Version}}' helm.sh/helm/v3)"
echo "testenv: building helm $version (a first build compiles for minutes)"
start=$SECONDS
mkdir -p "$(dirname "$out")"
(
    cd "$here"
    # As Helm's Makefile does: stamp its version, and the Kubernetes version `helm template` and
    # `helm lint` assume (that of the client-go it links; unstamped it is 1.20, which fails charts
    # that require a recent Kubernetes).
    client_go="$(go list -m -f '{{.Version}}' k8s.io/client-go)"  # v0.MINOR.PATCH = Kubernetes 1.MINOR
    minor="${client_go#v0.}"; minor="${minor%%.*}"
    flags="-s -w -X helm.sh/helm/v3/internal/version.version=$version"
    for pkg in helm.sh/helm/v3/pkg/chartutil helm.sh/helm/v3/pkg/lint/rules; do
        flags+=" -X $pkg.k8sVersionMajor=1 -X $pkg.k8sVersionMinor=$minor"
    done
    GOFLAGS="${GOFLAGS:-} -mod=readonly" CGO_ENABLED=0 \
        go build -trimpath -ldflags="$flags" -o "$out.tmp" helm.sh/helm/v3/cmd/helm
)
mv -f "$out.tmp" "$out"
echo "testenv: built $out in $((SECONDS - start))s"
