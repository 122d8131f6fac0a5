//! The HTTP/2 `:authority` a grpc-go client sends, from the target it was dialed
//! with — what kubelet's connections to a plugin carry, byte for byte.
//!
//! grpc-go (`clientconn.go`, `initParsedTargetAndResolverBuilder`, `parseTarget`,
//! `initAuthority`, `encodeAuthority`):
//! - a target whose scheme names no registered resolver — a bare socket path such as
//!   `/var/lib/kubelet/plugins_registry/x-reg.sock` — becomes
//!   `passthrough:///<target>`, parsed as a URL; the endpoint is the URL's path
//!   (percent escapes decoded by Go's `url.Parse`, query and fragment cut off) less
//!   one leading `/`, and with no authority from the dial options, the credentials
//!   or the resolver, the authority is `encodeAuthority(endpoint)`: every byte
//!   outside RFC 3986's unreserved, sub-delims and `:[]@` percent-encoded with
//!   upper-case hex — so `/` becomes `%2F`;
//! - a `unix:` target goes to the unix resolver (`internal/resolver/unix/unix.go`),
//!   which implements `resolver.AuthorityOverrider` and answers `localhost`.
//!
//! Who dials what:
//! - kubelet's plugin watcher dials every registration socket with
//!   `grpc.DialContext(ctx, socketPath, …WithContextDialer(unix)…)`
//!   (`pkg/kubelet/pluginmanager/operationexecutor/operation_generator.go`, `dial`):
//!   a bare path, so the percent-encoded path;
//! - kubelet 1.32's DRA client dials `dra.sock` with `grpc.Dial(p.endpoint, …)`
//!   (`pkg/kubelet/cm/dra/plugin/plugin.go`, `getOrCreateGRPCConn`): the
//!   percent-encoded path again;
//! - kubelet 1.33 dials `unix://<endpoint>` (`plugin.go`, `grpc.NewClient`) and 1.34
//!   `"unix:" + endpoint` (`pkg/kubelet/cm/dra/plugin/dra_plugin_manager.go`, `add`):
//!   both `localhost`;
//! - kubelet's device manager dials device plugins with `localhost`.

use std::path::Path;

/// What the unix resolver and kubelet's device manager send.
pub const LOCALHOST: &str = "localhost";

/// Why grpc-go would refuse the target.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BadTarget(pub String);

impl std::fmt::Display for BadTarget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "grpc-go cannot parse target {:?}", self.0)
    }
}

impl std::error::Error for BadTarget {}

/// grpc-go's `encodeAuthority` (`clientconn.go`): percent-encodes, upper-case hex,
/// every byte RFC 3986 does not allow in an authority.
pub fn encode_authority(authority: &str) -> String {
    fn keep(c: u8) -> bool {
        c.is_ascii_alphanumeric()
            // unreserved
            || matches!(c, b'-' | b'_' | b'.' | b'~')
            // sub-delims
            || matches!(c, b'!' | b'$' | b'&' | b'\'' | b'(' | b')' | b'*' | b'+' | b',' | b';' | b'=')
            // authority delimiters
            || matches!(c, b':' | b'[' | b']' | b'@')
    }
    const HEX: &[u8; 16] = b"0123456789ABCDEF";
    let mut out = String::with_capacity(authority.len());
    for &c in authority.as_bytes() {
        if keep(c) {
            out.push(char::from(c));
        } else {
            out.push('%');
            out.push(char::from(HEX[usize::from(c >> 4)]));
            out.push(char::from(HEX[usize::from(c & 15)]));
        }
    }
    out
}

/// Go's `url.Parse` unescaping of a path: `%XX` decoded, a malformed escape an
/// error (`net/url`, `unescape` in `encodePath` mode).
fn unescape_path(s: &str) -> Option<Vec<u8>> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            let hex = |c: u8| char::from(c).to_digit(16);
            let hi = b.get(i + 1).copied().and_then(hex)?;
            let lo = b.get(i + 2).copied().and_then(hex)?;
            out.push(u8::try_from(hi * 16 + lo).ok()?);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    Some(out)
}

