#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Instant;

use prometheus_client::metrics::counter::Counter;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::*;

/// Any single step of a test; a hang fails instead of blocking the suite.
const STEP: Duration = Duration::from_secs(5);

#[test]
fn addresses_in_every_accepted_form() {
    let socket = |s: &str| ListenAddress::Socket(s.parse().unwrap());
    assert_eq!(
        parse_address("0.0.0.0:9403").unwrap(),
        socket("0.0.0.0:9403")
    );
    assert_eq!(
        parse_address("127.0.0.1:9403").unwrap(),
        socket("127.0.0.1:9403")
    );
    assert_eq!(parse_address("[::]:9403").unwrap(), socket("[::]:9403"));
    assert_eq!(parse_address("[::1]:0").unwrap(), socket("[::1]:0"));
    assert_eq!(parse_address(":9403").unwrap(), ListenAddress::Any(9403));
    assert_eq!(
        ":9403".parse::<ListenAddress>().unwrap().to_string(),
        ":9403"
    );
    assert_eq!(parse_address("[::]:9403").unwrap().to_string(), "[::]:9403");
}

#[test]
fn bad_addresses_name_the_flag_and_the_problem() {
    for (value, reason) in [
        ("", "no port"),
        ("9403", "no port"),
        ("0.0.0.0", "no port"),
        (":", "the port must be a number"),
        (":65536", "the port must be a number"),
        ("0.0.0.0:http", "the port must be a number"),
        ("127.0.0.1:-1", "the port must be a number"),
        ("localhost:9403", "the host must be a numeric IP address"),
        ("300.0.0.1:9403", "the host must be a numeric IP address"),
        ("::1:9403", "an IPv6 address must be in brackets"),
        ("[::1:9403", "the host must be a numeric IP address"),
    ] {
        let message = parse_address(value).unwrap_err().to_string();
        assert!(
            message.starts_with("invalid --metrics-address"),
            "{value:?}: {message}"
        );
        assert!(message.contains(reason), "{value:?}: {message}");
        assert!(
            message.contains(&format!("{value:?}")),
            "{value:?}: {message}"
        );
    }
}

#[tokio::test]
async fn a_taken_port_is_an_error_naming_the_address_and_flag() {
    let first = bind(&parse_address("127.0.0.1:0").unwrap()).await.unwrap();
    let taken = first.local_addr().unwrap().to_string();
    let e = bind(&parse_address(&taken).unwrap()).await.unwrap_err();
    let message = support::error_chain(&e);
    assert!(message.contains(&taken), "{message}");
    assert!(message.contains("--metrics-address"), "{message}");
    assert!(message.contains("in use"), "{message}");
}

/// A server with one counter (`vfio_sandbox_things_total` = 3) on a loopback port.
async fn server() -> SocketAddr {
    let mut registry = registry();
    let things = Counter::<u64>::default();
    registry.register("things", "Things counted", things.clone());
    things.inc_by(3);
    let listener = bind(&parse_address("127.0.0.1:0").unwrap()).await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(serve(listener, Arc::new(registry)));
    addr
}

/// Sends `bytes` on a fresh connection and reads until the server closes it.
/// Write errors are ignored: the server may close before taking everything.
async fn exchange(addr: SocketAddr, bytes: &[u8]) -> String {
    tokio::time::timeout(STEP, async {
        let mut s = TcpStream::connect(addr).await.unwrap();
        let _ = s.write_all(bytes).await;
        let mut out = Vec::new();
        let _ = s.read_to_end(&mut out).await;
        String::from_utf8_lossy(&out).into_owned()
    })
    .await
    .expect("the server neither answered nor closed the connection")
}

async fn scrape(addr: SocketAddr) -> String {
    exchange(
        addr,
        b"GET /metrics HTTP/1.1\r\nHost: node\r\nConnection: close\r\n\r\n",
    )
    .await
}

fn assert_scraped(response: &str) {
    assert!(response.starts_with("HTTP/1.1 200 OK\r\n"), "{response}");
    assert!(
        response.contains(&format!("\r\ncontent-type: {CONTENT_TYPE_OPENMETRICS}\r\n")),
        "{response}"
    );
    assert!(
        response.contains("\n# TYPE vfio_sandbox_things counter\n"),
        "{response}"
    );
    assert!(
        response.contains("\nvfio_sandbox_things_total 3\n"),
        "{response}"
    );
    assert!(response.ends_with("# EOF\n"), "{response}");
}

