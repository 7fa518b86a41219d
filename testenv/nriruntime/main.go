// Command gpufrac-nriruntime is the runtime side of NRI for gpufrac's tests: the real
// github.com/containerd/nri/pkg/adaptation library (what containerd embeds), driven by JSON lines.
//
// It opens the NRI socket, accepts external plugins exactly as containerd does, and runs pod sandboxes
// and containers through the adaptation when the test asks. Nothing of NRI is re-implemented here:
// plugin registration, configuration, synchronization, request timeouts and the merging of container
// adjustments are all the library's. This program only keeps the pods and containers a runtime would
// have, so that a reconnecting plugin is synchronized with them.
//
// Protocol: one JSON object per line on stdin, one reply per line on stdout (logs go to stderr). Pods and
// containers travel as protobuf JSON of NRI's own messages (api.PodSandbox, api.Container), so any
// field of the API can be set by a test. Every reply carries "ok" and, when false, "error".
//
//	{"op":"run_pod","pod":{...PodSandbox}}
//	{"op":"create_container","container":{...Container, "pod_sandbox_id" names the pod}}
//	    -> {"ok":true,"adjust":{...ContainerAdjustment},"container":{...Container as adjusted},"elapsed_ns":N}
//	{"op":"start_container","id":"<container id>"} -> {"ok":true,"elapsed_ns":N} (the adaptation's StartContainer)
//	{"op":"stop_container"|"remove_container","id":"<container id>"}
//	{"op":"stop_pod"|"remove_pod","id":"<pod id>"}
//	{"op":"wait_plugins","count":N,"timeout_ms":M}   -> waits until N plugins are connected AND synchronized
//	{"op":"wait_registrations","count":N,"timeout_ms":M} -> waits until N plugins have registered and
//	                                                      synchronized since this runtime (re)started
//	{"op":"list"}   -> {"pods":[...],"containers":[...],"plugins":N,"registrations":N}
//	{"op":"restart"}   -> saves its pods and containers, then re-executes itself (same pid, same pipes):
//	                      like a containerd restart, the kernel closes every plugin connection, and the
//	                      new image re-opens the socket and announces itself with {"event":"ready"}
//	{"op":"exit"}
//
// With -default-validator the adaptation runs NRI's built-in default validator (containerd's
// default_validator section): a container whose pod names a plugin in the annotation
// required-plugins.noderesource.dev (or that -required-plugins lists) is refused while that plugin is
// not connected.
//
// Send one command at a time and read its reply before the next: a restart replaces the process
// image, and input read ahead by the old image would be lost.
package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	nri "github.com/containerd/nri/pkg/adaptation"
	"github.com/containerd/nri/pkg/api"
	nrilog "github.com/containerd/nri/pkg/log"
	nriplugin "github.com/containerd/nri/pkg/plugin"
	validator "github.com/containerd/nri/plugins/default-validator/builtin"
	"github.com/sirupsen/logrus"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
)

const (
	runtimeName    = "gpufrac-nriruntime"
	runtimeVersion = "v0.1.0"
)

// state is what a runtime knows and a restarted runtime recovers: the pods and containers it runs.
type state struct {
	sync.Mutex
	pods       map[string]*api.PodSandbox
	podOrder   []string
	containers map[string]*api.Container
	ctrOrder   []string
}

func newState() *state {
	return &state{pods: map[string]*api.PodSandbox{}, containers: map[string]*api.Container{}}
}

func (s *state) snapshot() ([]*api.PodSandbox, []*api.Container) {
	s.Lock()
	defer s.Unlock()
	pods := make([]*api.PodSandbox, 0, len(s.podOrder))
	for _, id := range s.podOrder {
		pods = append(pods, proto.Clone(s.pods[id]).(*api.PodSandbox))
	}
	ctrs := make([]*api.Container, 0, len(s.ctrOrder))
	for _, id := range s.ctrOrder {
		ctrs = append(ctrs, proto.Clone(s.containers[id]).(*api.Container))
	}
	return pods, ctrs
}

func (s *state) putPod(p *api.PodSandbox) {
	s.Lock()
	defer s.Unlock()
	if _, ok := s.pods[p.Id]; !ok {
		s.podOrder = append(s.podOrder, p.Id)
	}
	s.pods[p.Id] = p
}

func (s *state) putContainer(c *api.Container) {
	s.Lock()
	defer s.Unlock()
	if _, ok := s.containers[c.Id]; !ok {
		s.ctrOrder = append(s.ctrOrder, c.Id)
	}
	s.containers[c.Id] = c
}

