//! Named steps where a test can stop the process, compiled in only with the
//! `failpoints` feature (the `fail` crate; off in every shipped build).
//!
//! With `FAILPOINTS=bind-after-probe=return` in the environment of a binary built
//! with the feature, the process prints `failpoint bind-after-probe: paused` to
//! stderr when it reaches that step and then sleeps until it is killed, so a test
//! can `kill -9` it at exactly that point. The steps of binding one device are
//! `bind-after-record` (its record is on disk), `bind-after-override`,
//! `bind-after-unbind` and `bind-after-probe`; those of putting it back are
//! `restore-after-override`, `restore-after-unbind` and `restore-after-probe` (its
//! record is still on disk); the DRA driver adds `prepare-after-save` and
//! `unprepare-after-save`. The `fail` crate's counts apply: `1*off->return` passes
//! the step once and stops there the second time.
//!
//! The feature is decided here, in this crate: the crates above call [`step`] and
//! turn it on by forwarding their own `failpoints` feature to this one.

/// Marks a named step; a no-op unless built with `failpoints`.
#[cfg(feature = "failpoints")]
pub fn step(name: &'static str) {
    fail::fail_point!(name, |_| pause(name));
}

/// Marks a named step; a no-op unless built with `failpoints`.
#[cfg(not(feature = "failpoints"))]
#[inline(always)]
pub fn step(_name: &'static str) {}

/// Says where the process stopped, then sleeps until killed.
#[cfg(feature = "failpoints")]
pub fn pause(step: &str) -> ! {
    crate::errln!("failpoint {step}: paused");
    loop {
        std::thread::sleep(std::time::Duration::from_secs(3600));
    }
}