#[tokio::test]
async fn get_metrics_answers_openmetrics_text() {
    let addr = server().await;
    assert_scraped(&scrape(addr).await);
    // A query string is not a different path.
    let r = exchange(addr, b"GET /metrics?x=1 HTTP/1.0\r\n\r\n").await;
    assert!(r.starts_with("HTTP/1.0 200 OK\r\n"), "{r}");
}

#[tokio::test]
async fn head_has_the_headers_and_no_body() {
    let addr = server().await;
    let r = exchange(
        addr,
        b"HEAD /metrics HTTP/1.1\r\nHost: node\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert!(r.starts_with("HTTP/1.1 200 OK\r\n"), "{r}");
    assert!(r.ends_with("\r\n\r\n"), "{r}");
}

#[tokio::test]
async fn other_paths_are_404_and_other_methods_405() {
    let addr = server().await;
    for path in ["/", "/metricsx", "/metrics/", "/favicon.ico", "*"] {
        let r = exchange(
            addr,
            format!("GET {path} HTTP/1.1\r\nHost: node\r\nConnection: close\r\n\r\n").as_bytes(),
        )
        .await;
        assert!(r.starts_with("HTTP/1.1 404 Not Found\r\n"), "{path}: {r}");
    }
    for method in ["POST", "PUT", "DELETE", "OPTIONS", "PATCH", "BREW"] {
        let r = exchange(
            addr,
            format!(
                "{method} /metrics HTTP/1.1\r\nHost: node\r\nContent-Length: \
                    0\r\nConnection: close\r\n\r\n"
            )
            .as_bytes(),
        )
        .await;
        assert!(
            r.starts_with("HTTP/1.1 405 Method Not Allowed\r\n"),
            "{method}: {r}"
        );
        assert!(r.contains("\r\nallow: GET, HEAD\r\n"), "{method}: {r}");
    }
}

#[tokio::test]
async fn garbage_gets_400_and_the_server_keeps_serving() {
    let addr = server().await;
    let noise: Vec<u8> = (0..4096u32).map(|i| (i * 7919 % 251) as u8).collect();
    for input in [
        &b"\x00\x01\x02\xff\xfe\r\n\r\n"[..],
        b"GET\r\n\r\n",
        b"GET /metrics HTTP/9.9\r\n\r\n",
        b"GET /metrics HTTP/1.1\r\nHost: a\r\nContent-Length: -1\r\n\r\n",
        b"GET /metrics HTTP/1.1\r\nbad header line\r\n\r\n",
        b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
        &noise,
    ] {
        let r = exchange(addr, input).await;
        assert!(
            r.is_empty() || r.starts_with("HTTP/1.1 4"),
            "{input:?}: {r}"
        );
        assert_scraped(&scrape(addr).await);
    }
}

#[tokio::test]
async fn a_one_mebibyte_header_is_refused_and_the_server_keeps_serving() {
    let addr = server().await;
    let mut request = b"GET /metrics HTTP/1.1\r\nHost: node\r\nX-Big: ".to_vec();
    request.resize(request.len() + (1 << 20), b'a');
    request.extend_from_slice(b"\r\n\r\n");
    let r = exchange(addr, &request).await;
    // hyper answers 431 and closes; the close can race our write, which may then
    // turn into a reset that swallows the answer. Either way: no 200, connection closed.
    assert!(r.is_empty() || r.starts_with("HTTP/1.1 431"), "{r}");
    assert_scraped(&scrape(addr).await);
}

#[tokio::test]
async fn a_stalled_half_request_does_not_block_other_scrapes() {
    let addr = server().await;
    let mut stalled = Vec::new();
    for _ in 0..8 {
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(b"GET /metrics HTTP/1.1\r\nHost: no")
            .await
            .unwrap();
        stalled.push(s);
    }
    let idle = TcpStream::connect(addr).await.unwrap(); // connects, sends nothing
    let start = Instant::now();
    assert_scraped(&scrape(addr).await);
    assert!(
        start.elapsed() < Duration::from_secs(1),
        "{:?}",
        start.elapsed()
    );
    drop((stalled, idle));
}

#[tokio::test]
async fn a_stalled_client_is_closed_after_the_head_timeout() {
    let addr = server().await;
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(b"GET /metrics HTTP/1.1\r\n").await.unwrap();
    let start = Instant::now();
    let mut out = Vec::new();
    tokio::time::timeout(HEAD_TIMEOUT + STEP, s.read_to_end(&mut out))
        .await
        .expect("a stalled client kept its connection")
        .ok();
    assert!(start.elapsed() >= HEAD_TIMEOUT - Duration::from_secs(1));
}

#[tokio::test]
async fn many_connections_at_once_then_the_server_still_serves() {
    let addr = server().await;
    let mut conns = Vec::new();
    for i in 0..(MAX_CONNECTIONS * 3) {
        let mut s = TcpStream::connect(addr).await.unwrap();
        if i % 2 == 0 {
            let _ = s.write_all(b"GET /metr").await;
        }
        conns.push(s);
    }
    drop(conns);
    // Each scrape reuses nothing; all of them must get through.
    for _ in 0..(MAX_CONNECTIONS * 2) {
        assert_scraped(&scrape(addr).await);
    }
}

#[tokio::test]
async fn keep_alive_serves_several_requests_on_one_connection() {
    let addr = server().await;
    let r = exchange(
        addr,
        b"GET /metrics HTTP/1.1\r\nHost: a\r\n\r\nGET /nope HTTP/1.1\r\nHost: \
            a\r\n\r\nGET /metrics HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert_eq!(r.matches("HTTP/1.1 200 OK\r\n").count(), 2, "{r}");
    assert_eq!(r.matches("HTTP/1.1 404 Not Found\r\n").count(), 1, "{r}");
}

/// 200 clients that connect and send half a request head (slowloris), against a
/// limit of 64 open connections: a scrape that comes after them still answers
/// at once, since the oldest stalled ones are closed to make room; done 5 times,
/// the slowest scrape is printed.
#[tokio::test]
async fn a_scrape_answers_within_a_second_beside_200_slowloris_clients() {
    let addr = server().await;
    let mut slowest = Duration::ZERO;
    for _ in 0..5 {
        let mut stalled = Vec::new();
        for _ in 0..200 {
            let mut s = TcpStream::connect(addr).await.unwrap();
            let _ = s.write_all(b"GET /metrics HTTP/1.1\r\nHo").await;
            stalled.push(s);
        }
        let start = Instant::now();
        let response = tokio::time::timeout(Duration::from_secs(1), scrape(addr))
            .await
            .expect("no answer within a second beside 200 stalled clients");
        slowest = slowest.max(start.elapsed());
        assert_scraped(&response);
        drop(stalled);
    }
    println!("slowest scrape beside 200 slowloris clients: {slowest:?}");
}

/// `/readyz` answers what the check says, 200 or 503, each time it is asked;
/// without a check it is a path like any other (404).
#[tokio::test]
async fn readyz_answers_the_check_and_only_when_there_is_one() {
    let ready = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let check: Readiness = {
        let ready = ready.clone();
        Arc::new(move || {
            if ready.load(Ordering::SeqCst) {
                Ok("leading".to_owned())
            } else {
                Err("no Lease read for 12 s".to_owned())
            }
        })
    };
    let listener = bind(&parse_address("127.0.0.1:0").unwrap()).await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(serve_with_readiness(listener, Arc::new(registry()), check));
    let r = get(addr, READY_PATH).await;
    assert!(r.starts_with("HTTP/1.1 503 Service Unavailable\r\n"), "{r}");
    assert!(r.ends_with("not ready: no Lease read for 12 s\n"), "{r}");
    ready.store(true, Ordering::SeqCst);
    let r = get(addr, READY_PATH).await;
    assert!(r.starts_with("HTTP/1.1 200 OK\r\n"), "{r}");
    assert!(r.ends_with("ready: leading\n"), "{r}");
    assert!(get(addr, PATH).await.starts_with("HTTP/1.1 200 OK\r\n"));
    let r = exchange(
        server().await,
        b"GET /readyz HTTP/1.1\r\nHost: node\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert!(r.starts_with("HTTP/1.1 404 Not Found\r\n"), "{r}");
}

async fn get(addr: SocketAddr, path: &str) -> String {
    let request = format!("GET {path} HTTP/1.1\r\nHost: node\r\nConnection: close\r\n\r\n");
    exchange(addr, request.as_bytes()).await
}
