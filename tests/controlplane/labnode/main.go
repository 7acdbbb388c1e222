// labnode: a lab node played by the real kubelet of the lab's release (k8s.io/kubernetes
// v1.35.4, cmd/kubelet), with what a kubelet needs around it and the lab has not:
//
//	labnode kubelet FLAGS...                the kubelet's own main (cmd/kubelet/kubelet.go)
//	labnode cri SOCKET                      a fake CRI runtime on a Unix socket
//	labnode device-plugin RESOURCE FILE     a device plugin serving the IDs listed in FILE
//
// The runtime is k8s.io/cri-client/pkg/fake's (v0.35.4, fake_runtime.go): the CRI's
// gRPC services over cri-api's FakeRuntimeService and FakeImageService, which keep
// sandboxes and containers in memory: a container "runs" from StartContainer to
// StopContainer, an image is "pulled" at once, nothing is executed.
//
// The device plugin speaks the kubelet's device plugin API (k8s.io/kubelet v0.35.4,
// pkg/apis/deviceplugin/v1beta1): it serves DevicePlugin on a socket in
// /var/lib/kubelet/device-plugins/ (a constant, so one kubelet per mount namespace),
// registers with the kubelet's Registration service on kubelet.sock, and sends the
// IDs in FILE (one a line) through ListAndWatch, again each time FILE changes, as
// NVIDIA's plugin sends its GPUs (k8s-device-plugin v0.17, internal/plugin/server.go).
package main

import (
	"bufio"
	"context"
	"fmt"
	"net"
	"os"
	"os/signal"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"k8s.io/component-base/cli"
	_ "k8s.io/component-base/logs/json/register"
	_ "k8s.io/component-base/metrics/prometheus/clientgo"
	_ "k8s.io/component-base/metrics/prometheus/version"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"
	"k8s.io/cri-client/pkg/fake"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
	kubelet "k8s.io/kubernetes/cmd/kubelet/app"
)

func main() {
	if len(os.Args) < 2 {
		usage()
	}
	args := os.Args[2:]
	switch os.Args[1] {
	case "kubelet":
		command := kubelet.NewKubeletCommand(context.Background())
		command.SetArgs(args)
		os.Exit(cli.Run(command))
	case "cri":
		if len(args) != 1 {
			usage()
		}
		exit(cri(args[0]))
	case "device-plugin":
		if len(args) != 2 {
			usage()
		}
		exit(devicePlugin(args[0], args[1]))
	default:
		usage()
	}
}

func usage() {
	fmt.Fprintln(os.Stderr, "usage: labnode kubelet FLAGS... | cri SOCKET | device-plugin RESOURCE FILE")
	os.Exit(2)
}

func exit(err error) {
	if err != nil {
		fmt.Fprintf(os.Stderr, "labnode: %v\n", err)
		os.Exit(1)
	}
	os.Exit(0)
}

func stopped() context.Context {
	ctx, _ := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	return ctx
}

// cri serves the fake runtime until SIGTERM. What the kubelet asks of a runtime that
// the fake leaves empty is filled as a runtime on this machine would answer it: the
// cgroup driver (cgroupfs, as the kubelet is configured), one image filesystem, so
// that its stats and image garbage collection have something to read, and a size for
// each image pulled: cri-client's ImageStatus (pkg/remote_image.go) refuses an image
// of size 0 ("Id or size of image ... is not set"), which the fake's default is.
func cri(socket string) error {
	runtime := fake.NewFakeRemoteRuntime()
	runtime.RuntimeService.FakeLinuxConfiguration = &runtimeapi.LinuxRuntimeConfiguration{
		CgroupDriver: runtimeapi.CgroupDriver_CGROUPFS}
	runtime.ImageService.SetFakeImageSize(1 << 20)
	now := time.Now().UnixNano()
	runtime.ImageService.SetFakeFilesystemUsage([]*runtimeapi.FilesystemUsage{{
		Timestamp: now, FsId: &runtimeapi.FilesystemIdentifier{Mountpoint: filepath.Dir(socket)},
		UsedBytes: &runtimeapi.UInt64Value{Value: 0}, InodesUsed: &runtimeapi.UInt64Value{Value: 0},
	}})
	if err := runtime.Start("unix://" + socket); err != nil {
		return err
	}
	<-stopped().Done()
	runtime.Stop()
	return nil
}

type plugin struct {
	pluginapi.UnimplementedDevicePluginServer
	file string
}

