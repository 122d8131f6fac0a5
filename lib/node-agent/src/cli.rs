//! Command-line pieces every binary shares: the common flags (each with an env
//! twin), duration parsing, exit codes and the logging setup.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use passthrough::config::{ConfigError, ResourceList};
use sysfs_pci::deadline::Bounded;
use sysfs_pci::host::{DEFAULT_DEV_ROOT, DEFAULT_MODULES_ROOT, DEFAULT_SYSFS_ROOT};
use sysfs_pci::kernel::SysKernel;
use sysfs_pci::Host;

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
    /// Root of /dev (holds `vfio/<group>`).
    #[arg(long, env = "VFIO_SANDBOX_DEV_ROOT", global = true, default_value = DEFAULT_DEV_ROOT, value_name = "DIR")]
    pub dev_root: PathBuf,
    /// Logging.
    #[command(flatten)]
    pub log: LogArgs,
}

/// The logging flags, every binary's (the cluster-wide labeller's only ones).
#[derive(Debug, Clone, clap::Args)]
pub struct LogArgs {
    /// Log format on stderr.
    #[arg(
        long,
        env = "VFIO_SANDBOX_LOG_FORMAT",
        global = true,
        value_enum,
        default_value = "text"
    )]
    pub log_format: LogFormat,
    /// Log filter: a level (error, warn, info, debug, trace, off), or comma-separated
    /// TARGET=LEVEL directives with an optional default level
    /// (`passthrough=debug,warn`). kube-rs's own HTTP error lines, which name no
    /// request, are off unless the filter names a `kube_client` target.
    #[arg(
        long,
        env = "VFIO_SANDBOX_LOG_LEVEL",
        global = true,
        default_value = "info",
        value_name = "FILTER"
    )]
    pub log_level: String,
}

impl LogArgs {
    /// Sets up logging to stderr.
    pub fn init_logging(&self) {
        init_logging(self.log_format, &self.log_level);
    }
}

/// The deadline of the agents that move devices (vfio-manager, sandbox-dra-driver).
#[derive(Debug, Clone, clap::Args)]
pub struct WriteArgs {
    /// How long one sysfs write (a native driver's unbind, a probe) may take. Past it
    /// the device is declared stuck (its driver is blocked in the kernel): named in
    /// the log, an Event and a metric, left out of readiness, its record kept, and no
    /// other write goes to it until the stuck one returns; the rest of the node goes
    /// on (90s, 5m, 500ms, seconds).
    #[arg(
        long,
        env = "VFIO_SANDBOX_WRITE_TIMEOUT",
        global = true,
        default_value = "60s",
        value_parser = parse_duration,
        value_name = "DURATION"
    )]
    pub write_timeout: Duration,
}

impl WriteArgs {
    /// The real kernel with this deadline on every sysfs write.
    pub fn kernel(&self) -> Bounded<SysKernel> {
        Bounded::new(Arc::new(SysKernel), self.write_timeout)
    }
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
        self.log.init_logging();
    }
}

/// Prints `PROGRAM: error: <error and its sources>` to stderr and returns `code` as
/// the process exit code.
pub fn fail(program: &str, error: &dyn std::error::Error, code: u8) -> std::process::ExitCode {
    support::errln!("{program}: error: {}", support::error_chain(error));
    std::process::ExitCode::from(code)
}

/// Prints `PROGRAM: error: <message>` to stderr and returns [`EXIT_USAGE`]: a
/// usage or configuration problem, said as is.
pub fn fail_usage(program: &str, message: &str) -> std::process::ExitCode {
    support::errln!("{program}: error: {message}");
    std::process::ExitCode::from(EXIT_USAGE)
}

/// kube-rs's HTTP layer logs each failed request as `failed with error client error
/// (SendRequest)`, at ERROR, saying neither what was asked nor of whom. Our own
/// line for the same failure names the request (`get Node a: ...`), so that
/// target is off unless the operator's filter names a `kube_client` target.
const KUBE_HTTP_TARGET: &str = "kube_client::client::builder";

/// The operator's log filter, plus `KUBE_HTTP_TARGET` turned off unless the
/// filter says something about kube_client itself.
pub fn log_targets(
    filter: &str,
) -> Result<tracing_subscriber::filter::Targets, tracing_subscriber::filter::ParseError> {
    let targets: tracing_subscriber::filter::Targets = filter.parse()?;
    if filter.contains("kube_client") {
        return Ok(targets);
    }
    Ok(targets.with_target(
        KUBE_HTTP_TARGET,
        tracing_subscriber::filter::LevelFilter::OFF,
    ))
}

/// Installs the tracing subscriber (stderr, text or JSON).
pub fn init_logging(format: LogFormat, filter: &str) {
    use tracing_subscriber::filter::{LevelFilter, Targets};
    use tracing_subscriber::layer::{Layer, SubscriberExt};
    use tracing_subscriber::util::SubscriberInitExt;
    // A plain target/level filter: no regular-expression engine is linked or run
    // for it (a smaller, leaner binary than a full directive filter).
    let (targets, bad) = match log_targets(filter) {
        Ok(t) => (t, None),
        Err(e) => (
            log_targets("info").unwrap_or_else(|_| Targets::new().with_default(LevelFilter::INFO)),
            Some(e),
        ),
    };
    let fmt = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_target(false)
        // Its fallback for a failed write is eprintln!, which panics on a closed
        // stderr (`run 2>&1 | head`): a log line that cannot be written is dropped.
        .log_internal_errors(false);
    let _ = match format {
        LogFormat::Text => tracing_subscriber::registry()
            .with(fmt.with_filter(targets))
            .try_init(),
        LogFormat::Json => tracing_subscriber::registry()
            .with(fmt.json().with_filter(targets))
            .try_init(),
    };
    if let Some(e) = bad {
        tracing::warn!(filter, error = %e, "log filter not understood; logging at info");
    }
}

