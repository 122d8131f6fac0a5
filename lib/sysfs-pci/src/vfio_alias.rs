//! Which vfio driver the running kernel itself offers for a device: the `vfio_pci:`
//! aliases of `<modules-root>/<release>/modules.alias`, matched against the device's
//! `modalias` the way the kernel's module tools match aliases.
//!
//! A vfio-pci variant driver declares the devices it serves with
//! `PCI_DRIVER_OVERRIDE_DEVICE_VFIO()` (`include/linux/pci.h`); the flag
//! `PCI_ID_F_VFIO_DRIVER_OVERRIDE` makes `scripts/mod/file2alias.c` (`do_pci_entry`)
//! write the alias with the prefix `vfio_pci:` instead of `pci:`, so udev never
//! autoloads it, and vfio-pci itself adds the catch-all `vfio_pci:v*d*sv*sd*bc*sc*i*`
//! (`drivers/vfio/pci/vfio_pci.c`). `file2alias.c` prints each field as `%08X`
//! (`%02X` for the class bytes) or `*` when the driver leaves it open, and ends every
//! alias with `*`:
//!
//! ```text
//! alias vfio_pci:v000010DEd00002342sv*sd*bc*sc*i* nvgrace_gpu_vfio_pci
//! alias vfio_pci:v*d*sv*sd*bc*sc*i* vfio_pci
//! ```
//!
//! The kernel commit that added the prefix (`vfio: Introduce the
//! PCI_ID_F_VFIO_DRIVER_OVERRIDE flag`) spells out the algorithm for userspace: take
//! the device's `modalias` (`drivers/pci/pci-sysfs.c`, `modalias_show`), replace the
//! leading `pci:` with `vfio_pci:`, and match it against the aliases as modprobe
//! does — kmod's `fnmatch(pattern, alias, 0)` (`libkmod/libkmod-index.c`), a shell
//! glob with `*`, `?` and `[...]` ([`glob_match`]). Several aliases match (at least
//! vfio-pci's catch-all); the most specific wins: the one with the fewest `*`, the
//! earliest in the file among equals. That is libvirt's
//! `virPCIDeviceFindBestVFIOVariant` (libvirt commit 82e2fac2) and NVIDIA's
//! `FindBestVFIOVariant` (its `nvpci` package, used by vfio-manage), which count
//! wildcards and keep the first of equals.
//!
//! ```
//! use sysfs_pci::vfio_alias::AliasTable;
//! let table = AliasTable::parse(
//!     "modules.alias".as_ref(),
//!     b"alias vfio_pci:v*d*sv*sd*bc*sc*i* vfio_pci\n\
//!       alias vfio_pci:v000010DEd00002342sv*sd*bc*sc*i* nvgrace_gpu_vfio_pci\n",
//! );
//! let best = table.best_match("pci:v000010DEd00002342sv000010DEsd000016EBbc03sc02i00").unwrap();
//! assert_eq!(best.driver(), "nvgrace_gpu_vfio_pci");
//! let other = table.best_match("pci:v00001EFFd00001250sv00001EFFsd00000000bc12sc00i00").unwrap();
//! assert_eq!(other.driver(), "vfio-pci");
//! ```

use std::fmt;
use std::path::{Path, PathBuf};

use crate::attribute::read_optional_attribute;
use crate::vfio_driver::{is_vfio_driver, VFIO_PCI};
use crate::{Host, PciAddress};
use support::io::{read_small_bytes, IoError, SmallFileError};

/// The start of every line this module reads from `modules.alias` (as depmod writes it).
pub const ALIAS_PREFIX: &str = "alias vfio_pci:";

/// The largest `modules.alias` read: 64 MiB (a distribution kernel's is about 1.5 MB).
pub const MAX_ALIAS_FILE_BYTES: u64 = 64 * 1024 * 1024;

/// The longest alias pattern considered; longer ones are junk, never a kernel's.
pub const MAX_PATTERN_BYTES: usize = 1024;

/// One `alias vfio_pci:<pattern> <module>` line.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct VfioAlias {
    /// 1-based line number in the file.
    pub line: usize,
    /// The pattern, `vfio_pci:` included.
    pub pattern: String,
    /// The module the alias names, e.g. `nvgrace_gpu_vfio_pci`.
    pub module: String,
}

