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

# build_module DIR NAME [LDFLAGS [PACKAGE]]: go build PACKAGE (default: DIR's main package) with DIR's
# module graph into bin/NAME unless the binary is newer than the module's sources and this script
# (which holds the flags).
build_module() {
    local dir="$here/$1" name="$2" ldflags="${3:-}" package="${4:-.}"
    local out="$bin/$name"
    if [[ $force == 0 && -x "$out" && ! "${BASH_SOURCE[0]}" -nt "$out" ]] \
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
            go build -trimpath -ldflags="-s -w $ldflags" -o "$out.tmp" "$package"
    )
    mv -f "$out.tmp" "$out"
    echo "testenv: built $out in $((SECONDS - start))s"
}

command -v go >/dev/null || { echo "testenv: go is not installed (needed to build $bin)" >&2; exit 1; }

# kube-apiserver reports the version stamped into k8s.io/component-base/version at link time, as
# Kubernetes' own build does; unstamped it says v0.0.0-master, which kubectl and Helm cannot parse.
# The kubelet of the real test node (tests/realnode/), kube-controller-manager and kube-scheduler are
# `tool`s of the control plane's module, so they are built from the same module graph, and stamped the
# same way, as the API server they talk to.
build_controlplane() {
    local version
    version="$(cd "$here/controlplane" && go list -m -f '{{.Version}}' k8s.io/kubernetes)"
    local major="${version#v}"; major="${major%%.*}"
    local minor="${version#v*.}"; minor="${minor%%.*}"
    local pkg=k8s.io/component-base/version
    local stamp="-X $pkg.gitVersion=$version -X $pkg.gitMajor=$major -X $pkg.gitMinor=$minor -X $pkg.gitTreeState=clean"
    build_module controlplane gpufrac-controlplane "$stamp"
    build_module controlplane kubelet "$stamp" k8s.io/kubernetes/cmd/kubelet
    build_module controlplane kube-controller-manager "$stamp" k8s.io/kubernetes/cmd/kube-controller-manager
    build_module controlplane kube-scheduler "$stamp" k8s.io/kubernetes/cmd/kube-scheduler
    # kubectl of the control plane's own version, for `gpufrac up` users (a distribution's kubectl may be
    # many minors behind the v1.37 server): `gpufrac up` prints how to use it.
    build_module controlplane kubectl "$stamp" k8s.io/kubernetes/cmd/kubectl
}

bash "$here/packages.sh"  # runc and busybox-static from Debian for the real node (apt-get only when missing)
build_controlplane
# crictl: a `tool` of testenv/critools, stamped with its module version as cri-tools' Makefile does.
build_critools() {
    local version
    version="$(cd "$here/critools" && go list -m -f '{{.Version}}' sigs.k8s.io/cri-tools)"
    build_module critools crictl "-X sigs.k8s.io/cri-tools/pkg/version.Version=$version" sigs.k8s.io/cri-tools/cmd/crictl
}

bash "$here/containerd/build.sh" "$@"  # containerd 2.x with NRI, ctr and the runc shim, for the real node
build_critools
bash "$here/nriruntime/build.sh" "$@"  # NRI runtime driver: its own script (build tag nri_no_wasm)
bash "$here/helm/build.sh" "$@"  # helm for the chart tests (tests/deploy/): a main package in a dependency
if [[ $(id -u) == 0 ]]; then
    bash "$here/image/build.sh" "$@"  # the gpufrac image from ./Dockerfile (buildah, no registry) for tests/install/
else
    echo "testenv: the gpufrac image needs root (mmdebstrap, buildah): skipped, as is tests/install" >&2
fi
