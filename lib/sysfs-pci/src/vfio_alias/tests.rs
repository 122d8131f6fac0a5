//! Tests of the alias matcher: the glob against the C library's own `fnmatch` (what
//! kmod calls), the choice among competing aliases, and hostile `modules.alias` files.

use std::io::ErrorKind::NotFound;

use super::*;
use proptest::prelude::*;

/// The C library's `fnmatch(pattern, text, 0)`: the function kmod's
/// `libkmod-index.c` matches aliases with, so the oracle is the real rule.
fn libc_fnmatch(pattern: &str, text: &str) -> bool {
    let p = std::ffi::CString::new(pattern).unwrap();
    let t = std::ffi::CString::new(text).unwrap();
    // SAFETY: both pointers are valid NUL-terminated strings that outlive the call;
    // fnmatch only reads them.
    #[allow(unsafe_code)]
    let rc = unsafe { nix::libc::fnmatch(p.as_ptr(), t.as_ptr(), 0) };
    rc == 0
}

fn glob(pattern: &str, text: &str) -> bool {
    glob_match(pattern.as_bytes(), text.as_bytes())
}

#[test]
fn glob_follows_the_kernel_rules_table() {
    for (pattern, text, want) in [
        // file2alias output: fixed fields and `*` fields.
        (
            "vfio_pci:v*d*sv*sd*bc*sc*i*",
            "vfio_pci:v00001EFFd00001250sv00001EFFsd00000000bc12sc00i00",
            true,
        ),
        (
            "vfio_pci:v000010DEd00002342sv*sd*bc*sc*i*",
            "vfio_pci:v000010DEd00002342sv000010DEsd000016EBbc03sc02i00",
            true,
        ),
        (
            "vfio_pci:v000010DEd00002342sv*sd*bc*sc*i*",
            "vfio_pci:v000010DEd00002343sv000010DEsd000016EBbc03sc02i00",
            false,
        ),
        (
            "vfio_pci:v000010DEd*sv*sd*bc03sc*i*",
            "vfio_pci:v000010DEd00002342sv0sd0bc03sc02i00",
            true,
        ),
        (
            "vfio_pci:v000010DEd*sv*sd*bc03sc*i*",
            "vfio_pci:v000010DEd00002342sv0sd0bc02sc02i00",
            false,
        ),
        // The prefix matters: a `pci:` alias never matches a `vfio_pci:` name.
        (
            "pci:v*d*sv*sd*bc*sc*i*",
            "vfio_pci:v1d2sv3sd4bc5sc6i7",
            false,
        ),
        // `*` spans anything, `?` one byte, the end must meet the end.
        ("a*", "a", true),
        ("*", "", true),
        ("?", "", false),
        ("a?c", "abc", true),
        ("a?c", "ac", false),
        ("*b*b", "abab", true),
        ("*b*b", "abba", false),
        // Bracket sets, ranges, negation with ! and ^, `]` first is literal.
        ("[0-9A-F]", "C", true),
        ("[0-9A-F]", "c", false),
        ("[!0-9]", "x", true),
        ("[^0-9]", "5", false),
        ("[]x]", "]", true),
        ("[!]x]", "]", false),
        ("[a-]", "-", true),
        ("[[:xdigit:]]", "e", true),
        ("[[:digit:]]", "e", false),
        ("[[:blank:]]", "\t", true),
        // An unknown class name matches nothing; a name with a byte outside a..y is
        // no class at all, so its '[' and ':' are members.
        ("[[:foo:]]", "f", false),
        ("*[![:foo:]]", "ab", false),
        ("[a[:B:]*", "[", true),
        ("[[:alpz:]x]", "zx]", true),
        // Backslash escapes; an unclosed `[` is a literal.
        ("\\*", "*", true),
        ("\\*", "a", false),
        ("a\\", "a\\", false),
        ("[ab", "[ab", true),
        ("[ab", "a", false),
    ] {
        assert_eq!(glob(pattern, text), want, "{pattern:?} vs {text:?}");
        assert_eq!(
            libc_fnmatch(pattern, text),
            want,
            "libc: {pattern:?} vs {text:?}"
        );
    }
}

fn glob_bytes() -> impl Strategy<Value = String> {
    proptest::collection::vec(
        prop::sample::select(vec![
            'a', 'b', 'B', '0', '*', '?', '[', ']', '!', '^', '-', '\\', ':',
        ]),
        0..12,
    )
    .prop_map(|v| v.into_iter().collect())
}

