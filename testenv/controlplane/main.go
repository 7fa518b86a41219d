// Command gpufrac-controlplane runs a real Kubernetes control plane in one process: kube-apiserver
// (linked as a library from k8s.io/kubernetes) on top of an embedded etcd, listening on loopback
// with TLS, RBAC and the admission chain (webhooks included) switched on.
//
// It exists so that gpufrac's tests talk to the same API server a cluster runs: resourceVersion
// conflicts, 410 Gone after compaction, the Binding subresource, impersonation under RBAC and
// admission webhooks behave as they do in production, and no fake has to guess at them. No
// scheduler, controller-manager or kubelet runs: pods stay Pending until something binds them,
// which is exactly what a scheduler test needs.
//
// Usage:
//
//	gpufrac-controlplane --data-dir DIR [--port N] [--etcd-client-port N] [--etcd-peer-port N] [-- APISERVER-FLAGS...]
//
// Ports default to 0, meaning a free loopback port. Flags after "--" go to kube-apiserver verbatim,
// after ours, so they override them (for example --etcd-compaction-interval=2s). When the API server
// answers /readyz and the `default` namespace exists, one line is printed on stdout:
//
//	gpufrac-controlplane: ready https://127.0.0.1:PORT kubeconfig=DIR/admin.kubeconfig ca=DIR/pki/ca.crt
//
// SIGTERM or SIGINT shut the API server down, then etcd, and the process exits 0.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"net"
	"os"
	"os/signal"
	"path/filepath"
	"syscall"
	"time"

	"k8s.io/klog/v2"
)

type config struct {
	dataDir        string
	port           int
	etcdClientPort int
	etcdPeerPort   int
	etcdFsync      bool
	exitWithParent bool
	apiserverArgs  []string
}

func main() {
	err := run()
	klog.Flush()
	if err != nil {
		fmt.Fprintf(os.Stderr, "gpufrac-controlplane: %v\n", err)
		os.Exit(1)
	}
}

func parseFlags() (config, error) {
	var c config
	fs := flag.NewFlagSet("gpufrac-controlplane", flag.ContinueOnError)
	fs.StringVar(&c.dataDir, "data-dir", "", "directory for etcd data, the PKI and admin.kubeconfig (created if missing; reused on restart)")
	fs.IntVar(&c.port, "port", 0, "API server port on 127.0.0.1 (0: a free port)")
	fs.IntVar(&c.etcdClientPort, "etcd-client-port", 0, "etcd client port on 127.0.0.1 (0: a free port)")
	fs.IntVar(&c.etcdPeerPort, "etcd-peer-port", 0, "etcd peer port on 127.0.0.1 (0: a free port)")
	fs.BoolVar(&c.etcdFsync, "etcd-fsync", false, "fsync etcd's WAL and backend; off by default because this is a test "+
		"control plane: a process crash loses nothing (writes sit in the page cache), only a machine crash can")
	fs.BoolVar(&c.exitWithParent, "exit-with-parent", false, "shut down when the parent process goes away, so a crashed "+
		"test run leaves no control plane behind")
	if err := fs.Parse(os.Args[1:]); err != nil {
		return c, err
	}
	// flag stops at "--" and leaves the rest as positional arguments.
	c.apiserverArgs = fs.Args()
	if c.dataDir == "" {
		return c, errors.New("--data-dir is required")
	}
	abs, err := filepath.Abs(c.dataDir)
	if err != nil {
		return c, err
	}
	c.dataDir = abs
	return c, nil
}