func (s *state) pod(id string) (*api.PodSandbox, error) {
	s.Lock()
	defer s.Unlock()
	p, ok := s.pods[id]
	if !ok {
		return nil, fmt.Errorf("no pod sandbox %q", id)
	}
	return p, nil
}

func (s *state) container(id string) (*api.Container, *api.PodSandbox, error) {
	s.Lock()
	defer s.Unlock()
	c, ok := s.containers[id]
	if !ok {
		return nil, nil, fmt.Errorf("no container %q", id)
	}
	return c, s.pods[c.PodSandboxId], nil
}

func (s *state) removeContainer(id string) {
	s.Lock()
	defer s.Unlock()
	delete(s.containers, id)
	s.ctrOrder = without(s.ctrOrder, id)
}

func (s *state) removePod(id string) {
	s.Lock()
	defer s.Unlock()
	delete(s.pods, id)
	s.podOrder = without(s.podOrder, id)
}

func without(ids []string, id string) []string {
	out := ids[:0]
	for _, x := range ids {
		if x != id {
			out = append(out, x)
		}
	}
	return out
}

// savedState is the on-disk form used across a restart (protobuf JSON of each object).
type savedState struct {
	Pods       []json.RawMessage `json:"pods"`
	Containers []json.RawMessage `json:"containers"`
}

func (s *state) save(path string) error {
	pods, ctrs := s.snapshot()
	var out savedState
	for _, p := range pods {
		b, err := protojson.Marshal(p)
		if err != nil {
			return err
		}
		out.Pods = append(out.Pods, b)
	}
	for _, c := range ctrs {
		b, err := protojson.Marshal(c)
		if err != nil {
			return err
		}
		out.Containers = append(out.Containers, b)
	}
	b, err := json.Marshal(out)
	if err != nil {
		return err
	}
	return os.WriteFile(path, b, 0o600)
}

func (s *state) load(path string) error {
	b, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	var in savedState
	if err := json.Unmarshal(b, &in); err != nil {
		return err
	}
	for _, raw := range in.Pods {
		p := &api.PodSandbox{}
		if err := protojson.Unmarshal(raw, p); err != nil {
			return err
		}
		s.putPod(p)
	}
	for _, raw := range in.Containers {
		c := &api.Container{}
		if err := protojson.Unmarshal(raw, c); err != nil {
			return err
		}
		s.putContainer(c)
	}
	return nil
}

// pluginCounter learns from the adaptation's own metrics hook how many plugins are active; the
// adaptation updates the count only after a plugin has been configured and synchronized. The count is of
// plugins connected over the socket: the adaptation's own count includes its built-in ones (the default
// validator), which are there from the start.
//
// It also counts registrations: a plugin whose connection closed stays counted until the adaptation's
// next call prunes it (any call, or the next registration), so "one more plugin" cannot tell that a new
// one is in; "one more registration" can. A registration is complete at the first count update after
// its synchronization returned, when the adaptation has added the plugin.
type pluginCounter struct {
	mu         sync.Mutex
	cond       *sync.Cond
	count      int
	builtin    int
	synced     int
	registered int
}

func (c *pluginCounter) synchronized() {
	c.mu.Lock()
	c.synced++
	c.mu.Unlock()
}

func (c *pluginCounter) registrations() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.registered
}

func (c *pluginCounter) waitRegistrations(n int, timeout time.Duration) (int, bool) {
	deadline := time.Now().Add(timeout)
	timer := time.AfterFunc(timeout, c.cond.Broadcast)
	defer timer.Stop()
	c.mu.Lock()
	defer c.mu.Unlock()
	for c.registered < n && time.Now().Before(deadline) {
		c.cond.Wait()
	}
	return c.registered, c.registered >= n
}

func newPluginCounter() *pluginCounter {
	c := &pluginCounter{}
	c.cond = sync.NewCond(&c.mu)
	return c
}

func (c *pluginCounter) RecordPluginInvocation(string, string, error)                               {}
func (c *pluginCounter) RecordPluginLatency(string, string, time.Duration)                          {}
func (c *pluginCounter) RecordPluginAdjustments(string, string, *api.ContainerAdjustment, int, int) {}
func (c *pluginCounter) UpdatePluginCount(count int) {
	c.mu.Lock()
	c.count = count - c.builtin
	c.registered = c.synced
	c.mu.Unlock()
	c.cond.Broadcast()
}

func (c *pluginCounter) current() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.count
}

func (c *pluginCounter) wait(count int, timeout time.Duration) (int, bool) {
	deadline := time.Now().Add(timeout)
	timer := time.AfterFunc(timeout, c.cond.Broadcast)
	defer timer.Stop()
	c.mu.Lock()
	defer c.mu.Unlock()
	for c.count < count && time.Now().Before(deadline) {
		c.cond.Wait()
	}
	return c.count, c.count >= count
}