func (p *plugin) GetDevicePluginOptions(context.Context, *pluginapi.Empty) (*pluginapi.DevicePluginOptions, error) {
	return &pluginapi.DevicePluginOptions{}, nil
}

func (p *plugin) ListAndWatch(_ *pluginapi.Empty, stream grpc.ServerStreamingServer[pluginapi.ListAndWatchResponse]) error {
	var sent []string
	first := true
	for {
		ids := readIDs(p.file)
		if first || !slices.Equal(ids, sent) {
			devices := make([]*pluginapi.Device, 0, len(ids))
			for _, id := range ids {
				devices = append(devices, &pluginapi.Device{ID: id, Health: pluginapi.Healthy})
			}
			if err := stream.Send(&pluginapi.ListAndWatchResponse{Devices: devices}); err != nil {
				return err
			}
			sent, first = ids, false
		}
		select {
		case <-stream.Context().Done():
			return nil
		case <-time.After(200 * time.Millisecond):
		}
	}
}

func (p *plugin) GetPreferredAllocation(context.Context, *pluginapi.PreferredAllocationRequest) (*pluginapi.PreferredAllocationResponse, error) {
	return &pluginapi.PreferredAllocationResponse{}, nil
}

// Allocate answers as NVIDIA's plugin does with its default strategy (envvar): the
// container gets NVIDIA_VISIBLE_DEVICES with the IDs it was given.
func (p *plugin) Allocate(_ context.Context, request *pluginapi.AllocateRequest) (*pluginapi.AllocateResponse, error) {
	response := &pluginapi.AllocateResponse{}
	for _, container := range request.ContainerRequests {
		response.ContainerResponses = append(response.ContainerResponses, &pluginapi.ContainerAllocateResponse{
			Envs: map[string]string{"NVIDIA_VISIBLE_DEVICES": strings.Join(container.DevicesIds, ",")}})
	}
	return response, nil
}

func (p *plugin) PreStartContainer(context.Context, *pluginapi.PreStartContainerRequest) (*pluginapi.PreStartContainerResponse, error) {
	return &pluginapi.PreStartContainerResponse{}, nil
}

func readIDs(file string) []string {
	f, err := os.Open(file)
	if err != nil {
		return nil
	}
	defer f.Close()
	var ids []string
	scanner := bufio.NewScanner(f)
	for scanner.Scan() {
		if id := strings.TrimSpace(scanner.Text()); id != "" {
			ids = append(ids, id)
		}
	}
	return ids
}

// devicePlugin serves `resource` and registers it, again whenever the kubelet's
// socket is made anew (a kubelet restart), as device plugins must.
func devicePlugin(resource, file string) error {
	ctx := stopped()
	name := strings.NewReplacer("/", "-", ".", "-").Replace(resource) + ".sock"
	socket := filepath.Join(pluginapi.DevicePluginPath, name)
	for ctx.Err() == nil {
		_ = os.Remove(socket)
		listener, err := net.Listen("unix", socket)
		if err != nil {
			return err
		}
		server := grpc.NewServer()
		pluginapi.RegisterDevicePluginServer(server, &plugin{file: file})
		go server.Serve(listener)
		if err := register(ctx, resource, name); err != nil {
			fmt.Fprintf(os.Stderr, "labnode: registering %s: %v\n", resource, err)
		} else {
			fmt.Fprintf(os.Stderr, "labnode: registered %s\n", resource)
		}
		// The kubelet removes every socket in the directory when it starts: ours gone
		// means a new kubelet to register with.
		for ctx.Err() == nil {
			if _, err := os.Stat(socket); err != nil {
				break
			}
			time.Sleep(200 * time.Millisecond)
		}
		server.Stop()
	}
	return nil
}

func register(ctx context.Context, resource, endpoint string) error {
	deadline := time.Now().Add(30 * time.Second)
	for {
		err := registerOnce(ctx, resource, endpoint)
		if err == nil || time.Now().After(deadline) || ctx.Err() != nil {
			return err
		}
		time.Sleep(500 * time.Millisecond)
	}
}

func registerOnce(ctx context.Context, resource, endpoint string) error {
	conn, err := grpc.NewClient("unix://"+pluginapi.KubeletSocket,
		grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return err
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	_, err = pluginapi.NewRegistrationClient(conn).Register(ctx, &pluginapi.RegisterRequest{
		Version: pluginapi.Version, Endpoint: endpoint, ResourceName: resource})
	return err
}
