//! Kernel modules without `modprobe`: `modules.dep` resolution, `finit_module`, and a
//! non-blocking `delete_module`.
//!
//! ```
//! use sysfs_pci::module::ModulesDep;
//! let dep = ModulesDep::parse(
//!     "kernel/drivers/vfio/pci/vfio-pci.ko: kernel/drivers/vfio/pci/vfio-pci-core.ko kernel/drivers/vfio/vfio.ko\n\
//!      kernel/drivers/vfio/pci/vfio-pci-core.ko: kernel/drivers/vfio/vfio.ko\n\
//!      kernel/drivers/vfio/vfio.ko:\n",
//! );
//! let order: Vec<_> = dep.load_order("vfio-pci").unwrap().iter().map(|m| m.name.clone()).collect();
//! assert_eq!(order, ["vfio", "vfio_pci_core", "vfio_pci"]);
//! ```

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use crate::kernel::{Kernel, SyscallError};
use crate::Host;
use support::io::{read_trimmed, IoError};

/// Why a module could not be loaded or unloaded.
#[derive(Debug, thiserror::Error)]
pub enum ModuleError {
    /// `modules.dep` could not be read.
    #[error("cannot resolve module {module} (is the host's {root} mounted into the container?)")]
    ReadDep {
        /// The module asked for.
        module: String,
        /// The modules root.
        root: String,
        /// The read failure.
        #[source]
        source: IoError,
    },
    /// The module is not in `modules.dep`.
    #[error("module {module} is not in {path}")]
    NotFound {
        /// The module asked for.
        module: String,
        /// The `modules.dep` searched.
        path: PathBuf,
    },
    /// The kernel cannot decompress a compressed module file itself.
    #[error(
        "failed to load module {module} from {}: the kernel does not decompress modules itself \
         (it needs CONFIG_MODULE_DECOMPRESS, Linux 5.17 or later)",
        file.display()
    )]
    #[allow(missing_docs)]
    LoadCompressed {
        module: String,
        /// The compressed file (`.ko.xz`, `.ko.zst`, `.ko.gz`).
        file: PathBuf,
        /// The syscall failure.
        #[source]
        source: SyscallError,
    },
    /// The kernel refused to load it.
    #[error("failed to load module {module}")]
    #[allow(missing_docs)]
    Load {
        module: String,
        /// The syscall failure.
        #[source]
        source: SyscallError,
    },
    /// The module is in use and was not unloaded.
    #[error("module {module} is in use (refcount > 0); not unloading it")]
    #[allow(missing_docs)]
    InUse { module: String },
    /// The kernel refused to unload it for another reason.
    #[error("failed to unload module {module}")]
    #[allow(missing_docs)]
    Unload {
        module: String,
        /// The syscall failure.
        #[source]
        source: SyscallError,
    },
}

/// One module file from `modules.dep`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModuleFile {
    /// Canonical name: file stem with `-` turned into `_` (`vfio_pci`).
    pub name: String,
    /// Path relative to the release directory.
    pub path: PathBuf,
}

/// A parsed `modules.dep`.
#[derive(Debug, Default, Clone)]
pub struct ModulesDep {
    deps: HashMap<String, (ModuleFile, Vec<ModuleFile>)>,
}

/// The canonical module name: `-` and `_` are the same to the kernel.
pub fn canonical_name(name: &str) -> String {
    name.replace('-', "_")
}

fn module_file(path: &str) -> Option<ModuleFile> {
    let file = Path::new(path).file_name()?.to_str()?;
    let stem = file.split(".ko").next()?;
    (!stem.is_empty()).then(|| ModuleFile {
        name: canonical_name(stem),
        path: PathBuf::from(path),
    })
}

impl ModulesDep {
    /// Parses the text of `modules.dep` (`path: dep dep ...` per line).
    pub fn parse(text: &str) -> Self {
        let mut deps = HashMap::new();
        for line in text.lines() {
            let Some((target, rest)) = line.split_once(':') else {
                continue;
            };
            let Some(module) = module_file(target.trim()) else {
                continue;
            };
            let list = rest.split_whitespace().filter_map(module_file).collect();
            deps.insert(module.name.clone(), (module, list));
        }
        Self { deps }
    }

    /// Reads `<modules>/<release>/modules.dep`.
    pub fn read(host: &Host, release: &str) -> Result<Self, IoError> {
        let path = host.modules_release_dir(release).join("modules.dep");
        read_trimmed(&path).map(|t| Self::parse(&t))
    }

