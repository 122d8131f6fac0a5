//! The names a claim's files are made of, checked before anything is written:
//! driver names, claim uids, request names, iommufd nodes and directories, each
//! refused with what it is and why.

use super::*;
use claim_label::names as rules;
pub(super) use claim_label::names::SUBDOMAIN_MAX;

/// A value for an error message: quoted, and cut after 64 characters.
pub(super) fn shown(value: &str) -> String {
    let cut: String = value.chars().take(64).collect();
    if cut.len() < value.len() {
        format!("{cut:?}… ({} bytes)", value.len())
    } else {
        format!("{cut:?}")
    }
}

pub(super) fn invalid(what: &'static str, value: &str, reason: &'static str) -> CdiError {
    CdiError::InvalidName {
        what,
        value: value.to_string(),
        reason,
    }
}

/// A DNS label ([`claim_label::names::check_label`]).
pub(super) fn check_label(what: &'static str, s: &str) -> Result<(), CdiError> {
    rules::check_label(s).map_err(|reason| invalid(what, s, reason))
}

/// A DNS subdomain of at most `max` characters ([`claim_label::names::check_subdomain`]).
pub(super) fn check_subdomain(what: &'static str, s: &str, max: usize) -> Result<(), CdiError> {
    rules::check_subdomain(s, max).map_err(|reason| invalid(what, s, reason))
}

/// A driver name: the one both sides take ([`claim_label::names::check_driver_name`])
/// that is a CDI vendor too (it starts with a letter).
pub(super) fn check_driver(driver: &str) -> Result<(), CdiError> {
    rules::check_driver_name(driver).map_err(|reason| invalid("driver name", driver, reason))?;
    spec::check_vendor_or_class(driver).map_err(|e| invalid("driver name", driver, e.0))
}

/// A claim UID: 1–64 of `A-Za-z0-9-`, starting and ending alphanumeric. Real UIDs
/// are RFC 4122 strings; nothing here can be `.`, `..` or hold a `/`.
pub(super) fn check_uid(uid: &str) -> Result<(), CdiError> {
    let b = uid.as_bytes();
    let ok_ends = matches!((b.first(), b.last()),
        (Some(f), Some(l)) if f.is_ascii_alphanumeric() && l.is_ascii_alphanumeric());
    if b.is_empty() || b.len() > 64 {
        Err(invalid("claim UID", uid, "must be 1 to 64 characters"))
    } else if !b.iter().all(|c| c.is_ascii_alphanumeric() || *c == b'-') {
        Err(invalid(
            "claim UID",
            uid,
            "only A-Z, a-z, 0-9 and '-' are allowed",
        ))
    } else if !ok_ends {
        Err(invalid(
            "claim UID",
            uid,
            "must start and end with a letter or digit",
        ))
    } else {
        Ok(())
    }
}

/// A request reference, `request` or `request/subrequest`; returns the request.
pub(super) fn base_request(reference: &str) -> Result<&str, CdiError> {
    let (base, sub) = match reference.split_once('/') {
        Some((b, s)) => (b, Some(s)),
        None => (reference, None),
    };
    check_label("request name", base).map_err(|_| {
        invalid(
            "request name",
            reference,
            "want a DNS label, or two joined by '/'",
        )
    })?;
    if let Some(sub) = sub {
        check_label("request name", sub).map_err(|_| {
            invalid(
                "request name",
                reference,
                "want a DNS label, or two joined by '/'",
            )
        })?;
    }
    Ok(base)
}

/// An iommufd node name: `vfio` and a number.
pub(super) fn check_iommufd_node(node: &str) -> Result<(), CdiError> {
    let digits = node.strip_prefix("vfio").unwrap_or("");
    if digits.is_empty() || digits.len() > 10 || !digits.bytes().all(|c| c.is_ascii_digit()) {
        return Err(invalid("iommufd node", node, "want vfio<N>"));
    }
    Ok(())
}

pub(super) fn utf8_dir<'a>(what: &'static str, dir: &'a Path) -> Result<&'a str, CdiError> {
    match dir.to_str() {
        Some(s) if dir.is_absolute() => Ok(s.trim_end_matches('/')),
        _ => Err(CdiError::InvalidDir {
            what,
            path: dir.to_path_buf(),
        }),
    }
}
