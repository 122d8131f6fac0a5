//! The names a claim's files are made of, checked before anything is written:
//! driver names, claim uids, request names, iommufd nodes and directories, each
//! refused with what it is and why.

use super::*;

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

/// A DNS label as Kubernetes checks one (`IsDNS1123Label`, apimachinery
/// `pkg/util/validation/validation.go`): 1–63 of `a-z0-9-`, starting and ending
/// with a letter or digit.
pub(super) fn check_label(what: &'static str, s: &str) -> Result<(), CdiError> {
    let reason = match part(s) {
        _ if s.len() > 63 => "longer than 63 characters",
        Part::Fine => return Ok(()),
        Part::Empty => "empty",
        Part::BadCharacter => "only a-z, 0-9 and '-' are allowed",
        Part::BadEnd => "must start and end with a-z or 0-9",
    };
    Err(invalid(what, s, reason))
}

/// A DNS subdomain as Kubernetes checks one (`IsDNS1123Subdomain`, the same
/// file) of at most `max` characters: labels joined by dots. Only the whole is
/// bounded: an object named with a label of 64 characters or more is a valid
/// Kubernetes name.
pub(super) fn check_subdomain(what: &'static str, s: &str, max: usize) -> Result<(), CdiError> {
    if s.len() > max {
        return Err(invalid(what, s, "too long"));
    }
    let worst = s.split('.').map(part).max().unwrap_or(Part::Empty);
    let reason = match worst {
        Part::Fine => return Ok(()),
        Part::Empty => "empty, or an empty part between dots",
        Part::BadCharacter => "only a-z, 0-9, '-' and '.' are allowed",
        Part::BadEnd => "each part between dots must start and end with a-z or 0-9",
    };
    Err(invalid(what, s, reason))
}

/// What is wrong with one label of either, unbounded, the gravest last.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Part {
    Fine,
    BadEnd,
    Empty,
    BadCharacter,
}

fn part(s: &str) -> Part {
    let alnum = |c: &u8| c.is_ascii_lowercase() || c.is_ascii_digit();
    let b = s.as_bytes();
    if b.is_empty() {
        Part::Empty
    } else if !b.iter().all(|c| alnum(c) || *c == b'-') {
        Part::BadCharacter
    } else if !b.first().is_some_and(alnum) || !b.last().is_some_and(alnum) {
        Part::BadEnd
    } else {
        Part::Fine
    }
}

/// A driver name: a DNS subdomain of at most 63 characters that is a CDI
/// vendor too (it starts with a letter).
pub(super) fn check_driver(driver: &str) -> Result<(), CdiError> {
    check_subdomain("driver name", driver, 63)?;
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
