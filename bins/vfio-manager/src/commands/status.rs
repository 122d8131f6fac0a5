//! `vfio-manager status`: what is selected, where it is, and whether its group is usable.
//!
//! A device whose entry has `"driver": "auto"` gets a line saying which driver the
//! kernel's `vfio_pci:` aliases chose and the alias line that chose it (or why none
//! did).
//!
//! Devices the scan had to skip (malformed sysfs attributes, or a group with such a
//! member) are listed with their error, and make the exit code 1: the node is not
//! fully usable.

use std::process::ExitCode;

use node_agent::cli::{OutputFormat, EXIT_NOT_READY};
use passthrough::inventory::{product_name, DriverChoice, Entry, Inventory, Role, Skipped};
use sysfs_pci::{Host, PciDevice};

use crate::Context;

/// Flags of `status`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Output format.
    #[arg(long, short, value_enum, default_value = "table")]
    output: OutputFormat,
}

/// One row of the report.
#[derive(Debug, serde::Serialize)]
struct Row {
    bdf: String,
    vendor: String,
    device: String,
    class: String,
    name: Option<String>,
    role: &'static str,
    resource: Option<String>,
    companion_of: Option<String>,
    driver: Option<String>,
    target_driver: String,
    /// How `"driver": "auto"` chose `target_driver`, and why.
    #[serde(skip_serializing_if = "Option::is_none")]
    driver_choice: Option<DriverChoice>,
    bound: bool,
    iommu_group: Option<u32>,
    group_viable: Option<bool>,
    numa_node: Option<u32>,
    recorded_original_driver: Option<String>,
}

fn row(entry: &Entry, inv: &Inventory, ctx_state: &passthrough::state::State) -> Row {
    let d = &entry.device;
    let (role, companion_of) = match &entry.role {
        Role::Selected { .. } => ("selected", None),
        Role::Companion { of } => ("companion", Some(of.to_string())),
        Role::Bridge => ("bridge", None),
    };
    Row {
        bdf: d.address.to_string(),
        vendor: format!("{:04x}", d.vendor),
        device: format!("{:04x}", d.device),
        class: format!("{:06x}", d.class),
        name: product_name(d.vendor, d.device),
        role,
        resource: entry.resource().map(|r| r.to_string()),
        companion_of,
        driver: d.driver.clone(),
        target_driver: entry.target_driver.clone(),
        driver_choice: entry.driver_choice.clone(),
        bound: entry.is_bound(),
        iommu_group: d.iommu_group,
        group_viable: d
            .iommu_group
            .and_then(|g| inv.groups.get(&g))
            .map(|v| v.is_viable()),
        numa_node: d.numa_node,
        recorded_original_driver: ctx_state
            .devices
            .get(&d.address)
            .map(|r| r.original_driver.clone().unwrap_or_else(|| "none".into())),
    }
}

/// Runs `status`.
pub fn run(ctx: &Context, args: &Args) -> anyhow::Result<ExitCode> {
    let list = ctx.common.resource_list()?;
    let inv = Inventory::scan(&ctx.host, &list)?;
    let state = ctx.state(false)?;
    let rows: Vec<Row> = inv
        .entries
        .iter()
        .map(|e| row(e, &inv, state.state()))
        .collect();
    match args.output {
        OutputFormat::Json => {
            let groups: Vec<_> = inv.groups.values().collect();
            let skipped: Vec<SkippedRow> = inv.skipped.iter().map(SkippedRow::from).collect();
            let doc = serde_json::json!({ "devices": rows, "groups": groups, "skipped": skipped });
            support::outln!("{}", serde_json::to_string_pretty(&doc)?);
        }
        OutputFormat::Table => print_table(&ctx.host, &rows, &inv),
    }
    Ok(if inv.skipped.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(EXIT_NOT_READY)
    })
}

