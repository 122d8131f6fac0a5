//! A call's claims, checked once: each uid answered once, and only the uids
//! kubelet asked about.

use std::collections::{BTreeMap, HashMap, HashSet};

use crate::claim::ClaimRef;
use crate::driver::{Answers, ClaimError};

/// The claims of one request, checked: each uid once for the driver, and the
/// answers already settled without it.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Batch {
    /// For the driver, in kubelet's order.
    pub claims: Vec<ClaimRef>,
    /// Refused by uid, with the claim as named and why.
    pub refused: BTreeMap<String, (ClaimRef, String)>,
}

/// Sorts a request's claims: an empty uid is refused, a uid repeated with the same
/// namespace and name counts once, a uid repeated with another namespace or name
/// is refused (which of them would the answer be for?).
pub(crate) fn batch(claims: impl IntoIterator<Item = ClaimRef>) -> Batch {
    let mut seen: HashMap<String, ClaimRef> = HashMap::new();
    let mut order = Vec::new();
    let mut refused = BTreeMap::new();
    for c in claims {
        if c.uid.is_empty() {
            let why = format!("claim {}/{} has no uid", c.namespace, c.name);
            refused.insert(String::new(), (c, why));
            continue;
        }
        match seen.get(&c.uid) {
            None => {
                order.push(c.uid.clone());
                seen.insert(c.uid.clone(), c);
            }
            Some(first) if *first == c => {}
            Some(first) => {
                let why = format!(
                    "claim uid {} is named twice in one request, as {}/{} and {}/{}",
                    c.uid, first.namespace, first.name, c.namespace, c.name
                );
                refused.insert(c.uid.clone(), (c, why));
            }
        }
    }
    let claims = order
        .into_iter()
        .filter(|uid| !refused.contains_key(uid))
        .filter_map(|uid| seen.remove(&uid))
        .collect();
    Batch { claims, refused }
}

/// Completes a driver's answers: one per uid in `asked`, none for a uid kubelet
/// did not ask about (kubelet fails the whole call on either).
pub(crate) fn complete<T, E: std::error::Error>(
    asked: &[ClaimRef],
    mut answers: Answers<T, ClaimError<E>>,
) -> Answers<T, ClaimError<E>> {
    let uids: HashSet<&str> = asked.iter().map(|c| c.uid.as_str()).collect();
    answers.retain(|uid, _| {
        let keep = uids.contains(uid.as_str());
        if !keep {
            tracing::warn!(uid = %uid, "the driver answered for a claim not asked about; dropped");
        }
        keep
    });
    for uid in uids {
        answers
            .entry(uid.to_owned())
            .or_insert(Err(ClaimError::NoAnswer));
    }
    answers
}

#[cfg(test)]
mod tests {
    use super::*;

    fn claim(uid: &str, ns: &str, name: &str) -> ClaimRef {
        ClaimRef {
            uid: uid.into(),
            namespace: ns.into(),
            name: name.into(),
        }
    }

    #[test]
    fn a_batch_has_each_uid_once_and_refuses_empty_and_conflicting_ones() {
        let b = batch([
            claim("a", "ns", "one"),
            claim("", "ns", "nouid"),
            claim("a", "ns", "one"),
            claim("b", "ns", "two"),
            claim("c", "ns", "three"),
            claim("c", "other", "three"),
        ]);
        assert_eq!(
            b.claims,
            vec![claim("a", "ns", "one"), claim("b", "ns", "two")]
        );
        assert_eq!(b.refused.len(), 2);
        assert_eq!(b.refused[""].1, "claim ns/nouid has no uid");
        assert!(
            b.refused["c"].1.contains("ns/three and other/three"),
            "{}",
            b.refused["c"].1
        );
    }

    #[test]
    fn answers_cover_every_uid_asked_and_nothing_else() {
        let asked = [claim("a", "ns", "x"), claim("b", "ns", "y")];
        let mut m: Answers<(), ClaimError<std::io::Error>> = BTreeMap::new();
        m.insert("a".into(), Ok(()));
        m.insert("stranger".into(), Ok(()));
        let answers = complete(&asked, m);
        let keys: Vec<_> = answers.keys().cloned().collect();
        assert_eq!(keys, ["a", "b"]);
        assert!(answers["a"].is_ok());
        assert!(matches!(answers["b"], Err(ClaimError::NoAnswer)));
    }
}
