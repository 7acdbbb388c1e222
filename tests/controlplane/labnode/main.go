// labnode: a lab node played by the real kubelet of the lab's release (k8s.io/kubernetes
// v1.35.4, cmd/kubelet), with what a kubelet needs around it and the lab has not:
//
//	labnode kubelet FLAGS...                the kubelet's own main (cmd/kubelet/kubelet.go)
//	labnode cri SOCKET                      a fake CRI runtime on a Unix socket
//	labnode device-plugin RESOURCE FILE     a device plugin serving the IDs listed in FILE
//	labnode dra-plugin DRIVER NODE KUBECONFIG FILE
//	                                        a DRA kubelet plugin publishing the devices in FILE
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
//
// The DRA plugin is k8s.io/dynamic-resource-allocation v0.35.4's kubeletplugin helper,
// as NVIDIA's DRA driver uses it (k8s-dra-driver-gpu, cmd/gpu-kubelet-plugin/driver.go):
// it registers through /var/lib/kubelet/plugins_registry, publishes one pool named after
// the node in one ResourceSlice (each line of FILE a GPU: its name and UUID) and answers
// the kubelet's NodePrepareResources with a CDI device per allocated GPU.
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
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/component-base/cli"
	_ "k8s.io/component-base/logs/json/register"
	_ "k8s.io/component-base/metrics/prometheus/clientgo"
	_ "k8s.io/component-base/metrics/prometheus/version"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"
	"k8s.io/cri-client/pkg/fake"
	"k8s.io/dynamic-resource-allocation/kubeletplugin"
	"k8s.io/dynamic-resource-allocation/resourceslice"
	"k8s.io/klog/v2"
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
	case "dra-plugin":
		if len(args) != 4 {
			usage()
		}
		exit(draPlugin(args[0], args[1], args[2], args[3]))
	default:
		usage()
	}
}

func usage() {
	fmt.Fprintln(os.Stderr, "usage: labnode kubelet FLAGS... | cri SOCKET | device-plugin RESOURCE FILE"+
		" | dra-plugin DRIVER NODE KUBECONFIG FILE")
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

type draDriver struct {
	name string
}

// PrepareResourceClaims gives each GPU allocated to a claim as the CDI device NVIDIA's
// driver names it (k8s.gpu.nvidia.com/gpu=<uuid>); the fake runtime takes it as given.
func (d *draDriver) PrepareResourceClaims(_ context.Context, claims []*resourceapi.ResourceClaim) (map[types.UID]kubeletplugin.PrepareResult, error) {
	result := map[types.UID]kubeletplugin.PrepareResult{}
	for _, claim := range claims {
		var devices []kubeletplugin.Device
		if claim.Status.Allocation != nil {
			for _, r := range claim.Status.Allocation.Devices.Results {
				if r.Driver != d.name {
					continue
				}
				devices = append(devices, kubeletplugin.Device{
					Requests: []string{r.Request}, PoolName: r.Pool, DeviceName: r.Device,
					CDIDeviceIDs: []string{"k8s." + d.name + "/gpu=" + r.Device}})
			}
		}
		fmt.Fprintf(os.Stderr, "labnode: prepared claim %s/%s:", claim.Namespace, claim.Name)
		for _, device := range devices {
			fmt.Fprintf(os.Stderr, " %s", strings.Join(device.CDIDeviceIDs, ","))
		}
		fmt.Fprintln(os.Stderr)
		result[claim.UID] = kubeletplugin.PrepareResult{Devices: devices}
	}
	return result, nil
}

func (d *draDriver) UnprepareResourceClaims(_ context.Context, claims []kubeletplugin.NamespacedObject) (map[types.UID]error, error) {
	result := map[types.UID]error{}
	for _, claim := range claims {
		result[claim.UID] = nil
	}
	return result, nil
}

func (d *draDriver) HandleError(ctx context.Context, err error, msg string) {
	klog.FromContext(ctx).Error(err, msg)
}

// draGPUs reads FILE: one GPU a line, its device name and UUID.
func draGPUs(file string) []resourceapi.Device {
	var devices []resourceapi.Device
	for _, line := range readIDs(file) {
		fields := strings.Fields(line)
		if len(fields) != 2 {
			continue
		}
		gpu, uuid := fields[0], fields[1]
		devices = append(devices, resourceapi.Device{Name: gpu, Attributes: map[resourceapi.QualifiedName]resourceapi.DeviceAttribute{
			"type": {StringValue: ptr("gpu")}, "uuid": {StringValue: ptr(uuid)}}})
	}
	return devices
}

func ptr[T any](v T) *T { return &v }

func draPlugin(driver, node, kubeconfig, file string) error {
	ctx := stopped()
	config, err := clientcmd.BuildConfigFromFlags("", kubeconfig)
	if err != nil {
		return err
	}
	client, err := kubernetes.NewForConfig(config)
	if err != nil {
		return err
	}
	// The driver's own directory, which NVIDIA's DaemonSet mounts from the host with
	// DirectoryOrCreate; the helper only listens in it.
	if err := os.MkdirAll(filepath.Join(kubeletplugin.KubeletPluginsDir, driver), 0o750); err != nil {
		return err
	}
	helper, err := kubeletplugin.Start(ctx, &draDriver{name: driver}, kubeletplugin.DriverName(driver),
		kubeletplugin.NodeName(node), kubeletplugin.KubeClient(client))
	if err != nil {
		return err
	}
	defer helper.Stop()
	var published []resourceapi.Device
	first := true
	for ctx.Err() == nil {
		devices := draGPUs(file)
		if first || fmt.Sprint(devices) != fmt.Sprint(published) {
			if err := helper.PublishResources(ctx, resourceslice.DriverResources{Pools: map[string]resourceslice.Pool{
				node: {Slices: []resourceslice.Slice{{Devices: devices}}}}}); err != nil {
				return err
			}
			published, first = devices, false
		}
		select {
		case <-ctx.Done():
		case <-time.After(200 * time.Millisecond):
		}
	}
	return nil
}
