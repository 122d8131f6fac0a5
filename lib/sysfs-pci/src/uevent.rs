//! Kernel uevents: a netlink socket that tells us when PCI devices appear, vanish,
//! bind or unbind, so daemons react at once instead of polling.
//!
//! Receiving them needs the host's network namespace (`hostNetwork: true`); callers
//! fall back to periodic rescans without it.

use std::collections::BTreeSet;
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd};

use nix::sys::socket::{
    bind, recv, socket, AddressFamily, MsgFlags, NetlinkAddr, SockFlag, SockProtocol, SockType,
};

use crate::PciAddress;

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

/// True when a uevent message (`ACTION@DEVPATH\0KEY=VALUE\0...`) concerns the PCI bus.
pub fn is_pci(msg: &[u8]) -> bool {
    fields(msg).any(|field| field == b"SUBSYSTEM=pci")
}

fn fields(msg: &[u8]) -> impl Iterator<Item = &[u8]> {
    msg.split(|b| *b == 0)
}

/// The PCI function a PCI uevent is about: `PCI_SLOT_NAME`, else the last component
/// of `DEVPATH`. `None` for other subsystems; `Some(None)` for a PCI event that
/// names no function we can parse.
pub fn pci_address(msg: &[u8]) -> Option<Option<PciAddress>> {
    if !is_pci(msg) {
        return None;
    }
    let value = |key: &[u8]| {
        fields(msg).find_map(|f| {
            f.strip_prefix(key)
                .and_then(|v| std::str::from_utf8(v).ok())
        })
    };
    let slot = value(b"PCI_SLOT_NAME=").and_then(|v| v.parse().ok());
    let from_path = || {
        value(b"DEVPATH=")
            .and_then(|p| p.rsplit('/').next())
            .and_then(|last| last.parse().ok())
    };
    Some(slot.or_else(from_path))
}

/// What a batch of uevents said about the PCI bus.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct PciEvents {
    /// The functions named (added, removed, bound, unbound, changed).
    pub addresses: BTreeSet<PciAddress>,
    /// True when some PCI event could not be placed, or events were lost (the
    /// socket's buffer overflowed): the whole bus must be looked at again.
    pub lost: bool,
}

impl PciEvents {
    /// True when nothing about PCI arrived.
    pub fn is_empty(&self) -> bool {
        self.addresses.is_empty() && !self.lost
    }

    /// Takes one message.
    pub fn note(&mut self, msg: &[u8]) {
        match pci_address(msg) {
            None => {}
            Some(Some(address)) => {
                self.addresses.insert(address);
            }
            Some(None) => self.lost = true,
        }
    }
}

/// Reads every queued message without blocking; what they said about PCI.
pub fn drain_pci(fd: BorrowedFd<'_>) -> PciEvents {
    let mut buf = vec![0u8; 8192];
    let mut events = PciEvents::default();
    loop {
        match recv(fd.as_raw_fd(), &mut buf, MsgFlags::MSG_DONTWAIT) {
            Ok(0) => break,
            Ok(n) => events.note(&buf[..n]),
            // The kernel dropped messages it could not queue.
            Err(nix::errno::Errno::ENOBUFS) => events.lost = true,
            Err(nix::errno::Errno::EINTR) => {}
            Err(_) => break,
        }
    }
    events
}

/// Reads every queued message without blocking; true when one was about PCI (or
/// some were lost).
pub fn drain(fd: BorrowedFd<'_>) -> bool {
    !drain_pci(fd).is_empty()
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

    #[test]
    fn names_the_function_an_event_is_about() {
        let unbind = b"unbind@/devices/pci0000:00/0000:00:02.0/0000:01:00.0\0ACTION=unbind\0\
            DEVPATH=/devices/pci0000:00/0000:00:02.0/0000:01:00.0\0SUBSYSTEM=pci\0\
            PCI_SLOT_NAME=0000:01:00.0\0";
        let addr: PciAddress = "0000:01:00.0".parse().unwrap();
        assert_eq!(pci_address(unbind), Some(Some(addr)));
        // No slot name: the path says it.
        let bind =
            b"bind@/x\0DEVPATH=/devices/pci0000:00/0000:00:02.0/0000:01:00.0\0SUBSYSTEM=pci\0";
        assert_eq!(pci_address(bind), Some(Some(addr)));
        assert_eq!(
            pci_address(b"add@/devices/virtual/net/lo\0SUBSYSTEM=net\0"),
            None
        );
        let mut events = PciEvents::default();
        events.note(b"change@/x\0SUBSYSTEM=pci\0DEVPATH=/devices/pci0000:00\0");
        assert!(
            events.lost,
            "a PCI event without a function makes the batch a full look"
        );
    }

    proptest::proptest! {
        #[test]
        fn hostile_messages_never_panic(
            bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..300),
        ) {
            let mut events = PciEvents::default();
            events.note(&bytes);
            let _ = pci_address(&bytes);
        }
    }
}
