//! containerd's configuration for a node of the harness (the host's, in its
//! mount namespace, and the test bed guest's).

use std::path::Path;

use crate::image::PAUSE;

/// Where a node's containerd keeps things.
pub struct Paths<'a> {
    /// Its root (images, snapshots).
    pub root: &'a Path,
    /// Its state directory.
    pub state: &'a Path,
    /// Its gRPC socket (the ttrpc one is beside it).
    pub socket: &'a Path,
    /// Where the DRA driver writes CDI specs.
    pub cdi: &'a Path,
    /// The CNI network's configuration directory.
    pub cni: &'a Path,
    /// The snapshotter: `native` (a copy per container, no overlay mounts to
    /// clean up) on the host's node, `overlayfs` (containerd's default) in the
    /// guest, where a copy of an image per container is slow.
    pub snapshotter: &'a str,
}

/// CRI's configuration (containerd 2, version 3): the given snapshotter, our
/// sandbox image, runc with cgroupfs, CDI specs
/// from the drivers' directory and the CNI plugins of Debian's
/// containernetworking-plugins. `restrict_oom_score_adj` for a containerd that
/// may not lower its OOM score (no CAP_SYS_RESOURCE), which kubelet asks for
/// the sandbox (-998): containerd then keeps such scores at its own.
pub fn config(paths: &Paths, restrict_oom_score_adj: bool) -> String {
    let restrict = if restrict_oom_score_adj {
        "  restrict_oom_score_adj = true\n"
    } else {
        ""
    };
    format!(
        r#"version = 3
root = "{root}"
state = "{state}"
[grpc]
  address = "{sock}"
[ttrpc]
  address = "{sock}.ttrpc"
[plugins."io.containerd.cri.v1.images"]
  snapshotter = "{snapshotter}"
  [plugins."io.containerd.cri.v1.images".pinned_images]
    sandbox = "{PAUSE}"
[plugins."io.containerd.cri.v1.runtime"]
{restrict}  cdi_spec_dirs = ["{cdi}"]
  [plugins."io.containerd.cri.v1.runtime".containerd]
    default_runtime_name = "runc"
    [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc.options]
        BinaryName = "/usr/sbin/runc"
        SystemdCgroup = false
  [plugins."io.containerd.cri.v1.runtime".cni]
    bin_dirs = ["/usr/lib/cni"]
    conf_dir = "{cni}"
[plugins."io.containerd.grpc.v1.cri"]
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
"#,
        root = paths.root.display(),
        snapshotter = paths.snapshotter,
        state = paths.state.display(),
        sock = paths.socket.display(),
        cdi = paths.cdi.display(),
        cni = paths.cni.display(),
    )
}
