//! sysfs attributes: read whole, up to one page, as text.

use std::path::Path;

use support::io::{absent_is_none, IoError, WrapIo};

/// The most of one sysfs attribute that is read: the kernel's attributes fit one page
/// (4 KiB, 64 KiB on some arm64 kernels); a longer file is not an attribute.
pub const MAX_ATTRIBUTE_BYTES: u64 = 64 * 1024;

/// Reads a sysfs attribute like [`support::io::read_trimmed`], but at most [`MAX_ATTRIBUTE_BYTES`]
/// (the rest is left unread, so a hostile tree cannot make us read without end).
/// Non-UTF-8 contents are an error (`InvalidData`) naming the file.
pub fn read_attribute(path: &Path) -> Result<String, IoError> {
    use std::io::Read;
    let mut file = std::fs::File::open(path).wrap_read(path)?;
    // An attribute arrives in one read; a read that fills the buffer may have more
    // behind it, so only then is the file read on (up to the limit).
    let mut first = [0u8; 256];
    let n = loop {
        match file.read(&mut first) {
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            other => break other.wrap_read(path)?,
        }
    };
    let mut bytes = first[..n].to_vec();
    if n == first.len() {
        file.take(MAX_ATTRIBUTE_BYTES - n as u64)
            .read_to_end(&mut bytes)
            .wrap_read(path)?;
    }
    let text = String::from_utf8(bytes)
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))
        .wrap_read(path)?;
    Ok(text.trim_end().to_owned())
}

/// Reads a sysfs attribute with [`read_attribute`], `None` when it does not exist.
pub fn read_optional_attribute(path: &Path) -> Result<Option<String>, IoError> {
    absent_is_none(read_attribute(path))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attributes_are_read_up_to_the_cap_and_must_be_utf8() {
        let dir = tempfile::tempdir_in(crate::testing::scratch_root()).unwrap();
        let file = dir.path().join("numa_node");
        assert!(read_optional_attribute(&file).unwrap().is_none());
        std::fs::write(&file, "0\n").unwrap();
        assert_eq!(read_attribute(&file).unwrap(), "0");
        let cap = usize::try_from(MAX_ATTRIBUTE_BYTES).unwrap();
        std::fs::write(&file, "7".repeat(cap + 10)).unwrap();
        assert_eq!(read_attribute(&file).unwrap().len(), cap);
        std::fs::write(&file, b"vfio\xff").unwrap();
        let err = read_attribute(&file).unwrap_err();
        assert_eq!(err.source.kind(), std::io::ErrorKind::InvalidData);
        assert!(
            support::error_chain(&err).starts_with(&format!("failed to read {}", file.display()))
        );
        let err = read_attribute(dir.path()).unwrap_err();
        assert!(
            !err.is_gone(),
            "a directory is not a vanished device: {err}"
        );
    }
}