impl VfioAlias {
    /// The driver the module registers: `vfio-pci` for the module `vfio_pci`, the
    /// module name for a variant (they register `KBUILD_MODNAME`).
    pub fn driver(&self) -> String {
        driver_of_module(&self.module)
    }

    /// How many `*` the pattern has: fewer is more specific.
    pub fn wildcards(&self) -> usize {
        self.pattern.bytes().filter(|&b| b == b'*').count()
    }
}

impl fmt::Display for VfioAlias {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "alias {} {}", self.pattern, self.module)
    }
}

/// The driver name a vfio module registers under `/sys/bus/pci/drivers`.
pub fn driver_of_module(module: &str) -> String {
    if module == "vfio_pci" {
        VFIO_PCI.to_owned()
    } else {
        module.to_owned()
    }
}

/// The `vfio_pci:` aliases of one `modules.alias`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AliasTable {
    /// The file read.
    pub path: PathBuf,
    /// Usable aliases, in file order.
    pub aliases: Vec<VfioAlias>,
    /// `alias vfio_pci:` lines left out: not UTF-8, malformed, a pattern longer than
    /// [`MAX_PATTERN_BYTES`], or a module that is not a vfio driver.
    pub ignored: usize,
}

/// Why `modules.alias` could not be read.
#[derive(Debug, thiserror::Error)]
pub enum AliasError {
    /// Opening or reading it failed (it may not exist).
    #[error("cannot read {}", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// Not a regular file, or larger than [`MAX_ALIAS_FILE_BYTES`].
    #[error("refusing to read {}: {problem}", path.display())]
    Refused {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        problem: String,
    },
}

impl AliasTable {
    /// `<modules-root>/<release>/modules.alias` of `host`.
    pub fn path(host: &Host, release: &str) -> PathBuf {
        host.modules_release_dir(release).join("modules.alias")
    }

    /// Reads and parses the `modules.alias` of `release` under `host`.
    pub fn read(host: &Host, release: &str) -> Result<Self, AliasError> {
        let path = Self::path(host, release);
        match read_small_bytes(&path, MAX_ALIAS_FILE_BYTES) {
            Ok(bytes) => Ok(Self::parse(&path, &bytes)),
            Err(SmallFileError::Io(source)) => Err(AliasError::Read { path, source }),
            Err(other) => Err(AliasError::Refused {
                problem: other.to_string(),
                path,
            }),
        }
    }

    /// Parses the text of a `modules.alias` (any bytes: lines that are not
    /// `alias vfio_pci:<pattern> <module>` in UTF-8 are skipped).
    pub fn parse(path: &Path, bytes: &[u8]) -> Self {
        let mut table = Self {
            path: path.to_owned(),
            ..Self::default()
        };
        for (i, raw) in bytes.split(|&b| b == b'\n').enumerate() {
            if !is_vfio_alias_line(raw) {
                continue;
            }
            match parse_line(i + 1, raw) {
                Some(alias) => table.aliases.push(alias),
                None => table.ignored += 1,
            }
        }
        table
    }

    /// The most specific alias matching a device's `modalias` (`pci:v…`), or `None`
    /// when none does (or the modalias is not a PCI one).
    pub fn best_match(&self, modalias: &str) -> Option<&VfioAlias> {
        let name = vfio_modalias(modalias)?;
        let mut best: Option<&VfioAlias> = None;
        for alias in &self.aliases {
            if !glob_match(alias.pattern.as_bytes(), name.as_bytes()) {
                continue;
            }
            // Strictly fewer: among equals the first in the file stays.
            if best.is_none_or(|b| alias.wildcards() < b.wildcards()) {
                best = Some(alias);
            }
        }
        best
    }
}

/// Whether a line is an `alias` whose pattern starts with `vfio_pci:` (depmod writes
/// one space between words; any whitespace is accepted).
fn is_vfio_alias_line(raw: &[u8]) -> bool {
    let Some(rest) = raw.trim_ascii_start().strip_prefix(b"alias") else {
        return false;
    };
    rest.first().is_some_and(u8::is_ascii_whitespace)
        && rest.trim_ascii_start().starts_with(b"vfio_pci:")
}

