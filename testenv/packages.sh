#!/usr/bin/env bash
# Installs the Debian packages of the real test node (tests/realnode/), each only when missing, so a
# second `make testenv` does nothing and touches no network:
#
# - runc: the OCI runtime containerd's shim starts containers with. Debian's rather than a build of
#   github.com/opencontainers/runc: runc needs cgo and libseccomp (headers and a static library) to
#   build, and Debian's is the package the issue found working on these machines.
# - busybox-static: the one static binary the test images are made of (src/gpufrac/local/ociimage.py).
# - containernetworking-plugins: the CNI plugins (bridge, host-local, loopback, portmap, in
#   /usr/lib/cni) of the node's pod network. The kubelet reports a node NotReady while the runtime's
#   network is not ready, even if every pod uses the host's network. Debian's build of
#   github.com/containernetworking/plugins saves compiling them.
# - mmdebstrap and buildah: the gpufrac image built from the Dockerfile without a registry or a daemon
#   (testenv/image/build.sh): mmdebstrap makes its Python base from Debian's packages, buildah builds
#   the Dockerfile (docs/development.md says why these two).
# - iptables: the node's route from the kubernetes Service's ClusterIP to the API server (no kube-proxy).
#
# Needs root (apt-get); without root it only says what is missing (the real node needs root anyway, and
# tests/realnode skips without it).
#
# Usage: bash testenv/packages.sh
set -euo pipefail

packages=(runc busybox-static containernetworking-plugins iptables mmdebstrap buildah)
missing=()
for p in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [[ ${#missing[@]} == 0 ]]; then
    echo "testenv: Debian packages are installed (${packages[*]})"
    exit 0
fi
if [[ $(id -u) != 0 ]]; then
    # Not fatal: without root the real node cannot run anyway, and tests/realnode skips, saying so.
    echo "testenv: missing Debian packages ${missing[*]} (the real node's; needs root): skipped" >&2
    exit 0
fi
echo "testenv: installing Debian packages ${missing[*]}"
start=$SECONDS
export DEBIAN_FRONTEND=noninteractive
apt-get install -y --no-install-recommends "${missing[@]}" \
    || { apt-get update && apt-get install -y --no-install-recommends "${missing[@]}"; }
echo "testenv: installed ${missing[*]} in $((SECONDS - start))s"