/// A device the scan left out, as reported.
#[derive(Debug, serde::Serialize)]
struct SkippedRow<'a> {
    #[serde(flatten)]
    skipped: &'a Skipped,
    message: String,
}

impl<'a> From<&'a Skipped> for SkippedRow<'a> {
    fn from(skipped: &'a Skipped) -> Self {
        Self {
            skipped,
            message: skipped.to_string(),
        }
    }
}

fn print_table(host: &Host, rows: &[Row], inv: &Inventory) {
    if rows.is_empty() && inv.skipped.is_empty() {
        support::outln!("no devices selected by the resource list");
        return;
    }
    let dash = || "-".to_string();
    let mut table: Vec<[String; 8]> = rows
        .iter()
        .map(|r| {
            [
                r.bdf.clone(),
                format!("{}:{}", r.vendor, r.device),
                match (&r.resource, &r.companion_of) {
                    (Some(res), _) => res.clone(),
                    (None, Some(of)) => format!("(companion of {of})"),
                    (None, None) => format!("({})", r.role),
                },
                match (&r.driver, r.bound) {
                    (Some(d), true) => d.clone(),
                    (Some(d), false) => format!("{d} (want {})", r.target_driver),
                    (None, _) => format!("none (want {})", r.target_driver),
                },
                r.iommu_group.map_or_else(dash, |g| g.to_string()),
                match r.group_viable {
                    Some(true) => "yes".into(),
                    Some(false) => "no".into(),
                    None => dash(),
                },
                r.numa_node.map_or_else(dash, |n| n.to_string()),
                r.name.clone().unwrap_or_default(),
            ]
        })
        .collect();
    table.extend(inv.skipped.iter().map(|s| {
        // A device held back for its group's sake reads fine on its own: show it.
        let dev = PciDevice::read(host, &s.address).ok();
        let dev = dev.as_ref();
        [
            s.address.to_string(),
            dev.map_or_else(
                || "?".into(),
                |d| format!("{:04x}:{:04x}", d.vendor, d.device),
            ),
            s.resource
                .as_ref()
                .map_or_else(|| "(skipped)".into(), |r| r.to_string()),
            match dev {
                Some(d) => format!("{} (skipped)", d.driver.as_deref().unwrap_or("none")),
                None => "? (skipped)".into(),
            },
            s.group.map_or_else(dash, |g| g.to_string()),
            if s.group.is_some() { "no" } else { "-" }.into(),
            dev.and_then(|d| d.numa_node)
                .map_or_else(dash, |n| n.to_string()),
            dev.and_then(|d| product_name(d.vendor, d.device))
                .unwrap_or_default(),
        ]
    }));
    table.sort_by(|a, b| a[0].cmp(&b[0]));
    let header = [
        "BDF", "ID", "RESOURCE", "DRIVER", "GROUP", "VIABLE", "NUMA", "NAME",
    ];
    let mut widths = header.map(str::len);
    for r in &table {
        for (w, c) in widths.iter_mut().zip(r) {
            *w = (*w).max(c.len());
        }
    }
    let line = |cells: &[String]| {
        let mut s = String::new();
        for (i, c) in cells.iter().enumerate() {
            if i + 1 == cells.len() {
                s.push_str(c);
            } else {
                s.push_str(&format!("{c:<w$}  ", w = widths[i]));
            }
        }
        support::outln!("{}", s.trim_end());
    };
    line(&header.map(String::from));
    for r in &table {
        line(r);
    }
    for r in rows {
        if let Some(choice) = &r.driver_choice {
            support::outln!("driver for {}: {choice}", r.bdf);
        }
    }
    for v in inv.groups.values().filter(|v| !v.is_viable()) {
        for b in &v.blockers {
            support::outln!(
                "group {} is not viable: {} is on {} (must be on a vfio driver, pci-stub or none)",
                v.group,
                b.address,
                b.driver
            );
        }
    }
    for s in &inv.skipped {
        support::outln!("skipped {s}");
    }
}
