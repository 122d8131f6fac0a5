//! Prometheus metrics over HTTP, shared by the node agents.
//!
//! A binary builds its metrics in a [`Registry`] from [`registry`] (every name gets
//! the `vfio_sandbox_` prefix), then, when the operator asks for it with
//! `--metrics-address`, binds a listener and serves the registry's OpenMetrics text
//! at `GET /metrics`:
//!
//! ```no_run
//! # async fn example() -> Result<(), node_agent::metrics::Error> {
//! use std::sync::Arc;
//! use node_agent::metrics::{self, prometheus_client::metrics::counter::Counter};
//!
//! let mut registry = metrics::registry();
//! let binds = Counter::<u64>::default();
//! registry.register("binds", "Devices bound", binds.clone());
//! let address = metrics::parse_address("127.0.0.1:9403")?;
//! let listener = metrics::bind(&address).await?;
//! tokio::spawn(metrics::serve(listener, Arc::new(registry)));
//! binds.inc();
//! # Ok(()) }
//! ```
//!
//! With [`serve_with_readiness`] it also answers `GET /readyz`: 200 with what
//! the check found, or 503 with why not (an HTTP readiness probe's endpoint).
//!
//! The server answers `GET` and `HEAD` on `/metrics`, 404 on any other path and 405
//! (with `Allow`) on other methods. It is exposed to whatever can reach the port, so
//! it bounds what a client can cost: request heads over 16 KiB are refused, a head
//! not complete within 3 s closes the connection, a connection lives at most 5
//! minutes, and at most 64 are open at once. A new client is always accepted: when
//! 64 are open, the oldest one that is not being answered (still sending its head,
//! or idle between requests) is closed to make room, so clients that open
//! connections and send nothing (slowloris) cannot keep a scrape waiting.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::fmt;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr};
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::header::{HeaderValue, ALLOW, CONTENT_TYPE};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tokio::sync::Notify;

pub use prometheus_client;
pub use prometheus_client::registry::Registry;

/// Prefix of every metric name.
pub const PREFIX: &str = "vfio_sandbox";
/// The flag that sets the listen address, for messages.
pub const FLAG: &str = "--metrics-address";
/// Content type of the OpenMetrics text that `prometheus-client` encodes.
pub const CONTENT_TYPE_OPENMETRICS: &str =
    "application/openmetrics-text; version=1.0.0; charset=utf-8";
/// The metrics' path.
pub const PATH: &str = "/metrics";
/// The readiness check's path ([`serve_with_readiness`]).
pub const READY_PATH: &str = "/readyz";

/// A readiness check: `Ok(what)` when ready, `Err(why)` when not. Called for
/// each request of [`READY_PATH`]: keep it cheap.
pub type Readiness = Arc<dyn Fn() -> Result<String, String> + Send + Sync>;

/// Largest request head accepted (hyper answers 431 above it).
const MAX_HEAD: usize = 16 * 1024;
/// Time a client has to send a complete request head (a scraper sends it at once).
const HEAD_TIMEOUT: Duration = Duration::from_secs(3);
/// Longest life of one connection, however busy.
const CONNECTION_LIFETIME: Duration = Duration::from_secs(300);
/// Connections open at once.
const MAX_CONNECTIONS: usize = 64;
/// Pause after a failed accept (out of descriptors), so the loop does not spin.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

/// Errors of the metrics endpoint.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The flag value is not an address to listen on.
    #[error(
        "invalid {FLAG} {value:?}: {reason} (use e.g. 0.0.0.0:9403, [::]:9403, \
            127.0.0.1:9403 or :9403)"
    )]
    ParseAddress {
        /// What was given.
        value: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// Listening failed (port taken, address not on this node, no permission).
    #[error("failed to listen for metrics on {address} ({FLAG})")]
    #[allow(missing_docs)]
    Bind {
        address: String,
        /// The system's answer.
        #[source]
        source: std::io::Error,
    },
}