    /// The files to load for `name`, dependencies first, the module last.
    ///
    /// `modules.dep` lists a module's dependencies so that the last one must be loaded
    /// first (as `modprobe` does); each appears once.
    pub fn load_order(&self, name: &str) -> Option<Vec<ModuleFile>> {
        let (module, deps) = self.deps.get(&canonical_name(name))?;
        let mut order: Vec<ModuleFile> = deps.iter().rev().cloned().collect();
        order.push(module.clone());
        Some(order)
    }
}

/// True when `/sys/module/<name>` exists (loaded, or built in with parameters).
pub fn is_loaded(host: &Host, name: &str) -> bool {
    Host::exists(&host.module_dir(name))
}

/// The running kernel's release (`uname -r`).
pub fn kernel_release() -> String {
    nix::sys::utsname::uname()
        .map(|u| u.release().to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// Loads `name` and its dependencies from `<modules>/<release>`, skipping those
/// already loaded. Returns the modules actually loaded, in order.
///
/// Files are loaded as `modules.dep` names them, compressed ones (`.ko.xz` on Debian 13)
/// included: [`Kernel::load_module`] asks the kernel to decompress them
/// (`MODULE_INIT_COMPRESSED_FILE`); a kernel that cannot is reported as
/// [`ModuleError::LoadCompressed`].
pub fn load(
    host: &Host,
    kernel: &dyn Kernel,
    release: &str,
    name: &str,
) -> Result<Vec<String>, ModuleError> {
    let module = canonical_name(name);
    if is_loaded(host, &module) {
        return Ok(Vec::new());
    }
    let dep = ModulesDep::read(host, release).map_err(|source| ModuleError::ReadDep {
        module: module.clone(),
        root: host.modules.display().to_string(),
        source,
    })?;
    let order = dep
        .load_order(&module)
        .ok_or_else(|| ModuleError::NotFound {
            module: module.clone(),
            path: host.modules_release_dir(release).join("modules.dep"),
        })?;
    let mut loaded = Vec::new();
    for file in order {
        if is_loaded(host, &file.name) {
            continue;
        }
        let path = host.modules_release_dir(release).join(&file.path);
        match kernel.load_module(&file.name, &path) {
            Ok(()) => {
                if !kernel.is_dry_run() {
                    tracing::info!(module = %file.name, file = %path.display(), "loaded module");
                }
                loaded.push(file.name);
            }
            // Loaded meanwhile (or built in): fine.
            Err(e) if e.errno() == Some(nix::errno::Errno::EEXIST) => {}
            Err(source)
                if source.errno() == Some(nix::errno::Errno::EOPNOTSUPP)
                    && crate::kernel::is_compressed(&path) =>
            {
                return Err(ModuleError::LoadCompressed {
                    module: file.name,
                    file: path,
                    source,
                })
            }
            Err(source) => {
                return Err(ModuleError::Load {
                    module: file.name,
                    source,
                })
            }
        }
    }
    Ok(loaded)
}

/// Unloads `name` if loaded; `Ok(false)` when it was not loaded.
/// Never waits: a module in use is reported as [`ModuleError::InUse`].
pub fn unload(host: &Host, kernel: &dyn Kernel, name: &str) -> Result<bool, ModuleError> {
    let module = canonical_name(name);
    if !is_loaded(host, &module) {
        return Ok(false);
    }
    match kernel.unload_module(&module) {
        Ok(()) => {
            if !kernel.is_dry_run() {
                tracing::info!(module = %module, "unloaded module");
            }
            Ok(true)
        }
        Err(e)
            if matches!(
                e.errno(),
                Some(nix::errno::Errno::EWOULDBLOCK | nix::errno::Errno::EBUSY)
            ) =>
        {
            Err(ModuleError::InUse { module })
        }
        Err(e) if e.errno() == Some(nix::errno::Errno::ENOENT) => Ok(false),
        Err(source) => Err(ModuleError::Unload { module, source }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DEP: &str = "\
kernel/drivers/vfio/pci/vfio-pci.ko.xz: kernel/drivers/vfio/pci/vfio-pci-core.ko.xz kernel/drivers/vfio/vfio.ko.xz kernel/drivers/vfio/vfio_iommu_type1.ko.xz kernel/virt/lib/irqbypass.ko.xz
kernel/drivers/vfio/pci/vfio-pci-core.ko.xz: kernel/drivers/vfio/vfio.ko.xz kernel/virt/lib/irqbypass.ko.xz
kernel/drivers/vfio/vfio.ko.xz:
kernel/virt/lib/irqbypass.ko.xz:
garbage line without colon
";

    #[test]
    fn parses_compressed_names_and_orders_dependencies_last_first() {
        let dep = ModulesDep::parse(DEP);
        let order = dep.load_order("vfio_pci").unwrap();
        let names: Vec<_> = order.iter().map(|m| m.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "irqbypass",
                "vfio_iommu_type1",
                "vfio",
                "vfio_pci_core",
                "vfio_pci"
            ]
        );
        assert_eq!(
            order[4].path,
            PathBuf::from("kernel/drivers/vfio/pci/vfio-pci.ko.xz")
        );
    }

    /// Records the files it is asked to load; answers each with `answer`.
    struct LoadRecorder {
        loaded: std::sync::Mutex<Vec<PathBuf>>,
        answer: Option<nix::errno::Errno>,
    }

    impl Kernel for LoadRecorder {
        fn write(&self, _path: &Path, _data: &str) -> Result<(), IoError> {
            Ok(())
        }
        fn load_module(&self, name: &str, file: &Path) -> Result<(), SyscallError> {
            self.loaded.lock().unwrap().push(file.to_path_buf());
            match self.answer {
                None => Ok(()),
                Some(errno) => Err(SyscallError::Kernel {
                    call: "finit_module",
                    target: name.to_owned(),
                    errno,
                }),
            }
        }
        fn unload_module(&self, _name: &str) -> Result<(), SyscallError> {
            Ok(())
        }
        fn group_in_use(&self, _node: &Path) -> Result<bool, IoError> {
            Ok(false)
        }
    }

    /// A host whose modules tree holds [`DEP`] for release `6.12.0-test`.
    fn host_with_dep(dir: &Path) -> Host {
        let release = dir.join("modules/6.12.0-test");
        std::fs::create_dir_all(&release).unwrap();
        std::fs::write(release.join("modules.dep"), DEP).unwrap();
        std::fs::create_dir_all(dir.join("sys/module")).unwrap();
        Host::new(dir.join("sys"), dir.join("dev"), dir.join("modules"))
    }

    #[test]
    fn loads_compressed_files_as_modules_dep_names_them() {
        let dir = tempfile::tempdir().unwrap();
        let host = host_with_dep(dir.path());
        let kernel = LoadRecorder {
            loaded: Default::default(),
            answer: None,
        };
        let loaded = load(&host, &kernel, "6.12.0-test", "vfio-pci").unwrap();
        assert_eq!(
            loaded,
            [
                "irqbypass",
                "vfio_iommu_type1",
                "vfio",
                "vfio_pci_core",
                "vfio_pci"
            ]
        );
        let release = dir.path().join("modules/6.12.0-test");
        assert_eq!(
            kernel.loaded.lock().unwrap()[4],
            release.join("kernel/drivers/vfio/pci/vfio-pci.ko.xz")
        );
        assert!(kernel
            .loaded
            .lock()
            .unwrap()
            .iter()
            .all(|f| crate::kernel::is_compressed(f)));
    }

    #[test]
    fn a_kernel_that_cannot_decompress_is_named_as_the_cause() {
        let dir = tempfile::tempdir().unwrap();
        let host = host_with_dep(dir.path());
        let kernel = LoadRecorder {
            loaded: Default::default(),
            answer: Some(nix::errno::Errno::EOPNOTSUPP),
        };
        let err = load(&host, &kernel, "6.12.0-test", "vfio").unwrap_err();
        assert!(matches!(err, ModuleError::LoadCompressed { .. }), "{err:?}");
        let msg = err.to_string();
        assert!(msg.contains("vfio.ko.xz"), "{msg}");
        assert!(msg.contains("CONFIG_MODULE_DECOMPRESS"), "{msg}");
    }

    #[test]
    fn dash_and_underscore_are_the_same_module() {
        let dep = ModulesDep::parse(DEP);
        assert_eq!(dep.load_order("vfio-pci-core").unwrap().len(), 3);
        assert!(dep.load_order("nvidia").is_none());
    }
}