type runtime struct {
	startupSynced bool
	nri           *nri.Adaptation
	state         *state
	plugins       *pluginCounter
	updates       []*api.ContainerUpdate
	umu           sync.Mutex
}

// syncPlugin hands a newly connected plugin the pods and containers this runtime has.
func (r *runtime) syncPlugin(ctx context.Context, cb nri.SyncCB) error {
	pods, ctrs := r.state.snapshot()
	_, err := cb(ctx, pods, ctrs)
	switch {
	case !r.startupSynced: // the adaptation's Start synchronizes its pre-installed plugins (none) once
		r.startupSynced = true
	case err == nil:
		r.plugins.synchronized()
	}
	return err
}

// updateFromPlugin records unsolicited updates; this runtime has no real containers to apply them to.
func (r *runtime) updateFromPlugin(_ context.Context, req []*api.ContainerUpdate) ([]*api.ContainerUpdate, error) {
	r.umu.Lock()
	defer r.umu.Unlock()
	r.updates = append(r.updates, req...)
	return nil, nil
}

type command struct {
	Op        string          `json:"op"`
	ID        string          `json:"id"`
	Pod       json.RawMessage `json:"pod"`
	Container json.RawMessage `json:"container"`
	Count     int             `json:"count"`
	TimeoutMs int             `json:"timeout_ms"`
}

type reply map[string]any

func protoJSON(m proto.Message) json.RawMessage {
	b, err := protojson.MarshalOptions{UseProtoNames: true, EmitUnpopulated: false}.Marshal(m)
	if err != nil {
		return json.RawMessage(fmt.Sprintf("%q", err.Error()))
	}
	return b
}

