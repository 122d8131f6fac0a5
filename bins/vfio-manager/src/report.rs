//! Turning library reports into lines for people.

use passthrough::{BindReport, PassthroughError, RestoreReport};
use support::error_chain as chain;

/// What vfio-manager does about devices a failed rollback left half-bound.
const HALF_BOUND_ADVICE: &str = "`vfio-manager unbind` puts them back once the cause is \
     fixed, and so does the restore when the node leaves VM mode";

/// A failure of the passthrough engine, said with vfio-manager's own advice.
pub fn failure(e: &PassthroughError) -> String {
    if e.left_half_bound() {
        format!("{}; {HALF_BOUND_ADVICE}", chain(e))
    } else {
        chain(e)
    }
}

/// Prints a bind report (of a dry run when `dry`); true when nothing failed.
pub fn print_bind(report: &BindReport, dry: bool) -> bool {
    for (addr, previous) in &report.bound {
        let from = previous.as_deref().unwrap_or("no driver");
        match dry {
            true => support::outln!("would bind {addr} (now on {from})"),
            false => support::outln!("bound {addr} (was on {from})"),
        }
    }
    for addr in &report.already {
        support::outln!("already bound {addr}");
    }
    for e in &report.failed {
        support::errln!("vfio-manager: error: {}", failure(e));
    }
    report.failed.is_empty()
}

/// What to say of a group a VM holds.
pub struct Held<'a> {
    /// How it gets restored later, e.g. "run unbind again once the VM has stopped".
    pub again: &'a str,
    /// Groups said already (by an earlier pass of `run`): not repeated.
    pub said: &'a [u32],
}

/// `unbind`'s advice for a held group.
pub const HELD_BY_UNBIND: Held<'static> = Held {
    again: "run unbind again once the VM has stopped",
    said: &[],
};

/// Prints a restore report (of a dry run when `dry`); true when everything recorded
/// was put back.
pub fn print_restore(report: &RestoreReport, dry: bool, held: &Held<'_>) -> bool {
    let verb = if dry { "would restore" } else { "restored" };
    for m in &report.reloaded {
        support::outln!(
            "{} module {m}",
            if dry { "would reload" } else { "reloaded" }
        );
    }
    for (addr, driver) in &report.restored {
        support::outln!(
            "{verb} {addr} to {}",
            driver.as_deref().unwrap_or("no driver")
        );
    }
    for (addr, group) in report.in_use.iter().filter(|(_, g)| !held.said.contains(g)) {
        support::errln!(
            "vfio-manager: warning: skipped {addr}: /dev/vfio/{group} is open (a VM holds the group); \
             its record is kept, {}",
            held.again
        );
    }
    for addr in &report.gone {
        support::errln!("vfio-manager: warning: {addr} no longer exists; dropped its record");
    }
    for e in &report.failed {
        support::errln!("vfio-manager: error: {}", chain(e));
    }
    report.failed.is_empty() && report.in_use.is_empty()
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use passthrough::{PassthroughError, StepError};
    use sysfs_pci::bind::DriverError;
    use sysfs_pci::PciAddress;

    use super::failure;

    fn address(text: &str) -> PciAddress {
        text.parse().expect("a PCI address")
    }

    fn cause() -> Box<StepError> {
        Box::new(StepError::Driver(DriverError::IommuOff {
            address: address("0000:01:00.0"),
            path: PathBuf::from("/sys/bus/pci/devices/0000:01:00.0/iommu_group"),
        }))
    }

    #[test]
    fn a_failed_rollback_says_how_vfio_manager_puts_the_devices_back() {
        let e = PassthroughError::RollbackFailed {
            group: 7,
            put_back: vec![address("0000:01:00.1")],
            stuck: vec![(address("0000:01:00.0"), "write timed out".into())],
            source: cause(),
        };
        let said = failure(&e);
        assert!(said.contains("IOMMU group 7 is half-bound"), "{said}");
        assert!(
            said.contains("their records are kept for the next restore"),
            "{said}"
        );
        assert!(
            said.ends_with(
                "; `vfio-manager unbind` puts them back once the cause is fixed, and so does the \
                 restore when the node leaves VM mode"
            ),
            "{said}"
        );
    }

    #[test]
    fn other_failures_get_no_rollback_advice() {
        let e = PassthroughError::Group {
            group: 7,
            put_back: vec![],
            source: cause(),
        };
        assert!(
            !failure(&e).contains("vfio-manager unbind"),
            "{}",
            failure(&e)
        );
    }
}
