#!/usr/bin/env bash
# Builds containerd 2.x for the real test node (tests/realnode/): testenv/bin/containerd, ctr and
# containerd-shim-runc-v2 (the shim containerd starts runc through; without it no container runs).
# The version is pinned once, in go.mod (`tool` directives); containerd's NRI dependency there is the
# same github.com/containerd/nri version testenv/nriruntime links, so our plugin meets the NRI it was
# tested against. Debian's containerd (1.6) is too old to have NRI.
#
# Static (CGO_ENABLED=0): the btrfs and devmapper snapshotters need cgo and are left out; the test node
# uses the native snapshotter. Cached: nothing happens when all three binaries are newer than go.mod,
# go.sum and this script.
#
# Usage: bash testenv/containerd/build.sh [--force]
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
bin="$(cd "$here/.." && pwd)/bin"
tools=(containerd ctr containerd-shim-runc-v2)

stale=0
for t in "${tools[@]}"; do
    if [[ "${1:-}" == "--force" || ! -x "$bin/$t" ]] \
        || [[ -n "$(find "$here" \( -name go.mod -o -name go.sum -o -name build.sh \) -newer "$bin/$t" -print -quit)" ]]; then
        stale=1
    fi
done
if [[ $stale == 0 ]]; then
    echo "testenv: containerd is up to date ($bin/containerd)"
    exit 0
fi
command -v go >/dev/null || { echo "testenv: go is not installed (needed to build $bin/containerd)" >&2; exit 1; }

version="$(cd "$here" && go list -m -f '{{.Version}}' github.com/containerd/containerd/v2)"
echo "testenv: building containerd $version, ctr and containerd-shim-runc-v2 (a first build compiles for minutes)"
start=$SECONDS
mkdir -p "$bin"
(
    cd "$here"
    for t in "${tools[@]}"; do
        GOFLAGS="${GOFLAGS:-} -mod=readonly" CGO_ENABLED=0 \
            go build -trimpath -tags "no_btrfs no_devmapper no_zfs" \
            -ldflags="-s -w -X github.com/containerd/containerd/v2/version.Version=$version" \
            -o "$bin/$t.tmp" "github.com/containerd/containerd/v2/cmd/$t"
        mv -f "$bin/$t.tmp" "$bin/$t"
    done
)
echo "testenv: built containerd $version in $((SECONDS - start))s"