func (r *runtime) handle(ctx context.Context, cmd *command) (reply, error) {
	switch cmd.Op {
	case "run_pod":
		pod := &api.PodSandbox{}
		if err := protojson.Unmarshal(cmd.Pod, pod); err != nil {
			return nil, fmt.Errorf("bad pod: %w", err)
		}
		if pod.Id == "" {
			return nil, errors.New("pod needs an id")
		}
		if err := r.nri.RunPodSandbox(ctx, &api.RunPodSandboxRequest{Pod: pod}); err != nil {
			return nil, err
		}
		r.state.putPod(pod)
		return reply{}, nil

	case "create_container":
		ctr := &api.Container{}
		if err := protojson.Unmarshal(cmd.Container, ctr); err != nil {
			return nil, fmt.Errorf("bad container: %w", err)
		}
		pod, err := r.state.pod(ctr.PodSandboxId)
		if err != nil {
			return nil, err
		}
		if ctr.Id == "" {
			return nil, errors.New("container needs an id")
		}
		ctr.State = api.ContainerState_CONTAINER_UNKNOWN
		req := &api.CreateContainerRequest{Pod: pod, Container: ctr}
		start := time.Now()
		rpl, err := r.nri.CreateContainer(ctx, req)
		elapsed := time.Since(start)
		if err != nil {
			return reply{"elapsed_ns": elapsed.Nanoseconds()}, err
		}
		// The adaptation has applied every plugin's adjustment to req.Container (env, mounts,
		// devices) for the plugins that follow; CDI devices are resolved later by a real runtime.
		adjusted := req.Container
		adjusted.CDIDevices = append(adjusted.CDIDevices, rpl.GetAdjust().GetCDIDevices()...)
		adjusted.State = api.ContainerState_CONTAINER_CREATED
		adjusted.CreatedAt = time.Now().UnixNano()
		r.state.putContainer(adjusted)
		return reply{
			"adjust":     protoJSON(rpl.GetAdjust()),
			"container":  protoJSON(adjusted),
			"updates":    len(rpl.GetUpdate()),
			"elapsed_ns": elapsed.Nanoseconds(),
		}, nil

	case "start_container":
		ctr, pod, err := r.state.container(cmd.ID)
		if err != nil {
			return nil, err
		}
		began := time.Now()
		if err := r.nri.StartContainer(ctx, &api.StartContainerRequest{Pod: pod, Container: ctr}); err != nil {
			return nil, err
		}
		elapsed := time.Since(began)
		ctr.State = api.ContainerState_CONTAINER_RUNNING
		ctr.StartedAt = time.Now().UnixNano()
		return reply{"elapsed_ns": elapsed.Nanoseconds()}, nil

	case "stop_container":
		ctr, pod, err := r.state.container(cmd.ID)
		if err != nil {
			return nil, err
		}
		if _, err := r.nri.StopContainer(ctx, &api.StopContainerRequest{Pod: pod, Container: ctr}); err != nil {
			return nil, err
		}
		ctr.State = api.ContainerState_CONTAINER_STOPPED
		ctr.FinishedAt = time.Now().UnixNano()
		return reply{}, nil

	case "remove_container":
		ctr, pod, err := r.state.container(cmd.ID)
		if err != nil {
			return nil, err
		}
		if err := r.nri.RemoveContainer(ctx, &api.RemoveContainerRequest{Pod: pod, Container: ctr}); err != nil {
			return nil, err
		}
		r.state.removeContainer(cmd.ID)
		return reply{}, nil

	case "stop_pod":
		pod, err := r.state.pod(cmd.ID)
		if err != nil {
			return nil, err
		}
		return reply{}, r.nri.StopPodSandbox(ctx, &api.StopPodSandboxRequest{Pod: pod})

	case "remove_pod":
		pod, err := r.state.pod(cmd.ID)
		if err != nil {
			return nil, err
		}
		if err := r.nri.RemovePodSandbox(ctx, &api.RemovePodSandboxRequest{Pod: pod}); err != nil {
			return nil, err
		}
		r.state.removePod(cmd.ID)
		return reply{}, nil

	case "wait_plugins":
		timeout := time.Duration(cmd.TimeoutMs) * time.Millisecond
		if timeout <= 0 {
			timeout = 10 * time.Second
		}
		count, ok := r.plugins.wait(cmd.Count, timeout)
		if !ok {
			return reply{"plugins": count}, fmt.Errorf("%d plugin(s) connected after %v, wanted %d", count, timeout, cmd.Count)
		}
		return reply{"plugins": count}, nil

	case "wait_registrations":
		timeout := time.Duration(cmd.TimeoutMs) * time.Millisecond
		if timeout <= 0 {
			timeout = 10 * time.Second
		}
		n, ok := r.plugins.waitRegistrations(cmd.Count, timeout)
		if !ok {
			return reply{"registrations": n}, fmt.Errorf("%d plugin registration(s) after %v, wanted %d", n, timeout, cmd.Count)
		}
		return reply{"registrations": n}, nil

	case "list":
		pods, ctrs := r.state.snapshot()
		p := make([]json.RawMessage, 0, len(pods))
		for _, x := range pods {
			p = append(p, protoJSON(x))
		}
		c := make([]json.RawMessage, 0, len(ctrs))
		for _, x := range ctrs {
			c = append(c, protoJSON(x))
		}
		r.umu.Lock()
		updates := len(r.updates)
		r.umu.Unlock()
		return reply{"pods": p, "containers": c, "plugins": r.plugins.current(),
			"registrations": r.plugins.registrations(), "updates": updates}, nil
	}
	return nil, fmt.Errorf("unknown op %q", cmd.Op)
}

// quietLogger passes NRI's logs to logrus on stderr, minus the one error every start logs in a build
// without WASM support (this program is built with nri_no_wasm on purpose).
type quietLogger struct{}

func (quietLogger) Debugf(ctx context.Context, f string, a ...any) {
	logrus.WithContext(ctx).Debugf(f, a...)
}
func (quietLogger) Infof(ctx context.Context, f string, a ...any) {
	logrus.WithContext(ctx).Infof(f, a...)
}
func (quietLogger) Warnf(ctx context.Context, f string, a ...any) {
	logrus.WithContext(ctx).Warnf(f, a...)
}
func (quietLogger) Errorf(ctx context.Context, f string, a ...any) {
	if msg := fmt.Sprintf(f, a...); !strings.Contains(msg, "WASM support is disabled") {
		logrus.WithContext(ctx).Error(msg)
	}
}