func run() error {
	c, err := parseFlags()
	if err != nil {
		return err
	}
	if err := os.MkdirAll(c.dataDir, 0o700); err != nil {
		return err
	}
	// etcd's own lock on its database would make a second control plane on the same directory wait
	// forever; this one makes it fail at once, with a reason.
	lock, err := os.OpenFile(filepath.Join(c.dataDir, "lock"), os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		return err
	}
	defer lock.Close()
	if err := syscall.Flock(int(lock.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		return fmt.Errorf("data directory %s is in use by another control plane: %w", c.dataDir, err)
	}
	certs := pki{dir: filepath.Join(c.dataDir, "pki")}
	if err := certs.ensure(); err != nil {
		return fmt.Errorf("preparing PKI: %w", err)
	}

	ctx, stop := context.WithCancel(context.Background())
	defer stop()
	go handleSignals(stop, c.exitWithParent)

	if c.etcdClientPort == 0 {
		if c.etcdClientPort, err = freePort(); err != nil {
			return err
		}
	}
	if c.etcdPeerPort == 0 {
		if c.etcdPeerPort, err = freePort(); err != nil {
			return err
		}
	}
	etcd, err := startEtcd(ctx, etcdOptions{
		dir:        filepath.Join(c.dataDir, "etcd"),
		clientPort: c.etcdClientPort,
		peerPort:   c.etcdPeerPort,
		fsync:      c.etcdFsync,
	})
	if err != nil {
		return fmt.Errorf("starting etcd: %w", err)
	}
	// Order matters: etcd must outlive the API server, which flushes and closes its watches
	// against it while shutting down.
	defer func() {
		etcd.Close()
		<-etcd.Server.StopNotify()
		klog.Info("gpufrac-controlplane: etcd stopped")
	}()
	go func() {
		select {
		case err := <-etcd.Err():
			if err != nil {
				klog.Errorf("gpufrac-controlplane: etcd failed: %v", err)
			}
			stop()
		case <-ctx.Done():
		}
	}()

	// Holding the listener from here on means the port cannot be taken between choosing and
	// serving it, unlike etcd's ports above.
	ln, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", c.port))
	if err != nil {
		return fmt.Errorf("listening for the API server: %w", err)
	}
	port := ln.Addr().(*net.TCPAddr).Port
	server := fmt.Sprintf("https://127.0.0.1:%d", port)
	kubeconfig := filepath.Join(c.dataDir, "admin.kubeconfig")
	if err := certs.writeKubeconfig(kubeconfig, server); err != nil {
		return fmt.Errorf("writing kubeconfig: %w", err)
	}

	done := make(chan error, 1)
	go func() {
		done <- runAPIServer(ctx, apiserverOptions{
			listener:  ln,
			etcdURL:   fmt.Sprintf("http://127.0.0.1:%d", c.etcdClientPort),
			pki:       certs,
			extraArgs: c.apiserverArgs,
		})
	}()

	readyErr := make(chan error, 1)
	go func() { readyErr <- waitReady(ctx, server, certs) }()

	for {
		select {
		case err := <-readyErr:
			if err != nil {
				if ctx.Err() == nil {
					stop()
					<-done
					return err
				}
				continue
			}
			fmt.Printf("gpufrac-controlplane: ready %s kubeconfig=%s ca=%s\n", server, kubeconfig, certs.CACert())
		case err := <-done:
			if ctx.Err() != nil {
				// A shutdown we asked for; the API server returns nil or the context's error.
				klog.Info("gpufrac-controlplane: API server stopped")
				return nil
			}
			if err == nil {
				err = errors.New("API server exited unexpectedly")
			}
			return fmt.Errorf("API server: %w", err)
		}
	}
}

// handleSignals cancels the context on the first SIGTERM/SIGINT (or when the parent goes away) and
// exits at once on a second signal, for a shutdown that hangs.
func handleSignals(stop context.CancelFunc, exitWithParent bool) {
	signals := make(chan os.Signal, 2)
	signal.Notify(signals, syscall.SIGTERM, syscall.SIGINT)
	parent := os.Getppid()
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	for {
		select {
		case s := <-signals:
			klog.Infof("gpufrac-controlplane: %v received, shutting down", s)
			stop()
			<-signals
			fmt.Fprintln(os.Stderr, "gpufrac-controlplane: second signal, exiting now")
			os.Exit(1)
		case <-tick.C:
			if exitWithParent && os.Getppid() != parent {
				klog.Info("gpufrac-controlplane: parent process went away, shutting down")
				stop()
				exitWithParent = false
			}
		}
	}
}

func freePort() (int, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port, nil
}
