//! The small sysfs PCI layer of vfio-sandbox: what Linux shows of PCI devices under
//! `/sys` and `/dev`, and the writes that move a device between drivers.
//!
//! This is the bottom layer of the workspace (`passthrough` builds the engine on it,
//! `node-agent` and the binaries sit above): it knows nothing of resource lists,
//! claims or Kubernetes, and depends only on nix, serde, thiserror and tracing.
//!
//! Every function that touches the node takes its roots from a [`Host`]: the real
//! `/sys`, `/dev` and `/lib/modules` are only defaults, so the same code runs on fake
//! trees in tests and on a real kernel. Every change to the node goes through a
//! [`kernel::Kernel`], so a dry run prints exactly the writes a real run makes.

pub mod address;
pub mod bind;
pub mod cdev;
pub mod deadline;
pub mod device;
pub mod failpoint;
pub mod group;
pub mod host;
pub mod io;
pub mod kernel;
pub mod module;
pub mod out;
#[cfg(any(test, feature = "testing"))]
pub mod testing;
pub mod uevent;
pub mod vfio_alias;
pub mod vfio_driver;

pub use address::PciAddress;
pub use device::PciDevice;
pub use host::Host;

/// An error and all its sources on one line, `: `-separated, so every error reaches
/// a person with its causes.
///
/// Our own messages never repeat their source; some of our dependencies' do (kube's
/// `Error deserializing response: {0}` over the serde error `{0}`, hyper-util's
/// `client error (SendRequest)` over itself): a source whose text the line already
/// ends with adds nothing and is left out.
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        let text = c.to_string();
        if !text.is_empty() && !s.ends_with(&text) {
            s.push_str(": ");
            s.push_str(&text);
        }
        cur = c.source();
    }
    s
}

#[cfg(test)]
mod error_chain_tests {
    use super::error_chain;

    /// An error with a message and an optional source.
    #[derive(Debug)]
    struct E(String, Option<Box<E>>);

    impl std::fmt::Display for E {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str(&self.0)
        }
    }

    impl std::error::Error for E {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            self.1.as_deref().map(|e| e as _)
        }
    }

    fn chain(links: &[&str]) -> E {
        links
            .iter()
            .rev()
            .fold(None, |inner, m| Some(E((*m).into(), inner.map(Box::new))))
            .unwrap_or(E(String::new(), None))
    }

    #[test]
    fn every_source_is_said_once() {
        let e = chain(&[
            "cannot bind 0000:01:00.0",
            "write driver_override",
            "No such device",
        ]);
        assert_eq!(
            error_chain(&e),
            "cannot bind 0000:01:00.0: write driver_override: No such device"
        );
    }

    #[test]
    fn a_source_the_message_already_ends_with_is_left_out() {
        // kube's SerdeError: "Error deserializing response: {0}" over the serde error.
        let e = chain(&[
            "Error deserializing response: missing field `kind` at line 1 column 2",
            "missing field `kind` at line 1 column 2",
        ]);
        assert_eq!(
            error_chain(&e),
            "Error deserializing response: missing field `kind` at line 1 column 2"
        );
        // hyper-util's legacy client error over itself, then the real cause.
        let e = chain(&[
            "list ResourceSlices",
            "client error (SendRequest)",
            "client error (SendRequest)",
            "connection refused",
        ]);
        assert_eq!(
            error_chain(&e),
            "list ResourceSlices: client error (SendRequest): connection refused"
        );
    }
}
