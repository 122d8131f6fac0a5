//! Named steps where a test can stop the process.
//!
//! Code marks each step of a change to the node with [`step`] and a name of its
//! own (the crates that mark steps list theirs). Only a test variant of a binary
//! (its `failpoints` feature, with the `fail` crate) [`install`]s a hook that
//! decides at each step; a shipped binary never does, so its `step` is one load of
//! an unset cell and it links no failpoint code. The libraries compile the same
//! for both variants: one build of them per architecture serves both.
//!
//! When the hook stops at a step, the process prints `failpoint <step>: paused`
//! to stderr and then sleeps until it is killed, so a test can `kill -9` it at
//! exactly that point. The variants read `FAILPOINTS` in the `fail` crate's
//! syntax: `bind-after-probe=return` stops there, `1*off->return` passes the step
//! once and stops there the second time.

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
