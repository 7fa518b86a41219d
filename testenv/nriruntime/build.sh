#!/usr/bin/env bash
# Builds testenv/bin/gpufrac-nriruntime: NRI's runtime-side adaptation library driven by JSON lines
# (see main.go). Cached: nothing happens when the binary is newer than go.mod, go.sum and every *.go
# file here. The NRI version is pinned once, in go.mod; scripts/gen-nri-protos reads the same pin to
# generate the Python plugin's messages, so both sides of the socket speak one api.proto.
#
# Built with the nri_no_wasm tag: WASM plugins are not used, and leaving out the WASM runtime (wazero)
# halves the compile on a small machine.
#
# Usage: bash testenv/nriruntime/build.sh [--force]
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
out="$(cd "$here/.." && pwd)/bin/gpufrac-nriruntime"

if [[ "${1:-}" != "--force" && -x "$out" ]] \
    && [[ -z "$(find "$here" \( -name go.mod -o -name go.sum -o -name '*.go' \) -newer "$out" -print -quit)" ]]; then
    echo "testenv: gpufrac-nriruntime is up to date ($out)"
    exit 0
fi
command -v go >/dev/null || { echo "testenv: go is not installed (needed to build $out)" >&2; exit 1; }

echo "testenv: building gpufrac-nriruntime (NRI $(awk '$1=="github.com/containerd/nri"{print $2}' "$here/go.mod"))"
start=$SECONDS
mkdir -p "$(dirname "$out")"
(
    cd "$here"
    GOFLAGS="${GOFLAGS:-} -mod=readonly" CGO_ENABLED=0 \
        go build -tags nri_no_wasm -trimpath -ldflags="-s -w" -o "$out.tmp" .
)
mv -f "$out.tmp" "$out"
echo "testenv: built $out in $((SECONDS - start))s"
