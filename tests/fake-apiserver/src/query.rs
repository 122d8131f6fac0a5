//! The query string of a request: percent-decoding and the equality-based field
//! and label selectors the API server applies to lists.

use serde_json::Value;

/// The query parameters, decoded, in order.
pub(crate) fn parse(query: &str) -> Vec<(String, String)> {
    query
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            (decode(k), decode(v))
        })
        .collect()
}

/// A boolean query parameter as the API server reads one
/// (`Convert_Slice_string_To_bool` in
/// staging/src/k8s.io/apimachinery/pkg/runtime/conversion.go): anything but `0`
/// or `false` (any case) is true, even an empty value.
pub(crate) fn truthy(value: &str) -> bool {
    value != "0" && !value.eq_ignore_ascii_case("false")
}

/// Whether the boolean parameter `key` is present and true.
pub(crate) fn flag(params: &[(String, String)], key: &str) -> bool {
    params.iter().any(|(k, v)| k == key && truthy(v))
}

/// `application/x-www-form-urlencoded` decoding: `+` is a space, `%XX` a byte.
/// A malformed escape is kept as written.
pub(crate) fn decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'+' => out.push(b' '),
            b'%' => {
                let hex = bytes
                    .get(i + 1..i + 3)
                    .and_then(|h| std::str::from_utf8(h).ok())
                    .and_then(|h| u8::from_str_radix(h, 16).ok());
                match hex {
                    Some(b) => {
                        out.push(b);
                        i += 2;
                    }
                    None => out.push(b'%'),
                }
            }
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// One requirement of a selector.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Requirement {
    /// `key=value` or `key==value`.
    Equals(String, String),
    /// `key!=value`.
    NotEquals(String, String),
    /// `key` (labels only).
    Exists(String),
    /// `!key` (labels only).
    NotExists(String),
}

impl Requirement {
    fn key(&self) -> &str {
        match self {
            Self::Equals(k, _) | Self::NotEquals(k, _) | Self::Exists(k) | Self::NotExists(k) => k,
        }
    }
}

/// Parses a selector; `labels` allows the existence forms. Set-based forms
/// (`in (...)`, `notin (...)`) are refused rather than misread.
pub(crate) fn selector(text: &str, labels: bool) -> Result<Vec<Requirement>, String> {
    if text.contains('(') {
        return Err(format!(
            "set-based selector {text:?} is not served by this stand-in"
        ));
    }
    let mut out = Vec::new();
    for term in text.split(',').map(str::trim).filter(|t| !t.is_empty()) {
        let req = if let Some((k, v)) = term.split_once("!=") {
            Requirement::NotEquals(k.trim().into(), v.trim().into())
        } else if let Some((k, v)) = term.split_once("==") {
            Requirement::Equals(k.trim().into(), v.trim().into())
        } else if let Some((k, v)) = term.split_once('=') {
            Requirement::Equals(k.trim().into(), v.trim().into())
        } else if !labels {
            return Err(format!("invalid field selector: {term:?} is not key=value"));
        } else if let Some(k) = term.strip_prefix('!') {
            Requirement::NotExists(k.trim().into())
        } else {
            Requirement::Exists(term.into())
        };
        if req.key().is_empty() {
            return Err(format!("invalid selector term {term:?}: empty key"));
        }
        out.push(req);
    }
    Ok(out)
}

/// Whether `object` meets every field requirement (a field the object lacks reads
/// as the empty string, as in the API server).
pub(crate) fn fields_match(object: &Value, reqs: &[Requirement]) -> bool {
    reqs.iter().all(|r| {
        let have = field(object, r.key());
        match r {
            Requirement::Equals(_, v) => have == *v,
            Requirement::NotEquals(_, v) => have != *v,
            Requirement::Exists(_) | Requirement::NotExists(_) => false,
        }
    })
}

/// The value of a dotted field path (`spec.nodeName`) as a string.
pub(crate) fn field(object: &Value, path: &str) -> String {
    let pointer = format!("/{}", path.replace('.', "/"));
    match object.pointer(&pointer) {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Bool(b)) => b.to_string(),
        Some(Value::Number(n)) => n.to_string(),
        _ => String::new(),
    }
}

/// Whether `object`'s labels meet every requirement.
pub(crate) fn labels_match(object: &Value, reqs: &[Requirement]) -> bool {
    let labels = object
        .pointer("/metadata/labels")
        .and_then(Value::as_object);
    let get = |k: &str| labels.and_then(|l| l.get(k)).and_then(Value::as_str);
    reqs.iter().all(|r| match r {
        Requirement::Equals(k, v) => get(k) == Some(v.as_str()),
        Requirement::NotEquals(k, v) => get(k) != Some(v.as_str()),
        Requirement::Exists(k) => get(k).is_some(),
        Requirement::NotExists(k) => get(k).is_none(),
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn decodes_form_encoding() {
        assert_eq!(
            decode("spec.nodeName%3Dnode-a%2Cspec.driver%3Dx.y"),
            "spec.nodeName=node-a,spec.driver=x.y"
        );
        assert_eq!(decode("a+b%"), "a b%");
        assert_eq!(decode("%zz"), "%zz");
        assert_eq!(
            parse("fieldSelector=a%3Db&limit=5"),
            [
                ("fieldSelector".into(), "a=b".into()),
                ("limit".into(), "5".into())
            ]
        );
    }

    #[test]
    fn selectors_match_like_the_api_server() {
        let o = json!({"metadata": {"labels": {"app": "x"}}, "spec": {"nodeName": "n1"}});
        let f = selector("spec.nodeName=n1,spec.driver!=d", false).unwrap();
        assert!(fields_match(&o, &f));
        assert!(!fields_match(
            &o,
            &selector("spec.nodeName==n2", false).unwrap()
        ));
        assert!(selector("spec.nodeName", false).is_err());
        assert!(labels_match(&o, &selector("app=x,!other", true).unwrap()));
        assert!(!labels_match(
            &o,
            &selector("app", true)
                .map(|mut v| {
                    v.push(Requirement::Exists("nope".into()));
                    v
                })
                .unwrap()
        ));
        assert!(selector("app in (x,y)", true).is_err());
        assert!(selector("=x", true).is_err());
    }
}
