//! Extended resource names, checked the way the kubelet checks them.

use std::fmt;
use std::str::FromStr;

/// The kubelet prefixes a resource name with this for quota; the prefixed name must
/// still be a valid qualified name, and names may not start with it.
const QUOTA_PREFIX: &str = "requests.";

/// Names in this domain (and its subdomains) are Kubernetes' own.
const RESERVED_DOMAIN: &str = "kubernetes.io/";

/// Longest DNS subdomain; the domain must fit with [`QUOTA_PREFIX`] in front.
const MAX_SUBDOMAIN: usize = 253;

/// Longest DNS label and longest name part.
const MAX_LABEL: usize = 63;

/// A validated extended resource name such as `rebellions.ai/ATOM_CA22_PT`.
///
/// The rules are the kubelet's (`IsExtendedResourceName`): `domain/name`, where the
/// domain is a lowercase DNS-1123 subdomain outside `kubernetes.io`, short enough to
/// take the `requests.` quota prefix (244 characters), and the name is at most 63
/// characters of `[A-Za-z0-9._-]` starting and ending with a letter or digit.
/// Each domain label is also held to the DNS limit of 63 characters.
#[derive(
    Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
#[serde(try_from = "String", into = "String")]
pub struct ResourceName(String);

/// A string that is not a valid extended resource name.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid resource name {name:?}: {problem}")]
pub struct ResourceNameError {
    /// The rejected string.
    pub name: String,
    /// Which rule it breaks.
    pub problem: String,
}

impl ResourceName {
    /// The name as a string.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// KubeVirt's environment variable for the devices of this resource in the
    /// virt-launcher pod: `PCI_RESOURCE_` and the name upper-cased, with '/' and '.'
    /// turned into '_' (hyphens are kept).
    ///
    /// ```
    /// # use passthrough::config::ResourceName;
    /// let name: ResourceName = "rebellions.ai/ATOM_CA22_PT".parse()?;
    /// assert_eq!(name.kubevirt_env_var(), "PCI_RESOURCE_REBELLIONS_AI_ATOM_CA22_PT");
    /// # Ok::<(), passthrough::config::ResourceNameError>(())
    /// ```
    pub fn kubevirt_env_var(&self) -> String {
        let mut var = String::from("PCI_RESOURCE_");
        var.extend(self.0.chars().map(|c| match c {
            '/' | '.' => '_',
            c => c.to_ascii_uppercase(),
        }));
        var
    }

    /// KubeVirt's variable for the functions at `addresses` given to one container:
    /// [`Self::kubevirt_env_var`] and the addresses comma-separated, in order — what
    /// the device plugin's `Allocate` and a claim's CDI spec both set.
    pub fn kubevirt_env<A: std::fmt::Display>(
        &self,
        addresses: impl IntoIterator<Item = A>,
    ) -> (String, String) {
        let list: Vec<String> = addresses.into_iter().map(|a| a.to_string()).collect();
        (self.kubevirt_env_var(), list.join(","))
    }

    /// Wraps a name that is valid by construction; checked in debug builds.
    pub(super) fn from_trusted(name: String) -> Self {
        debug_assert!(check(&name).is_ok(), "{name}");
        Self(name)
    }
}

impl FromStr for ResourceName {
    type Err = ResourceNameError;

    fn from_str(name: &str) -> Result<Self, Self::Err> {
        check(name).map_err(|problem| ResourceNameError {
            name: name.to_owned(),
            problem,
        })?;
        Ok(Self(name.to_owned()))
    }
}

impl TryFrom<String> for ResourceName {
    type Error = ResourceNameError;

    fn try_from(name: String) -> Result<Self, Self::Error> {
        match check(&name) {
            Ok(()) => Ok(Self(name)),
            Err(problem) => Err(ResourceNameError { name, problem }),
        }
    }
}

impl From<ResourceName> for String {
    fn from(name: ResourceName) -> Self {
        name.0
    }
}

