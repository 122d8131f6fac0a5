//! Accepting gRPC clients that send a socket path as `:authority`.
//!
//! kubelet's plugin watcher dials a registration socket, and kubelet 1.32's DRA
//! client a driver's `dra.sock`, with grpc-go and no authority override
//! (`pkg/kubelet/pluginmanager/operationexecutor/operation_generator.go`, `dial`;
//! `pkg/kubelet/cm/dra/plugin/plugin.go`), so grpc-go sends the socket path,
//! percent-encoded (`%2Fvar%2Flib%2Fkubelet%2F…`), as the HTTP/2 `:authority` of every
//! call. Clients built on grpc-core (Python grpcio ≥ 1.57, C++) do the same. That is
//! not a valid URI authority, and the HTTP/2 layer under tonic (h2) answers each such
//! request with `RST_STREAM PROTOCOL_ERROR` before any of our code runs; h2 has no
//! setting to relax it. Only kubelet's device manager sets `localhost`.
//!
//! [`AuthorityFix`] sits between the accepted socket and the HTTP/2 server and
//! rewrites what the client sends: every header block is decoded (HPACK, with the
//! client's dynamic table), an invalid `:authority` becomes `localhost`, and the block
//! is re-encoded with literals only, so the server's decoder never depends on the
//! client's dynamic table. Everything else passes through byte for byte, and the
//! server's replies are not touched. Input that is not well-formed HTTP/2 is passed on
//! unchanged from that point, so the server reports the error it would have reported.
//!
//! [`SendAuthority`] is the same rewrite on a client's outgoing bytes, setting the
//! `:authority` of every request to a given value: how a test peer written with
//! tonic (which cannot build such a URI) sends what grpc-go sends.

use std::io;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// The client connection preface, passed through as is.
const PREFACE_LEN: usize = 24;
const FRAME_HEADER_LEN: usize = 9;
const HEADERS: u8 = 0x1;
const CONTINUATION: u8 = 0x9;
const END_STREAM: u8 = 0x1;
const END_HEADERS: u8 = 0x4;
const PADDED: u8 = 0x8;
const PRIORITY: u8 = 0x20;
/// Frames we emit stay within the smallest maximum frame size a peer may set.
const MAX_FRAME: usize = 16_384;
/// A header block larger than this is passed on unchanged (the server refuses
/// header lists far smaller).
const MAX_BLOCK: usize = 1 << 20;
/// Dynamic table size updates larger than this are a decoding error.
const MAX_TABLE: usize = 1 << 16;
/// What an invalid `:authority` becomes, as grpc-go and kubelet send.
const LOCALHOST: &[u8] = b"localhost";

/// A header block waiting for its last CONTINUATION frame.
struct Pending {
    stream: [u8; 4],
    /// END_STREAM and PRIORITY of the HEADERS frame.
    flags: u8,
    priority: Option<[u8; 5]>,
    block: Vec<u8>,
    /// The frames as received, for passing them on if the block cannot be decoded.
    raw: Vec<u8>,
}

/// What becomes of each request's `:authority`.
#[derive(Debug, Clone)]
enum Policy {
    /// One h2 refuses becomes `localhost`; a valid one is kept (our servers).
    InvalidToLocalhost,
    /// Every one becomes this value (a client sending what grpc-go sends).
    Set(Vec<u8>),
}

/// The client-to-server half of the rewrite, as a pure function of the bytes fed in.
pub struct Rewriter {
    policy: Policy,
    preface_left: usize,
    /// Payload bytes of a frame being passed through.
    skip: usize,
    /// An incomplete frame header, or a whole HEADERS/CONTINUATION frame being read.
    frame: Vec<u8>,
    pending: Option<Pending>,
    decoder: loona_hpack::Decoder<'static>,
    /// Gave up on malformed input: copy everything from here on.
    passthrough: bool,
}

impl Default for Rewriter {
    /// Invalid authorities become `localhost`, as our servers need.
    fn default() -> Self {
        Self::with_policy(Policy::InvalidToLocalhost)
    }
}

impl Rewriter {
    /// Sets the `:authority` of every request to `value`.
    pub fn setting(value: &[u8]) -> Self {
        Self::with_policy(Policy::Set(value.to_vec()))
    }

    fn with_policy(policy: Policy) -> Self {
        let mut decoder = loona_hpack::Decoder::new();
        decoder.set_max_allowed_table_size(MAX_TABLE);
        Self {
            policy,
            preface_left: PREFACE_LEN,
            skip: 0,
            frame: Vec::new(),
            pending: None,
            decoder,
            passthrough: false,
        }
    }
}

/// Length and type of the frame whose 9-byte header starts `frame`.
fn frame_header(frame: &[u8]) -> Option<(usize, u8)> {
    let h = frame.get(..FRAME_HEADER_LEN)?;
    let len = usize::from(h[0]) << 16 | usize::from(h[1]) << 8 | usize::from(h[2]);
    Some((len, h[3]))
}

/// True when h2 accepts `value` as an `:authority`.
fn valid_authority(value: &[u8]) -> bool {
    http::uri::Authority::try_from(value).is_ok()
}

