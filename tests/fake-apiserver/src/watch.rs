//! Watches of a collection (`GET <collection>?watch=true`), served the way
//! kube-apiserver serves them from its watch cache.
//!
//! Every change of a served object is kept, per resource, in a bounded
//! [`History`] (the cyclic buffer of
//! staging/src/k8s.io/apiserver/pkg/storage/cacher/watch_cache.go), and handed
//! at once to every open watch of that resource (`dispatchEvent` in
//! .../storage/cacher/cacher.go; nothing polls). A watch starts from a
//! resourceVersion, replays what it missed from the history (or the current
//! state), then writes each change that concerns it as one JSON watch event per
//! line to a chunked body. A client that goes away closes the body's channel,
//! which ends the task serving it.
//!
//! One difference: the cacher gives each watch a bounded buffer and drops a
//! watch that lets it fill; here the buffer is unbounded.

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use hyper::body::{Bytes, Frame};
use hyper::StatusCode;
use serde_json::{json, Value};
use tokio::sync::mpsc;
use tokio::time::Instant;

use crate::history::{Change, OpenWatch};
use crate::query;
use crate::rest::{status, Answer, Kind, Objects, Route, Selectors};

/// How long a watch without `timeoutSeconds` lasts: the server's
/// `--min-request-timeout` default (staging/src/k8s.io/apiserver/pkg/endpoints/
/// handlers/get.go stretches it by a random factor of 1 to 2; we take 1).
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(1800);

/// How long a watch from a resourceVersion the store has not reached yet waits
/// for it (`blockTimeout` in .../storage/cacher/watch_cache.go).
const FUTURE_WAIT: Duration = Duration::from_secs(3);

/// `ParseResourceVersion` of staging/src/k8s.io/apiserver/pkg/storage/
/// api_object_versioner.go: empty and `0` are 0, anything else must be a
/// number. The error is the field error it wraps, as the server words it.
pub(crate) fn parse_resource_version(rv: &str) -> Result<u64, String> {
    if rv.is_empty() {
        return Ok(0);
    }
    rv.parse::<u64>().map_err(|e| {
        let why = match e.kind() {
            std::num::IntErrorKind::PosOverflow => "value out of range",
            _ => "invalid syntax",
        };
        format!(
            "resourceVersion: Invalid value: \"{rv}\": strconv.ParseUint: parsing \"{rv}\": {why}"
        )
    })
}

/// A watch being served: what it selects and how far it has got.
#[derive(Debug)]
pub(crate) struct Watcher {
    kind: &'static Kind,
    namespace: Option<String>,
    selectors: Selectors,
    /// Every change up to here has been sent (or did not match).
    last: u64,
    bookmarks: bool,
    period: Duration,
    deadline: Instant,
    /// The changes of its resource, from the moment it started.
    changes: mpsc::UnboundedReceiver<Arc<Change>>,
    rx: tokio::sync::watch::Receiver<u64>,
    /// Where a watch from the future must get to before it starts.
    wait_for: Option<u64>,
    /// Whether it replays the current state once it got there.
    initial: bool,
    /// What it sends first: the replay, or the changes it resumes after.
    first: Vec<Bytes>,
    /// Whether a bookmark marked `k8s.io/initial-events-end` follows that
    /// replay (`sendInitialEvents=true`).
    initial_end_bookmark: bool,
    /// An ERROR event to send instead of anything else, closing the watch.
    error: Option<Value>,
}

fn invalid_list_options(errors: &[String]) -> Answer {
    // errors.NewInvalid(GroupKind{"meta.k8s.io", "ListOptions"}, "", errs)
    let list = match errors {
        [one] => one.clone(),
        many => format!("[{}]", many.join(", ")),
    };
    status(
        StatusCode::UNPROCESSABLE_ENTITY,
        "Invalid",
        &format!("ListOptions.meta.k8s.io \"\" is invalid: {list}"),
    )
}

fn param<'p>(params: &'p [(String, String)], key: &str) -> Option<&'p str> {
    params
        .iter()
        .find(|(k, _)| k == key)
        .map(|(_, v)| v.as_str())
}

/// The watch options of a query that are not about where it starts.
struct Options {
    /// How long the watch lasts.
    lasts: Duration,
    bookmarks: bool,
    send_initial: Option<bool>,
}

