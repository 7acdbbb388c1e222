#!/bin/sh
# Builds the lab's Kubernetes control plane (labkube: etcd, kube-apiserver,
# kube-controller-manager, kube-scheduler and kubectl from their sources, see main.go)
# once per release, into a cache outside the clone, so that a fresh clone on the same
# machine builds nothing:
#
#   tests/controlplane/build.sh      prints the binary's path; builds it if missing
#
# A cold build downloads the modules through the Go module proxy and compiles
# Kubernetes: tens of minutes on 2 cores (README, "The lab"), progress printed.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
release=$(sed -n 's/^[[:space:]]*k8s.io\/kubernetes \(v[0-9.]*\)$/\1/p' "$here/go.mod" | head -1)
cache=${HOSTAGENT_LAB_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/hostagent-lab}
out="$cache/kube-$release"
sum=$(cat "$here/go.mod" "$here/go.sum" "$here/main.go" "$0" | sha256sum | cut -c1-16)
if [ -x "$out/labkube" ] && [ "$(cat "$out/source" 2>/dev/null)" = "$sum" ]; then
    echo "$out/labkube"
    exit 0
fi

# Go: the version go.mod asks for, or newer. Debian 12's golang (1.19) is too old.
need=$(sed -n 's/^go \([0-9.]*\)$/\1/p' "$here/go.mod")
GO=${GO:-$(command -v go || echo /usr/local/go/bin/go)}
if ! [ -x "$GO" ] && ! command -v "$GO" >/dev/null 2>&1; then
    echo "build.sh: no Go found: Kubernetes $release needs Go $need or newer (put its" \
         "bin/ on PATH, or set GO=/path/to/go); Debian 12's golang package is too old" >&2
    exit 1
fi
have=$("$GO" env GOVERSION | sed 's/^go//')
if [ "$(printf '%s\n%s\n' "$need" "$have" | sort -V | head -1)" != "$need" ]; then
    echo "build.sh: $("$GO" version) is too old: Kubernetes $release needs Go $need or newer" >&2
    exit 1
fi

echo "building the lab's Kubernetes $release from source with $("$GO" version | cut -d' ' -f3)" \
     "(once per release, cached in $out)" >&2
start=$(date +%s)
mkdir -p "$out"
cd "$here"
echo "  downloading modules..." >&2
"$GO" mod download
echo "  compiling etcd, kube-apiserver, kube-controller-manager, kube-scheduler and kubectl" \
     "(the longest part)..." >&2
# The version stamps the release's own build sets (hack/lib/version.sh), so that
# `kubectl version` and /version say the release.
minor=$(echo "$release" | cut -d. -f2)
stamp=""
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    stamp="$stamp -X $pkg.gitVersion=$release -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor"
    stamp="$stamp -X $pkg.gitTreeState=clean -X $pkg.buildDate=1970-01-01T00:00:00Z"
done
CGO_ENABLED=0 nice -n 10 "$GO" build -trimpath -ldflags "-s -w $stamp" -o "$out/labkube.tmp" .
mv -f "$out/labkube.tmp" "$out/labkube"
ln -sfn labkube "$out/kubectl"
echo "$sum" > "$out/source"
echo "  built in $(( $(date +%s) - start )) s" >&2
echo "$out/labkube"
