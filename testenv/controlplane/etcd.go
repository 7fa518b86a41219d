package main

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"time"

	"go.etcd.io/etcd/server/v3/embed"
)

type etcdOptions struct {
	dir        string
	clientPort int
	peerPort   int
	fsync      bool
}

// startEtcd runs a single-member etcd in this process, plain HTTP on loopback: only the API server
// in the same process talks to it. Compaction is left to the API server (--etcd-compaction-interval),
// as in a real cluster, so 410 Gone comes from the same mechanism.
func startEtcd(ctx context.Context, o etcdOptions) (*embed.Etcd, error) {
	cfg := embed.NewConfig()
	cfg.Name = "gpufrac"
	cfg.Dir = o.dir
	client := url.URL{Scheme: "http", Host: fmt.Sprintf("127.0.0.1:%d", o.clientPort)}
	peer := url.URL{Scheme: "http", Host: fmt.Sprintf("127.0.0.1:%d", o.peerPort)}
	cfg.ListenClientUrls = []url.URL{client}
	cfg.AdvertiseClientUrls = []url.URL{client}
	cfg.ListenPeerUrls = []url.URL{peer}
	cfg.AdvertisePeerUrls = []url.URL{peer}
	cfg.InitialCluster = cfg.InitialClusterFromName(cfg.Name)
	cfg.UnsafeNoFsync = !o.fsync
	cfg.LogLevel = "error"
	cfg.LogOutputs = []string{"stderr"}
	// No metrics listener and no gRPC gateway: nothing here reads them.
	cfg.ListenMetricsUrls = nil
	cfg.EnableGRPCGateway = false

	e, err := embed.StartEtcd(cfg)
	if err != nil {
		return nil, err
	}
	select {
	case <-e.Server.ReadyNotify():
		return e, nil
	case err := <-e.Err():
		e.Close()
		return nil, err
	case <-time.After(60 * time.Second):
		e.Close()
		return nil, errors.New("etcd not ready after 60s")
	case <-ctx.Done():
		e.Close()
		return nil, ctx.Err()
	}
}