/// Reads the watch options as the handler decodes and validates them.
fn options(params: &[(String, String)]) -> Result<Options, Answer> {
    // The query decodes into ListOptions first: a timeout that is not an
    // integer is a 400 (handlers/get.go, ListResource).
    let timeout = match param(params, "timeoutSeconds") {
        None | Some("") => None,
        Some(t) => Some(t.parse::<i64>().map_err(|_| {
            status(
                StatusCode::BAD_REQUEST,
                "BadRequest",
                &format!("timeoutSeconds: strconv.ParseInt: parsing \"{t}\": invalid syntax"),
            )
        })?),
    };
    let bookmarks = query::flag(params, "allowWatchBookmarks");
    let send_initial = param(params, "sendInitialEvents").map(query::truthy);
    let version_match = param(params, "resourceVersionMatch").filter(|m| !m.is_empty());
    // validateWatchOptions in staging/src/k8s.io/apimachinery/pkg/apis/meta/
    // internalversion/validation/validation.go (WatchList is on by default).
    let mut invalid = Vec::new();
    if send_initial.is_some() && version_match != Some("NotOlderThan") {
        invalid.push(
            "resourceVersionMatch: Forbidden: sendInitialEvents requires setting \
                resourceVersionMatch to NotOlderThan"
                .to_owned(),
        );
    }
    if let Some(m) = version_match {
        if send_initial.is_none() {
            invalid.push(
                "resourceVersionMatch: Forbidden: resourceVersionMatch is \
                    forbidden for watch unless sendInitialEvents is provided"
                    .to_owned(),
            );
        }
        if m != "NotOlderThan" {
            invalid.push(format!(
                "resourceVersionMatch: Unsupported value: \"{m}\": supported \
                    values: \"NotOlderThan\""
            ));
        }
        if param(params, "continue").is_some_and(|c| !c.is_empty()) {
            invalid.push(
                "resourceVersionMatch: Forbidden: resourceVersionMatch is \
                    forbidden when continue is provided"
                    .to_owned(),
            );
        }
    }
    if !invalid.is_empty() {
        return Err(invalid_list_options(&invalid));
    }
    let lasts = match timeout {
        None | Some(0) => DEFAULT_TIMEOUT,
        // A negative timeout ends the watch at once, as a negative Go timer does.
        Some(t) => Duration::from_secs(t.max(0).unsigned_abs()),
    };
    Ok(Options {
        lasts,
        bookmarks,
        send_initial,
    })
}

/// Checks a watch request and fixes where it starts, under the store's lock so
/// that no change slips between the replay and the live events. An `Err` is
/// the whole (non-200) answer.
pub(crate) fn start(
    objects: &mut Objects,
    route: &Route,
    params: &[(String, String)],
) -> Result<Watcher, Answer> {
    let Options {
        lasts,
        bookmarks,
        send_initial,
    } = options(params)?;
    let selectors = Objects::selectors(route, params)?;
    // Cacher.Watch (storage/cacher/cacher.go) returns the versioner's error
    // as it is; not being an API status, the handler answers it as a 500.
    let rv_text = param(params, "resourceVersion").unwrap_or("");
    let rv = parse_resource_version(rv_text).map_err(|e| {
        let (code, mut body) = status(StatusCode::INTERNAL_SERVER_ERROR, "", &e);
        // StatusReasonUnknown is empty, and omitted.
        if let Some(o) = body.as_object_mut() {
            o.remove("reason");
        }
        (code, body)
    })?;
    let now = objects.resource_version;
    let deadline = later(Instant::now(), lasts);
    let (tx, changes) = mpsc::unbounded_channel();
    objects
        .history
        .subscribers
        .push((route.kind.resource(), tx));
    let mut w = Watcher {
        kind: route.kind,
        namespace: route.namespace.clone(),
        selectors,
        last: rv,
        bookmarks,
        period: objects.history.bookmark_period,
        deadline,
        changes,
        rx: objects.history.notify.subscribe(),
        wait_for: None,
        initial: false,
        first: Vec::new(),
        initial_end_bookmark: false,
        error: None,
    };
    // getAllEventsSinceLocked in storage/cacher/watch_cache.go and
    // watch_cache_history.go: resourceVersion 0 (or none) replays the current
    // state as ADDED events unless sendInitialEvents says otherwise;
    // sendInitialEvents=true replays it from any resourceVersion, then marks
    // the end with a bookmark.
    match (rv, send_initial) {
        (_, Some(true)) => {
            w.initial = true;
            // Only a watch that allows bookmarks gets any (kube-rs insists on
            // both together; the server does not).
            w.initial_end_bookmark = bookmarks;
            w.wait_for = (rv > now).then_some(rv);
        }
        (0, None) => w.initial = true,
        (0, Some(false)) => w.last = now,
        (rv, _) if rv > now => w.wait_for = Some(rv),
        (rv, _) => {
            let window = objects.history.windows.get(&route.kind.resource());
            let oldest = window
                .filter(|win| win.dropped > 0)
                .and_then(|win| win.changes.front())
                .map(|c| c.rv);
            if let Some(oldest) = oldest.filter(|o| rv < o - 1) {
                w.error = Some(expired(rv, oldest - 1));
            } else if let Some(window) = window {
                for c in window.changes.iter().filter(|c| c.rv > rv) {
                    w.first.extend(w.convert(c));
                }
                w.last = now;
            }
        }
    }
    if w.initial && w.wait_for.is_none() {
        w.first = w.replay(objects);
    }
    Ok(w)
}

