//! Output for people that never kills the process.
//!
//! Rust ignores `SIGPIPE`, so writing to a closed pipe (`vfio-manager status | head`)
//! returns `EPIPE`, and `println!` turns that into a panic — an abort, with our
//! release profile. A command that reports while it changes the node (`bind`,
//! `unbind`) must never stop half-way because its reader went away, so every line
//! goes through [`line()`]: a write that fails drops the rest of that stream's output
//! and the command carries on to its normal end and exit code.

use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};

static STDOUT_GONE: AtomicBool = AtomicBool::new(false);
static STDERR_GONE: AtomicBool = AtomicBool::new(false);

/// Which stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stream {
    /// Standard output.
    Out,
    /// Standard error.
    Err,
}

/// Writes one line to `stream`; after the first failed write the stream is left
/// alone. Never panics.
pub fn line(stream: Stream, args: std::fmt::Arguments<'_>) {
    let gone = match stream {
        Stream::Out => &STDOUT_GONE,
        Stream::Err => &STDERR_GONE,
    };
    if gone.load(Ordering::Relaxed) {
        return;
    }
    let result = match stream {
        Stream::Out => {
            let mut w = std::io::stdout().lock();
            w.write_fmt(args)
                .and_then(|()| w.write_all(b"\n"))
                .and_then(|()| w.flush())
        }
        Stream::Err => {
            let mut w = std::io::stderr().lock();
            w.write_fmt(args).and_then(|()| w.write_all(b"\n"))
        }
    };
    if result.is_err() {
        gone.store(true, Ordering::Relaxed);
    }
}

/// `println!` that survives a closed stdout (see the module docs).
#[macro_export]
macro_rules! outln {
    ($($arg:tt)*) => {
        $crate::output::line($crate::output::Stream::Out, format_args!($($arg)*))
    };
}

/// `eprintln!` that survives a closed stderr (see the module docs).
#[macro_export]
macro_rules! errln {
    ($($arg:tt)*) => {
        $crate::output::line($crate::output::Stream::Err, format_args!($($arg)*))
    };
}
