//! The DRA driver that loses the node's owner lock withdraws its devices from
//! the real API server at once, and publishes them again once the node is its
//! own again.

use std::time::{Duration, Instant};

use anyhow::{ensure, Context, Result};

use super::{delete_pod, dra, our_slices, template_pod, wait_slice_owned, Outcome};
use crate::drivers;
use crate::proc::wait_for;
use crate::Ctx;

/// What the driver promises: every device withdrawn within this long of
/// losing the node.
const WITHDRAWN_WITHIN: Duration = Duration::from_secs(2);

/// Replaces the lock file at `lock` with one held by this process under
/// `program`'s name, as a rival that took the freed path would: a new file, its
/// record (`passthrough::owner`'s format) written, `flock`ed, then renamed over
/// the lock. Held until the returned file drops.
fn replace_lock_held_by(
    lock: &std::path::Path,
    program: &str,
) -> Result<nix::fcntl::Flock<std::fs::File>> {
    let new = lock.with_file_name("owner.lock.replacement");
    std::fs::write(
        &new,
        format!(
            "{{\"owner\":\"{program}\",\"pid\":{},\"since\":\"2026-01-01T00:00:00Z\",\"devices\":0}}\n",
            std::process::id()
        ),
    )?;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&new)?;
    let held = nix::fcntl::Flock::lock(file, nix::fcntl::FlockArg::LockExclusiveNonblock)
        .map_err(|(_, e)| e)
        .with_context(|| format!("flock {}", new.display()))?;
    std::fs::rename(&new, lock)?;
    Ok(held)
}

/// The devices of our slices, all slices together.
fn published(ctx: &Ctx) -> Result<usize> {
    Ok(our_slices(&ctx.plane)?
        .iter()
        .map(|s| s["spec"]["devices"].as_array().map_or(0, Vec::len))
        .sum())
}

pub fn dra_owner_lost(ctx: &mut Ctx) -> Result<Outcome> {
    dra(ctx)?;
    wait_slice_owned(ctx)?;
    let dir = drivers::dra_dir(&ctx.node);
    let (lock, ready) = (dir.join("owner.lock"), dir.join("ready"));
    let lost = Instant::now();
    let held = replace_lock_held_by(&lock, "vfio-manager")?;
    wait_for(
        "the driver to withdraw its devices from its slices",
        Duration::from_secs(30),
        || Ok((published(ctx)? == 0).then_some(())),
    )?;
    let took = lost.elapsed();
    ensure!(
        took < WITHDRAWN_WITHIN,
        "the driver withdrew its devices {took:?} after it lost the node"
    );
    ensure!(
        !our_slices(&ctx.plane)?.is_empty(),
        "the pool was deleted instead of emptied"
    );
    wait_for("the driver not ready", Duration::from_secs(10), || {
        Ok((!ready.exists()).then_some(()))
    })?;
    // The lock free again, its record rewritten: the driver takes the node back
    // and publishes every device, and a pod's claim is prepared.
    drop(held);
    std::fs::write(
        &lock,
        "{\"owner\":\"vfio-manager\",\"pid\":1,\"since\":\"x\",\"devices\":0}\n",
    )?;
    let back = Instant::now();
    wait_slice_owned(ctx)?;
    let returned = back.elapsed();
    wait_for("the driver ready again", Duration::from_secs(30), || {
        Ok(ready.exists().then_some(()))
    })?;
    template_pod(ctx, "after-owner-back")?;
    delete_pod(&ctx.plane, "after-owner-back")?;
    println!(
        "     (withdrawn {} ms after the lock was lost, published again {} ms after it was free)",
        took.as_millis(),
        returned.as_millis()
    );
    Ok(Outcome::Passed)
}
