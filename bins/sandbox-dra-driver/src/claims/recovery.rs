//! A restart's recovery: claims of another node's state file set aside, claims
//! caught half-prepared rolled back, half-unprepared ones finished, and device
//! records no claim owns restored.

use super::*;

impl Claims<'_> {
    /// Forgets the claims whose devices are in another pool than ours, and the
    /// device records of their groups that no claim of ours shares: they describe
    /// another node, and acting on them (restoring "orphans") could move this
    /// node's devices of the same address.
    fn quarantine_foreign(&mut self, out: &mut Recovery) {
        let claims = self.engine.state.records().clone();
        let (foreign, local): (Vec<_>, Vec<_>) = claims
            .iter()
            .partition(|(_, r)| r.devices.iter().any(|d| d.pool != self.pool));
        if foreign.is_empty() {
            return;
        }
        let local_groups: BTreeSet<u32> = local.iter().flat_map(|(_, r)| r.groups()).collect();
        let foreign_groups: BTreeSet<u32> = foreign
            .iter()
            .flat_map(|(_, r)| r.groups())
            .filter(|g| !local_groups.contains(g))
            .collect();
        let records: Vec<PciAddress> = self
            .engine
            .state
            .state()
            .devices
            .iter()
            .filter(|(_, r)| foreign_groups.contains(&r.group))
            .map(|(a, _)| *a)
            .collect();
        for a in records {
            if let Err(e) = self.engine.state.forget(self.engine.kernel, &a) {
                out.failed.push(format!(
                    "cannot forget {a}, recorded by a claim of another node: {}",
                    error_chain(&e)
                ));
            }
        }
        for (uid, r) in foreign {
            let pools: BTreeSet<&str> = r.devices.iter().map(|d| d.pool.as_str()).collect();
            let pools: Vec<&str> = pools.into_iter().collect();
            let shown = format!(
                "claim {}/{} (uid {uid}) of pool {} on {} (this node's pool is {})",
                r.namespace,
                r.name,
                pools.join(", "),
                device_list(&r.devices),
                self.pool
            );
            match self.forget_claim(uid) {
                Ok(()) => out.foreign.push(shown),
                Err(e) => out
                    .failed
                    .push(format!("cannot forget {shown}: {}", error_chain(&e))),
            }
        }
    }

    /// Converges after a restart: forgets claims of another pool (a state file
    /// from another node) and the device records of their groups without touching
    /// a device, rolls back claims caught half-prepared, finishes claims caught
    /// half-unprepared, and restores device records no claim owns.
    pub fn recover(&mut self) -> Recovery {
        let mut out = Recovery::default();
        self.quarantine_foreign(&mut out);
        let claims = self.engine.state.records().clone();
        for (uid, record) in claims.iter() {
            let claim = crate::model::recorded_claim(uid, record);
            match record.phase {
                // A moved claim waits for its prepare, or for the claim watcher to
                // find it lost its allocation.
                ClaimPhase::Prepared | ClaimPhase::Moved => {}
                ClaimPhase::Preparing => {
                    let undo = self.undo(uid, record);
                    if self.engine.state.records().contains_key(uid) {
                        out.failed.push(format!("claim {claim}: {undo}"));
                    } else {
                        out.rolled_back.push(claim.to_string());
                    }
                }
                ClaimPhase::Unpreparing => match self.finish_unprepare(&claim, record.clone()) {
                    Ok(()) => out.finished.push(claim.to_string()),
                    Err(e) => out.failed.push(error_chain(&e)),
                },
            }
        }
        let owned: BTreeSet<u32> = self
            .engine
            .state
            .records()
            .values()
            .flat_map(|c| c.groups())
            .collect();
        let orphans: Vec<PciAddress> = self
            .engine
            .state
            .state()
            .devices
            .iter()
            .filter(|(_, r)| !owned.contains(&r.group))
            .map(|(a, _)| *a)
            .collect();
        if !orphans.is_empty() {
            let report = self.engine.restore(&orphans);
            out.orphans.extend(report.restored.iter().map(|(a, _)| *a));
            out.orphans.extend(report.gone);
            out.failed
                .extend(report.failed.iter().map(|e| error_chain(e)));
            for (a, g) in report.in_use {
                out.failed
                    .push(format!("{a}: /dev/vfio/{g} is open; its record is kept"));
            }
        }
        out
    }
}