/// Where the metrics endpoint listens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ListenAddress {
    /// One address and port (`0.0.0.0:9403`, `[::]:9403`, `127.0.0.1:9403`).
    Socket(SocketAddr),
    /// Every address of the node, IPv6 and IPv4 (`:9403`).
    Any(u16),
}

impl fmt::Display for ListenAddress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Socket(a) => write!(f, "{a}"),
            Self::Any(port) => write!(f, ":{port}"),
        }
    }
}

impl FromStr for ListenAddress {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self, Error> {
        parse_address(s)
    }
}

/// Parses a `--metrics-address` value: `HOST:PORT` with a numeric IPv4 host or a
/// bracketed IPv6 one, or `:PORT` for every address. Usable as a clap
/// `value_parser`.
pub fn parse_address(value: &str) -> Result<ListenAddress, Error> {
    let error = |reason| Error::ParseAddress {
        value: value.to_string(),
        reason,
    };
    if let Some(port) = value.strip_prefix(':').filter(|p| !p.contains(':')) {
        return port
            .parse()
            .map(ListenAddress::Any)
            .map_err(|_| error("the port must be a number from 0 to 65535"));
    }
    if let Ok(a) = value.parse() {
        return Ok(ListenAddress::Socket(a));
    }
    Err(match value.rsplit_once(':') {
        None => error("no port"),
        Some((_, port)) if port.parse::<u16>().is_err() => {
            error("the port must be a number from 0 to 65535")
        }
        Some((host, _)) if host.contains(':') && !host.starts_with('[') => {
            error("an IPv6 address must be in brackets")
        }
        Some(_) => error("the host must be a numeric IP address"),
    })
}

/// Starts listening on `address`. [`ListenAddress::Any`] takes the IPv6 wildcard
/// (which Linux shares with IPv4) and falls back to IPv4's on a node without IPv6.
pub async fn bind(address: &ListenAddress) -> Result<TcpListener, Error> {
    let bind_one = |a: SocketAddr| async move {
        TcpListener::bind(a).await.map_err(|source| Error::Bind {
            address: a.to_string(),
            source,
        })
    };
    match *address {
        ListenAddress::Socket(a) => bind_one(a).await,
        ListenAddress::Any(port) => {
            match bind_one(SocketAddr::from((Ipv6Addr::UNSPECIFIED, port))).await {
                Err(Error::Bind { source, .. })
                    if matches!(
                        source.raw_os_error(),
                        Some(nix::libc::EAFNOSUPPORT | nix::libc::EADDRNOTAVAIL)
                    ) =>
                {
                    bind_one(SocketAddr::from((Ipv4Addr::UNSPECIFIED, port))).await
                }
                other => other,
            }
        }
    }
}

/// A registry whose metric names all start with [`PREFIX`].
pub fn registry() -> Registry {
    Registry::with_prefix(PREFIX)
}

/// One open connection, as the accept loop sees it.
#[derive(Default)]
struct Open {
    /// A request of it is being answered (it may not be closed for room).
    answering: AtomicBool,
    /// Told to close, to make room.
    close: Notify,
}

/// The open connections by age (their accept order), and a bell rung when one ends.
#[derive(Default)]
struct Connections {
    open: Mutex<BTreeMap<u64, Arc<Open>>>,
    ended: Notify,
}

impl Connections {
    /// Makes room for one more: closes the oldest connection not being answered,
    /// or, while all are answered, waits for one to end.
    async fn make_room(&self) {
        loop {
            let ended = self.ended.notified();
            {
                let mut open = lock(&self.open);
                if open.len() < MAX_CONNECTIONS {
                    return;
                }
                let idle = open
                    .iter()
                    .find(|(_, c)| !c.answering.load(Ordering::SeqCst))
                    .map(|(id, _)| *id);
                if let Some(conn) = idle.and_then(|id| open.remove(&id)) {
                    conn.close.notify_one();
                    return;
                }
            }
            ended.await;
        }
    }

