package main

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"net"
	"net/http"
	"os"
	"strings"
	"time"

	"github.com/spf13/pflag"
	utilerrors "k8s.io/apimachinery/pkg/util/errors"
	"k8s.io/client-go/rest"
	basecompatibility "k8s.io/component-base/compatibility"
	logsapi "k8s.io/component-base/logs/api/v1"
	"k8s.io/kubernetes/cmd/kube-apiserver/app"
	"k8s.io/kubernetes/cmd/kube-apiserver/app/options"
)

type apiserverOptions struct {
	listener  net.Listener
	etcdURL   string
	pki       pki
	extraArgs []string
}

// apiserverFlags are the kube-apiserver flags this control plane runs with. Each departure from the
// defaults is there for a reason a test would otherwise trip over:
//
//   - --disable-admission-plugins=ServiceAccount: that plugin rejects a pod until the namespace's
//     `default` ServiceAccount exists, and only kube-controller-manager creates it. Without the
//     plugin, pods without a service account are admitted as they are (no token volume, empty
//     serviceAccountName); every other default plugin stays on, webhooks included.
//   - --endpoint-reconciler-type=none: the reconciler would publish 127.0.0.1 as the endpoint of the
//     `kubernetes` Service, which validation rejects for loopback addresses.
//   - --enable-priority-and-fairness=false: saves the flow-control machinery's memory and startup
//     time; plain max-in-flight limits still apply.
//   - --allow-privileged=true: gpufrac's node agent runs as a privileged DaemonSet.
func apiserverFlags(o apiserverOptions) []string {
	p := o.pki
	return []string{
		"--etcd-servers=" + o.etcdURL,
		"--advertise-address=127.0.0.1",
		"--tls-cert-file=" + p.ServingCert(),
		"--tls-private-key-file=" + p.ServingKey(),
		"--client-ca-file=" + p.CACert(),
		"--service-account-issuer=https://kubernetes.default.svc.cluster.local",
		"--service-account-key-file=" + p.SAPub(),
		"--service-account-signing-key-file=" + p.SAKey(),
		"--service-cluster-ip-range=" + serviceCIDR,
		"--authorization-mode=Node,RBAC",
		"--disable-admission-plugins=ServiceAccount",
		"--endpoint-reconciler-type=none",
		"--enable-priority-and-fairness=false",
		"--allow-privileged=true",
		"--profiling=false",
	}
}

// withOverrides is our flags without those that extra sets again, then extra: a flag given after "--"
// replaces ours. Appending alone would not do that for list flags, which pflag extends on every
// occurrence: `--disable-admission-plugins=` (an empty list) must switch the ServiceAccount plugin
// back on for a cluster whose kube-controller-manager creates the `default` ServiceAccounts.
func withOverrides(ours, extra []string) []string {
	name := func(arg string) string {
		flagName, _, _ := strings.Cut(strings.TrimLeft(arg, "-"), "=")
		return flagName
	}
	given := map[string]bool{}
	for _, arg := range extra {
		if strings.HasPrefix(arg, "--") {
			given[name(arg)] = true
		}
	}
	kept := make([]string, 0, len(ours)+len(extra))
	for _, arg := range ours {
		if !given[name(arg)] {
			kept = append(kept, arg)
		}
	}
	return append(kept, extra...)
}

// runAPIServer follows what kube-apiserver's own command does (options → Complete → Validate →
// Run), minus its process-wide signal handler: the context is ours, so etcd can be stopped after
// the API server has finished.
func runAPIServer(ctx context.Context, o apiserverOptions) error {
	s := options.NewServerRunOptions()
	fs := pflag.NewFlagSet("kube-apiserver", pflag.ContinueOnError)
	for _, f := range s.Flags().FlagSets {
		fs.AddFlagSet(f)
	}
	args := withOverrides(apiserverFlags(o), o.extraArgs)
	if err := fs.Parse(args); err != nil {
		return fmt.Errorf("kube-apiserver flags: %w", err)
	}
	s.SecureServing.Listener = o.listener
	s.SecureServing.BindPort = o.listener.Addr().(*net.TCPAddr).Port

	if err := s.GenericServerRunOptions.ComponentGlobalsRegistry.Set(); err != nil {
		return err
	}
	// The loopback clients the API server uses on itself should not log warnings it issued.
	rest.SetDefaultWarningHandler(rest.NoWarnings{})
	featureGate := s.GenericServerRunOptions.ComponentGlobalsRegistry.FeatureGateFor(basecompatibility.DefaultKubeComponent)
	if err := logsapi.ValidateAndApply(s.Logs, featureGate); err != nil {
		return err
	}
	completed, err := s.Complete(ctx)
	if err != nil {
		return err
	}
	if errs := completed.Validate(); len(errs) != 0 {
		return utilerrors.NewAggregate(errs)
	}
	return app.Run(ctx, completed)
}

// waitReady polls /readyz as the admin, then waits for the `default` namespace, which the API
// server's system-namespaces controller creates shortly after it starts serving: tests create
// objects there right away.
func waitReady(ctx context.Context, server string, p pki) error {
	caPEM, err := os.ReadFile(p.CACert())
	if err != nil {
		return err
	}
	roots := x509.NewCertPool()
	roots.AppendCertsFromPEM(caPEM)
	cert, err := tls.LoadX509KeyPair(p.AdminCert(), p.AdminKey())
	if err != nil {
		return err
	}
	client := &http.Client{
		Timeout: 5 * time.Second,
		Transport: &http.Transport{
			TLSClientConfig: &tls.Config{RootCAs: roots, Certificates: []tls.Certificate{cert}},
		},
	}
	defer client.CloseIdleConnections()
	for _, path := range []string{"/readyz", "/api/v1/namespaces/default"} {
		for {
			req, err := http.NewRequestWithContext(ctx, http.MethodGet, server+path, nil)
			if err != nil {
				return err
			}
			resp, err := client.Do(req)
			if err == nil {
				resp.Body.Close()
				if resp.StatusCode == http.StatusOK {
					break
				}
			}
			select {
			case <-ctx.Done():
				return ctx.Err()
			case <-time.After(100 * time.Millisecond):
			}
		}
	}
	return nil
}
