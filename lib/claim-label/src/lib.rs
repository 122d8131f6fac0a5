//! What the DRA node driver (`sandbox-dra-driver`) and its claim labeller
//! (`sandbox-dra-controller`) must agree on, in one place both build from: the
//! driver name, the binding condition the labeller looks for, the node label on a
//! ResourceClaim (its key, its value and the hashed form of a long node name), and
//! the labeller's Lease (its name and the rule by which a node judges it alive,
//! [`lease`]), and Kubernetes' rules for the names both make keys of ([`names`]).
//!
//! # The node label
//!
//! No field selector picks ResourceClaims by node (the API server offers only
//! `metadata.name` and `metadata.namespace` for them), so a driver that watched
//! claims itself had every claim change of the cluster sent to every node. The
//! claim labeller (one leader per cluster) watches claims once and labels each
//! claim allocated to this driver's devices with their binding condition:
//!
//! ```text
//! vfio-sandbox.rebellions.ai/node=<label value of the node>     # <driver>/node
//! ```
//!
//! and each node's driver watches with the label selector [`selector`], which the
//! API server applies before it sends: a claim change reaches the labeller and at
//! most one node.
//!
//! Both sides compute the value with [`label_value`] from the pool name, which for
//! this driver is the node's name. A node name (a DNS subdomain, up to 253
//! characters) of at most 63 characters is a valid label value and is used as it
//! is; a longer one becomes its first 40 characters, `_` and a 64-bit FNV-1a hash
//! of the whole name in hex. `_` never appears in a node name, so a hashed form
//! never equals another node's plain name. The label only narrows what a node is
//! sent: the node still checks that the claim's devices are in its own pool, so
//! two long names with one hash would cost traffic, never a wrong move.

pub mod lease;
pub mod names;

/// The DRA driver name both sides use unless told otherwise (a DNS subdomain:
/// the prefix of the label key and of the binding conditions).
pub const DEFAULT_DRIVER_NAME: &str = "vfio-sandbox.rebellions.ai";

/// The binding condition a device's status entry gets once its group is on vfio
/// (KEP-5007): the scheduler binds the pod only then, and the labeller labels
/// the claims whose allocation waits on it.
pub const READY: &str = "VfioReady";
/// The binding failure condition: the group could not be moved.
pub const FAILED: &str = "VfioFailed";

/// `<driver>/VfioReady`: a qualified name, as the API server requires.
pub fn ready_condition(driver: &str) -> String {
    format!("{driver}/{READY}")
}

/// `<driver>/VfioFailed`.
pub fn failed_condition(driver: &str) -> String {
    format!("{driver}/{FAILED}")
}

/// The longest label value the API server takes.
const LABEL_VALUE_MAX: usize = 63;
/// How much of a long name its hashed form keeps, for people reading labels.
const HASHED_PREFIX: usize = 40;

/// `<driver>/node`: the label's key (the driver name is a DNS subdomain, a valid
/// key prefix).
pub fn label_key(driver: &str) -> String {
    format!("{driver}/node")
}

/// The label value standing for node (pool) `node`: the name itself when it is a
/// valid label value, otherwise `<first 40 characters>_<FNV-1a 64 in hex>`, the
/// prefix cut back to its last letter or digit.
pub fn label_value(node: &str) -> String {
    if valid_label_value(node) {
        return node.to_owned();
    }
    let mut prefix: String = node
        .chars()
        .take_while(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        .take(HASHED_PREFIX)
        .collect();
    while prefix.ends_with(|c: char| !c.is_ascii_alphanumeric()) {
        prefix.pop();
    }
    let hash = format!("{:016x}", fnv1a64(node.as_bytes()));
    if prefix.is_empty() {
        hash
    } else {
        format!("{prefix}_{hash}")
    }
}

/// The label selector a node's driver watches with: `<driver>/node=<value>`.
pub fn selector(driver: &str, node: &str) -> String {
    format!("{}={}", label_key(driver), label_value(node))
}

/// Whether `value` is a label value the API server takes: at most 63
/// characters of `[A-Za-z0-9._-]`, beginning and ending with a letter or digit
/// (or empty).
pub fn valid_label_value(value: &str) -> bool {
    let bytes = value.as_bytes();
    if bytes.len() > LABEL_VALUE_MAX {
        return false;
    }
    let (Some(first), Some(last)) = (bytes.first(), bytes.last()) else {
        return true;
    };
    first.is_ascii_alphanumeric()
        && last.is_ascii_alphanumeric()
        && bytes
            .iter()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
}

/// FNV-1a, 64 bits: small, fixed and the same everywhere, which is all a routing
/// label needs (see the module's note on collisions).
fn fnv1a64(bytes: &[u8]) -> u64 {
    const OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
    const PRIME: u64 = 0x0000_0100_0000_01b3;
    bytes
        .iter()
        .fold(OFFSET, |h, b| (h ^ u64::from(*b)).wrapping_mul(PRIME))
}

#[cfg(test)]
mod tests;