func main() {
	socket := flag.String("socket", api.DefaultSocketPath, "NRI socket to listen on")
	stateFile := flag.String("state-file", "", "where pods and containers are kept across a restart (default: <socket>.state.json)")
	restore := flag.Bool("restore", false, "recover pods and containers from --state-file (set by restart)")
	requestTimeout := flag.Duration("request-timeout", api.DefaultPluginRequestTimeout, "plugin request timeout")
	registrationTimeout := flag.Duration("registration-timeout", api.DefaultPluginRegistrationTimeout, "plugin registration timeout")
	logLevel := flag.String("log-level", "warning", "logrus level for NRI's logs on stderr")
	defaultValidator := flag.Bool("default-validator", false,
		"enable NRI's built-in default validator, as containerd's [plugins.\"io.containerd.nri.v1.nri\".default_validator] enable = true does: "+
			"a container whose pod annotation "+nriplugin.RequiredPluginsAnnotation+" names a plugin that is not connected is refused")
	requiredPlugins := flag.String("required-plugins", "", "comma-separated plugins every container requires (default_validator.required_plugins)")
	flag.Parse()

	logrus.SetOutput(os.Stderr)
	nrilog.Set(quietLogger{})
	if lvl, err := logrus.ParseLevel(*logLevel); err == nil {
		logrus.SetLevel(lvl)
	}
	if *stateFile == "" {
		*stateFile = *socket + ".state.json"
	}

	nri.SetPluginRequestTimeout(*requestTimeout)
	nri.SetPluginRegistrationTimeout(*registrationTimeout)

	out := bufio.NewWriter(os.Stdout)
	emit := func(v any) {
		b, _ := json.Marshal(v)
		out.Write(b)
		out.WriteByte('\n')
		out.Flush()
	}
	fail := func(err error) {
		emit(reply{"event": "fatal", "ok": false, "error": err.Error()})
		os.Exit(1)
	}

	r := &runtime{state: newState(), plugins: newPluginCounter()}
	if *restore {
		if err := r.state.load(*stateFile); err != nil {
			fail(fmt.Errorf("restore from %s: %w", *stateFile, err))
		}
	}

	// No pre-installed plugins: the plugin under test connects over the socket, as gpufrac's node
	// agent does in a cluster. Empty directories keep the adaptation from reading /opt/nri or /etc/nri.
	empty, err := os.MkdirTemp("", "gpufrac-nriruntime-")
	if err != nil {
		fail(err)
	}
	defer os.RemoveAll(empty)

	options := []nri.Option{
		nri.WithSocketPath(*socket),
		nri.WithPluginPath(filepath.Join(empty, "plugins")),
		nri.WithPluginConfigPath(filepath.Join(empty, "conf.d")),
		nri.WithMetrics(r.plugins),
	}
	if *defaultValidator {
		cfg := &validator.DefaultValidatorConfig{Enable: true}
		if *requiredPlugins != "" {
			cfg.RequiredPlugins = strings.Split(*requiredPlugins, ",")
		}
		options = append(options, nri.WithDefaultValidator(cfg))
		r.plugins.builtin = 1
	}
	r.nri, err = nri.New(runtimeName, runtimeVersion, r.syncPlugin, r.updateFromPlugin, options...)
	if err != nil {
		fail(err)
	}
	if err := r.nri.Start(); err != nil {
		fail(err)
	}
	emit(reply{"event": "ready", "ok": true, "socket": *socket, "pid": os.Getpid(), "restored": *restore})

	ctx := context.Background()
	in := bufio.NewScanner(os.Stdin)
	in.Buffer(make([]byte, 1<<20), 16<<20)
	for in.Scan() {
		var cmd command
		if err := json.Unmarshal(in.Bytes(), &cmd); err != nil {
			emit(reply{"ok": false, "error": "bad command: " + err.Error()})
			continue
		}
		switch cmd.Op {
		case "exit":
			r.nri.Stop()
			emit(reply{"op": cmd.Op, "ok": true})
			return
		case "restart":
			if err := r.state.save(*stateFile); err != nil {
				emit(reply{"op": cmd.Op, "ok": false, "error": err.Error()})
				continue
			}
			r.nri.Stop()
			emit(reply{"op": cmd.Op, "ok": true})
			os.RemoveAll(empty)
			args := append([]string{os.Args[0]}, withoutFlag(os.Args[1:], "-restore")...)
			args = append(args, "-restore", "-state-file", *stateFile)
			exe, err := os.Executable()
			if err != nil {
				fail(err)
			}
			// Sockets are close-on-exec in Go, so every plugin connection drops here, as on a crash.
			fail(syscall.Exec(exe, args, os.Environ()))
		}
		rpl, err := r.handle(ctx, &cmd)
		if rpl == nil {
			rpl = reply{}
		}
		rpl["op"] = cmd.Op
		rpl["ok"] = err == nil
		if err != nil {
			rpl["error"] = err.Error()
		}
		emit(rpl)
	}
	r.nri.Stop()
}

// withoutFlag drops a boolean flag and "-state-file X" from args so a restart can add them once.
func withoutFlag(args []string, flagName string) []string {
	var out []string
	for i := 0; i < len(args); i++ {
		switch args[i] {
		case flagName, "-" + flagName:
			continue
		case "-state-file", "--state-file":
			i++
			continue
		}
		out = append(out, args[i])
	}
	return out
}
