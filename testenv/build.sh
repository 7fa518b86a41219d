#!/usr/bin/env bash
# Builds the Go programs of the test environment into testenv/bin/.
#
# Each program is its own Go module under testenv/ and gets one build_<name> line below; a build is
# skipped when the binary is newer than every go.mod, go.sum and *.go file of its module, so a second
# `make testenv` costs nothing. Modules come from the Go module proxy on first use; the module and
# build caches (go env GOMODCACHE, GOCACHE) persist between runs and make rebuilds incremental.
#
# Usage: bash testenv/build.sh [--force]
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
bin="$here/bin"
force=0
[[ "${1:-}" == "--force" ]] && force=1

# build_module DIR NAME: go build DIR's main package into bin/NAME unless the binary is up to date.
build_module() {
    local dir="$here/$1" name="$2"
    local out="$bin/$name"
    if [[ $force == 0 && -x "$out" ]] \
        && [[ -z "$(find "$dir" \( -name go.mod -o -name go.sum -o -name '*.go' \) -newer "$out" -print -quit)" ]]; then
        echo "testenv: $name is up to date ($out)"
        return 0
    fi
    echo "testenv: building $name from testenv/$1 (a first build downloads modules and compiles for minutes)"
    local start=$SECONDS
    mkdir -p "$bin"
    (
        cd "$dir"
        GOFLAGS="${GOFLAGS:-} -mod=readonly" CGO_ENABLED=0 \
            go build -trimpath -ldflags="-s -w" -o "$out.tmp" .
    )
    mv -f "$out.tmp" "$out"
    echo "testenv: built $out in $((SECONDS - start))s"
}

command -v go >/dev/null || { echo "testenv: go is not installed (needed to build $bin)" >&2; exit 1; }

build_module controlplane gpufrac-controlplane
bash "$here/nriruntime/build.sh" "$@"  # NRI runtime driver: its own script (build tag nri_no_wasm)
