//! The processes of a test cluster: each one's output in a log file, each killed
//! with the harness (the parent-death signal, so a harness that panics or is
//! killed leaves no component behind), and a way to wait for a condition.

use std::fs::File;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::thread::sleep;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

/// A component process.
pub struct Proc {
    /// Its name in messages and its log's name.
    pub name: String,
    /// The process.
    pub child: Child,
    /// Its output.
    pub log: PathBuf,
    /// When it was started.
    pub started: Instant,
}

impl Proc {
    /// Starts `cmd` with stdin closed and stdout and stderr in `<log_dir>/<name>.log`
    /// (appended, so a restarted component keeps one log).
    pub fn spawn(name: &str, mut cmd: Command, log_dir: &Path) -> Result<Self> {
        let log = log_dir.join(format!("{name}.log"));
        let out = File::options()
            .create(true)
            .append(true)
            .open(&log)
            .with_context(|| format!("opening {}", log.display()))?;
        cmd.stdin(Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out);
        die_with_parent(&mut cmd);
        let child = cmd
            .spawn()
            .with_context(|| format!("starting {name}: {cmd:?}"))?;
        Ok(Self {
            name: name.to_owned(),
            child,
            log,
            started: Instant::now(),
        })
    }

    /// Its process id.
    pub fn pid(&self) -> Pid {
        Pid::from_raw(self.child.id() as i32)
    }

