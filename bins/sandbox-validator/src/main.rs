//! `sandbox-validator`: proves the node is ready for VFIO passthrough (IOMMU on, vfio
//! loaded, every selected device bound, every group viable, every group node present)
//! and publishes a ready file.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::Parser;
use node_agent::cli::{
    fail, parse_duration, parse_duration_or_zero, CommonArgs, OutputFormat, EXIT_NOT_READY,
    EXIT_USAGE,
};
use support::io::write_atomic;

mod checks;

use checks::{validate, Report};

const PROGRAM: &str = "sandbox-validator";

const LONG_ABOUT: &str = "\
Checks what actually makes a VM start with the node's selected devices, each check by
name with a reason and a hint: iommu, vfio-modules, interrupt-isolation,
vfio-container, devices-found, devices-bound, groups-viable, group-nodes.

interrupt-isolation reads the interrupt chips the kernel lists under
/sys/kernel/irq: interrupt remapping (IR-*, Intel VT-d and AMD-Vi) or a GICv3 ITS
(ITS-*) isolates device MSIs; without either, vfio refuses every VM its devices. A
vfio_iommu_type1 or iommufd loaded with allow_unsafe_interrupts=1 passes with a
warning saying what it gives up.

On success it writes <status-dir>/vfio-pci-ready (JSON: devices, groups, check results,
time) atomically; on failure it makes sure that file is absent. With --wait it re-checks
every --interval until all pass or --timeout ends, printing only what changed: the
init-container mode of the device plugin.

Exit codes: 0 all checks pass, 1 a check fails, 2 bad usage or bad configuration.";

/// Command line.
#[derive(Debug, Parser)]
#[command(name = "sandbox-validator", version, about = "Prove the node is ready for \
    VFIO passthrough", long_about = LONG_ABOUT)]
struct Cli {
    #[command(flatten)]
    common: CommonArgs,
    /// Re-check until every check passes or --timeout ends.
    #[arg(long)]
    wait: bool,
    /// How long --wait keeps trying (90s, 5m, 500ms or seconds, at most 8760h); 0 checks
    /// once, like a run without --wait.
    #[arg(long, env = "VFIO_SANDBOX_VALIDATOR_TIMEOUT", default_value = "5m", value_parser = parse_duration_or_zero)]
    timeout: Duration,
    /// Time between checks with --wait (1ms to 8760h; 0 is refused, it would spin).
    #[arg(long, env = "VFIO_SANDBOX_VALIDATOR_INTERVAL", default_value = "5s", value_parser = parse_duration)]
    interval: Duration,
    /// Pass devices-found when no device is selected.
    #[arg(long, env = "VFIO_SANDBOX_ALLOW_EMPTY")]
    allow_empty: bool,
    /// Directory of the ready file (vfio-pci-ready).
    #[arg(
        long,
        env = "VFIO_SANDBOX_STATUS_DIR",
        default_value = node_agent::ready::DEFAULT_STATUS_DIR,
        value_name = "DIR"
    )]
    status_dir: PathBuf,
    /// Output format.
    #[arg(long, short, value_enum, default_value = "table")]
    output: OutputFormat,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    cli.common.init_logging();
    let list = match cli.common.resource_list() {
        Ok(l) => l,
        Err(e) => return fail(PROGRAM, &e, EXIT_USAGE),
    };
    let host = cli.common.host();
    let ready = node_agent::ready::validator_ready_file(&cli.status_dir);
    let start = Instant::now();
    let mut shown: Option<Report> = None;
    let mut round = 0u64;
    loop {
        round = round.saturating_add(1);
        let report = validate(&host, &list, cli.allow_empty);
        let passed = report.passed();
        tracing::debug!(round, passed, "validated");
        if let Err(e) = publish(&ready, &report) {
            return fail(PROGRAM, e.as_ref(), EXIT_NOT_READY);
        }
        let done = passed || !cli.wait || start.elapsed() >= cli.timeout;
        print_changes(&cli, shown.as_ref(), &report, done, start.elapsed());
        if done {
            if cli.wait && !passed {
                support::errln!("sandbox-validator: still failing after {:?}", cli.timeout);
            }
            return if passed {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(EXIT_NOT_READY)
            };
        }
        shown = Some(report);
        std::thread::sleep(
            cli.interval
                .min(cli.timeout.saturating_sub(start.elapsed())),
        );
    }
}

/// Writes the ready file on success, removes it otherwise.
fn publish(ready: &Path, report: &Report) -> anyhow::Result<()> {
    if report.passed() {
        let time = support::time::unix_now();
        let doc = serde_json::json!({
            "devices": report.devices,
            "groups": report.groups,
            "checks": report.checks,
            "time": time,
        });
        write_atomic(ready, format!("{doc:#}\n").as_bytes())?;
    } else {
        support::io::remove_if_present(ready)?;
    }
    Ok(())
}

/// Prints the first report in full, then only the checks whose outcome changed; the
/// final report of a wait is printed in full again when something was omitted.
fn print_changes(
    cli: &Cli,
    before: Option<&Report>,
    report: &Report,
    done: bool,
    elapsed: Duration,
) {
    if cli.output == OutputFormat::Json {
        if before.is_none_or(|b| b.checks != report.checks) || done {
            let doc = serde_json::json!({
                "ready": report.passed(),
                "checks": report.checks,
                "devices": report.devices,
                "groups": report.groups,
            });
            support::outln!("{doc}");
        }
        return;
    }
    let changed: Vec<&checks::Check> = match before {
        None => report.checks.iter().collect(),
        Some(b) => report
            .checks
            .iter()
            .filter(|c| !b.checks.contains(c))
            .collect(),
    };
    if !changed.is_empty() {
        if before.is_some() {
            support::outln!("-- changed after {:.1}s:", elapsed.as_secs_f64());
        }
        print_table(&changed);
    }
    if done {
        let failed = report.checks.iter().filter(|c| !c.passed).count();
        match failed {
            0 => support::outln!(
                "node is ready for VFIO passthrough ({} device(s))",
                report.devices.len()
            ),
            n => support::outln!("node is NOT ready: {n} check(s) failed"),
        }
    }
}

fn print_table(checks: &[&checks::Check]) {
    // Fixed to the longest check name, so updates line up with the first table.
    let width = checks::NAME_INTERRUPTS.len();
    support::outln!("{:<width$}  RESULT  DETAIL", "CHECK");
    for c in checks {
        let result = match (c.passed, &c.warning) {
            (true, None) => "ok",
            (true, Some(_)) => "WARN",
            (false, _) => "FAIL",
        };
        support::outln!("{:<width$}  {result:<6}  {}", c.name, c.reason);
        if let Some(h) = &c.hint {
            support::outln!("{:<width$}          hint: {h}", "");
        }
        if let Some(w) = &c.warning {
            support::outln!("{:<width$}          warning: {w}", "");
            tracing::warn!(check = c.name, "{w}");
        }
    }
}
