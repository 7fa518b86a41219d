//go:build tools

// Package tools pins Helm's command (helm.sh/helm/v3/cmd/helm) as a dependency of this module, so that
// build.sh can `go build` it with the versions recorded in go.mod and go.sum. Nothing here is compiled
// into the binary; the tools build tag keeps this file out of every normal build.
package tools

import _ "helm.sh/helm/v3/cmd/helm"
