//! What every crate of vfio-sandbox shares below its first layer, and nothing
//! else: one line per error with its causes ([`error_chain`]), a lock that
//! survives a panicked holder ([`lock`]), output that survives a closed pipe
//! ([`output`]), file helpers that name the action and the path ([`io`]), the
//! test bed's named stopping points ([`failpoint`]) and wall-clock time as the
//! API server writes it ([`time`]).
//!
//! It knows nothing of PCI, of the kernel's sysfs or of Kubernetes.

pub mod failpoint;
pub mod io;
pub mod output;
pub mod time;

use std::sync::{Mutex, MutexGuard, PoisonError};

/// Locks `m`, taking the data of a poisoned lock as it is: every value kept behind
/// these locks is whole between statements (a push, a clone), so a thread that
/// panicked while holding one cannot have left it half-changed.
pub fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

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
