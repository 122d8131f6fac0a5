//! The few API server calls kubelet's DRA code makes, over plain HTTP/1.1 to a
//! test API server (`http://host:port`): one request per connection, JSON both ways.

use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// A client of the API server at a base URL.
#[derive(Debug, Clone)]
pub struct Api {
    host: String,
    user_agent: String,
}

/// An answer: the status code and the JSON body (`Null` when there is none).
pub type Reply = (u16, Value);

impl Api {
    /// A client of `url` (`http://host:port`, no path), sending `user_agent`.
    pub fn new(url: &str, user_agent: &str) -> anyhow::Result<Self> {
        let host = url
            .strip_prefix("http://")
            .ok_or_else(|| anyhow::anyhow!("API server URL {url:?} is not http://host:port"))?
            .trim_end_matches('/')
            .to_owned();
        anyhow::ensure!(!host.contains('/'), "API server URL {url:?} has a path");
        Ok(Self {
            host,
            user_agent: user_agent.to_owned(),
        })
    }

    /// One request; `path` may carry a query.
    pub async fn call(
        &self,
        method: &str,
        path: &str,
        body: Option<&Value>,
    ) -> anyhow::Result<Reply> {
        let mut conn = tokio::net::TcpStream::connect(&self.host).await?;
        let body = body.map(Value::to_string).unwrap_or_default();
        let mut req = format!(
            "{method} {path} HTTP/1.1\r\nHost: {}\r\nUser-Agent: {}\r\nAccept: application/json\r\nConnection: close\r\n",
            self.host, self.user_agent
        );
        if !body.is_empty() {
            req.push_str(&format!(
                "Content-Type: application/json\r\nContent-Length: {}\r\n",
                body.len()
            ));
        }
        req.push_str("\r\n");
        req.push_str(&body);
        conn.write_all(req.as_bytes()).await?;
        let mut raw = Vec::new();
        conn.read_to_end(&mut raw).await?;
        parse_response(&raw)
    }

    /// GET `path`.
    pub async fn get(&self, path: &str) -> anyhow::Result<Reply> {
        self.call("GET", path, None).await
    }
}

fn parse_response(raw: &[u8]) -> anyhow::Result<Reply> {
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or_else(|| anyhow::anyhow!("no end of headers in the API server's answer"))?;
    let head = String::from_utf8_lossy(&raw[..split]);
    let mut lines = head.split("\r\n");
    let status: u16 = lines
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| anyhow::anyhow!("bad status line from the API server"))?;
    let chunked = lines.any(|l| {
        l.split_once(':').is_some_and(|(k, v)| {
            k.trim().eq_ignore_ascii_case("transfer-encoding")
                && v.trim().eq_ignore_ascii_case("chunked")
        })
    });
    let mut body = raw[split + 4..].to_vec();
    if chunked {
        body = dechunk(&body)?;
    }
    let json = if body.iter().all(u8::is_ascii_whitespace) {
        Value::Null
    } else {
        serde_json::from_slice(&body)?
    };
    Ok((status, json))
}

fn dechunk(mut b: &[u8]) -> anyhow::Result<Vec<u8>> {
    let mut out = Vec::new();
    loop {
        let end = b
            .windows(2)
            .position(|w| w == b"\r\n")
            .ok_or_else(|| anyhow::anyhow!("bad chunk"))?;
        let size_text = String::from_utf8_lossy(&b[..end]);
        let size = usize::from_str_radix(size_text.split(';').next().unwrap_or("").trim(), 16)?;
        b = &b[end + 2..];
        if size == 0 {
            return Ok(out);
        }
        anyhow::ensure!(b.len() >= size + 2, "short chunk");
        out.extend_from_slice(&b[..size]);
        b = &b[size + 2..];
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_parse_plain_and_chunked() {
        let plain = b"HTTP/1.1 200 OK\r\ncontent-length: 7\r\n\r\n{\"a\":1}";
        assert_eq!(
            parse_response(plain).unwrap(),
            (200, serde_json::json!({"a": 1}))
        );
        let chunked = b"HTTP/1.1 404 Not Found\r\nTransfer-Encoding: chunked\r\n\r\n3\r\n{\"b\r\n4\r\n\":2}\r\n0\r\n\r\n";
        assert_eq!(
            parse_response(chunked).unwrap(),
            (404, serde_json::json!({"b": 2}))
        );
    }
}
