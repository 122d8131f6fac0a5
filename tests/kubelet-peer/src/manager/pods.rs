//! The pod side of kubelet's DRA manager (`pkg/kubelet/cm/dra/manager.go`):
//! preparing the claims of each pod that arrives and unpreparing them when it
//! goes, checkpointed as kubelet does.

use super::*;

impl Peer {
    /// The pods now; prepare the new ones, unprepare the gone ones' claims.
    pub(super) async fn sync_pods(self: &Arc<Self>) {
        let pods: Vec<Pod> = match std::fs::read(&self.cfg.pods) {
            Ok(b) => match serde_json::from_slice(&b) {
                Ok(p) => p,
                Err(_) => return,
            },
            Err(_) => vec![],
        };
        let active: BTreeSet<String> = pods.iter().map(|p| p.uid.clone()).collect();
        // Pod workers run side by side: prepare every pod that needs it at once.
        let mut work = tokio::task::JoinSet::new();
        for pod in pods {
            let due = {
                let st = lock(&self.state);
                !st.ready.contains(&pod.uid)
                    && st
                        .retry_pod
                        .get(&pod.uid)
                        .is_none_or(|t| Instant::now() >= *t)
            };
            if due {
                let peer = self.clone();
                work.spawn(async move { peer.prepare_pod(pod).await });
            }
        }
        while work.join_next().await.is_some() {}
        // The reconcile loop (`manager.go`, `reconcileLoop`): claims of pods no
        // longer active, grouped by pod.
        let inactive: BTreeMap<String, (String, Vec<String>)> = {
            let st = lock(&self.state);
            let mut m: BTreeMap<String, (String, Vec<String>)> = BTreeMap::new();
            for c in st.claims.values() {
                for p in c.pod_uids.iter().filter(|p| !active.contains(*p)) {
                    m.entry(p.clone())
                        .or_insert_with(|| (c.namespace.clone(), vec![]))
                        .1
                        .push(c.name.clone());
                }
            }
            m
        };
        for (pod, (ns, names)) in inactive {
            match self.unprepare(&pod, &ns, &names).await {
                Ok(()) => {
                    lock(&self.state).ready.remove(&pod);
                    self.emit(Event::PodGone { pod });
                }
                Err(error) => self.emit(Event::UnprepareFailed { pod, error }),
            }
        }
        let mut st = lock(&self.state);
        st.ready.retain(|p| active.contains(p));
    }

    pub(super) async fn prepare_pod(self: Arc<Self>, pod: Pod) {
        match self.prepare(&pod).await {
            Ok(()) => {
                let mut st = lock(&self.state);
                st.ready.insert(pod.uid.clone());
                st.retry_pod.remove(&pod.uid);
                drop(st);
                self.emit(Event::PodReady { pod: pod.uid });
            }
            Err(error) => {
                lock(&self.state)
                    .retry_pod
                    .insert(pod.uid.clone(), Instant::now() + Duration::from_secs(1));
                self.emit(Event::PrepareFailed {
                    pod: pod.uid,
                    error: format!("prepare dynamic resources: {error}"),
                });
            }
        }
    }

