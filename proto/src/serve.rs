//! Serving a gRPC service on a Unix socket the way every kubelet client can reach it.
//!
//! Every server we run goes through [`listen`] and [`spawn`]: the socket's directory
//! is made, a stale socket is replaced (anything else at the path is refused, never
//! deleted), the [`SocketFile`] we bound is told apart from a replacement (so we only
//! ever remove our own socket, and notice when kubelet deleted it), [`DirEvents`]
//! tells at once when a socket file or its directory goes, and each accepted
//! connection goes through [`AuthorityFix`], so requests
//! whose `:authority` is the socket path — what kubelet's plugin watcher and DRA
//! client send — reach the service instead of being reset by the HTTP/2 layer.
//!
//! ```no_run
//! # async fn f(router: tonic::transport::server::Router) -> Result<(), Box<dyn std::error::Error>> {
//! let (listener, file) = kubelet_api::serve::listen(std::path::Path::new("/var/lib/kubelet/plugins/d/dra.sock"))?;
//! let stop = kubelet_api::serve::spawn(listener, router, "DRA service");
//! // ... later
//! let _ = stop.send(());
//! file.remove_if_ours()?;
//! # Ok(()) }
//! ```

use std::ffi::OsString;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};

use inotify::Inotify;
pub use inotify::{Event, EventMask, WatchMask};

use tokio::net::UnixListener;
use tokio::sync::oneshot;

use crate::authority::AuthorityFix;

/// The longest path a Unix socket can be bound at: `sockaddr_un.sun_path` holds
/// 108 bytes on Linux, one of them the terminating NUL (`unix(7)`).
pub const SOCKET_PATH_MAX: usize = 107;

/// A socket path longer than [`SOCKET_PATH_MAX`]: no socket can be bound there.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("the socket path {} is {len} bytes long, and a Unix socket path holds at most \
    {max} bytes (sun_path); choose a shorter directory", path.display(), max = SOCKET_PATH_MAX)]
pub struct SocketPathTooLong {
    /// The path.
    pub path: PathBuf,
    /// Its length in bytes.
    pub len: usize,
}

/// Refuses a path no socket can be bound at, before anything is created there:
/// a server checks each of its socket paths at start (bad configuration).
pub fn check_socket_path(path: &Path) -> Result<(), SocketPathTooLong> {
    let len = path.as_os_str().len();
    if len > SOCKET_PATH_MAX {
        return Err(SocketPathTooLong {
            path: path.to_owned(),
            len,
        });
    }
    Ok(())
}

/// Why a socket could not be served.
#[derive(Debug, thiserror::Error)]
pub enum ListenError {
    /// The path is too long for a socket.
    #[error(transparent)]
    TooLong(#[from] SocketPathTooLong),
    /// The socket's directory could not be made.
    #[error("cannot create directory {}", dir.display())]
    CreateDir {
        /// The directory.
        dir: PathBuf,
        /// What the kernel said.
        #[source]
        source: std::io::Error,
    },
    /// Something other than a socket is at the path.
    #[error("refusing to replace {}: it is {what}, not a socket", path.display())]
    NotASocket {
        /// The path.
        path: PathBuf,
        /// What is there.
        what: &'static str,
    },
    /// The path could not be read, or a stale socket removed, or the socket bound.
    #[error("cannot {action} {}", path.display())]
    Io {
        /// `stat`, `remove stale socket`, `listen on`.
        action: &'static str,
        /// The path.
        path: PathBuf,
        /// What the kernel said.
        #[source]
        source: std::io::Error,
    },
}

fn file_kind(t: &std::fs::FileType) -> &'static str {
    if t.is_dir() {
        "a directory"
    } else if t.is_symlink() {
        "a symbolic link"
    } else if t.is_file() {
        "a regular file"
    } else {
        "a special file"
    }
}

/// A socket file we bound: its path, and the device and inode it had then.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SocketFile {
    path: PathBuf,
    id: (u64, u64),
}

/// What is at a [`SocketFile`]'s path now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SocketState {
    /// The socket we bound.
    Ours,
    /// Nothing (kubelet deletes every plugin socket when it restarts).
    Gone,
    /// Another file: a second instance's socket, say. Never ours to remove.
    Replaced,
}

impl SocketFile {
    /// The socket's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// What is at the path now.
    pub fn state(&self) -> std::io::Result<SocketState> {
        match std::fs::symlink_metadata(&self.path) {
            Ok(m) if (m.dev(), m.ino()) == self.id => Ok(SocketState::Ours),
            Ok(_) => Ok(SocketState::Replaced),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(SocketState::Gone),
            Err(e) => Err(e),
        }
    }

    /// Removes the socket if it is still the one we bound; a replacement is left
    /// alone. Returns whether it removed it.
    pub fn remove_if_ours(&self) -> std::io::Result<bool> {
        if self.state()? != SocketState::Ours {
            return Ok(false);
        }
        match std::fs::remove_file(&self.path) {
            Ok(()) => Ok(true),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
            Err(e) => Err(e),
        }
    }
}

