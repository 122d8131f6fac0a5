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
                    tracing::trace!(from = %String::from_utf8_lossy(&value), to = %String::from_utf8_lossy(new), "rewrote :authority");
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
mod tests {
    use super::*;

    const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
    const STREAM1: [u8; 4] = [0, 0, 0, 1];
    const STREAM3: [u8; 4] = [0, 0, 0, 3];

    fn string(s: &str) -> Vec<u8> {
        let mut v = Vec::new();
        put_int(&mut v, 7, 0, s.len());
        v.extend_from_slice(s.as_bytes());
        v
    }

    /// What grpc-core sends first: static-table fields, and :path and :authority as
    /// literals added to the dynamic table (indexed name).
    fn first_block(authority: &str) -> Vec<u8> {
        let mut b = vec![0x83, 0x86]; // :method POST, :scheme http
        b.push(0x44); // :path, incremental indexing
        b.extend(string("/v1beta1.DevicePlugin/Allocate"));
        b.push(0x41); // :authority, incremental indexing
        b.extend(string(authority));
        put_literal(&mut b, b"te", b"trailers");
        b
    }

    /// The next request reuses both through the dynamic table.
    fn second_block() -> Vec<u8> {
        vec![0x83, 0x86, 0x80 | 63, 0x80 | 62] // :path (63), :authority (62)
    }

    fn frame(kind: u8, flags: u8, stream: [u8; 4], payload: &[u8]) -> Vec<u8> {
        let mut v = Vec::new();
        put_frame(&mut v, kind, flags, stream, &[payload]);
        v
    }

    /// Feeds `input` in pieces of `step` bytes.
    fn rewrite(input: &[u8], step: usize) -> Vec<u8> {
        let mut r = Rewriter::default();
        let mut out = Vec::new();
        input.chunks(step).for_each(|c| r.feed(c, &mut out));
        out
    }

    /// A frame as seen by the server: type, flags, decoded headers, payload.
    type Seen = (u8, u8, Vec<(String, String)>, Vec<u8>);

    /// The frames in `bytes` after the preface, with header blocks decoded.
    fn frames(bytes: &[u8]) -> Vec<Seen> {
        assert_eq!(&bytes[..PREFACE_LEN], PREFACE);
        let mut rest = &bytes[PREFACE_LEN..];
        let mut decoder = loona_hpack::Decoder::new();
        let mut got = Vec::new();
        while !rest.is_empty() {
            let (len, kind) = frame_header(rest).unwrap();
            let payload = &rest[FRAME_HEADER_LEN..FRAME_HEADER_LEN + len];
            let headers = if kind == HEADERS {
                decoder
                    .decode(payload)
                    .unwrap()
                    .into_iter()
                    .map(|(n, v)| (String::from_utf8(n).unwrap(), String::from_utf8(v).unwrap()))
                    .collect()
            } else {
                Vec::new()
            };
            got.push((kind, rest[4], headers, payload.to_vec()));
            rest = &rest[FRAME_HEADER_LEN + len..];
        }
        got
    }

    fn input(authority: &str) -> Vec<u8> {
        let mut v = PREFACE.to_vec();
        v.extend(frame(0x4, 0, [0; 4], &[0, 3, 0, 0, 0, 100])); // SETTINGS
        v.extend(frame(
            HEADERS,
            END_HEADERS,
            STREAM1,
            &first_block(authority),
        ));
        v.extend(frame(0x0, END_STREAM, STREAM1, b"\0\0\0\0\x02hi")); // DATA
        v.extend(frame(
            HEADERS,
            END_HEADERS | END_STREAM,
            STREAM3,
            &second_block(),
        ));
        v
    }

    #[test]
    fn a_percent_encoded_socket_path_becomes_localhost_in_every_request() {
        for step in [1, 7, 4096] {
            let got = frames(&rewrite(&input("%2Ftmp%2Fplugin.sock"), step));
            let kinds: Vec<(u8, u8)> = got.iter().map(|f| (f.0, f.1)).collect();
            assert_eq!(
                kinds,
                [
                    (0x4, 0),
                    (HEADERS, END_HEADERS),
                    (0x0, END_STREAM),
                    (HEADERS, END_HEADERS | END_STREAM)
                ]
            );
            let want = |extra: bool| {
                let mut h = vec![
                    (":method", "POST"),
                    (":scheme", "http"),
                    (":path", "/v1beta1.DevicePlugin/Allocate"),
                    (":authority", "localhost"),
                ];
                if extra {
                    h.push(("te", "trailers"));
                }
                h.into_iter()
                    .map(|(n, v)| (n.to_string(), v.to_string()))
                    .collect::<Vec<_>>()
            };
            assert_eq!(got[1].2, want(true), "step {step}");
            assert_eq!(
                got[3].2,
                want(false),
                "through the dynamic table, step {step}"
            );
            assert_eq!(got[0].3, [0, 3, 0, 0, 0, 100]);
            assert_eq!(got[2].3, b"\0\0\0\0\x02hi");
        }
    }

    #[test]
    fn a_valid_authority_is_kept() {
        let got = frames(&rewrite(&input("localhost:50051"), 4096));
        assert!(got[1]
            .2
            .contains(&(":authority".into(), "localhost:50051".into())));
        assert!(got[3]
            .2
            .contains(&(":authority".into(), "localhost:50051".into())));
        let got = frames(&rewrite(
            &input("/var/lib/kubelet/device-plugins/x.sock"),
            4096,
        ));
        assert!(got[1]
            .2
            .contains(&(":authority".into(), "localhost".into())));
    }

