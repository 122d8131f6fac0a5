//! Kubernetes' DNS name rules, as apimachinery's `pkg/util/validation/validation.go`
//! states them (`IsDNS1123Label`, `IsDNS1123Subdomain`), for the names both sides
//! make keys, labels and paths of: the driver name ([`check_driver_name`]), and on
//! the node the names of a claim, its namespace and its requests. Each refusal is
//! the reason in words a person can act on.

/// The longest DNS label (`DNS1123LabelMaxLength`).
pub const LABEL_MAX: usize = 63;
/// The longest DNS subdomain (`DNS1123SubdomainMaxLength`).
pub const SUBDOMAIN_MAX: usize = 253;
/// The longest DRA driver name (`DriverNameMaxLength`, `pkg/apis/resource/types.go`).
pub const DRIVER_NAME_MAX: usize = 63;

/// A DNS label: 1–63 of `a-z0-9-`, starting and ending with a letter or digit.
pub fn check_label(s: &str) -> Result<(), &'static str> {
    match part(s) {
        _ if s.len() > LABEL_MAX => Err("longer than 63 characters"),
        Part::Fine => Ok(()),
        Part::Empty => Err("empty"),
        Part::BadCharacter => Err("only a-z, 0-9 and '-' are allowed"),
        Part::BadEnd => Err("must start and end with a-z or 0-9"),
    }
}

/// A DNS subdomain of at most `max` characters: labels joined by dots. Only the
/// whole is bounded, as upstream: an object named with 64 characters and no dot
/// is a valid Kubernetes name.
pub fn check_subdomain(s: &str, max: usize) -> Result<(), &'static str> {
    if s.len() > max {
        return Err("too long");
    }
    match s.split('.').map(part).max().unwrap_or(Part::Empty) {
        Part::Fine => Ok(()),
        Part::Empty => Err("empty, or an empty part between dots"),
        Part::BadCharacter => Err("only a-z, 0-9, '-' and '.' are allowed"),
        Part::BadEnd => Err("each part between dots must start and end with a-z or 0-9"),
    }
}

/// A driver name both sides can use: a DRA driver name (a DNS subdomain of at
/// most 63 characters; `ValidateCSIDriverName` takes it in any case) that is
/// also the prefix of the label key and the binding conditions, which must be
/// lowercase.
pub fn check_driver_name(driver: &str) -> Result<(), &'static str> {
    check_subdomain(driver, DRIVER_NAME_MAX)
}

/// What is wrong with one label, unbounded; the gravest last.
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_their_kubernetes_grammar() {
        assert_eq!(check_label("a"), Ok(()));
        assert_eq!(check_label(&"a".repeat(63)), Ok(()));
        for bad in ["", "-a", "a-", "A", "a.b", "a_b", "..", &"a".repeat(64)] {
            assert!(check_label(bad).is_err(), "{bad:?}");
        }
        assert_eq!(check_subdomain("vfio-sandbox.rebellions.ai", 63), Ok(()));
        for bad in ["", ".", "a.", ".a", "a..b", "a/b", "A.b"] {
            assert!(check_subdomain(bad, SUBDOMAIN_MAX).is_err(), "{bad:?}");
        }
        // The whole is bounded, not its labels.
        assert_eq!(check_subdomain(&"a".repeat(64), SUBDOMAIN_MAX), Ok(()));
        let long = format!("{}.b", "a".repeat(200));
        assert_eq!(check_subdomain(&long, SUBDOMAIN_MAX), Ok(()));
        assert_eq!(
            check_subdomain(&"a".repeat(254), SUBDOMAIN_MAX),
            Err("too long")
        );
    }

    #[test]
    fn each_refusal_says_what_is_wrong() {
        let why = |s: &str| check_subdomain(s, SUBDOMAIN_MAX).unwrap_err();
        assert_eq!(
            why("Vfio.example"),
            "only a-z, 0-9, '-' and '.' are allowed"
        );
        assert_eq!(why("a..b"), "empty, or an empty part between dots");
        assert_eq!(
            why("a.-b"),
            "each part between dots must start and end with a-z or 0-9"
        );
        assert_eq!(check_label("a-"), Err("must start and end with a-z or 0-9"));
    }

    #[test]
    fn the_driver_name_is_a_lowercase_subdomain_of_63_at_most() {
        assert_eq!(check_driver_name(crate::DEFAULT_DRIVER_NAME), Ok(()));
        assert_eq!(check_driver_name(&"a".repeat(64)), Err("too long"));
        assert!(check_driver_name("Vfio.example").is_err());
    }
}