impl fmt::Display for ResourceName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl AsRef<str> for ResourceName {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

/// Checks `name`, describing the first rule it breaks.
pub(super) fn check(name: &str) -> Result<(), String> {
    let Some((domain, local)) = name.split_once('/') else {
        return Err("expected domain/name, e.g. example.com/MY_DEVICE".to_owned());
    };
    if local.contains('/') {
        return Err("expected exactly one '/'".to_owned());
    }
    if name.starts_with(QUOTA_PREFIX) {
        return Err(format!(
            "must not start with {QUOTA_PREFIX:?} (reserved for quota)"
        ));
    }
    if name.contains(RESERVED_DOMAIN) {
        return Err("the kubernetes.io domain is reserved for Kubernetes".to_owned());
    }
    check_domain(domain)?;
    check_local(local)
}

fn check_domain(domain: &str) -> Result<(), String> {
    if domain.is_empty() {
        return Err("the domain before '/' is empty".to_owned());
    }
    let max = MAX_SUBDOMAIN - QUOTA_PREFIX.len();
    if domain.len() > max {
        return Err(format!("the domain is longer than {max} characters"));
    }
    if let Some(c) = domain
        .chars()
        .find(|&c| !(c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '.'))
    {
        return Err(format!(
            "domain {domain:?} has {c:?}: only lowercase letters, digits, '-' and '.' are allowed"
        ));
    }
    for label in domain.split('.') {
        if label.is_empty() {
            return Err(format!("domain {domain:?} has an empty label"));
        }
        if label.len() > MAX_LABEL {
            return Err(format!(
                "domain label {label:?} is longer than {MAX_LABEL} characters"
            ));
        }
        if !starts_and_ends_alphanumeric(label) {
            return Err(format!(
                "domain label {label:?} must start and end with a letter or digit"
            ));
        }
    }
    Ok(())
}

fn check_local(local: &str) -> Result<(), String> {
    if local.is_empty() {
        return Err("the name after '/' is empty".to_owned());
    }
    if local.len() > MAX_LABEL {
        return Err(format!(
            "the name after '/' is {} characters, more than {MAX_LABEL}",
            local.len()
        ));
    }
    if let Some(c) = local
        .chars()
        .find(|&c| !(c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.')))
    {
        return Err(format!(
            "{local:?} has {c:?}: only letters, digits, '-', '_' and '.' are allowed after '/'"
        ));
    }
    if !starts_and_ends_alphanumeric(local) {
        return Err(format!(
            "{local:?} must start and end with a letter or digit"
        ));
    }
    Ok(())
}

fn starts_and_ends_alphanumeric(text: &str) -> bool {
    let bytes = text.as_bytes();
    matches!(
        (bytes.first(), bytes.last()),
        (Some(first), Some(last)) if first.is_ascii_alphanumeric() && last.is_ascii_alphanumeric()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn problem(name: &str) -> String {
        name.parse::<ResourceName>().unwrap_err().problem
    }

    #[test]
    fn accepts_valid_names() {
        for name in [
            "rebellions.ai/ATOM_CA22_PT",
            "nvidia.com/GH100_H100_SXM5_80GB",
            "example.com/my-dev.v2",
            "a/b",
            "x1-2.y/Z",
            "requestsx.com/a",
        ] {
            let parsed: ResourceName = name.parse().unwrap();
            assert_eq!(parsed.as_str(), name);
            assert_eq!(parsed.to_string(), name);
        }
        let longest_domain = format!(
            "{}.{}.{}.com",
            "a".repeat(63),
            "b".repeat(63),
            "c".repeat(63)
        );
        assert!(longest_domain.len() <= 244);
        format!("{longest_domain}/{}", "N".repeat(63))
            .parse::<ResourceName>()
            .unwrap();
    }

    #[test]
    fn rejects_missing_domain() {
        assert!(problem("ATOM_CA22_PT").contains("expected domain/name"));
        assert!(problem("/ATOM").contains("domain before '/' is empty"));
        assert!(problem("a.com/b/c").contains("exactly one '/'"));
    }

    #[test]
    fn rejects_uppercase_domain() {
        assert!(problem("Example.com/x").contains("only lowercase letters"));
    }

    #[test]
    fn rejects_bad_domain_labels() {
        assert!(problem("-example.com/x").contains("must start and end"));
        assert!(problem("example-.com/x").contains("must start and end"));
        assert!(problem("example..com/x").contains("empty label"));
        assert!(problem("example.com./x").contains("empty label"));
        assert!(problem("exa_mple.com/x").contains("'_'"));
        let long_label = format!("{}.com/x", "a".repeat(64));
        assert!(problem(&long_label).contains("longer than 63"));
        let long_domain = format!("{0}.{0}.{0}.{0}/x", "a".repeat(61));
        assert_eq!(long_domain.len() - 2, 247);
        assert!(problem(&long_domain).contains("longer than 244"));
    }

    #[test]
    fn rejects_kubernetes_domain() {
        for name in [
            "kubernetes.io/gpu",
            "node.kubernetes.io/x",
            "example.com/kubernetes.io/x",
        ] {
            assert!(!problem(name).is_empty(), "{name}");
        }
        assert!(problem("kubernetes.io/gpu").contains("reserved for Kubernetes"));
        assert!(problem("foo.kubernetes.io/gpu").contains("reserved for Kubernetes"));
    }

    #[test]
    fn rejects_quota_prefix() {
        assert!(problem("requests.example.com/x").contains("reserved for quota"));
    }

    #[test]
    fn rejects_bad_name_part() {
        assert!(problem("example.com/").contains("after '/' is empty"));
        let long = format!("example.com/{}", "A".repeat(64));
        assert!(problem(&long).contains("64 characters, more than 63"));
        assert!(problem("example.com/-dev").contains("must start and end"));
        assert!(problem("example.com/dev_").contains("must start and end"));
        assert!(problem("example.com/my dev").contains("' '"));
        assert!(problem("example.com/dév").contains("'é'"));
    }

    #[test]
    fn error_names_the_string() {
        let err = "Example.com/x".parse::<ResourceName>().unwrap_err();
        assert_eq!(err.name, "Example.com/x");
        assert!(err
            .to_string()
            .starts_with("invalid resource name \"Example.com/x\": domain"));
    }

    #[test]
    fn kubevirt_env_var() {
        for (name, var) in [
            (
                "rebellions.ai/ATOM_CA22_PT",
                "PCI_RESOURCE_REBELLIONS_AI_ATOM_CA22_PT",
            ),
            (
                "nvidia.com/GH100_H100_SXM5_80GB",
                "PCI_RESOURCE_NVIDIA_COM_GH100_H100_SXM5_80GB",
            ),
            (
                "example.com/my-dev.v2",
                "PCI_RESOURCE_EXAMPLE_COM_MY-DEV_V2",
            ),
        ] {
            let name: ResourceName = name.parse().unwrap();
            assert_eq!(name.kubevirt_env_var(), var);
        }
    }

    #[test]
    fn serde_uses_the_plain_string() {
        let name: ResourceName = "example.com/x".parse().unwrap();
        assert_eq!(serde_json::to_string(&name).unwrap(), "\"example.com/x\"");
        let back: ResourceName = serde_json::from_str("\"example.com/x\"").unwrap();
        assert_eq!(back, name);
        let err = serde_json::from_str::<ResourceName>("\"Example.com/x\"").unwrap_err();
        assert!(err.to_string().contains("invalid resource name"));
    }
}
