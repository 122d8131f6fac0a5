//! Command-line pieces every binary shares: the common flags (each with an env
//! twin), duration parsing, exit codes and the logging setup.

use std::path::PathBuf;
use std::time::Duration;

use crate::config::{ConfigError, ResourceList};
use crate::host::{DEFAULT_DEV_ROOT, DEFAULT_MODULES_ROOT, DEFAULT_SYSFS_ROOT};
use crate::Host;

/// Exit code: the node is in the asked state.
pub const EXIT_OK: u8 = 0;
/// Exit code: the node is not in the asked state.
pub const EXIT_NOT_READY: u8 = 1;
/// Exit code: bad usage or bad config; nothing was touched.
pub const EXIT_USAGE: u8 = 2;

/// Log output format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line, for log collectors.
    Json,
}

/// Output format of reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum OutputFormat {
    /// A readable table.
    Table,
    /// JSON for machines.
    Json,
}

/// Flags shared by every binary.
#[derive(Debug, Clone, clap::Args)]
pub struct CommonArgs {
    /// Resource list (JSON) selecting devices and naming resources; without it the
    /// built-in Rebellions preset applies.
    #[arg(long, env = "VFIO_SANDBOX_CONFIG", global = true, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Root of sysfs.
    #[arg(long, env = "VFIO_SANDBOX_SYSFS_ROOT", global = true, default_value = DEFAULT_SYSFS_ROOT, value_name = "DIR")]
    pub sysfs_root: PathBuf,
    /// Root of /dev (holds vfio/<group>).
    #[arg(long, env = "VFIO_SANDBOX_DEV_ROOT", global = true, default_value = DEFAULT_DEV_ROOT, value_name = "DIR")]
    pub dev_root: PathBuf,
    /// Log format on stderr.
    #[arg(
        long,
        env = "VFIO_SANDBOX_LOG_FORMAT",
        global = true,
        value_enum,
        default_value = "text"
    )]
    pub log_format: LogFormat,
    /// Log filter (error, warn, info, debug, trace, or a tracing directive).
    #[arg(
        long,
        env = "VFIO_SANDBOX_LOG_LEVEL",
        global = true,
        default_value = "info",
        value_name = "FILTER"
    )]
    pub log_level: String,
}

impl CommonArgs {
    /// The host these flags describe, with the default modules root.
    pub fn host(&self) -> Host {
        Host::new(&self.sysfs_root, &self.dev_root, DEFAULT_MODULES_ROOT)
    }

    /// The resource list from `--config`, or the built-in default.
    pub fn resource_list(&self) -> Result<ResourceList, ConfigError> {
        ResourceList::load(self.config.as_deref())
    }

    /// Sets up logging to stderr.
    pub fn init_logging(&self) {
        init_logging(self.log_format, &self.log_level);
    }
}

/// Prints `PROGRAM: error: <error and its sources>` to stderr and returns `code` as
/// the process exit code.
pub fn fail(program: &str, error: &dyn std::error::Error, code: u8) -> std::process::ExitCode {
    eprintln!("{program}: error: {}", crate::error_chain(error));
    std::process::ExitCode::from(code)
}

/// Installs the tracing subscriber (stderr, text or JSON).
pub fn init_logging(format: LogFormat, filter: &str) {
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::try_new(filter).unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_target(false);
    let _ = match format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().try_init(),
    };
}

/// Parses `90s`, `5m`, `500ms`, `1h` or plain seconds (`30`, `0.5`).
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let value: f64 = num
        .parse()
        .map_err(|_| format!("{s:?} is not a duration (use e.g. 90s, 5m, 500ms or seconds)"))?;
    let scale = match unit {
        "" | "s" => 1.0,
        "ms" => 0.001,
        "m" => 60.0,
        "h" => 3600.0,
        _ => return Err(format!("{s:?}: unknown unit {unit:?} (use ms, s, m or h)")),
    };
    Duration::try_from_secs_f64(value * scale).map_err(|e| format!("{s:?}: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_in_every_accepted_form() {
        assert_eq!(parse_duration("90s").unwrap(), Duration::from_secs(90));
        assert_eq!(parse_duration("5m").unwrap(), Duration::from_secs(300));
        assert_eq!(parse_duration("500ms").unwrap(), Duration::from_millis(500));
        assert_eq!(parse_duration("30").unwrap(), Duration::from_secs(30));
        assert_eq!(parse_duration("1h").unwrap(), Duration::from_secs(3600));
        assert_eq!(parse_duration("0.5").unwrap(), Duration::from_millis(500));
        for bad in ["", "s", "5x", "-1s", "1.2.3s"] {
            assert!(parse_duration(bad).is_err(), "{bad}");
        }
    }
}
