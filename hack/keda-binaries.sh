#!/usr/bin/env bash
# Builds KEDA's operator and metrics adapter (github.com/kedacore/keda/v2,
# cmd/operator and cmd/adapter) from its Go module into a cache outside the
# repository, for the HPA end-to-end test. Rebuilds only what is missing.
# Prints two lines last: the binary folder, then the module's source folder
# (its config/crd/bases holds the CRDs the test installs).
#
# KEDA's go.mod has replace and exclude directives, which `go install
# module@version` refuses, so a wrapper module requires KEDA and copies them;
# it also names a newer Go than the one installed here, so GOTOOLCHAIN fetches
# that toolchain (a module from the Go proxy) for this build only.
set -euo pipefail

KEDA_VERSION=${KEDA_VERSION:-v2.21.1}
CACHE=${DISAGG_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/disagg}
BIN=${DISAGG_KEDA_BIN:-$CACHE/keda-$KEDA_VERSION/bin}
WORK=$CACHE/gobuild/keda-$KEDA_VERSION
MODULE=github.com/kedacore/keda/v2
# KEDA v2.21.1's graph holds two pseudo-versions the module proxy here refuses
# (403 "This module version is not available"): google.golang.org/genproto
# v0.0.0-20261110000943-09e21b237f2c (the old monolith; KEDA needs only a few
# leftover packages of it) and github.com/google/pprof
# v0.0.0-20261111200114-fac431ef4d26 (reached through ginkgo, which the
# binaries do not link). Each is pinned to its newest served version, a week
# or two older.
PINS=(
  google.golang.org/genproto=v0.0.0-20261026165753-2ffab32bce7e
  github.com/google/pprof=v0.0.0-20261105003125-4bf881d7fb0b
)
export GOFLAGS="${GOFLAGS:--trimpath}" CGO_ENABLED=0

log() { echo "[keda-binaries] $*" >&2; }

# Cold build times measured on a 2-core machine shared with other work (nice
# 19, load around 10), printed so a first run is not mistaken for a hang: the
# operator links every scaler's SDK (AWS, Azure, GCP...); the adapter then
# reuses most of its packages.
declare -A EXPECTED_MINUTES=([keda]="25-35" [keda-adapter]="1-3")

mkdir -p "$BIN" "$WORK"
# One build at a time per cache (test sessions may start together).
exec 9>"$CACHE/.keda-build.lock"
flock 9

# The Go release KEDA's go.mod asks for (its "go" line). With the local Go
# the download reports that as an error but still fetches the go.mod.
download=$(cd "$CACHE" && GOTOOLCHAIN=local go mod download -json "$MODULE@$KEDA_VERSION" 2>/dev/null || true)
gomod=$(sed -n 's/.*"GoMod": "\(.*\)".*/\1/p' <<<"$download")
if [ ! -f "$gomod" ]; then
  log "cannot download $MODULE@$KEDA_VERSION: $(sed -n 's/.*"Error": "\(.*\)".*/\1/p' <<<"$download")"
  exit 1
fi
export GOTOOLCHAIN="go$(sed -n 's/^go \([0-9.]*\)$/\1/p' "$gomod")"

if [ ! -x "$BIN/keda" ] || [ ! -x "$BIN/keda-adapter" ]; then
  if [ ! -f "$WORK/go.sum" ]; then
    log "resolving $MODULE@$KEDA_VERSION with $GOTOOLCHAIN"
    {
      printf 'module disagg.dev/keda-binaries\n\ngo %s\n\nrequire %s %s\n\n' "${GOTOOLCHAIN#go}" "$MODULE" "$KEDA_VERSION"
      # Every replace and exclude directive, one-line or block form.
      awk '/^(replace|exclude) *\($/ {inblock=1} inblock {print} inblock && /^\)/ {inblock=0; next}
           !inblock && /^(replace|exclude) [^(]/ {print}' "$gomod"
      for pin in "${PINS[@]}"; do echo "replace ${pin%%=*} => ${pin%%=*} ${pin#*=}"; done
    } >"$WORK/go.mod"
    printf '//go:build tools\n\npackage tools\n\nimport (\n\t_ "%s/cmd/adapter"\n\t_ "%s/cmd/operator"\n)\n' \
      "$MODULE" "$MODULE" >"$WORK/tools.go"
    (cd "$WORK" && go mod tidy)
  fi
  ldflags="-s -w -X $MODULE/version.Version=$KEDA_VERSION -X $MODULE/version.GitCommit=module-proxy"
  for pair in operator:keda adapter:keda-adapter; do
    cmd=${pair%%:*} name=${pair#*:}
    if [ ! -x "$BIN/$name" ]; then
      log "building $name $KEDA_VERSION (${EXPECTED_MINUTES[$name]} minutes cold on 2 cores)"
      (cd "$WORK" && go build -ldflags "$ldflags" -o "$BIN/$name.tmp.$$" "$MODULE/cmd/$cmd")
      mv "$BIN/$name.tmp.$$" "$BIN/$name"
    fi
  done
fi
echo "$BIN"
(cd "$WORK" && go list -m -f '{{.Dir}}' "$MODULE")