/// `alias vfio_pci:<pattern> <module>`, split on whitespace as kmod's config reader
/// does; `None` for anything else.
fn parse_line(line: usize, raw: &[u8]) -> Option<VfioAlias> {
    let text = std::str::from_utf8(raw).ok()?;
    let mut words = text.split_ascii_whitespace();
    let (Some("alias"), Some(pattern), Some(module), None) =
        (words.next(), words.next(), words.next(), words.next())
    else {
        return None;
    };
    if pattern.len() > MAX_PATTERN_BYTES || !is_vfio_driver(&driver_of_module(module)) {
        return None;
    }
    Some(VfioAlias {
        line,
        pattern: pattern.to_owned(),
        module: module.to_owned(),
    })
}

/// A device's `modalias` with `pci:` replaced by `vfio_pci:`; `None` when it does
/// not start with `pci:`.
pub fn vfio_modalias(modalias: &str) -> Option<String> {
    modalias
        .trim()
        .strip_prefix("pci:")
        .map(|rest| format!("vfio_pci:{rest}"))
}

/// The `modalias` of the device at `address`: the sysfs file, or, where a tree has
/// none, the same string built from the id attributes as `modalias_show`
/// (`drivers/pci/pci-sysfs.c`) prints it:
/// `pci:v%08Xd%08Xsv%08Xsd%08Xbc%02Xsc%02Xi%02X`.
pub fn device_modalias(host: &Host, address: &PciAddress) -> Result<String, IoError> {
    let dir = host.device_dir(address);
    if let Some(text) = read_optional_attribute(&dir.join("modalias"))? {
        return Ok(text.trim().to_owned());
    }
    let hex = |name: &str| -> Result<u32, IoError> {
        let path = dir.join(name);
        let text = crate::attribute::read_attribute(&path)?;
        crate::device::parse_hex(&text).ok_or_else(|| {
            IoError::new(
                support::io::Action::Read,
                path,
                std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    format!("{:?} is not a hex number", text.trim()),
                ),
            )
        })
    };
    let class = hex("class")?;
    Ok(format!(
        "pci:v{:08X}d{:08X}sv{:08X}sd{:08X}bc{:02X}sc{:02X}i{:02X}",
        hex("vendor")?,
        hex("device")?,
        hex("subsystem_vendor")?,
        hex("subsystem_device")?,
        (class >> 16) & 0xff,
        (class >> 8) & 0xff,
        class & 0xff
    ))
}

/// `fnmatch(pattern, text, 0)` of the C library, as kmod calls it: `*` matches any
/// run of bytes (`/` and a leading `.` included: no flags), `?` any one byte,
/// `[...]` one byte of a set (`!` or `^` first negates, `a-z` ranges, `]` first is
/// literal, `[:alpha:]`-style classes), `\` makes the next byte literal (a trailing
/// `\` matches nothing). An unclosed `[` is a literal `[`.
///
/// Runs in O(pattern × text) time without recursion: on a mismatch it retries from
/// the last `*` only, which is exact because every other element matches one byte.
pub fn glob_match(pattern: &[u8], text: &[u8]) -> bool {
    let (mut p, mut t) = (0, 0);
    // Where to resume after the last `*`: (pattern after it, text it took up to).
    let mut resume: Option<(usize, usize)> = None;
    loop {
        if p < pattern.len() && pattern[p] == b'*' {
            p += 1;
            resume = Some((p, t));
            continue;
        }
        if p == pattern.len() && t == text.len() {
            return true;
        }
        if p < pattern.len() && t < text.len() {
            if let Some(next) = match_one(pattern, p, text[t]) {
                p = next;
                t += 1;
                continue;
            }
        }
        match resume {
            Some((after_star, taken)) if taken < text.len() => {
                resume = Some((after_star, taken + 1));
                p = after_star;
                t = taken + 1;
            }
            _ => return false,
        }
    }
}