fn text_bytes() -> impl Strategy<Value = String> {
    proptest::collection::vec(
        prop::sample::select(vec![
            'a', 'b', 'B', '0', '*', '?', '[', ']', '!', '-', '\\', ':',
        ]),
        0..10,
    )
    .prop_map(|v| v.into_iter().collect())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(4000))]

    /// Any pattern over the glob's special bytes agrees with the C library's fnmatch.
    #[test]
    fn glob_agrees_with_libc_fnmatch(pattern in glob_bytes(), text in text_bytes()) {
        prop_assert_eq!(glob(&pattern, &text), libc_fnmatch(&pattern, &text),
            "{:?} vs {:?}", pattern, text);
    }

    /// A modalias-shaped pattern with some fields left open agrees too, and matches
    /// the modalias it was made from.
    #[test]
    fn modalias_patterns_agree_with_libc(
        fields in proptest::collection::vec(any::<bool>(), 7),
        ids in proptest::collection::vec(any::<u16>(), 7),
    ) {
        let names = ["v", "d", "sv", "sd", "bc", "sc", "i"];
        let mut name = String::from("vfio_pci:");
        let mut pattern = String::from("vfio_pci:");
        for (i, (open, id)) in fields.iter().zip(&ids).enumerate() {
            let value = if i < 4 { format!("{:08X}", id) } else { format!("{:02X}", id & 0xff) };
            name.push_str(names[i]);
            name.push_str(&value);
            pattern.push_str(names[i]);
            pattern.push_str(if *open { "*" } else { &value });
        }
        pattern.push('*');
        prop_assert!(glob(&pattern, &name));
        prop_assert!(libc_fnmatch(&pattern, &name));
    }
}

#[test]
fn glob_is_linear_enough_on_hostile_patterns() {
    // Many stars against a long text that never matches: a naive recursive matcher
    // would take exponential time; this one answers at once.
    let pattern = format!("{}b", "*a".repeat(40));
    let text = "a".repeat(5000);
    assert!(!glob(&pattern, &text));
}

const ALIASES: &str = "\
# Aliases extracted from modules themselves.
alias pci:v000010DEd00002342sv*sd*bc03sc*i* nvidia
alias vfio_pci:v*d*sv*sd*bc*sc*i* vfio_pci
alias vfio_pci:v000010DEd*sv*sd*bc03sc*i* first_gpu_vfio_pci
alias vfio_pci:v000010DEd*sv*sd*bc03sc02i* second_gpu_vfio_pci
alias vfio_pci:v000010DEd00002342sv*sd*bc*sc*i* nvgrace_gpu_vfio_pci
alias vfio_pci:v000010DEd00002342sv*sd*bc*sc*i* later_equal_vfio_pci
alias vfio_pci:v000015B3d0000101Esv*sd*bc*sc*i* mlx5_vfio_pci
";

fn table(text: &[u8]) -> AliasTable {
    AliasTable::parse(Path::new("/lib/modules/6.12.0/modules.alias"), text)
}

#[test]
fn the_most_specific_alias_wins_and_the_first_among_equals() {
    let t = table(ALIASES.as_bytes());
    assert_eq!(t.aliases.len(), 6);
    assert_eq!(t.ignored, 0);
    let grace = "pci:v000010DEd00002342sv000010DEsd000016EBbc03sc02i00";
    let best = t.best_match(grace).unwrap();
    // The catch-all has 7 stars, first_gpu 5, nvgrace 5, second_gpu 4.
    assert_eq!(best.module, "second_gpu_vfio_pci", "{best}");
    assert_eq!(best.wildcards(), 4);
    assert_eq!(best.line, 5);
    assert_eq!(
        best.to_string(),
        "alias vfio_pci:v000010DEd*sv*sd*bc03sc02i* second_gpu_vfio_pci"
    );
    // Subclass 00: first_gpu, nvgrace and later_equal tie at 5; the earliest wins.
    let other = t
        .best_match("pci:v000010DEd00002342sv000010DEsd000016EBbc03sc00i00")
        .unwrap();
    assert_eq!(
        (other.module.as_str(), other.line),
        ("first_gpu_vfio_pci", 4)
    );
    // Not a display controller: nvgrace and later_equal tie; the earlier line wins.
    let coproc = t
        .best_match("pci:v000010DEd00002342sv000010DEsd000016EBbc12sc00i00")
        .unwrap();
    assert_eq!(
        (coproc.module.as_str(), coproc.line),
        ("nvgrace_gpu_vfio_pci", 6)
    );
    // A different NVIDIA GPU: only the class alias and the catch-all.
    let gpu = t
        .best_match("pci:v000010DEd000026B9sv000010DEsd00001957bc03sc02i00")
        .unwrap();
    assert_eq!(gpu.module, "second_gpu_vfio_pci");
    // A Rebellions NPU: only vfio-pci's catch-all.
    let npu = t
        .best_match("pci:v00001EFFd00001250sv00001EFFsd00000000bc12sc00i00")
        .unwrap();
    assert_eq!(
        (npu.module.as_str(), npu.driver()),
        ("vfio_pci", "vfio-pci".to_owned())
    );
    // Not a PCI modalias at all.
    assert_eq!(
        t.best_match("usb:v1D6Bp0002d0606dc09dsc00dp01ic09isc00ip00in00"),
        None
    );
}