    #[test]
    fn a_setting_rewriter_sends_the_given_authority_in_every_request() {
        let mut r = Rewriter::setting(b"%2Fvar%2Flib%2Fkubelet%2Fx.sock");
        let mut out = Vec::new();
        r.feed(&input("localhost"), &mut out);
        let got = frames(&out);
        for i in [1, 3] {
            assert!(
                got[i].2.contains(&(
                    ":authority".into(),
                    "%2Fvar%2Flib%2Fkubelet%2Fx.sock".into()
                )),
                "request {i}: {:?}",
                got[i].2
            );
        }
        assert_eq!(got[2].3, b"\0\0\0\0\x02hi");
    }

    #[test]
    fn padding_priority_and_continuation_frames_are_reassembled() {
        let block = first_block("%2Fa.sock");
        let (a, b) = block.split_at(10);
        let mut payload = vec![3]; // pad length
        payload.extend([0x80, 0, 0, 0, 16]); // priority: exclusive, on stream 0, weight
        payload.extend(a);
        payload.extend([0, 0, 0]);
        let mut v = PREFACE.to_vec();
        v.extend(frame(
            HEADERS,
            PADDED | PRIORITY | END_STREAM,
            STREAM1,
            &payload,
        ));
        v.extend(frame(CONTINUATION, END_HEADERS, STREAM1, b));
        let out = rewrite(&v, 5);
        let one = &out[PREFACE_LEN..];
        let (len, kind) = frame_header(one).unwrap();
        assert_eq!(FRAME_HEADER_LEN + len, one.len(), "one frame");
        assert_eq!(
            (kind, one[4]),
            (HEADERS, PRIORITY | END_STREAM | END_HEADERS)
        );
        let payload = &one[FRAME_HEADER_LEN..];
        assert_eq!(&payload[..5], [0x80, 0, 0, 0, 16]);
        let h = loona_hpack::Decoder::new().decode(&payload[5..]).unwrap();
        assert!(h.contains(&(b":authority".to_vec(), b"localhost".to_vec())));
    }

    #[test]
    fn a_large_header_block_is_split_into_continuation_frames() {
        let mut block = first_block("%2Fa.sock");
        put_literal(&mut block, b"x-big", &[b'a'; 40_000]);
        let mut v = PREFACE.to_vec();
        v.extend(frame(HEADERS, END_HEADERS, STREAM1, &block));
        let out = rewrite(&v, 4096);
        let mut rest = &out[PREFACE_LEN..];
        let mut kinds = Vec::new();
        let mut joined = Vec::new();
        while !rest.is_empty() {
            let (len, kind) = frame_header(rest).unwrap();
            assert!(len <= MAX_FRAME);
            kinds.push((kind, rest[4]));
            joined.extend_from_slice(&rest[FRAME_HEADER_LEN..FRAME_HEADER_LEN + len]);
            rest = &rest[FRAME_HEADER_LEN + len..];
        }
        assert_eq!(
            kinds,
            [(HEADERS, 0), (CONTINUATION, 0), (CONTINUATION, END_HEADERS)]
        );
        let h = loona_hpack::Decoder::new().decode(&joined).unwrap();
        assert!(h.contains(&(b":authority".to_vec(), b"localhost".to_vec())));
        assert!(h.contains(&(b"x-big".to_vec(), vec![b'a'; 40_000])));
    }

    #[test]
    fn malformed_input_is_passed_on_unchanged() {
        let mut bad_hpack = PREFACE.to_vec();
        bad_hpack.extend(frame(
            HEADERS,
            END_HEADERS,
            STREAM1,
            &[0xff, 0xff, 0xff, 0xff, 0xff, 0xff],
        ));
        bad_hpack.extend(frame(0x0, 0, STREAM1, b"after"));
        let mut interrupted = PREFACE.to_vec();
        interrupted.extend(frame(HEADERS, 0, STREAM1, &first_block("%2Fa")));
        interrupted.extend(frame(0x0, 0, STREAM1, b"data inside a header block"));
        let mut bad_padding = PREFACE.to_vec();
        bad_padding.extend(frame(HEADERS, PADDED | END_HEADERS, STREAM1, &[200, 0x83]));
        let mut stray = PREFACE.to_vec();
        stray.extend(frame(CONTINUATION, END_HEADERS, STREAM1, &[0x83]));
        let mut huge = PREFACE.to_vec();
        huge.extend(frame(HEADERS, 0, STREAM1, &vec![0; MAX_FRAME]));
        for _ in 0..(MAX_BLOCK / MAX_FRAME) {
            huge.extend(frame(CONTINUATION, 0, STREAM1, &vec![0; MAX_FRAME]));
        }
        for (name, input) in [
            ("bad hpack", bad_hpack),
            ("interrupted", interrupted),
            ("bad padding", bad_padding),
            ("stray continuation", stray),
            ("huge", huge),
        ] {
            for step in [1, 1000, usize::MAX] {
                if step == 1 && name == "huge" {
                    continue; // a million single-byte feeds prove nothing more
                }
                assert!(
                    rewrite(&input, step.min(input.len())) == input,
                    "{name}, step {step}"
                );
            }
        }
    }
}