/// Whether the element at `pattern[p]` (not `*`) matches `c`; the index after it if so.
fn match_one(pattern: &[u8], p: usize, c: u8) -> Option<usize> {
    match pattern[p] {
        b'?' => Some(p + 1),
        b'\\' => {
            let literal = *pattern.get(p + 1)?;
            (literal == c).then_some(p + 2)
        }
        b'[' => match bracket(pattern, p, c) {
            Some((matched, next)) => matched.then_some(next),
            // Unclosed: a literal '['.
            None => (c == b'[').then_some(p + 1),
        },
        literal => (literal == c).then_some(p + 1),
    }
}

/// A bracket expression starting at `pattern[open] == b'['`: whether `c` is in it and
/// the index after its `]`; `None` when it is not closed.
fn bracket(pattern: &[u8], open: usize, c: u8) -> Option<(bool, usize)> {
    let mut i = open + 1;
    let negate = matches!(pattern.get(i), Some(b'!' | b'^'));
    if negate {
        i += 1;
    }
    let mut matched = false;
    let mut first = true;
    loop {
        let b = *pattern.get(i)?;
        if b == b']' && !first {
            return Some((matched != negate, i + 1));
        }
        first = false;
        if b == b'[' && pattern.get(i + 1) == Some(&b':') {
            match class(pattern, i + 2, c) {
                Class::Member(in_class, next) => {
                    matched |= in_class;
                    i = next;
                    continue;
                }
                // glibc: an unknown class name makes the whole pattern match nothing.
                Class::Unknown => return Some((false, pattern.len())),
                // Not a class name at all: the '[' is a member like any other byte.
                Class::Literal => {}
            }
        }
        let (low, next) = bracket_byte(pattern, i)?;
        i = next;
        if pattern.get(i) == Some(&b'-') && pattern.get(i + 1).is_some_and(|&b| b != b']') {
            let (high, next) = bracket_byte(pattern, i + 1)?;
            i = next;
            matched |= (low..=high).contains(&c);
        } else {
            matched |= low == c;
        }
    }
}

/// One byte inside brackets, `\` escaping the next; the index after it.
fn bracket_byte(pattern: &[u8], i: usize) -> Option<(u8, usize)> {
    match *pattern.get(i)? {
        b'\\' => Some((*pattern.get(i + 1)?, i + 2)),
        b => Some((b, i + 1)),
    }
}

/// What `[:` inside a bracket expression turns out to be.
enum Class {
    /// A known class: whether the byte is in it, and the index after its `:]`.
    Member(bool, usize),
    /// A well-formed but unknown name such as `[:foo:]`.
    Unknown,
    /// Not a class (a byte outside `a`..`y` before any `:]`): the `[` is literal.
    Literal,
}

/// `[:name:]` whose name starts at `start`, parsed as glibc's `fnmatch_loop.c` does:
/// a name is made of the bytes `a` to `y` (its test is `c < 'a' || c >= 'z'`).
fn class(pattern: &[u8], start: usize, c: u8) -> Class {
    let mut end = start;
    loop {
        match pattern.get(end) {
            Some(b':') if pattern.get(end + 1) == Some(&b']') => break,
            Some(b) if (b'a'..=b'y').contains(b) => end += 1,
            _ => return Class::Literal,
        }
    }
    let in_class = match &pattern[start..end] {
        b"alpha" => c.is_ascii_alphabetic(),
        b"digit" => c.is_ascii_digit(),
        b"alnum" => c.is_ascii_alphanumeric(),
        b"xdigit" => c.is_ascii_hexdigit(),
        b"upper" => c.is_ascii_uppercase(),
        b"lower" => c.is_ascii_lowercase(),
        b"space" => c.is_ascii_whitespace() || c == 0x0b,
        b"blank" => c == b' ' || c == b'\t',
        b"punct" => c.is_ascii_punctuation(),
        b"print" => (0x20..0x7f).contains(&c),
        b"graph" => (0x21..0x7f).contains(&c),
        b"cntrl" => c < 0x20 || c == 0x7f,
        _ => return Class::Unknown,
    };
    Class::Member(in_class, end + 2)
}

#[cfg(test)]
mod tests;