/// The `:authority` grpc-go sends on a connection dialed as `grpc.Dial(target)`
/// (no authority option, insecure credentials).
pub fn dial_authority(target: &str) -> Result<String, BadTarget> {
    let bad = || BadTarget(target.to_owned());
    // A registered scheme: kubelet only ever uses `unix:` (the unix resolver
    // overrides the authority); `unix://host/…` is refused by that resolver.
    if let Some(rest) = target
        .strip_prefix("unix:")
        .or_else(|| target.strip_prefix("unix-abstract:"))
    {
        if let Some(after) = rest.strip_prefix("//") {
            if !after.starts_with('/') && !after.is_empty() {
                return Err(bad());
            }
        }
        return Ok(LOCALHOST.to_owned());
    }
    // Anything else is the passthrough resolver's: `passthrough:///` + target.
    let url_path = format!("/{target}");
    let cut = url_path.find(['?', '#']).unwrap_or(url_path.len());
    let decoded = unescape_path(&url_path[..cut]).ok_or_else(bad)?;
    let endpoint = decoded.strip_prefix(b"/").unwrap_or(&decoded);
    let endpoint = String::from_utf8_lossy(endpoint);
    Ok(if endpoint.starts_with(':') {
        format!("localhost{endpoint}")
    } else {
        encode_authority(&endpoint)
    })
}

/// The `:authority` of a socket dialed by its bare path (the plugin watcher,
/// kubelet 1.32's DRA client).
pub fn path_authority(socket: &Path) -> String {
    let target = socket.to_string_lossy();
    // A path with a malformed escape is one grpc-go cannot dial at all; send
    // what it would have encoded had it tried, so the call still shows the path.
    dial_authority(&target).unwrap_or_else(|_| encode_authority(&target))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_socket_path_is_percent_encoded_as_grpc_go_does() {
        assert_eq!(
            dial_authority("/var/lib/kubelet/plugins_registry/vfio-sandbox.rebellions.ai-reg.sock")
                .unwrap(),
            "%2Fvar%2Flib%2Fkubelet%2Fplugins_registry%2Fvfio-sandbox.rebellions.ai-reg.sock"
        );
        assert_eq!(
            dial_authority("/var/lib/kubelet/plugins/gpu.example.com/dra.sock").unwrap(),
            "%2Fvar%2Flib%2Fkubelet%2Fplugins%2Fgpu.example.com%2Fdra.sock"
        );
        // Sub-delims and authority delimiters stay; a space and non-ASCII do not.
        assert_eq!(
            dial_authority("/tmp/a b/x+y=z,@[1]:ü.sock").unwrap(),
            "%2Ftmp%2Fa%20b%2Fx+y=z,@[1]:%C3%BC.sock"
        );
        // Go's url.Parse decodes escapes and drops a query or fragment first.
        assert_eq!(
            dial_authority("/tmp/%41.sock?x#y").unwrap(),
            "%2Ftmp%2FA.sock"
        );
        assert!(dial_authority("/tmp/%zz.sock").is_err());
        // A relative path and a host:port.
        assert_eq!(dial_authority("run/x.sock").unwrap(), "run%2Fx.sock");
        assert_eq!(dial_authority(":50051").unwrap(), "localhost:50051");
    }

    #[test]
    fn the_unix_resolver_overrides_to_localhost() {
        assert_eq!(
            dial_authority("unix:/var/lib/kubelet/plugins/d/dra.sock").unwrap(),
            "localhost"
        );
        assert_eq!(
            dial_authority("unix:///var/lib/kubelet/plugins/d/dra.sock").unwrap(),
            "localhost"
        );
        assert!(dial_authority("unix://host/x.sock").is_err());
        assert_eq!(
            path_authority(Path::new("/run/x/dra.sock")),
            "%2Frun%2Fx%2Fdra.sock"
        );
    }
}
