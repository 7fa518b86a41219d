#!/usr/bin/env bash
# Builds the gpufrac image from the repository's own Dockerfile, with no registry and no daemon, into an
# OCI archive the real node imports into containerd (tests/install/, docs/development.md "The gpufrac
# image"):
#
# 1. the Python base, gpufrac.local/python:3.11-bookworm: Debian bookworm's python3, python3-pip,
#    python-is-python3 and ca-certificates made into a root file system by mmdebstrap (from Debian's
#    mirror, the one package source reachable here), committed by buildah with PATH and
#    PIP_BREAK_SYSTEM_PACKAGES=1 (Debian's python3 refuses `pip install` into the system otherwise:
#    PEP 668). It stands in for Docker Hub's python:3.11-slim.
# 2. the Go base, gpufrac.local/go:<version>: this machine's Go toolchain (/usr/local/go, the one that
#    builds testenv) in an image of its own, standing in for golang:1.24-bookworm. The proto stage only
#    copies /usr/local/go out of it.
# 3. `buildah build --layers --isolation chroot --storage-driver vfs` of ./Dockerfile with those two
#    as its PYTHON_IMAGE and GO_IMAGE build arguments: every step of the Dockerfile runs as written
#    (the RUN steps reach PyPI and the Go module proxy over the host's network). Tagged
#    gpufrac.local/gpufrac:<version>, the version read from src/gpufrac/__init__.py, its one home.
# 4. `buildah push` to testenv/bin/images/gpufrac.oci.tar (an OCI archive whose image name
#    annotation is the tag, which `ctr images import` reads).
#
# Each step is skipped when its output is up to date (a base: made from the same suite and packages, or
# the same Go; the image: made from the same bases and the same content of the Dockerfile and every file
# it copies), so a second run does nothing. buildah's storage lives in
# ${GPUFRAC_BUILDAH_STORE:-~/.cache/gpufrac-testenv/buildah} and keeps the layer cache between runs.
# It keeps nothing else: before and after each build the working containers left behind (buildah leaves
# one per `FROM` stage that only serves `COPY --from`, and a killed build leaves its own) and the images
# no tag reaches any more (the previous build's chain) are removed. vfs stores a full copy of each, and
# without this every build added about 3 GB (54 GB after a day of CI runs, until the disk was full).
# One run at a time per store (flock), since the tidying would remove a concurrent build's containers.
# Needs root (mmdebstrap's root mode, buildah's chroot) and Debian's mmdebstrap and buildah
# (installed by testenv/packages.sh).
#
# Usage: bash testenv/image/build.sh [--force | --tidy]   (--tidy: only tidy the store, build nothing)
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
out="$here/../bin/images"
archive="$out/gpufrac.oci.tar"
store="${GPUFRAC_BUILDAH_STORE:-${XDG_CACHE_HOME:-$HOME/.cache}/gpufrac-testenv/buildah}"
force=0
tidy_only=0
case "${1:-}" in
    --force) force=1 ;;
    --tidy) tidy_only=1 ;;
    "") ;;
    *) echo "image: unknown argument ${1} (usage: build.sh [--force | --tidy])" >&2; exit 2 ;;
esac

version="$(sed -n 's/^__version__ = "\(.*\)"$/\1/p' "$repo/src/gpufrac/__init__.py")"
[[ -n "$version" ]] || { echo "image: no __version__ in src/gpufrac/__init__.py" >&2; exit 1; }
image="gpufrac.local/gpufrac:$version"
suite=bookworm
packages=python3,python3-pip,python-is-python3,ca-certificates
python_base="gpufrac.local/python:3.11-$suite"
go_root="$(go env GOROOT)"
ca_bundle=/etc/ssl/certs/ca-certificates.crt
go_base="gpufrac.local/go:$(go env GOVERSION)"

for tool in buildah mmdebstrap; do
    command -v "$tool" >/dev/null || { echo "image: $tool is missing: bash testenv/packages.sh" >&2; exit 1; }
done
[[ $(id -u) == 0 ]] || { echo "image: needs root (mmdebstrap --mode=root, buildah --isolation chroot)" >&2; exit 1; }

buildah=(buildah --root "$store/root" --runroot "$store/run" --storage-driver vfs)
mkdir -p "$out" "$store"
stamps="$store/stamps"
mkdir -p "$stamps"
exec 9>"$store/lock"
flock 9

# tidy_store: remove every working container and every image no tag reaches (the bases, the current image
# and the intermediate images of its layer cache stay).
# A failure only warns: the build itself does not depend on it.
tidy_store() {
    "${buildah[@]}" rm --all >/dev/null || echo "image: warning: could not remove $store's working containers" >&2
    "${buildah[@]}" rmi --prune >/dev/null || echo "image: warning: could not prune $store's untagged images" >&2
}

if [[ $tidy_only == 1 ]]; then
    before="$(du -sm "$store" | cut -f1)"
    tidy_store
    echo "image: tidied $store (${before} MB before, $(du -sm "$store" | cut -f1) MB after)"
    exit 0
fi