/// Makes the socket's directory, removes a stale socket file and listens.
/// Anything but a socket at the path is refused, never deleted; so is a path too
/// long for a socket, before anything is made.
pub fn listen(path: &Path) -> Result<(UnixListener, SocketFile), ListenError> {
    check_socket_path(path)?;
    let io = |action, source| ListenError::Io {
        action,
        path: path.to_owned(),
        source,
    };
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|source| ListenError::CreateDir {
            dir: dir.to_owned(),
            source,
        })?;
    }
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_socket() => {
            std::fs::remove_file(path).map_err(|e| io("remove stale socket", e))?
        }
        Ok(m) => {
            return Err(ListenError::NotASocket {
                path: path.to_owned(),
                what: file_kind(&m.file_type()),
            })
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(io("stat", e)),
    }
    let listener = UnixListener::bind(path).map_err(|e| io("listen on", e))?;
    let m = std::fs::symlink_metadata(path).map_err(|e| io("stat", e))?;
    let file = SocketFile {
        path: path.to_owned(),
        id: (m.dev(), m.ino()),
    };
    Ok((listener, file))
}

/// Serves `router` on `listener` from a task of its own until the returned sender
/// fires (or is dropped); calls in flight then finish. Each connection goes through
/// [`AuthorityFix`]. `what` names the service in the log if the server fails.
pub fn spawn(
    listener: UnixListener,
    router: tonic::transport::server::Router,
    what: &'static str,
) -> oneshot::Sender<()> {
    let (tx, rx) = oneshot::channel::<()>();
    let incoming = tokio_stream::StreamExt::map(
        tokio_stream::wrappers::UnixListenerStream::new(listener),
        |conn| conn.map(AuthorityFix::new),
    );
    tokio::spawn(async move {
        let stopped = async {
            let _ = rx.await;
        };
        if let Err(e) = router.serve_with_incoming_shutdown(incoming, stopped).await {
            tracing::error!(error = %e, "{what} gRPC server failed");
        }
    });
    tx
}

/// What happens to the files of some directories (kubelet's plugin and
/// device-plugin directories, where our sockets live): one inotify stream.
pub struct DirEvents(
    std::pin::Pin<
        Box<dyn tokio_stream::Stream<Item = std::io::Result<inotify::Event<OsString>>> + Send>,
    >,
);

impl DirEvents {
    /// Watches `dirs` for `mask` (and for the directories themselves going away).
    /// Needs a tokio runtime.
    pub fn open(dirs: &[PathBuf], mask: WatchMask) -> std::io::Result<Self> {
        let inotify = Inotify::init()?;
        for d in dirs {
            inotify
                .watches()
                .add(d, mask | WatchMask::DELETE_SELF | WatchMask::MOVE_SELF)?;
        }
        let stream = inotify.into_event_stream(vec![0u8; 4096])?;
        Ok(Self(Box::pin(stream)))
    }

    /// The next event; `None` when the stream ended or a watched directory went
    /// away (the caller watches again once it is back).
    pub async fn next(&mut self) -> Option<inotify::Event<OsString>> {
        use tokio_stream::StreamExt as _;
        match self.0.next().await {
            Some(Ok(ev))
                if !ev.mask.intersects(
                    EventMask::IGNORED | EventMask::DELETE_SELF | EventMask::MOVE_SELF,
                ) =>
            {
                Some(ev)
            }
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_stale_socket_is_replaced_and_anything_else_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sub/x.sock");
        let first = listen(&path).unwrap();
        drop(first); // the file stays behind, as after a crash
        assert!(path.exists());
        let (_l, second) = listen(&path).expect("a stale socket is replaced");
        assert_eq!(second.state().unwrap(), SocketState::Ours);
        let file = dir.path().join("file");
        std::fs::write(&file, "keep").unwrap();
        let e = listen(&file).unwrap_err();
        assert!(
            e.to_string().contains("it is a regular file, not a socket"),
            "{e}"
        );
        assert_eq!(std::fs::read_to_string(&file).unwrap(), "keep");
    }

    #[tokio::test]
    async fn only_our_own_socket_is_removed() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x.sock");
        let (_old_listener, old) = listen(&path).unwrap();
        let (_new_listener, new) = listen(&path).unwrap();
        assert_eq!(old.state().unwrap(), SocketState::Replaced);
        assert!(
            !old.remove_if_ours().unwrap(),
            "a replacement is left alone"
        );
        assert!(path.exists());
        assert!(new.remove_if_ours().unwrap());
        assert_eq!(new.state().unwrap(), SocketState::Gone);
        assert!(!new.remove_if_ours().unwrap());
    }

    #[tokio::test]
    async fn a_path_too_long_for_a_socket_is_refused_before_anything_is_made() {
        let dir = tempfile::tempdir().unwrap();
        let base = dir.path().as_os_str().len() + 1;
        // Exactly at the limit the kernel binds it; one byte more it cannot.
        let fits = dir.path().join("f".repeat(SOCKET_PATH_MAX - base));
        assert_eq!(fits.as_os_str().len(), SOCKET_PATH_MAX);
        let (_l, file) = listen(&fits).expect("107 bytes fit in sun_path");
        assert_eq!(file.state().unwrap(), SocketState::Ours);
        let sub = dir.path().join("d".repeat(SOCKET_PATH_MAX - base));
        let long = sub.join("x.sock");
        let e = listen(&long).unwrap_err();
        let text = e.to_string();
        assert!(matches!(e, ListenError::TooLong(_)), "{e:?}");
        assert!(text.contains(&long.display().to_string()), "{text}");
        assert!(
            text.contains(&format!("is {} bytes long", SOCKET_PATH_MAX + 7)),
            "{text}"
        );
        assert!(text.contains("at most 107 bytes"), "{text}");
        assert!(
            !sub.exists(),
            "nothing is created for a path that cannot be served"
        );
        assert!(check_socket_path(&fits).is_ok());
    }
}