/// `errors.NewResourceExpired` (staging/src/k8s.io/apimachinery/pkg/api/errors/
/// errors.go) with the watch cache's message.
fn expired(rv: u64, oldest: u64) -> Value {
    status(
        StatusCode::GONE,
        "Expired",
        &format!("too old resource version: {rv} ({oldest})"),
    )
    .1
}

/// `storage.NewTooLargeResourceVersionError` (staging/src/k8s.io/apiserver/pkg/
/// storage/errors.go).
fn too_large(rv: u64, current: u64) -> Value {
    let mut s = status(
        StatusCode::GATEWAY_TIMEOUT,
        "Timeout",
        &format!("Too large resource version: {rv}, current: {current}"),
    )
    .1;
    s["details"] = json!({
        "causes": [{"reason": "ResourceVersionTooLarge", "message": "Too large resource version"}],
        "retryAfterSeconds": 1,
    });
    s
}

fn line(kind: &str, object: Value) -> Bytes {
    let mut out = json!({"type": kind, "object": object})
        .to_string()
        .into_bytes();
    out.push(b'\n');
    Bytes::from(out)
}

/// `from + d`, or a year on for a `d` too long to add (a watch that long is
/// one that never times out).
fn later(from: Instant, d: Duration) -> Instant {
    from.checked_add(d.min(Duration::from_secs(365 * 86_400)))
        .unwrap_or(from)
}

/// The next bookmark: a period from now, but 2 s before the deadline at the
/// latest, and none once that is past (`nextBookmarkTime` in
/// storage/cacher/cache_watcher.go).
fn next_bookmark(now: Instant, period: Duration, deadline: Instant) -> Option<Instant> {
    let pre_timeout = deadline.checked_sub(Duration::from_secs(2))?;
    let at = later(now, period).min(pre_timeout);
    (at > now).then_some(at)
}

impl Watcher {
    /// The object as a watch event carries it: typed like a GET.
    fn typed(&self, mut object: Value) -> Value {
        if let Some(o) = object.as_object_mut() {
            o.entry("apiVersion")
                .or_insert_with(|| self.kind.group_version.into());
            o.entry("kind").or_insert_with(|| self.kind.kind.into());
        }
        object
    }

    /// `convertToWatchEvent` in storage/cacher/cache_watcher.go: the event a
    /// change makes for this watch, judged on the object before and after.
    fn convert(&self, c: &Change) -> Option<Bytes> {
        if self.namespace.is_some() && c.namespace != self.namespace {
            return None;
        }
        let cur = c.object.as_ref().filter(|o| self.selectors.matches(o));
        let old = c.prev.as_ref().filter(|o| self.selectors.matches(o));
        match (cur, old) {
            (Some(o), None) => Some(line("ADDED", self.typed(o.clone()))),
            (Some(o), Some(_)) => Some(line("MODIFIED", self.typed(o.clone()))),
            // The object as it was, with the resourceVersion of the change that
            // removed it or took it out of the selection.
            (None, Some(p)) => {
                let mut p = p.clone();
                if let Some(m) = p.get_mut("metadata").and_then(Value::as_object_mut) {
                    m.insert("resourceVersion".into(), c.rv.to_string().into());
                }
                Some(line("DELETED", self.typed(p)))
            }
            (None, None) => None,
        }
    }

