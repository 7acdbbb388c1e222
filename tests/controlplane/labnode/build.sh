#!/bin/sh
# Builds labnode (main.go here: the real kubelet of the lab's release, its fake CRI
# runtime and a device plugin, for tests/controlplane/realkubelet.py) once per release,
# beside labkube in the cache outside the clone:
#
#   tests/controlplane/labnode/build.sh   prints the binary's path; builds it if missing
#
# Its own script and go.mod, not a step of ../build.sh: labkube's cache key hashes
# ../build.sh and ../go.mod, so any change there rebuilds labkube for every clone on the
# machine. The modules and most packages are labkube's (same versions, same flags, one Go
# build cache): after labkube, a build compiles about 100 packages and links.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
release=$(sed -n 's/^[[:space:]]*k8s.io\/kubernetes \(v[0-9.]*\)$/\1/p' "$here/go.mod" | head -1)
cache=${HOSTAGENT_LAB_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/hostagent-lab}
out="$cache/kube-$release"
sum=$(cat "$here/go.mod" "$here/go.sum" "$here/main.go" "$0" | sha256sum | cut -c1-16)
if [ -x "$out/labnode" ] && [ "$(cat "$out/labnode.source" 2>/dev/null)" = "$sum" ]; then
    echo "$out/labnode"
    exit 0
fi
GO=${GO:-$(command -v go || echo /usr/local/go/bin/go)}
if ! [ -x "$GO" ] && ! command -v "$GO" >/dev/null 2>&1; then
    echo "labnode/build.sh: no Go found (../build.sh says which)" >&2
    exit 1
fi
echo "building labnode (the kubelet of Kubernetes $release) with $("$GO" version | cut -d' ' -f3)" \
     "(once per release, cached in $out)" >&2
start=$(date +%s)
mkdir -p "$out"
cd "$here"
"$GO" mod download
# The version stamps of ../build.sh (hack/lib/version.sh), so that the node's
# nodeInfo.kubeletVersion says the release.
minor=$(echo "$release" | cut -d. -f2)
stamp=""
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    stamp="$stamp -X $pkg.gitVersion=$release -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor"
    stamp="$stamp -X $pkg.gitTreeState=clean -X $pkg.buildDate=1970-01-01T00:00:00Z"
done
# A temporary name of this build's own: two clones building at once each move a whole
# binary into place.
tmp="$out/labnode.tmp.$$"
trap 'rm -f "$tmp"' EXIT
CGO_ENABLED=0 nice -n 19 "$GO" build -trimpath -ldflags "-s -w $stamp" -o "$tmp" .
mv -f "$tmp" "$out/labnode"
echo "$sum" > "$out/labnode.source"
echo "  built in $(( $(date +%s) - start )) s" >&2
echo "$out/labnode"
