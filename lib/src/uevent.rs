//! Kernel uevents: a netlink socket that tells us when PCI devices appear, vanish,
//! bind or unbind, so daemons react at once instead of polling.
//!
//! Receiving them needs the host's network namespace (`hostNetwork: true`); callers
//! fall back to periodic rescans without it.

use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd};

use nix::sys::socket::{
    bind, recv, socket, AddressFamily, MsgFlags, NetlinkAddr, SockFlag, SockProtocol, SockType,
};

/// Opens a non-blocking socket on the kernel's uevent multicast group.
pub fn socket_nonblocking() -> nix::Result<OwnedFd> {
    let fd = socket(
        AddressFamily::Netlink,
        SockType::Datagram,
        SockFlag::SOCK_CLOEXEC | SockFlag::SOCK_NONBLOCK,
        SockProtocol::NetlinkKObjectUEvent,
    )?;
    bind(fd.as_raw_fd(), &NetlinkAddr::new(0, 1))?;
    Ok(fd)
}

/// The uevent socket, registered with the tokio runtime (for the agents that run one).
#[cfg(any(feature = "kube", feature = "metrics"))]
pub fn async_socket() -> std::io::Result<tokio::io::unix::AsyncFd<OwnedFd>> {
    let fd = socket_nonblocking()?;
    // SAFETY: the OwnedFd is moved into the AsyncFd, which owns it from here on: it
    // stays open, and as_raw_fd returns the same descriptor, until the AsyncFd drops.
    #[allow(unsafe_code)]
    let registered = unsafe { tokio::io::unix::AsyncFd::register(fd) };
    registered.map_err(|e| e.into_parts().1)
}

/// True when a uevent message (`ACTION@DEVPATH\0KEY=VALUE\0...`) concerns the PCI bus.
pub fn is_pci(msg: &[u8]) -> bool {
    msg.split(|b| *b == 0)
        .any(|field| field == b"SUBSYSTEM=pci")
}

/// Reads every queued message without blocking; true when one was about PCI.
pub fn drain(fd: BorrowedFd<'_>) -> bool {
    let mut buf = vec![0u8; 8192];
    let mut pci = false;
    while let Ok(n) = recv(fd.as_raw_fd(), &mut buf, MsgFlags::MSG_DONTWAIT) {
        if n == 0 {
            break;
        }
        pci |= is_pci(&buf[..n]);
    }
    pci
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recognises_pci_uevents() {
        let msg = b"add@/devices/pci0000:00/0000:00:02.0/0000:01:00.0\0ACTION=add\0SUBSYSTEM=pci\0PCI_ID=8086:10D3\0";
        assert!(is_pci(msg));
        let other = b"add@/devices/virtual/net/lo\0ACTION=add\0SUBSYSTEM=net\0";
        assert!(!is_pci(other));
    }
}
