#!/usr/bin/env bash
# Builds the real Kubernetes control plane the tests start (kube-apiserver,
# kube-controller-manager, kube-scheduler, etcd, the JobSet controller, kwok) from their Go
# modules, pinned in the go.mod files beside this script, into a cache folder named after
# their versions. Prints that folder last: the tests read it from KUBEBUILDER_ASSETS, as
# controller-runtime's envtest does. Built once per machine: a folder already complete is
# kept as it is.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
cache=${CONTROL_PLANE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/resiliency-supervisor/control-plane}

version_of() { # version_of <module dir> <module path>: its version in that go.mod
	awk -v m="$2" '$1 == m { print $2; exit } $1 == "require" && $2 == m { print $3; exit }' \
		"$here/$1/go.mod"
}

k8s=$(version_of kubernetes k8s.io/kubernetes)
etcd=$(version_of etcd go.etcd.io/etcd/server/v3)
jobset=$(version_of jobset sigs.k8s.io/jobset)
kwok=$(version_of kwok sigs.k8s.io/kwok)
dest="$cache/kubernetes-$k8s-etcd-$etcd-jobset-$jobset-kwok-$kwok"

binaries=(kube-apiserver kube-controller-manager kube-scheduler etcd jobset-controller kwok)
complete=1
for b in "${binaries[@]}"; do [[ -x "$dest/$b" ]] || complete=0; done
[[ -f "$dest/jobset/crd.yaml" && -f "$dest/kwok-stages/stages.yaml" ]] || complete=0
if [[ $complete -eq 1 ]]; then
	echo "$dest"
	exit 0
fi

mkdir -p "$dest.partial/jobset" "$dest.partial/kwok-stages"
# Kubernetes' binaries report their release (/version, and the version their compatibility
# checks start from) from these variables, which its own build sets the same way.
minor=${k8s#v1.}
minor=${minor%%.*}
k8s_version="-X k8s.io/component-base/version.gitVersion=$k8s"
k8s_version+=" -X k8s.io/component-base/version.gitMajor=1"
k8s_version+=" -X k8s.io/component-base/version.gitMinor=$minor"
k8s_version+=" -X k8s.io/component-base/version.gitTreeState=clean"

build() { # build <module dir> <package> <binary> [ldflags]
	local started=$SECONDS
	echo "control plane: building $3 ($2) ..." >&2
	(cd "$here/$1" && go build -trimpath -ldflags="-s ${4:-}" -o "$dest.partial/$3" "$2")
	echo "control plane: $3 built in $((SECONDS - started)) s" >&2
}
build etcd go.etcd.io/etcd/server/v3 etcd
build kwok sigs.k8s.io/kwok/cmd/kwok kwok
build jobset sigs.k8s.io/jobset jobset-controller
build kubernetes k8s.io/kubernetes/cmd/kube-apiserver kube-apiserver "$k8s_version"
build kubernetes k8s.io/kubernetes/cmd/kube-controller-manager kube-controller-manager "$k8s_version"
build kubernetes k8s.io/kubernetes/cmd/kube-scheduler kube-scheduler "$k8s_version"

# The JobSet CRD and its webhooks' configuration, from the module the controller was built
# from: applied by the tests as the JobSet install does.
jobset_dir=$(cd "$here/jobset" && go list -m -f '{{.Dir}}' sigs.k8s.io/jobset)
cat "$jobset_dir"/config/components/crd/bases/*.yaml > "$dest.partial/jobset/crd.yaml"
cp "$jobset_dir"/config/components/webhook/manifests.yaml "$dest.partial/jobset/webhooks.yaml"
# kwok's stages, from its module: nodes made Ready and kept so with Leases, pods made
# Ready, completed (those of Jobs) and deleted, as kwok's "fast" set does.
kwok_dir=$(cd "$here/kwok" && go list -m -f '{{.Dir}}' sigs.k8s.io/kwok)
stages=$kwok_dir/kustomize/stage
for stage in node/fast/node-initialize.yaml node/heartbeat-with-lease/node-heartbeat-with-lease.yaml \
	pod/fast/pod-ready.yaml pod/fast/pod-complete.yaml pod/fast/pod-delete.yaml; do
	echo "---"
	cat "$stages/$stage"
done > "$dest.partial/kwok-stages/stages.yaml"
chmod -R u+w "$dest.partial"

rm -rf "$dest"
mv "$dest.partial" "$dest"
echo "$dest"
