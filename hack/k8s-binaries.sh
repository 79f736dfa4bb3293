#!/usr/bin/env bash
# Builds the binaries the end-to-end tests run: kube-apiserver,
# kube-controller-manager and kubectl (k8s.io/kubernetes), etcd (go.etcd.io/etcd/server/v3)
# and helm (helm.sh/helm/v3), from their Go modules, into a cache outside the
# repository. Rebuilds only what is missing. Prints the binary folder last.
#
# KUBEBUILDER_ASSETS (envtest's convention) is honoured per binary: one it
# holds is not built (envtest's folders have etcd and kube-apiserver but no
# kube-controller-manager, which is then built here). The caller looks in
# KUBEBUILDER_ASSETS first, then in the printed folder.
set -euo pipefail

KUBE_VERSION=${KUBE_VERSION:-v1.36.3}
STAGING_VERSION=${STAGING_VERSION:-v0.${KUBE_VERSION#v1.}}
ETCD_VERSION=${ETCD_VERSION:-v3.6.16}
# v3.22.0 is served by the module proxy here but not approved for use, so the
# newest approved v3 release is the default.
HELM_VERSION=${HELM_VERSION:-v3.21.4}
CACHE=${DISAGG_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/disagg}
BIN=${DISAGG_K8S_BIN:-$CACHE/k8s-$KUBE_VERSION-etcd-$ETCD_VERSION-helm-$HELM_VERSION/bin}
WORK=$CACHE/gobuild
export GOFLAGS="${GOFLAGS:--trimpath}" CGO_ENABLED=0

log() { echo "[k8s-binaries] $*" >&2; }

# Cold build times measured on a 2-core machine, printed so a first run is
# not mistaken for a hang.
declare -A EXPECTED_MINUTES=([etcd]="2-4" [kube-apiserver]="6-12" [kube-controller-manager]="4-8" [kubectl]="2-4" [helm]="2-4")

mkdir -p "$BIN" "$WORK"
# One build at a time per cache (test sessions may start together).
exec 9>"$CACHE/.build.lock"
flock 9

# have NAME: the binary is in KUBEBUILDER_ASSETS or already built.
have() {
  { [ -n "${KUBEBUILDER_ASSETS:-}" ] && [ -x "$KUBEBUILDER_ASSETS/$1" ]; } || [ -x "$BIN/$1" ]
}

# A wrapper module that requires k8s.io/kubernetes and points every staging
# module (the repo's own replace => ./staging/...) at its published version.
build_kube() {
  have kube-apiserver && have kube-controller-manager && have kubectl && return
  local dir=$WORK/kube-$KUBE_VERSION
  mkdir -p "$dir"
  # A wrapper made before kubectl was built lacks its module sums: remake it.
  grep -qs cmd/kubectl "$dir/tools.go" || rm -f "$dir/go.sum"
  if [ ! -f "$dir/go.sum" ]; then
    log "resolving k8s.io/kubernetes@$KUBE_VERSION"
    local gomod
    gomod=$(cd "$dir" && go mod download -json "k8s.io/kubernetes@$KUBE_VERSION" \
      | sed -n 's/.*"GoMod": "\(.*\)".*/\1/p')
    {
      echo "module disagg.dev/kube-binaries"
      echo
      echo "go 1.26"
      echo
      echo "require k8s.io/kubernetes $KUBE_VERSION"
      echo
      echo "replace ("
      sed -n 's#^\s*\(k8s.io/[a-z0-9-]*\) => ./staging/src/.*#\t\1 => \1 '"$STAGING_VERSION"'#p' "$gomod"
      echo ")"
    } >"$dir/go.mod"
    cat >"$dir/tools.go" <<'GO'
//go:build tools

package tools

import (
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
	_ "k8s.io/kubernetes/cmd/kube-controller-manager"
	_ "k8s.io/kubernetes/cmd/kubectl"
)
GO
    (cd "$dir" && go mod tidy)
  fi
  local major=${KUBE_VERSION#v}; major=${major%%.*}
  local minor=${KUBE_VERSION#v*.}; minor=${minor%%.*}
  local pkg=k8s.io/component-base/version
  local ldflags="-s -w -X $pkg.gitVersion=$KUBE_VERSION -X $pkg.gitMajor=$major -X $pkg.gitMinor=$minor -X $pkg.gitTreeState=clean -X $pkg.buildDate=$(date -u +%Y-%m-%dT%H:%M:%SZ)"
  ldflags="$ldflags -X k8s.io/client-go/pkg/version.gitVersion=$KUBE_VERSION"
  for cmd in kube-apiserver kube-controller-manager kubectl; do
    if ! have "$cmd"; then
      log "building $cmd $KUBE_VERSION (${EXPECTED_MINUTES[$cmd]} minutes cold on 2 cores)"
      (cd "$dir" && go build -ldflags "$ldflags" -o "$BIN/$cmd.tmp.$$" "k8s.io/kubernetes/cmd/$cmd")
      mv "$BIN/$cmd.tmp.$$" "$BIN/$cmd"
    fi
  done
}

# One binary from a module without replace directives: a wrapper module that
# requires MODULE@VERSION and builds PACKAGE into $BIN/NAME.
# Args: NAME MODULE VERSION PACKAGE [extra ldflags]
build_module_binary() {
  local name=$1 module=$2 version=$3 package=$4 ldflags="-s -w ${5:-}"
  have "$name" && return
  local dir=$WORK/$name-$version
  mkdir -p "$dir"
  if [ ! -f "$dir/go.sum" ]; then
    printf 'module disagg.dev/%s-binary\n\ngo 1.26\n\nrequire %s %s\n' "$name" "$module" "$version" >"$dir/go.mod"
    printf '//go:build tools\n\npackage tools\n\nimport _ "%s"\n' "$package" >"$dir/tools.go"
    (cd "$dir" && go mod tidy)
  fi
  log "building $name $version (${EXPECTED_MINUTES[$name]} minutes cold on 2 cores)"
  (cd "$dir" && go build -ldflags "$ldflags" -o "$BIN/$name.tmp.$$" "$package")
  mv "$BIN/$name.tmp.$$" "$BIN/$name"
}

build_module_binary etcd go.etcd.io/etcd/server/v3 "$ETCD_VERSION" go.etcd.io/etcd/server/v3
build_kube
# As helm's own release build: offline `helm template` and `helm lint` assume this Kubernetes
# version (v1.20 without it, which the chart's kubeVersion refuses).
kube_minor=${KUBE_VERSION#v*.}; kube_minor=${kube_minor%%.*}
helm_kube_flags=""
for pkg in helm.sh/helm/v3/pkg/chartutil helm.sh/helm/v3/pkg/lint/rules; do
  helm_kube_flags="$helm_kube_flags -X $pkg.k8sVersionMajor=1 -X $pkg.k8sVersionMinor=$kube_minor"
done
build_module_binary helm helm.sh/helm/v3 "$HELM_VERSION" helm.sh/helm/v3/cmd/helm \
  "-X helm.sh/helm/v3/internal/version.version=$HELM_VERSION$helm_kube_flags"
echo "$BIN"
