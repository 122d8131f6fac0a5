//! Requests to the API server for the benchmarks, as JSON: a client of a
//! kubeconfig with its own connection pool, and GET, POST, merge PATCH and DELETE
//! of a path. Plus the median and percentiles the benchmarks print.

use std::path::Path;

use anyhow::{Context, Result};
use serde_json::Value;

/// A client of `kubeconfig` with its own connection pool (a simulated node's
/// own connection) and no read timeout (a watch may be silent for a whole run).
pub async fn client(kubeconfig: &Path) -> Result<kube::Client> {
    let file = kube::config::Kubeconfig::read_from(kubeconfig)?;
    let mut config =
        kube::Config::from_custom_kubeconfig(file, &kube::config::KubeConfigOptions::default())
            .await?;
    config.read_timeout = None;
    Ok(kube::Client::try_from(config)?)
}

/// `GET path`.
pub async fn get(client: &kube::Client, path: &str) -> Result<Value> {
    client
        .request::<Value>(http::Request::get(path).body(Vec::new())?)
        .await
        .with_context(|| format!("GET {path}"))
}

/// `POST path` of `body`.
pub async fn create(client: &kube::Client, path: &str, body: &Value) -> Result<Value> {
    send(
        client,
        http::Request::post(path),
        "application/json",
        path,
        body,
    )
    .await
}

/// `PATCH path` with the JSON merge patch `body`.
pub async fn merge_patch(client: &kube::Client, path: &str, body: &Value) -> Result<Value> {
    let patch = "application/merge-patch+json";
    send(client, http::Request::patch(path), patch, path, body).await
}

async fn send(
    client: &kube::Client,
    request: http::request::Builder,
    content_type: &str,
    path: &str,
    body: &Value,
) -> Result<Value> {
    let method = request.method_ref().cloned().unwrap_or_default();
    let request = request
        .header("Content-Type", content_type)
        .body(serde_json::to_vec(body)?)?;
    client
        .request::<Value>(request)
        .await
        .with_context(|| format!("{method} {path}"))
}

/// `DELETE path`.
pub async fn delete(client: &kube::Client, path: &str) -> Result<()> {
    let request = http::Request::delete(path).body(Vec::new())?;
    client
        .request::<Value>(request)
        .await
        .with_context(|| format!("DELETE {path}"))?;
    Ok(())
}

/// Opens the watch `path` (with `watch=true`): the response body, one JSON
/// event per line, as the server streams it.
pub async fn open_watch(client: &kube::Client, path: &str) -> Result<kube::client::Body> {
    let request = http::Request::get(path).body(kube::client::Body::from(Vec::new()))?;
    let response = client.send(request).await?;
    if !response.status().is_success() {
        anyhow::bail!("GET {path}: {}", response.status());
    }
    Ok(response.into_body())
}

/// Reads the watch `body` to its end, calling `event` with each event's type
/// (`ADDED`, `MODIFIED`, `DELETED`, …) and object as each line arrives.
pub async fn follow(mut body: kube::client::Body, mut event: impl FnMut(&str, Value)) {
    use http_body_util::BodyExt;
    let mut buffer: Vec<u8> = Vec::new();
    while let Some(Ok(frame)) = body.frame().await {
        let Ok(data) = frame.into_data() else {
            continue;
        };
        buffer.extend_from_slice(&data);
        while let Some(end) = buffer.iter().position(|b| *b == b'\n') {
            let line: Vec<u8> = buffer.drain(..=end).collect();
            if let Ok(mut e) = serde_json::from_slice::<Value>(&line) {
                let kind = e["type"].as_str().unwrap_or_default().to_owned();
                event(&kind, e["object"].take());
            }
        }
    }
}

/// The median of `values` (the mean of the two middle ones for an even count);
/// NaN for none.
pub fn median(values: &mut [f64]) -> f64 {
    if values.is_empty() {
        return f64::NAN;
    }
    values.sort_by(f64::total_cmp);
    let mid = values.len() / 2;
    if values.len() % 2 == 1 {
        values[mid]
    } else {
        (values[mid - 1] + values[mid]) / 2.0
    }
}

/// The `p`-th percentile of `values` (nearest rank: the smallest value with at
/// least p % of them at or below it); NaN for none.
pub fn percentile(values: &mut [f64], p: f64) -> f64 {
    if values.is_empty() {
        return f64::NAN;
    }
    values.sort_by(f64::total_cmp);
    let rank = ((p / 100.0) * values.len() as f64).ceil() as usize;
    values[rank.clamp(1, values.len()) - 1]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_and_percentiles() {
        assert!(median(&mut []).is_nan());
        assert_eq!(median(&mut [3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&mut [4.0, 1.0, 2.0, 3.0]), 2.5);
        let mut hundred: Vec<f64> = (1..=100).rev().map(f64::from).collect();
        assert_eq!(percentile(&mut hundred, 50.0), 50.0);
        assert_eq!(percentile(&mut hundred, 99.0), 99.0);
        assert_eq!(percentile(&mut hundred, 100.0), 100.0);
        assert_eq!(percentile(&mut [7.0], 99.0), 7.0);
        assert_eq!(percentile(&mut [1.0, 2.0], 0.0), 1.0);
    }
}