/// HPACK integer with an `n`-bit prefix (RFC 7541 §5.1).
fn put_int(out: &mut Vec<u8>, n: u32, first: u8, value: usize) {
    let max = (1usize << n) - 1;
    if value < max {
        out.push(first | value as u8);
        return;
    }
    out.push(first | max as u8);
    let mut rest = value - max;
    while rest >= 128 {
        out.push((rest % 128) as u8 | 0x80);
        rest /= 128;
    }
    out.push(rest as u8);
}

/// A header as "literal without indexing, new name", no Huffman (RFC 7541 §6.2.2).
fn put_literal(out: &mut Vec<u8>, name: &[u8], value: &[u8]) {
    out.push(0x00);
    for s in [name, value] {
        put_int(out, 7, 0, s.len());
        out.extend_from_slice(s);
    }
}

fn put_frame(out: &mut Vec<u8>, kind: u8, flags: u8, stream: [u8; 4], payload: &[&[u8]]) {
    let len: usize = payload.iter().map(|p| p.len()).sum();
    out.extend_from_slice(&[(len >> 16) as u8, (len >> 8) as u8, len as u8, kind, flags]);
    out.extend_from_slice(&stream);
    payload.iter().for_each(|p| out.extend_from_slice(p));
}

impl Rewriter {
    /// Takes the next bytes from the client and appends what the server should read.
    pub fn feed(&mut self, mut input: &[u8], out: &mut Vec<u8>) {
        loop {
            if self.passthrough {
                out.extend_from_slice(input);
                return;
            }
            if self.preface_left > 0 || self.skip > 0 {
                let left = if self.preface_left > 0 {
                    &mut self.preface_left
                } else {
                    &mut self.skip
                };
                let n = (*left).min(input.len());
                out.extend_from_slice(&input[..n]);
                *left -= n;
                input = &input[n..];
            } else if self.frame.len() < FRAME_HEADER_LEN {
                let n = (FRAME_HEADER_LEN - self.frame.len()).min(input.len());
                self.frame.extend_from_slice(&input[..n]);
                input = &input[n..];
            }
            let Some((len, kind)) = frame_header(&self.frame) else {
                if input.is_empty() {
                    return;
                }
                continue;
            };
            if kind != HEADERS && kind != CONTINUATION {
                if self.pending.is_some() {
                    self.give_up(out); // a header block must not be interrupted
                    continue;
                }
                out.append(&mut self.frame);
                self.skip = len;
                continue;
            }
            let buffered = self.pending.as_ref().map_or(0, |p| p.raw.len());
            if buffered + len > MAX_BLOCK {
                self.give_up(out);
                continue;
            }
            let n = (FRAME_HEADER_LEN + len - self.frame.len()).min(input.len());
            self.frame.extend_from_slice(&input[..n]);
            input = &input[n..];
            if self.frame.len() < FRAME_HEADER_LEN + len {
                return; // input is used up
            }
            let frame = std::mem::take(&mut self.frame);
            self.header_frame(frame, out);
        }
    }

    /// Passes on everything held back and copies all further input.
    fn give_up(&mut self, out: &mut Vec<u8>) {
        if let Some(p) = self.pending.take() {
            out.extend_from_slice(&p.raw);
        }
        out.append(&mut self.frame);
        self.passthrough = true;
    }

    /// A whole HEADERS or CONTINUATION frame.
    fn header_frame(&mut self, frame: Vec<u8>, out: &mut Vec<u8>) {
        let (kind, flags) = (frame[3], frame[4]);
        let stream = [frame[5], frame[6], frame[7], frame[8]];
        if kind == HEADERS {
            let Some(pending) = self
                .pending
                .is_none()
                .then(|| headers(flags, stream, &frame))
                .flatten()
            else {
                self.frame = frame;
                self.give_up(out);
                return;
            };
            self.pending = Some(pending);
        } else {
            match self.pending.as_mut().filter(|p| p.stream == stream) {
                Some(p) => {
                    p.block.extend_from_slice(&frame[FRAME_HEADER_LEN..]);
                    p.raw.extend_from_slice(&frame);
                }
                None => {
                    self.frame = frame;
                    self.give_up(out);
                    return;
                }
            }
        }
        if flags & END_HEADERS != 0 {
            if let Some(p) = self.pending.take() {
                self.rewrite(p, out);
            }
        }
    }

