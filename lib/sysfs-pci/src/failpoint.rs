//! Named steps where a test can stop the process.
//!
//! The libraries mark each step with [`step`]. Only the test bed's variants of
//! the binaries (`vfio-manager-failpoints`, `sandbox-dra-driver-failpoints`: the
//! binaries' own `failpoints` feature, with the `fail` crate) [`install`] a hook
//! that decides at each step; a shipped binary never does, so its `step` is one
//! load of an unset cell and it links no failpoint code. The libraries compile
//! the same for both variants: one build of them per architecture serves both.
//!
//! With `FAILPOINTS=bind-after-probe=return` in the environment of such a
//! variant, the process prints `failpoint bind-after-probe: paused` to stderr
//! when it reaches that step and then sleeps until it is killed, so a test can
//! `kill -9` it at exactly that point. The steps of binding one device are
//! `bind-after-record` (its record is on disk), `bind-after-override`,
//! `bind-after-unbind` and `bind-after-probe`; those of putting it back are
//! `restore-after-override`, `restore-after-unbind` and `restore-after-probe` (its
//! record is still on disk); the DRA driver adds `prepare-after-save`,
//! `early-after-save`, `early-after-moved` and `unprepare-after-save`. The `fail`
//! crate's counts apply: `1*off->return` passes the step once and stops there the
//! second time.

use std::sync::OnceLock;

/// Decides at a named step: `true` stops the process there.
pub type Hook = fn(&'static str) -> bool;

static HOOK: OnceLock<Hook> = OnceLock::new();

/// Installs the hook [`step`] asks; the first one installed stays. Only a test
/// variant of a binary calls this.
pub fn install(hook: Hook) {
    let _ = HOOK.set(hook);
}

/// Marks a named step: a no-op unless a hook is installed and stops here.
#[inline]
pub fn step(name: &'static str) {
    if HOOK.get().is_some_and(|hook| hook(name)) {
        pause(name);
    }
}

/// Says where the process stopped, then sleeps until killed.
#[cold]
fn pause(step: &str) -> ! {
    crate::errln!("failpoint {step}: paused");
    loop {
        std::thread::sleep(std::time::Duration::from_secs(3600));
    }
}