# has_image NAME STAMP KEY: the image exists and was made from KEY (what it is made of, kept in STAMP).
has_image() {
    [[ $force == 0 ]] && "${buildah[@]}" inspect --type image "$1" >/dev/null 2>&1 \
        && [[ -f "$2" && "$(cat "$2")" == "$3" ]]
}

python_stamp="$stamps/python-base"
python_key="mmdebstrap --variant=minbase $suite $packages"
if has_image "$python_base" "$python_stamp" "$python_key"; then
    echo "image: $python_base is up to date"
else
    echo "image: making $python_base from Debian $suite ($packages) with mmdebstrap"
    start=$SECONDS
    tmp="$(mktemp -d)"
    trap 'rm -rf "$tmp"' EXIT
    mmdebstrap --quiet --mode=root --variant=minbase --include="$packages" \
        --aptopt='Acquire::Retries "3"' --dpkgopt='path-exclude=/usr/share/doc/*' \
        --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/locale/*' \
        --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*' \
        "$suite" "$tmp/rootfs.tar"
    ctr="$("${buildah[@]}" from scratch)"
    "${buildah[@]}" add "$ctr" "$tmp/rootfs.tar" / >/dev/null
    "${buildah[@]}" config \
        --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
        --env PIP_BREAK_SYSTEM_PACKAGES=1 --env LANG=C.UTF-8 --cmd python3 \
        --label "org.opencontainers.image.description=Debian $suite $packages (mmdebstrap), gpufrac's testenv base" \
        "$ctr"
    "${buildah[@]}" commit --quiet --rm "$ctr" "$python_base" >/dev/null
    rm -rf "$tmp"
    trap - EXIT
    echo "$python_key" > "$python_stamp"
    echo "image: made $python_base in $((SECONDS - start))s"
fi

go_stamp="$stamps/go-base"
go_key="$go_root $(go env GOVERSION)"
if has_image "$go_base" "$go_stamp" "$go_key"; then
    echo "image: $go_base is up to date"
else
    echo "image: making $go_base from $go_root"
    start=$SECONDS
    ctr="$("${buildah[@]}" from scratch)"
    "${buildah[@]}" copy "$ctr" "$go_root" /usr/local/go >/dev/null
    "${buildah[@]}" config --env PATH=/usr/local/go/bin:/usr/bin:/bin "$ctr"
    "${buildah[@]}" commit --quiet --rm "$ctr" "$go_base" >/dev/null
    echo "$go_key" > "$go_stamp"
    echo "image: made $go_base in $((SECONDS - start))s"
fi

# The image's inputs: the Dockerfile, .dockerignore and what its COPY steps name, by content: a hash of
# every file's path and bytes and of the two bases' image IDs, kept next to the archive. What `make
# testenv` writes later (the generated messages, which the image makes for itself, and the directory
# entries that creates), the egg-info of `pip install -e` and byte code do not count; a deleted file does.
inputs=(Dockerfile .dockerignore pyproject.toml setup.py README.md src scripts/gen-nri-protos
    scripts/gen-cri-protos scripts/gen-kubelet-protos testenv/nriruntime/go.mod testenv/nriruntime/go.sum
    testenv/controlplane/go.mod testenv/controlplane/go.sum)
inputs_key="$( (cd "$repo" && find "${inputs[@]}" -type f -not -path 'src/gpufrac/_generated/*' \
    -not -path '*/__pycache__/*' -not -path '*.egg-info/*' -not -name '*.pyc' -print0 | LC_ALL=C sort -z \
    | xargs -0 sha256sum; for base in "$python_base" "$go_base"; do
        "${buildah[@]}" images --no-trunc --quiet "$base"; done) | sha256sum | cut -d' ' -f1)"
inputs_stamp="$archive.inputs"
if [[ ! -f "$archive" ]]; then
    why=missing
elif [[ $force == 1 ]]; then
    why=forced
elif [[ ! -f "$inputs_stamp" || "$(cat "$inputs_stamp")" != "$inputs_key" ]]; then
    why="its inputs changed"
else
    echo "image: $image is up to date ($archive)"
    exit 0
fi
echo "image: building $image from Dockerfile with buildah ($why)"
start=$SECONDS
tidy_store
# The RUN steps trust what this machine trusts: its CA bundle is bind-mounted over the image's for the
# build only (RUN mounts are not committed), since the network here may pass through a TLS proxy whose
# CA only the machine's bundle holds.
"${buildah[@]}" build --quiet --layers --isolation chroot --network host --pull=never \
    --volume "$ca_bundle:/etc/ssl/certs/ca-certificates.crt:ro" \
    --build-arg "PYTHON_IMAGE=$python_base" --build-arg "GO_IMAGE=$go_base" \
    -t "$image" -f "$repo/Dockerfile" "$repo" >/dev/null
"${buildah[@]}" push --quiet "$image" "oci-archive:$archive.tmp:$image"
mv -f "$archive.tmp" "$archive"
echo "$inputs_key" > "$inputs_stamp"
tidy_store
echo "image: built $image in $((SECONDS - start))s ($archive)"