#[test]
fn no_catch_all_means_no_match() {
    let t = table(b"alias vfio_pci:v000015B3d0000101Esv*sd*bc*sc*i* mlx5_vfio_pci\n");
    assert_eq!(
        t.best_match("pci:v00001EFFd00001250sv00001EFFsd00000000bc12sc00i00"),
        None
    );
    assert_eq!(
        t.best_match("pci:v000015B3d0000101Esv000015B3sd00000001bc02sc00i00")
            .map(|a| a.driver()),
        Some("mlx5_vfio_pci".to_owned())
    );
}

#[test]
fn junk_lines_are_skipped_and_counted() {
    let mut text = Vec::new();
    text.extend_from_slice(b"garbage without meaning\n");
    text.extend_from_slice(b"alias vfio_pci:v*d*sv*sd*bc*sc*i*\n"); // no module
    text.extend_from_slice(b"alias vfio_pci:v*d* vfio_pci extra\n"); // a word too many
    text.extend_from_slice(b"alias vfio_pci:v*d*sv*sd*bc*sc*i* ahci\n"); // not a vfio driver
    text.extend_from_slice(b"alias vfio_pci:v\xff\xfe* bad_vfio_pci\n"); // not UTF-8
    text.extend_from_slice(
        format!("alias vfio_pci:{} huge_vfio_pci\n", "*".repeat(200_000)).as_bytes(),
    );
    text.extend_from_slice(b"\x00\x01\x02\n\n\n");
    text.extend_from_slice(b"alias\tvfio_pci:v00001EFFd*sv*sd*bc*sc*i*\tnpu_vfio_pci"); // tabs, no final newline
    let t = table(&text);
    assert_eq!(t.ignored, 5, "{t:?}");
    assert_eq!(t.aliases.len(), 1);
    let best = t
        .best_match("pci:v00001EFFd00001250sv00001EFFsd00000000bc12sc00i00")
        .unwrap();
    assert_eq!((best.module.as_str(), best.line), ("npu_vfio_pci", 10));
}

#[test]
fn reading_refuses_what_is_not_a_small_regular_file() {
    let dir = tempfile::tempdir().unwrap();
    let host = Host::new(
        dir.path().join("sys"),
        dir.path().join("dev"),
        dir.path().join("lib/modules"),
    );
    let err = AliasTable::read(&host, "6.12.0").unwrap_err();
    assert!(matches!(&err, AliasError::Read { source, .. } if source.kind() == NotFound));
    assert!(
        err.to_string().contains("lib/modules/6.12.0/modules.alias"),
        "{err}"
    );

    let release = host.modules_release_dir("6.12.0");
    std::fs::create_dir_all(release.join("modules.alias")).unwrap();
    let err = AliasTable::read(&host, "6.12.0").unwrap_err();
    assert!(err.to_string().contains("a directory"), "{err}");

    std::fs::remove_dir(release.join("modules.alias")).unwrap();
    std::fs::write(release.join("modules.alias"), ALIASES).unwrap();
    let t = AliasTable::read(&host, "6.12.0").unwrap();
    assert_eq!(t.aliases.len(), 6);
    assert_eq!(t.path, release.join("modules.alias"));
}

#[test]
fn the_modalias_is_read_or_built_as_the_kernel_prints_it() {
    let dir = tempfile::tempdir().unwrap();
    let host = Host::new(
        dir.path().join("sys"),
        dir.path().join("dev"),
        dir.path().join("lib/modules"),
    );
    let addr: PciAddress = "0000:3b:00.0".parse().unwrap();
    let dev = host.device_dir(&addr);
    std::fs::create_dir_all(&dev).unwrap();
    for (name, value) in [
        ("vendor", "0x10de"),
        ("device", "0x2342"),
        ("subsystem_vendor", "0x10de"),
        ("subsystem_device", "0x16eb"),
        ("class", "0x030200"),
    ] {
        std::fs::write(dev.join(name), format!("{value}\n")).unwrap();
    }
    assert_eq!(
        device_modalias(&host, &addr).unwrap(),
        "pci:v000010DEd00002342sv000010DEsd000016EBbc03sc02i00"
    );
    std::fs::write(
        dev.join("modalias"),
        "pci:v000010DEd00002342sv000010DEsd000016EBbc03sc02i00\n",
    )
    .unwrap();
    std::fs::write(dev.join("class"), "junk\n").unwrap();
    assert_eq!(
        device_modalias(&host, &addr).unwrap(),
        "pci:v000010DEd00002342sv000010DEsd000016EBbc03sc02i00",
        "the sysfs file wins"
    );
    std::fs::remove_file(dev.join("modalias")).unwrap();
    let err = device_modalias(&host, &addr).unwrap_err();
    assert!(
        support::error_chain(&err).contains("class"),
        "{}",
        support::error_chain(&err)
    );
}
