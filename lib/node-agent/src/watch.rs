//! The node watcher: kernel uevents, `/dev/vfio` inotify and a periodic resync.

use std::os::fd::OwnedFd;

/// The uevent socket, registered with the tokio runtime (for the agents that run one).
pub fn async_socket() -> std::io::Result<tokio::io::unix::AsyncFd<OwnedFd>> {
    let fd = sysfs_pci::uevent::socket_nonblocking()?;
    // SAFETY: the OwnedFd is moved into the AsyncFd, which owns it from here on: it
    // stays open, and as_raw_fd returns the same descriptor, until the AsyncFd drops.
    #[allow(unsafe_code)]
    let registered = unsafe { tokio::io::unix::AsyncFd::register(fd) };
    registered.map_err(|e| e.into_parts().1)
}
