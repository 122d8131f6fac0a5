//! Named steps where a test can stop the process, compiled in only with the
//! `failpoints` feature (the `fail` crate; off in every shipped build).
//!
//! With `FAILPOINTS=bind-after-probe=return` in the environment of a binary built
//! with the feature, the process prints `failpoint bind-after-probe: paused` to
//! stderr when it reaches that step and then sleeps until it is killed, so a test
//! can `kill -9` it at exactly that point. The steps of binding one device are
//! `bind-after-record` (its record is on disk), `bind-after-override`,
//! `bind-after-unbind` and `bind-after-probe`.

/// Marks a named step; a no-op unless built with `failpoints`.
macro_rules! step {
    ($name:literal) => {
        #[cfg(feature = "failpoints")]
        fail::fail_point!($name, |_| $crate::failpoint::pause($name));
    };
}
pub(crate) use step;

/// Says where the process stopped, then sleeps until killed.
#[cfg(feature = "failpoints")]
pub fn pause(step: &str) -> ! {
    crate::errln!("failpoint {step}: paused");
    loop {
        std::thread::sleep(std::time::Duration::from_secs(3600));
    }
}
