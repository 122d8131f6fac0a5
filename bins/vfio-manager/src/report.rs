//! Turning library reports into lines for people.

use vfio_sandbox::passthrough::{error_chain, BindReport, RestoreReport};

/// An error with all its sources on one line.
pub fn chain(e: &(dyn std::error::Error + 'static)) -> String {
    error_chain(e)
}

/// Prints a bind report; true when nothing failed.
pub fn print_bind(report: &BindReport) -> bool {
    for (addr, previous) in &report.bound {
        let from = previous.as_deref().unwrap_or("no driver");
        println!("bound {addr} (was on {from})");
    }
    for addr in &report.already {
        println!("already bound {addr}");
    }
    for e in &report.failed {
        eprintln!("vfio-manager: error: {}", chain(e));
    }
    report.failed.is_empty()
}

/// Prints a restore report; true when everything recorded was put back.
pub fn print_restore(report: &RestoreReport) -> bool {
    for m in &report.reloaded {
        println!("reloaded module {m}");
    }
    for (addr, driver) in &report.restored {
        println!(
            "restored {addr} to {}",
            driver.as_deref().unwrap_or("no driver")
        );
    }
    for (addr, group) in &report.in_use {
        eprintln!(
            "vfio-manager: warning: skipped {addr}: /dev/vfio/{group} is open (a VM holds the group); \
             its record is kept, run unbind again once the VM has stopped"
        );
    }
    for addr in &report.gone {
        eprintln!("vfio-manager: warning: {addr} no longer exists; dropped its record");
    }
    for e in &report.failed {
        eprintln!("vfio-manager: error: {}", chain(e));
    }
    report.failed.is_empty() && report.in_use.is_empty()
}
