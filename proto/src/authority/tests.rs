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