    fn bookmark(&self, initial_end: bool) -> Bytes {
        let mut metadata = json!({"resourceVersion": self.last.to_string()});
        if initial_end {
            metadata["annotations"] = json!({"k8s.io/initial-events-end": "true"});
        }
        line(
            "BOOKMARK",
            json!({
                "kind": self.kind.kind,
                "apiVersion": self.kind.group_version,
                "metadata": metadata,
            }),
        )
    }

    /// The current state as ADDED events (`newCacheIntervalFromStore`), and
    /// the bookmark that ends it when asked for.
    fn replay(&mut self, objects: &Objects) -> Vec<Bytes> {
        self.last = objects.resource_version;
        let mut out: Vec<Bytes> = objects
            .map
            .iter()
            .filter(|(path, o)| {
                Route::parse(path).is_some_and(|r| {
                    std::ptr::eq(r.kind, self.kind)
                        && r.name.is_some()
                        && !r.status
                        && (self.namespace.is_none() || r.namespace == self.namespace)
                }) && self.selectors.matches(o)
            })
            .map(|(_, o)| line("ADDED", self.typed(o.clone())))
            .collect();
        if self.initial_end_bookmark {
            out.push(self.bookmark(true));
        }
        out
    }

    /// Sends the event of a change it has not seen yet; false when the client
    /// went away.
    async fn forward(&mut self, c: &Change, tx: &mpsc::Sender<Bytes>) -> bool {
        if c.rv <= self.last {
            return true;
        }
        self.last = c.rv;
        match self.convert(c) {
            Some(l) => tx.send(l).await.is_ok(),
            None => true,
        }
    }

    /// Serves the watch into `tx` until its deadline, until the server ends
    /// it, or until the client goes away.
    pub async fn run(
        mut self,
        store: Arc<Mutex<crate::Store>>,
        tx: mpsc::Sender<Bytes>,
        _open: OpenWatch,
    ) {
        let deadline = self.deadline;
        let done = tx.clone();
        tokio::select! {
            () = self.serve(&store, &tx) => {}
            () = done.closed() => {}
            () = tokio::time::sleep_until(deadline) => {}
        }
    }

    async fn serve(&mut self, store: &Mutex<crate::Store>, tx: &mpsc::Sender<Bytes>) {
        if let Some(target) = self.wait_for {
            let reached = matches!(
                tokio::time::timeout(FUTURE_WAIT, self.rx.wait_for(|rv| *rv >= target)).await,
                Ok(Ok(_))
            );
            if !reached {
                let current = crate::lock(store).objects.resource_version;
                let _ = tx.send(line("ERROR", too_large(target, current))).await;
                return;
            }
            if self.initial {
                let s = crate::lock(store);
                self.first = self.replay(&s.objects);
            }
        }
        if let Some(e) = self.error.take() {
            let _ = tx.send(line("ERROR", e)).await;
            return;
        }
        for l in std::mem::take(&mut self.first) {
            if tx.send(l).await.is_err() {
                return;
            }
        }
        let mut next_bm = self
            .bookmarks
            .then(|| next_bookmark(Instant::now(), self.period, self.deadline))
            .flatten();
        loop {
            tokio::select! {
                c = self.changes.recv() => {
                    // None: the server ended every watch.
                    let Some(c) = c else { return };
                    if !self.forward(&c, tx).await {
                        return;
                    }
                }
                () = sleep_until_some(next_bm) => {
                    // Every change up to the store's resourceVersion is in
                    // the queue by now (both happen under the store's lock):
                    // send them, then mark the point reached.
                    let now = crate::lock(store).objects.resource_version;
                    while let Ok(c) = self.changes.try_recv() {
                        if !self.forward(&c, tx).await {
                            return;
                        }
                    }
                    self.last = self.last.max(now);
                    if tx.send(self.bookmark(false)).await.is_err() {
                        return;
                    }
                    next_bm = next_bookmark(Instant::now(), self.period, self.deadline);
                }
            }
        }
    }
}

async fn sleep_until_some(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// A response body fed by a channel: each message is one chunk, and the body
/// ends (with the chunked terminator) when every sender is gone.
#[derive(Debug)]
pub(crate) struct ChannelBody(pub mpsc::Receiver<Bytes>);

impl hyper::body::Body for ChannelBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        self.0.poll_recv(cx).map(|b| b.map(|b| Ok(Frame::data(b))))
    }
}

#[cfg(test)]
mod tests;