    /// Whether it still runs.
    pub fn alive(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// Fails, with the end of its log, if it has exited.
    pub fn check(&mut self) -> Result<()> {
        if let Ok(Some(status)) = self.child.try_wait() {
            bail!(
                "{} exited ({status}); the end of {}:\n{}",
                self.name,
                self.log.display(),
                tail(&self.log, 30)
            );
        }
        Ok(())
    }

    /// Sends `signal` and waits for it to exit (SIGKILL after `grace`).
    pub fn stop_with(&mut self, signal: Signal, grace: Duration) {
        if !self.alive() {
            return;
        }
        let _ = kill(self.pid(), signal);
        let start = Instant::now();
        while self.alive() {
            if start.elapsed() > grace {
                let _ = kill(self.pid(), Signal::SIGKILL);
                let _ = self.child.wait();
                return;
            }
            sleep(Duration::from_millis(50));
        }
    }

    /// SIGTERM, then SIGKILL after 10 s.
    pub fn stop(&mut self) {
        self.stop_with(Signal::SIGTERM, Duration::from_secs(10));
    }

    /// `kill -9`.
    pub fn kill9(&mut self) {
        self.stop_with(Signal::SIGKILL, Duration::from_secs(10));
    }

    /// The last `lines` lines of its log.
    pub fn tail(&self, lines: usize) -> String {
        tail(&self.log, lines)
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The last `lines` lines of a file.
pub fn tail(path: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// Makes the child die when the harness does. The signal is tied to the thread
/// that forks: the harness starts every process from its main thread.
#[allow(unsafe_code)]
fn die_with_parent(cmd: &mut Command) {
    // SAFETY: prctl is async-signal-safe, and the closure touches no memory
    // shared with the parent.
    unsafe {
        cmd.pre_exec(|| {
            nix::sys::prctl::set_pdeathsig(Signal::SIGKILL)
                .map_err(|e| std::io::Error::from_raw_os_error(e as i32))
        });
    }
}

/// Polls `probe` every 200 ms until it returns `Ok(Some(_))`; fails after
/// `timeout` with what it waited for and the probe's last error.
pub fn wait_for<T>(
    what: &str,
    timeout: Duration,
    mut probe: impl FnMut() -> Result<Option<T>>,
) -> Result<T> {
    let start = Instant::now();
    let mut last = String::from("(not yet)");
    loop {
        match probe() {
            Ok(Some(v)) => return Ok(v),
            Ok(None) => {}
            Err(e) => last = format!("{e:#}"),
        }
        if start.elapsed() > timeout {
            bail!(
                "timed out after {} s waiting for {what}; last: {last}",
                timeout.as_secs()
            );
        }
        sleep(Duration::from_millis(200));
    }
}

/// Moves this process into a mount namespace of its own, with `/` private,
/// before any thread starts: mounts it makes (the fake PCI core's) end with it,
/// whatever way it ends.
pub fn own_mount_namespace() -> Result<()> {
    use nix::mount::{mount, MsFlags};
    nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNS)
        .context("unshare(CLONE_NEWNS): the harness needs root")?;
    mount(
        None::<&str>,
        "/",
        None::<&str>,
        MsFlags::MS_REC | MsFlags::MS_PRIVATE,
        None::<&str>,
    )
    .context("making / private in the harness's mount namespace")?;
    Ok(())
}

/// The time every thread of process `pid` (`self` for this one) has spent on a
/// CPU so far, from the scheduler's nanosecond count
/// (`/proc/<pid>/task/<tid>/schedstat`), and the context switches they made:
/// fine enough for a burst of a few milliseconds, where [`cpu_time`] counts
/// in ticks. A thread that ends in between takes its share with it.
pub fn run_time(pid: &str) -> Result<(Duration, u64)> {
    let (mut total, mut switches) = (Duration::ZERO, 0u64);
    for task in std::fs::read_dir(format!("/proc/{pid}/task"))? {
        let task = task?.path();
        let (Ok(on_cpu), Ok(status)) = (
            task_run_time(&task),
            std::fs::read_to_string(task.join("status")),
        ) else {
            continue;
        };
        total += on_cpu;
        switches += status
            .lines()
            .filter(|l| l.contains("ctxt_switches:"))
            .filter_map(|l| l.split_whitespace().last()?.parse::<u64>().ok())
            .sum::<u64>();
    }
    Ok((total, switches))
}

/// The time the thread named `name` of process `pid` has spent on a CPU so
/// far (its schedstat), if it has one.
pub fn thread_run_time(pid: u32, name: &str) -> Result<Option<Duration>> {
    for task in std::fs::read_dir(format!("/proc/{pid}/task"))? {
        let task = task?.path();
        if std::fs::read_to_string(task.join("comm")).is_ok_and(|c| c.trim_end() == name) {
            return task_run_time(&task).map(Some);
        }
    }
    Ok(None)
}

/// The time one thread (`/proc/<pid>/task/<tid>`) has spent on a CPU: the
/// first field of its schedstat, in nanoseconds.
fn task_run_time(task: &Path) -> Result<Duration> {
    let stat = std::fs::read_to_string(task.join("schedstat"))?;
    let ns = stat
        .split_whitespace()
        .next()
        .context("an empty schedstat")?;
    Ok(Duration::from_nanos(ns.parse()?))
}

/// The user and system CPU time process `pid` has used so far.
pub fn cpu_time(pid: u32) -> Result<Duration> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .context("/proc/<pid>/stat without a command")?
        .1
        .split_whitespace()
        .collect();
    let ticks: u64 = fields.get(11).context("no utime")?.parse::<u64>()?
        + fields.get(12).context("no stime")?.parse::<u64>()?;
    let hz = nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK)?.unwrap_or(100);
    Ok(Duration::from_secs_f64(ticks as f64 / hz as f64))
}

/// The resident memory of process `pid` (`VmRSS`), in KiB.
pub fn rss_kib(pid: u32) -> Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .with_context(|| format!("no VmRSS in /proc/{pid}/status"))
}

/// A free TCP port on loopback (bound, then released).
pub fn free_port() -> Result<u16> {
    let l = std::net::TcpListener::bind("127.0.0.1:0")?;
    Ok(l.local_addr()?.port())
}

/// Runs a command to its end; fails with its output if it fails.
pub fn run(cmd: &mut Command) -> Result<String> {
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("running {cmd:?}"))?;
    if !out.status.success() {
        bail!(
            "{cmd:?} failed ({}): {}{}",
            out.status,
            String::from_utf8_lossy(&out.stderr),
            String::from_utf8_lossy(&out.stdout)
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}
