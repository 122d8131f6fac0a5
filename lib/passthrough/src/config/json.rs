//! A JSON tree that keeps every key of an object, repeated ones included, so the
//! validator can reject repeated keys instead of silently keeping the last value.

use std::fmt;

use serde::de::{Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};

/// A parsed JSON value. Scalars other than strings are only ever reported as wrong,
/// so they carry no payload.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum Json {
    Null,
    Bool,
    Number,
    String(String),
    Array(Vec<Json>),
    /// Keys in document order, repeats kept.
    Object(Vec<(String, Json)>),
}

impl Json {
    /// The kind of value, for "expected X, found Y" messages.
    pub(super) fn kind(&self) -> &'static str {
        match self {
            Self::Null => "null",
            Self::Bool => "a boolean",
            Self::Number => "a number",
            Self::String(_) => "a string",
            Self::Array(_) => "a list",
            Self::Object(_) => "an object",
        }
    }
}

/// Fails on the first key that appears twice.
pub(super) fn check_unique_keys(fields: &[(String, Json)]) -> Result<(), String> {
    for (i, (key, _)) in fields.iter().enumerate() {
        if fields[..i].iter().any(|(earlier, _)| earlier == key) {
            return Err(format!("key {key:?} appears twice"));
        }
    }
    Ok(())
}

impl<'de> Deserialize<'de> for Json {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(JsonVisitor)
    }
}

struct JsonVisitor;

impl<'de> Visitor<'de> for JsonVisitor {
    type Value = Json;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_unit<E>(self) -> Result<Json, E> {
        Ok(Json::Null)
    }

    fn visit_none<E>(self) -> Result<Json, E> {
        Ok(Json::Null)
    }

    fn visit_bool<E>(self, _: bool) -> Result<Json, E> {
        Ok(Json::Bool)
    }

    fn visit_i64<E>(self, _: i64) -> Result<Json, E> {
        Ok(Json::Number)
    }

    fn visit_u64<E>(self, _: u64) -> Result<Json, E> {
        Ok(Json::Number)
    }

    fn visit_f64<E>(self, _: f64) -> Result<Json, E> {
        Ok(Json::Number)
    }

    fn visit_str<E>(self, text: &str) -> Result<Json, E> {
        Ok(Json::String(text.to_owned()))
    }

    fn visit_string<E>(self, text: String) -> Result<Json, E> {
        Ok(Json::String(text))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Json, A::Error> {
        let mut items = Vec::new();
        while let Some(item) = seq.next_element()? {
            items.push(item);
        }
        Ok(Json::Array(items))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Json, A::Error> {
        let mut fields = Vec::new();
        while let Some(field) = map.next_entry::<String, Json>()? {
            fields.push(field);
        }
        Ok(Json::Object(fields))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_repeated_keys_in_order() {
        let json: Json = serde_json::from_str(r#"{"a": 1, "b": [true, null], "a": "x"}"#).unwrap();
        let Json::Object(fields) = json else {
            panic!("not an object: {json:?}")
        };
        let keys: Vec<&str> = fields.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(keys, ["a", "b", "a"]);
        assert_eq!(fields[1].1, Json::Array(vec![Json::Bool, Json::Null]));
        assert_eq!(fields[2].1, Json::String("x".to_owned()));
        assert_eq!(
            check_unique_keys(&fields).unwrap_err(),
            "key \"a\" appears twice"
        );
    }

    #[test]
    fn kinds() {
        for (text, kind) in [
            ("null", "null"),
            ("false", "a boolean"),
            ("-1.5", "a number"),
            ("\"s\"", "a string"),
            ("[]", "a list"),
            ("{}", "an object"),
        ] {
            let json: Json = serde_json::from_str(text).unwrap();
            assert_eq!(json.kind(), kind, "{text}");
        }
    }
}