    /// `prepareResources` (`pkg/kubelet/cm/dra/manager.go`).
    pub(super) async fn prepare(&self, pod: &Pod) -> Result<(), String> {
        // The validation pass: fetch each claim, check it is reserved for the pod
        // and allocated, and find its drivers' plugins — the cache untouched.
        struct Info {
            claim: ClaimInfo,
        }
        let mut infos = Vec::new();
        for name in &pod.claims {
            let path = format!(
                "/apis/{}/namespaces/{}/resourceclaims/{}",
                self.cfg.kubelet.resource_api(),
                pod.namespace,
                name
            );
            let claim = match self.api.get(&path).await {
                Ok((200, c)) => c,
                Ok((_, status)) => {
                    return Err(format!(
                        "fetch ResourceClaim {name}: {}",
                        status["message"].as_str().unwrap_or("error")
                    ))
                }
                Err(e) => return Err(format!("fetch ResourceClaim {name}: {e}")),
            };
            let uid = claim["metadata"]["uid"]
                .as_str()
                .unwrap_or_default()
                .to_owned();
            // `resourceclaim.IsReservedForPod`: a reservedFor entry with the pod's uid.
            let reserved = claim["status"]["reservedFor"]
                .as_array()
                .is_some_and(|r| r.iter().any(|e| e["uid"] == json!(pod.uid)));
            if !reserved {
                return Err(format!(
                    "pod {} ({}) is not allowed to use ResourceClaim {name} ({uid})",
                    pod.name, pod.uid
                ));
            }
            // `newClaimInfoFromClaim` (`claiminfo.go`).
            let Some(results) = claim["status"]["allocation"]["devices"]["results"]
                .as_array()
                .filter(|_| !claim["status"]["allocation"].is_null())
            else {
                return Err(format!("ResourceClaim {name}: not allocated"));
            };
            let drivers = results
                .iter()
                .filter_map(|r| r["driver"].as_str().map(|d| (d.to_owned(), vec![])))
                .collect::<BTreeMap<_, _>>();
            for d in drivers.keys() {
                self.client(d).await?;
            }
            infos.push(Info {
                claim: ClaimInfo {
                    uid,
                    name: name.clone(),
                    namespace: pod.namespace.clone(),
                    pod_uids: BTreeSet::new(),
                    drivers,
                    prepared: false,
                },
            });
        }
        // Now the cache: add the pod's reference, checkpoint, and batch what is
        // not prepared yet. An already prepared claim ends the pass — upstream's
        // callback returns there, so later claims of this pod are not batched.
        let mut batches: BTreeMap<String, Vec<ClaimRef>> = BTreeMap::new();
        let mut to_mark: Vec<(String, String)> = Vec::new();
        {
            let mut st = lock(&self.state);
            for info in &infos {
                let key = (info.claim.namespace.clone(), info.claim.name.clone());
                let entry = st
                    .claims
                    .entry(key.clone())
                    .or_insert_with(|| info.claim.clone());
                if entry.uid != info.claim.uid {
                    return Err(format!(
                        "old ResourceClaim with same name {} and different UID {} still exists (previous pod force-deleted?!)",
                        info.claim.name, entry.uid
                    ));
                }
                entry.pod_uids.insert(pod.uid.clone());
                let prepared = entry.prepared;
                let claim = entry.claim_ref();
                let drivers: Vec<String> = entry.drivers.keys().cloned().collect();
                self.checkpoint(&st)?;
                if prepared {
                    break;
                }
                to_mark.push(key);
                for d in drivers {
                    batches.entry(d).or_default().push(claim.clone());
                }
            }
        }
        for (driver, claims) in batches {
            let (mut client, version) = self.client(&driver).await?;
            let answer = tokio::time::timeout(CLIENT_CALL_TIMEOUT, client.prepare(&claims))
                .await
                .map_err(|_| "NodePrepareResources: context deadline exceeded".to_owned())?;
            let answer = match answer {
                Ok(a) => a,
                Err(status) => {
                    self.drop_client(&driver);
                    return Err(format!("NodePrepareResources: {status}"));
                }
            };
            self.emit(Event::Prepared {
                pod: pod.uid.clone(),
                driver: driver.clone(),
                version,
                claims: claims.clone(),
                answer: answer.clone(),
            });
            for (uid, result) in &answer.claims {
                let Some(req) = claims.iter().find(|c| &c.uid == uid) else {
                    return Err(format!(
                        "NodePrepareResources returned result for unknown claim UID {uid}"
                    ));
                };
                if !result.error.is_empty() {
                    return Err(format!(
                        "NodePrepareResources failed for ResourceClaim {}: {}",
                        req.name, result.error
                    ));
                }
                let mut st = lock(&self.state);
                let info = st
                    .claims
                    .get_mut(&(req.namespace.clone(), req.name.clone()))
                    .ok_or_else(|| {
                        format!(
                            "internal error: unable to get claim info for ResourceClaim {}",
                            req.name
                        )
                    })?;
                info.drivers
                    .entry(driver.clone())
                    .or_default()
                    .extend(result.devices.iter().cloned());
            }
            // Counted against the request as sent: a claim listed twice is
            // answered once, and kubelet counts the second as skipped.
            let unfinished = claims.len().saturating_sub(answer.claims.len());
            if unfinished != 0 {
                return Err(format!(
                    "NodePrepareResources skipped {unfinished} ResourceClaims"
                ));
            }
        }
        let mut st = lock(&self.state);
        for key in &to_mark {
            if let Some(info) = st.claims.get_mut(key) {
                info.prepared = true;
            }
        }
        self.checkpoint(&st)
    }

    /// `unprepareResources` (`pkg/kubelet/cm/dra/manager.go`).
    pub(super) async fn unprepare(
        &self,
        pod: &str,
        namespace: &str,
        names: &[String],
    ) -> Result<(), String> {
        let mut batches: BTreeMap<String, Vec<ClaimRef>> = BTreeMap::new();
        let mut done: Vec<(String, String)> = Vec::new();
        {
            let mut st = lock(&self.state);
            for name in names {
                let key = (namespace.to_owned(), name.clone());
                let Some(info) = st.claims.get_mut(&key) else {
                    continue;
                };
                // Other pods still use it: drop this pod's reference only (the
                // checkpoint follows with the next write).
                if info.pod_uids.len() > 1 {
                    info.pod_uids.remove(pod);
                    continue;
                }
                done.push(key);
                for d in info.drivers.keys() {
                    batches.entry(d.clone()).or_default().push(info.claim_ref());
                }
            }
        }
        for (driver, claims) in batches {
            let (mut client, version) = self.client(&driver).await?;
            let answer = tokio::time::timeout(CLIENT_CALL_TIMEOUT, client.unprepare(&claims))
                .await
                .map_err(|_| "NodeUnprepareResources: context deadline exceeded".to_owned())?;
            let answer = match answer {
                Ok(a) => a,
                Err(status) => {
                    self.drop_client(&driver);
                    return Err(format!("NodeUnprepareResources: {status}"));
                }
            };
            self.emit(Event::Unprepared {
                pod: pod.to_owned(),
                driver: driver.clone(),
                version,
                claims: claims.clone(),
                answer: answer.clone(),
            });
            for (uid, result) in &answer.claims {
                let Some(req) = claims.iter().find(|c| &c.uid == uid) else {
                    return Err(format!(
                        "NodeUnprepareResources returned result for unknown claim UID {uid}"
                    ));
                };
                if !result.error.is_empty() {
                    return Err(format!(
                        "NodeUnprepareResources failed for ResourceClaim {}: {}",
                        req.name, result.error
                    ));
                }
            }
            let unfinished = claims.len().saturating_sub(answer.claims.len());
            if unfinished != 0 {
                return Err(format!(
                    "NodeUnprepareResources skipped {unfinished} ResourceClaims"
                ));
            }
        }
        let mut st = lock(&self.state);
        for key in &done {
            st.claims.remove(key);
        }
        self.checkpoint(&st)
    }
}
