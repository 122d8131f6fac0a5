// Command dra-reference is the DRA benchmark's reference peer: the driver the
// field would write on Go's k8s.io/dynamic-resource-allocation (kubeletplugin's
// Helper and its ResourceSlice controller), doing what kubelet-plugin's
// examples/cdi_driver.rs does. It publishes DEVICES devices (dev-0, dev-1, …) in
// this node's pool, in slices of 64; prepares a claim by writing one CDI spec
// for it (an environment variable per device) and answering its CDI ids; and
// unprepares it by removing that spec. Same work, two libraries.
//
// Settings (environment, as the Rust example reads them): NODE_NAME
// (required), DRIVER_NAME (cdi.example.com), DEVICES (8), CDI_DIR
// (/var/run/cdi), KUBELET_DIR (/var/lib/kubelet); the API server from
// KUBECONFIG or the pod's service account. The Helper's defaults are kept
// (calls serialized, as the field runs them), and so are client-go's (at most
// 5 requests a second in bursts of 10, rest.Config's QPS and Burst: every
// prepare reads its claim). SIGINT or SIGTERM stops it.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/dynamic-resource-allocation/kubeletplugin"
	"k8s.io/dynamic-resource-allocation/resourceslice"
	"k8s.io/klog/v2"
)

// devicesPerSlice matches kubelet-plugin's slices (the API server allows 128,
// but only 64 once a device has taints or counters).
const devicesPerSlice = 64

type driver struct {
	name    string
	devices int
	cdiDir  string
}

func setting(name, def string) string {
	if v, ok := os.LookupEnv(name); ok && v != "" {
		return v
	}
	return def
}

// kind is the CDI kind of the driver's devices: <vendor>/<class>.
func (d *driver) kind() string { return d.name + "/device" }

// specPath is the claim's spec file, <vendor>-<class>_<uid>.json as
// GenerateTransientSpecName in the CDI module's pkg/cdi/spec.go names it.
func (d *driver) specPath(uid types.UID) string {
	return filepath.Join(d.cdiDir, fmt.Sprintf("%s-device_%s.json", d.name, uid))
}

func (d *driver) ours(device string) bool {
	i, err := strconv.Atoi(strings.TrimPrefix(device, "dev-"))
	return strings.HasPrefix(device, "dev-") && err == nil && i >= 0 && i < d.devices
}

type cdiDevice struct {
	Name           string         `json:"name"`
	ContainerEdits map[string]any `json:"containerEdits"`
}

type cdiSpec struct {
	CDIVersion string      `json:"cdiVersion"`
	Kind       string      `json:"kind"`
	Devices    []cdiDevice `json:"devices"`
}

// writeAtomically puts bytes at path through a temporary file renamed over it.
func writeAtomically(path string, data []byte) error {
	tmp := path + ".tmp"
	f, err := os.Create(tmp)
	if err != nil {
		return err
	}
	if _, err := f.Write(data); err != nil {
		_ = f.Close()
		return err
	}
	if err := f.Sync(); err != nil {
		_ = f.Close()
		return err
	}
	if err := f.Close(); err != nil {
		return err
	}
	return os.Rename(tmp, path)
}

func (d *driver) prepareOne(claim *resourceapi.ResourceClaim) kubeletplugin.PrepareResult {
	if claim.Status.Allocation == nil {
		return kubeletplugin.PrepareResult{Err: fmt.Errorf("claim %s/%s is not allocated", claim.Namespace, claim.Name)}
	}
	spec := cdiSpec{CDIVersion: "0.3.0", Kind: d.kind()}
	var answer []kubeletplugin.Device
	for _, r := range claim.Status.Allocation.Devices.Results {
		if r.Driver != d.name {
			continue
		}
		if !d.ours(r.Device) {
			return kubeletplugin.PrepareResult{Err: fmt.Errorf("device %s is not one of this driver's", r.Device)}
		}
		// The device first: a name starting with a digit (as a uid may)
		// needs cdiVersion 0.5.0.
		name := fmt.Sprintf("%s-%s", r.Device, claim.UID)
		variable := "DEVICE_" + strings.ToUpper(strings.ReplaceAll(r.Device, "-", "_"))
		spec.Devices = append(spec.Devices, cdiDevice{
			Name:           name,
			ContainerEdits: map[string]any{"env": []string{variable + "=" + r.Device}},
		})
		answer = append(answer, kubeletplugin.Device{
			Requests:     []string{r.Request},
			PoolName:     r.Pool,
			DeviceName:   r.Device,
			CDIDeviceIDs: []string{d.kind() + "=" + name},
		})
	}
	data, err := json.Marshal(spec)
	if err != nil {
		return kubeletplugin.PrepareResult{Err: err}
	}
	if err := writeAtomically(d.specPath(claim.UID), data); err != nil {
		return kubeletplugin.PrepareResult{Err: fmt.Errorf("cannot write CDI spec: %w", err)}
	}
	return kubeletplugin.PrepareResult{Devices: answer}
}