/// The longest duration any flag accepts: one year. Every use adds a duration to
/// `Instant::now()`, which this keeps far from overflowing.
pub const MAX_DURATION: Duration = Duration::from_secs(365 * 24 * 3600);

/// The shortest period ([`parse_duration`]): the finest unit durations are written in.
pub const MIN_PERIOD: Duration = Duration::from_millis(1);

/// Parses a period between two actions: `90s`, `5m`, `500ms`, `1h` or plain seconds
/// (`30`, `0.5`), from [`MIN_PERIOD`] to [`MAX_DURATION`]. Zero is refused: a loop
/// that waits zero between passes spins.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let d = parse_duration_or_zero(s)?;
    if d < MIN_PERIOD {
        return Err(format!(
            "{s:?} is too short: a period must be at least 1ms (0 would spin)"
        ));
    }
    Ok(d)
}

/// Parses a duration like [`parse_duration`] but accepts zero, for limits where zero
/// has a meaning (a `--timeout 0` allows exactly one attempt).
pub fn parse_duration_or_zero(s: &str) -> Result<Duration, String> {
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
    // Digits and dots only: never negative or NaN, but it can be huge or infinite.
    let seconds = value * scale;
    if seconds > MAX_DURATION.as_secs_f64() {
        return Err(format!("{s:?} is too long: at most 8760h (one year)"));
    }
    Duration::try_from_secs_f64(seconds).map_err(|e| format!("{s:?}: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kube_rs_context_free_http_errors_are_off_unless_asked_for() {
        use tracing::Level;
        let t = log_targets("info").unwrap();
        assert!(!t.would_enable(KUBE_HTTP_TARGET, &Level::ERROR));
        assert!(t.would_enable("kube_client::client", &Level::ERROR));
        assert!(t.would_enable("passthrough::engine", &Level::INFO));
        let t = log_targets("debug,kube_client=debug").unwrap();
        assert!(
            t.would_enable(KUBE_HTTP_TARGET, &Level::ERROR),
            "the operator's filter wins"
        );
        assert!(log_targets("no=such=filter").is_err());
    }

    #[test]
    fn durations_in_every_accepted_form() {
        assert_eq!(parse_duration("90s").unwrap(), Duration::from_secs(90));
        assert_eq!(parse_duration("5m").unwrap(), Duration::from_secs(300));
        assert_eq!(parse_duration("500ms").unwrap(), Duration::from_millis(500));
        assert_eq!(parse_duration("30").unwrap(), Duration::from_secs(30));
        assert_eq!(parse_duration("1h").unwrap(), Duration::from_secs(3600));
        assert_eq!(parse_duration("0.5").unwrap(), Duration::from_millis(500));
        assert_eq!(parse_duration("1ms").unwrap(), MIN_PERIOD);
        assert_eq!(parse_duration("8760h").unwrap(), MAX_DURATION);
        for bad in ["", "s", "5x", "-1s", "1.2.3s", ".", "1e9h", "inf", "NaN"] {
            assert!(parse_duration(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn periods_refuse_zero_and_what_rounds_to_it() {
        for zero in ["0", "0s", "0ms", "0.0h", "0.0001ms", "0.0000001"] {
            let err = parse_duration(zero).unwrap_err();
            assert!(err.contains("at least 1ms"), "{zero}: {err}");
        }
        assert_eq!(parse_duration_or_zero("0").unwrap(), Duration::ZERO);
        assert_eq!(parse_duration_or_zero("0ms").unwrap(), Duration::ZERO);
    }

    #[test]
    fn durations_that_could_overflow_an_instant_are_refused() {
        for huge in [
            "18446744073709551615s",
            "18446744073709551616",
            "8761h",
            "1000000000000h",
            &"9".repeat(400),
        ] {
            let err = parse_duration_or_zero(huge).unwrap_err();
            assert!(err.contains("at most 8760h"), "{huge}: {err}");
        }
        // Whatever is accepted can be added to the current instant.
        let longest = parse_duration("8760h").unwrap();
        assert!(std::time::Instant::now().checked_add(longest).is_some());
    }

    mod hostile {
        use super::*;
        use proptest::prelude::*;

        proptest! {
            #[test]
            fn any_text_is_a_bounded_duration_or_an_error(text in any::<String>()) {
                if let Ok(d) = parse_duration_or_zero(&text) {
                    prop_assert!(d <= MAX_DURATION);
                    prop_assert!(std::time::Instant::now().checked_add(d).is_some());
                }
                if let Ok(d) = parse_duration(&text) {
                    prop_assert!(d >= MIN_PERIOD);
                }
            }

            #[test]
            fn numbers_with_units_are_bounded(n in "[0-9]{0,25}(\\.[0-9]{0,12})?", unit in "(|s|ms|m|h)") {
                let text = format!("{n}{unit}");
                if let Ok(d) = parse_duration_or_zero(&text) {
                    prop_assert!(d <= MAX_DURATION, "{}", text);
                }
            }
        }
    }
}
