//! Readiness: a driver is ready when kubelet has accepted its registration and
//! this node's ResourceSlices are published, and it has not withdrawn its offer. The serving process keeps a ready file
//! (JSON) while both hold; [`probe`], a readiness probe's check, reads the file and
//! checks that the sockets it names are still there.

use std::path::{Path, PathBuf};
use std::sync::Mutex;

use serde_json::json;
use support::io::{read_small_file, remove_if_present, write_atomic, SmallFileError};

/// The ready file is small JSON; anything bigger is not ours.
const MAX_READY_FILE: u64 = 1 << 20;

#[derive(Default)]
struct Status {
    registered: bool,
    /// The slices of the last successful publish; `None` after a failed one.
    slices: Option<Vec<String>>,
    /// Why the driver offers nothing now ([`crate::Offer::withdrawn`]).
    withdrawn: Option<String>,
}

/// What the serving process knows, and the file it keeps.
pub(crate) struct Readiness {
    /// The ready file, if one is kept.
    file: Option<PathBuf>,
    sockets: Vec<PathBuf>,
    status: Mutex<Status>,
}

impl Readiness {
    /// Readiness kept in `file`, naming the `sockets` kubelet dials. A file left by
    /// an earlier process is removed: this one is not registered yet.
    pub(crate) fn new(file: Option<PathBuf>, sockets: Vec<PathBuf>) -> Self {
        let r = Self {
            file,
            sockets,
            status: Mutex::default(),
        };
        r.clear();
        r
    }

    /// kubelet's answer to our registration.
    pub(crate) fn registered(&self, registered: bool) {
        self.update(|s| s.registered = registered);
    }

    /// The outcome of a publish pass: our slices' names, or `None` when it failed.
    pub(crate) fn published(&self, slices: Option<Vec<String>>) {
        self.update(|s| s.slices = slices);
    }

    /// Whether, and why, the driver withdrew its offer.
    pub(crate) fn withdrawn(&self, why: Option<String>) {
        self.update(|s| s.withdrawn = why);
    }

    /// Not registered, nothing published, no ready file: serving stopped.
    pub(crate) fn reset(&self) {
        *support::lock(&self.status) = Status::default();
        self.clear();
    }

    /// No ready file.
    fn clear(&self) {
        let Some(file) = &self.file else { return };
        if let Err(e) = remove_if_present(file) {
            tracing::warn!(file = %file.display(), error = %e, "cannot remove the ready file");
        }
    }

    fn update(&self, change: impl FnOnce(&mut Status)) {
        let mut seen = support::lock(&self.status);
        let was = is_ready(&seen);
        change(&mut seen);
        let now = is_ready(&seen);
        match (
            &seen.slices,
            seen.registered && seen.withdrawn.is_none(),
            &self.file,
        ) {
            (_, _, None) => {}
            (Some(slices), true, Some(file)) => {
                let doc = json!({
                    "registered": true,
                    "slices": slices,
                    "sockets": self.sockets,
                });
                if let Err(e) = write_atomic(file, format!("{doc}\n").as_bytes()) {
                    tracing::warn!(file = %file.display(), error = %e,
                        "cannot write the ready file");
                }
            }
            _ => self.clear(),
        }
        if now != was {
            tracing::info!(
                ready = now,
                registered = seen.registered,
                published = seen.slices.is_some(),
                withdrawn = seen.withdrawn.as_deref().unwrap_or("no"),
                "readiness changed"
            );
        }
    }
}

fn is_ready(s: &Status) -> bool {
    s.registered && s.slices.is_some() && s.withdrawn.is_none()
}

/// The readiness probe: `Ok(what)` when the ready file says registered and
/// published and every socket it names is still a socket, `Err(why)` otherwise.
pub fn probe(file: &Path) -> Result<String, String> {
    let text = match read_small_file(file, MAX_READY_FILE) {
        Ok(t) => t,
        Err(SmallFileError::Io(e)) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(format!(
                "{} does not exist (the driver writes it once kubelet accepted its \
                    registration and this node's ResourceSlices are published)",
                file.display()
            ))
        }
        Err(e) => return Err(format!("cannot read {}: {e}", file.display())),
    };
    let doc: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| format!("{} is not a ready file: {e}", file.display()))?;
    let slices: Option<Vec<&str>> = doc
        .get("slices")
        .and_then(|v| v.as_array())
        .and_then(|a| a.iter().map(|s| s.as_str()).collect());
    let sockets: Option<Vec<&str>> = doc
        .get("sockets")
        .and_then(|v| v.as_array())
        .and_then(|a| a.iter().map(|s| s.as_str()).collect());
    let (Some(slices), Some(sockets), Some(true)) = (
        slices,
        sockets,
        doc.get("registered").and_then(|v| v.as_bool()),
    ) else {
        return Err(format!(
            "{} is not a ready file (registered, slices and sockets expected)",
            file.display()
        ));
    };
    for socket in &sockets {
        use std::os::unix::fs::FileTypeExt;
        match std::fs::symlink_metadata(socket) {
            Ok(m) if m.file_type().is_socket() => {}
            Ok(_) => return Err(format!("{socket} is not a socket")),
            Err(e) => return Err(format!("{socket}: {e} (kubelet dials it)")),
        }
    }
    Ok(format!(
        "registered with kubelet; {} ResourceSlice(s) published ({})",
        slices.len(),
        slices.join(", ")
    ))
}