    /// Decodes a complete header block and emits it re-encoded.
    fn rewrite(&mut self, p: Pending, out: &mut Vec<u8>) {
        let mut block = Vec::with_capacity(p.block.len() * 2);
        let policy = &self.policy;
        let decoded = self.decoder.decode_with_cb(&p.block, |name, value| {
            let new = match policy {
                _ if &*name != b":authority" => None,
                Policy::InvalidToLocalhost if !valid_authority(&value) => Some(LOCALHOST),
                Policy::InvalidToLocalhost => None,
                Policy::Set(v) => Some(v.as_slice()),
            };
            match new {
                Some(new) => {
                    tracing::trace!(
                        from = %String::from_utf8_lossy(&value),
                        to = %String::from_utf8_lossy(new),
                        "rewrote :authority"
                    );
                    put_literal(&mut block, &name, new);
                }
                None => put_literal(&mut block, &name, &value),
            }
        });
        if decoded.is_err() {
            out.extend_from_slice(&p.raw);
            self.passthrough = true;
            return;
        }
        let priority: &[u8] = match &p.priority {
            Some(bytes) => bytes,
            None => &[],
        };
        let first = (MAX_FRAME - priority.len()).min(block.len());
        let (head, mut rest) = block.split_at(first);
        let end = if rest.is_empty() { END_HEADERS } else { 0 };
        put_frame(out, HEADERS, p.flags | end, p.stream, &[priority, head]);
        while !rest.is_empty() {
            let (chunk, tail) = rest.split_at(MAX_FRAME.min(rest.len()));
            rest = tail;
            let end = if rest.is_empty() { END_HEADERS } else { 0 };
            put_frame(out, CONTINUATION, end, p.stream, &[chunk]);
        }
    }
}

/// The header block fragment of a HEADERS frame, without padding and priority;
/// `None` when the frame is malformed.
fn headers(flags: u8, stream: [u8; 4], frame: &[u8]) -> Option<Pending> {
    let mut payload = frame.get(FRAME_HEADER_LEN..)?;
    let mut pad = 0;
    if flags & PADDED != 0 {
        pad = usize::from(*payload.first()?);
        payload = payload.get(1..)?;
    }
    let priority = if flags & PRIORITY != 0 {
        let p: [u8; 5] = payload.get(..5)?.try_into().ok()?;
        payload = payload.get(5..)?;
        Some(p)
    } else {
        None
    };
    let fragment = payload.get(..payload.len().checked_sub(pad)?)?;
    Some(Pending {
        stream,
        flags: flags & (END_STREAM | PRIORITY),
        priority,
        block: fragment.to_vec(),
        raw: frame.to_vec(),
    })
}

/// An accepted connection whose client-sent header blocks go through a [`Rewriter`].
pub struct AuthorityFix<S> {
    inner: S,
    rewriter: Rewriter,
    /// Rewritten bytes not yet read by the server, from `pos` on.
    out: Vec<u8>,
    pos: usize,
    scratch: Box<[u8]>,
}

impl<S> AuthorityFix<S> {
    /// Wraps an accepted connection.
    pub fn new(inner: S) -> Self {
        Self {
            inner,
            rewriter: Rewriter::default(),
            out: Vec::new(),
            pos: 0,
            scratch: vec![0; MAX_FRAME].into_boxed_slice(),
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for AuthorityFix<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        loop {
            if this.pos < this.out.len() {
                let n = buf.remaining().min(this.out.len() - this.pos);
                buf.put_slice(&this.out[this.pos..this.pos + n]);
                this.pos += n;
                if this.pos == this.out.len() {
                    this.out.clear();
                    this.pos = 0;
                }
                return Poll::Ready(Ok(()));
            }
            let mut read = ReadBuf::new(&mut this.scratch);
            ready!(Pin::new(&mut this.inner).poll_read(cx, &mut read))?;
            if read.filled().is_empty() {
                return Poll::Ready(Ok(())); // end of stream
            }
            this.rewriter.feed(read.filled(), &mut this.out);
        }
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for AuthorityFix<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

impl<S: tonic::transport::server::Connected> tonic::transport::server::Connected
    for AuthorityFix<S>
{
    type ConnectInfo = S::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.inner.connect_info()
    }
}

/// A client connection whose outgoing header blocks get a fixed `:authority`
/// ([`Rewriter::setting`]); replies pass through untouched.
pub struct SendAuthority<S> {
    inner: S,
    rewriter: Rewriter,
    /// Rewritten bytes not yet written to `inner`, from `pos` on.
    out: Vec<u8>,
    pos: usize,
}

impl<S> SendAuthority<S> {
    /// Wraps a connection so every request carries `authority`.
    pub fn new(inner: S, authority: &str) -> Self {
        Self {
            inner,
            rewriter: Rewriter::setting(authority.as_bytes()),
            out: Vec::new(),
            pos: 0,
        }
    }
}

impl<S: AsyncWrite + Unpin> SendAuthority<S> {
    /// Writes out everything rewritten so far.
    fn poll_drain(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while self.pos < self.out.len() {
            let n = ready!(Pin::new(&mut self.inner).poll_write(cx, &self.out[self.pos..]))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            self.pos += n;
        }
        self.out.clear();
        self.pos = 0;
        Poll::Ready(Ok(()))
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for SendAuthority<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for SendAuthority<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        ready!(this.poll_drain(cx))?;
        this.rewriter.feed(buf, &mut this.out);
        // Taken whole; what the socket does not take now goes at the next call.
        if let Poll::Ready(Err(e)) = this.poll_drain(cx) {
            return Poll::Ready(Err(e));
        }
        Poll::Ready(Ok(buf.len()))
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        ready!(this.poll_drain(cx))?;
        Pin::new(&mut this.inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        ready!(this.poll_drain(cx))?;
        Pin::new(&mut this.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests;