    fn end(&self, id: u64) {
        lock(&self.open).remove(&id);
        self.ended.notify_one();
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Serves `registry` on `listener` until the task is dropped. Never returns and
/// never panics on client input; a failed connection concerns only its client.
pub async fn serve(listener: TcpListener, registry: Arc<Registry>) {
    serve_with(listener, registry, None).await;
}

/// [`serve`], and `ready` at [`READY_PATH`].
pub async fn serve_with_readiness(
    listener: TcpListener,
    registry: Arc<Registry>,
    ready: Readiness,
) {
    serve_with(listener, registry, Some(ready)).await;
}

async fn serve_with(listener: TcpListener, registry: Arc<Registry>, ready: Option<Readiness>) {
    let connections = Arc::new(Connections::default());
    for id in 0u64.. {
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(e) => {
                tracing::warn!(error = %e, "metrics: accept failed");
                tokio::time::sleep(ACCEPT_BACKOFF).await;
                continue;
            }
        };
        connections.make_room().await;
        let open = Arc::new(Open::default());
        lock(&connections.open).insert(id, open.clone());
        let registry = registry.clone();
        let ready = ready.clone();
        let connections = connections.clone();
        tokio::spawn(async move {
            let answering = open.clone();
            let service = hyper::service::service_fn(move |req: Request<hyper::body::Incoming>| {
                answering.answering.store(true, Ordering::SeqCst);
                let response = respond(req.method(), req.uri().path(), &registry, ready.as_ref());
                answering.answering.store(false, Ordering::SeqCst);
                async move { Ok::<_, Infallible>(response) }
            });
            let connection = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(HEAD_TIMEOUT)
                .max_buf_size(MAX_HEAD)
                .serve_connection(TokioIo::new(stream), service);
            tokio::select! {
                result = tokio::time::timeout(CONNECTION_LIFETIME, connection) => match result {
                    Ok(Ok(())) | Err(_) => {}
                    Ok(Err(e)) => tracing::debug!(error = %e, "metrics: connection failed"),
                },
                () = open.close.notified() => tracing::debug!("metrics: closed an idle \
                    connection to make room"),
            }
            connections.end(id);
        });
    }
}

/// The answer to one request.
fn respond(
    method: &Method,
    path: &str,
    registry: &Registry,
    ready: Option<&Readiness>,
) -> Response<Full<Bytes>> {
    let ready = ready.filter(|_| path == READY_PATH);
    if path != PATH && ready.is_none() {
        return plain(
            StatusCode::NOT_FOUND,
            "not found: metrics are at /metrics\n",
        );
    }
    if method != Method::GET && method != Method::HEAD {
        let mut r = plain(StatusCode::METHOD_NOT_ALLOWED, "use GET\n");
        r.headers_mut()
            .insert(ALLOW, HeaderValue::from_static("GET, HEAD"));
        return r;
    }
    if let Some(check) = ready {
        let (status, text) = match check() {
            Ok(what) => (StatusCode::OK, format!("ready: {what}\n")),
            Err(why) => (
                StatusCode::SERVICE_UNAVAILABLE,
                format!("not ready: {why}\n"),
            ),
        };
        let mut r = Response::new(Full::new(Bytes::from(text)));
        *r.status_mut() = status;
        r.headers_mut().insert(
            CONTENT_TYPE,
            HeaderValue::from_static("text/plain; charset=utf-8"),
        );
        return r;
    }
    let mut text = String::new();
    if let Err(e) = prometheus_client::encoding::text::encode(&mut text, registry) {
        tracing::warn!(error = %e, "metrics: encoding failed");
        return plain(StatusCode::INTERNAL_SERVER_ERROR, "encoding failed\n");
    }
    let mut r = Response::new(Full::new(Bytes::from(text)));
    r.headers_mut().insert(
        CONTENT_TYPE,
        HeaderValue::from_static(CONTENT_TYPE_OPENMETRICS),
    );
    r
}

fn plain(status: StatusCode, body: &'static str) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(Bytes::from_static(body.as_bytes())));
    *r.status_mut() = status;
    r.headers_mut().insert(
        CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    r
}

#[cfg(test)]
mod tests;