func (d *driver) PrepareResourceClaims(_ context.Context, claims []*resourceapi.ResourceClaim) (map[types.UID]kubeletplugin.PrepareResult, error) {
	result := make(map[types.UID]kubeletplugin.PrepareResult, len(claims))
	for _, c := range claims {
		result[c.UID] = d.prepareOne(c)
	}
	return result, nil
}

func (d *driver) UnprepareResourceClaims(_ context.Context, claims []kubeletplugin.NamespacedObject) (map[types.UID]error, error) {
	result := make(map[types.UID]error, len(claims))
	for _, c := range claims {
		err := os.Remove(d.specPath(c.UID))
		if err != nil && !errors.Is(err, os.ErrNotExist) {
			result[c.UID] = fmt.Errorf("cannot remove CDI spec: %w", err)
		} else {
			result[c.UID] = nil
		}
	}
	return result, nil
}

func (d *driver) HandleError(ctx context.Context, err error, msg string) {
	klog.FromContext(ctx).Error(err, msg)
}

func (d *driver) WatchHealthStatus(context.Context, chan<- kubeletplugin.DeviceHealthReport) error {
	return kubeletplugin.ErrHealthNotSupported
}

// resources is the pool: DEVICES devices in slices of devicesPerSlice.
func (d *driver) resources(node string) resourceslice.DriverResources {
	var slices []resourceslice.Slice
	for start := 0; start == 0 || start < d.devices; start += devicesPerSlice {
		end := min(start+devicesPerSlice, d.devices)
		devices := make([]resourceapi.Device, 0, end-start)
		for i := start; i < end; i++ {
			devices = append(devices, resourceapi.Device{Name: fmt.Sprintf("dev-%d", i)})
		}
		slices = append(slices, resourceslice.Slice{Devices: devices})
	}
	return resourceslice.DriverResources{Pools: map[string]resourceslice.Pool{node: {Slices: slices}}}
}

func config() (*rest.Config, error) {
	if path := os.Getenv("KUBECONFIG"); path != "" {
		return clientcmd.BuildConfigFromFlags("", path)
	}
	return rest.InClusterConfig()
}

func run() error {
	node := os.Getenv("NODE_NAME")
	if node == "" {
		return errors.New("NODE_NAME is not set")
	}
	devices, err := strconv.Atoi(setting("DEVICES", "8"))
	if err != nil || devices < 0 {
		return fmt.Errorf("DEVICES is not a count: %q", os.Getenv("DEVICES"))
	}
	d := &driver{name: setting("DRIVER_NAME", "cdi.example.com"), devices: devices, cdiDir: setting("CDI_DIR", "/var/run/cdi")}
	if err := os.MkdirAll(d.cdiDir, 0o755); err != nil {
		return fmt.Errorf("cannot create CDI directory %s: %w", d.cdiDir, err)
	}
	kubeletDir := setting("KUBELET_DIR", "/var/lib/kubelet")
	registry := filepath.Join(kubeletDir, "plugins_registry")
	data := filepath.Join(kubeletDir, "plugins", d.name)
	// The Helper listens in these directories but does not make them.
	for _, dir := range []string{registry, data} {
		if err := os.MkdirAll(dir, 0o750); err != nil {
			return fmt.Errorf("cannot create %s: %w", dir, err)
		}
	}
	cfg, err := config()
	if err != nil {
		return fmt.Errorf("no API server: %w", err)
	}
	client, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return err
	}
	ctx, cancel := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer cancel()
	helper, err := kubeletplugin.Start(ctx, d,
		kubeletplugin.KubeClient(client),
		kubeletplugin.NodeName(node),
		kubeletplugin.DriverName(d.name),
		kubeletplugin.RegistrarDirectoryPath(registry),
		kubeletplugin.PluginDataDirectoryPath(data),
	)
	if err != nil {
		return fmt.Errorf("starting the kubelet plugin: %w", err)
	}
	if err := helper.PublishResources(ctx, d.resources(node)); err != nil {
		helper.Stop()
		return fmt.Errorf("publishing: %w", err)
	}
	<-ctx.Done()
	helper.Stop()
	return nil
}

func main() {
	if err := run(); err != nil {
		fmt.Fprintf(os.Stderr, "dra-reference: error: %v\n", err)
		os.Exit(1)
	}
}
