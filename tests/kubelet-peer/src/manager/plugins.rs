//! The plugin side of kubelet's DRA manager: the plugin watcher's registration
//! of drivers (`pkg/kubelet/pluginmanager`, `pkg/kubelet/cm/dra/plugin`), their
//! de-registration, and the wipes of a driver's ResourceSlices that follow.

use super::*;

impl Peer {
    /// `wipeResourceSlices` (1.32 `registration.go`, 1.34 `dra_plugin_manager.go`):
    /// get the Node (not there yet: retry), then `DeleteCollection` of
    /// ResourceSlices with field selector `spec.nodeName=<node>` plus
    /// `spec.driver=<driver>` for one driver (`fields.Set.String()`: keys sorted),
    /// retried with backoff from 1 s, factor 2, capped at 5 min, 100 steps.
    pub(super) async fn wipe(&self, reason: &str, driver: Option<&str>) {
        let mut selector = BTreeMap::new();
        selector.insert("spec.nodeName", self.cfg.node.clone());
        if let Some(d) = driver {
            selector.insert("spec.driver", d.to_owned());
        }
        let selector: Vec<String> = selector.iter().map(|(k, v)| format!("{k}={v}")).collect();
        let selector = selector.join(",");
        let path = format!(
            "/apis/{}/resourceslices?fieldSelector={}",
            self.cfg.kubelet.resource_api(),
            percent_encode_query(&selector)
        );
        let mut delay = Duration::from_secs(1);
        for _ in 0..100 {
            let node = self
                .api
                .get(&format!(
                    "/api/v1/nodes/{}",
                    percent_encode_query(&self.cfg.node)
                ))
                .await;
            if matches!(node, Ok((200, _))) {
                // client-go sends the (empty) DeleteOptions as the body.
                let body =
                    json!({"kind": "DeleteOptions", "apiVersion": self.cfg.kubelet.resource_api()});
                match self.api.call("DELETE", &path, Some(&body)).await {
                    Ok((200, list)) => {
                        let deleted = list["items"]
                            .as_array()
                            .map(|a| {
                                a.iter()
                                    .filter_map(|o| {
                                        o["metadata"]["name"].as_str().map(str::to_owned)
                                    })
                                    .collect()
                            })
                            .unwrap_or_default();
                        self.emit(Event::Wiped {
                            reason: reason.into(),
                            field_selector: selector,
                            deleted,
                        });
                        return;
                    }
                    // 1.34 takes NotFound as nothing to delete.
                    Ok((404, _)) if self.cfg.kubelet == KubeletVersion::V1_34 => {
                        self.emit(Event::Wiped {
                            reason: reason.into(),
                            field_selector: selector,
                            deleted: vec![],
                        });
                        return;
                    }
                    _ => {}
                }
            }
            tokio::time::sleep(delay).await;
            delay = (delay * 2).min(Duration::from_secs(300));
        }
    }

    /// The plugin watcher and its reconciler: register new sockets, deregister
    /// gone ones (`pkg/kubelet/pluginmanager/reconciler/reconciler.go`,
    /// `operationexecutor/operation_generator.go`).
    pub(super) async fn watch_plugins(self: &Arc<Self>) {
        use std::os::unix::fs::MetadataExt;
        let now: BTreeMap<PathBuf, u64> = dra::registration_sockets(&self.cfg.registry)
            .unwrap_or_default()
            .into_iter()
            .filter_map(|p| std::fs::symlink_metadata(&p).ok().map(|m| (p, m.ino())))
            .collect();
        let known: Vec<(PathBuf, Known)> = lock(&self.state)
            .known
            .iter()
            .map(|(p, k)| (p.clone(), k.clone()))
            .collect();
        for (socket, k) in known {
            if now.get(&socket) != Some(&k.ino) {
                self.deregister(&socket, k.driver.as_deref());
            }
        }
        for (socket, ino) in now {
            let (is_known, retry_at) = {
                let st = lock(&self.state);
                (
                    st.known.contains_key(&socket),
                    st.retry_registration.get(&socket).copied(),
                )
            };
            if is_known || retry_at.is_some_and(|t| Instant::now() < t) {
                continue;
            }
            self.register(&socket, ino).await;
        }
    }

    pub(super) async fn register(self: &Arc<Self>, socket: &Path, ino: u64) {
        let kubelet = self.cfg.kubelet;
        // `RegisterPlugin` → `add` (1.34, `dra_plugin_manager.go`): one plugin
        // instance cannot take over the endpoint of another of the same driver.
        let accept = |info: &kubelet_api::pluginregistration::PluginInfo| {
            let st = lock(&self.state);
            let taken = st
                .plugins
                .get(&info.name)
                .is_some_and(|ps| ps.iter().any(|p| p.endpoint == Path::new(&info.endpoint)));
            if kubelet == KubeletVersion::V1_34 && taken {
                return Err(format!(
                    "endpoint {} already registered for DRA driver plugin {}",
                    info.endpoint, info.name
                ));
            }
            Ok(())
        };
        match dra::register_as(socket, kubelet, accept).await {
            Ok(verdict) => {
                let (driver, endpoint, chosen) = match verdict {
                    Verdict::Registered(r) => (r.name.clone(), r.endpoint_path(), Some(r.chosen)),
                    Verdict::RegisteredAlpha(info) => {
                        (info.name.clone(), PathBuf::from(&info.endpoint), None)
                    }
                };
                {
                    let mut st = lock(&self.state);
                    st.retry_registration.remove(socket);
                    st.known.insert(
                        socket.to_owned(),
                        Known {
                            ino,
                            driver: Some(driver.clone()),
                        },
                    );
                    let plugins = st.plugins.entry(driver.clone()).or_default();
                    // 1.32's store keeps one plugin per driver name
                    // (`plugins_store.go`); 1.34 a list, newest last.
                    if kubelet == KubeletVersion::V1_32 {
                        plugins.clear();
                    }
                    plugins.push(Plugin {
                        socket: socket.to_owned(),
                        endpoint: endpoint.clone(),
                        chosen,
                        connected: false,
                        client: None,
                    });
                }
                self.emit(Event::Registered {
                    socket: socket.to_owned(),
                    driver: driver.clone(),
                    endpoint: endpoint.display().to_string(),
                    chosen,
                });
                match kubelet {
                    // 1.32 `RegisterPlugin`: cancel a pending wipe of this driver.
                    KubeletVersion::V1_32 => self.cancel_wipe(&driver),
                    // 1.34 `add` → `sync`: the new plugin is not connected yet.
                    KubeletVersion::V1_34 => self.sync(&driver),
                }
            }
            Err(e) => {
                // The reconciler tries again (every second here).
                lock(&self.state)
                    .retry_registration
                    .insert(socket.to_owned(), Instant::now() + Duration::from_secs(1));
                self.emit(Event::Refused {
                    socket: socket.to_owned(),
                    error: format!("{e:#}"),
                });
            }
        }
    }

    /// `DeRegisterPlugin`: the socket is gone (or was re-created).
    pub(super) fn deregister(self: &Arc<Self>, socket: &Path, driver: Option<&str>) {
        let last = {
            let mut st = lock(&self.state);
            st.known.remove(socket);
            let Some(driver) = driver else { return };
            let Some(plugins) = st.plugins.get_mut(driver) else {
                return;
            };
            let before = plugins.len();
            plugins.retain(|p| p.socket != socket);
            if plugins.len() == before {
                return;
            }
            let last = plugins.is_empty();
            if last {
                st.plugins.remove(driver);
            }
            last
        };
        let Some(driver) = driver else { return };
        self.emit(Event::Deregistered {
            socket: socket.to_owned(),
            driver: driver.to_owned(),
            last,
        });
        match self.cfg.kubelet {
            // 1.32 `DeRegisterPlugin` (`registration.go`): after the last
            // instance, wipe after the delay (replacing a pending wipe).
            KubeletVersion::V1_32 => {
                if last {
                    self.cancel_wipe(driver);
                    self.schedule_wipe(driver);
                }
            }
            // 1.34 `remove` → `sync`.
            KubeletVersion::V1_34 => self.sync(driver),
        }
    }

    /// 1.34 `sync` (`dra_plugin_manager.go`): a driver with a connected plugin
    /// cancels its pending wipe; one without gets a wipe queued, unless one is.
    pub(super) fn sync(self: &Arc<Self>, driver: &str) {
        let (usable, pending) = {
            let st = lock(&self.state);
            let usable = st
                .plugins
                .get(driver)
                .is_some_and(|ps| ps.iter().any(|p| p.connected));
            let pending = st
                .pending_wipes
                .get(driver)
                .is_some_and(|h| !h.is_finished());
            (usable, pending)
        };
        if usable {
            self.cancel_wipe(driver);
        } else if !pending {
            self.schedule_wipe(driver);
        }
    }

    pub(super) fn schedule_wipe(self: &Arc<Self>, driver: &str) {
        let delay = self.cfg.wiping_delay;
        let peer = self.clone();
        let d = driver.to_owned();
        let handle = tokio::spawn(async move {
            tokio::time::sleep(delay).await;
            peer.wipe("driver-cleanup", Some(&d)).await;
        });
        lock(&self.state)
            .pending_wipes
            .insert(driver.to_owned(), handle);
        self.emit(Event::WipeScheduled {
            driver: driver.to_owned(),
            delay_ms: u64::try_from(delay.as_millis()).unwrap_or(u64::MAX),
        });
    }

    pub(super) fn cancel_wipe(&self, driver: &str) {
        let handle = lock(&self.state).pending_wipes.remove(driver);
        if let Some(h) = handle {
            if !h.is_finished() {
                h.abort();
                self.emit(Event::WipeCancelled {
                    driver: driver.to_owned(),
                });
            }
        }
    }

    /// 1.34's connection tracking (`monitoredPlugin.HandleConn`): a change of a
    /// plugin's connection state → `sync` of its driver.
    pub(super) fn probe_connections(self: &Arc<Self>) {
        let mut changed = Vec::new();
        {
            let mut st = lock(&self.state);
            for (driver, plugins) in st.plugins.iter_mut() {
                for p in plugins.iter_mut() {
                    let up = std::os::unix::net::UnixStream::connect(&p.endpoint).is_ok();
                    if up != p.connected {
                        p.connected = up;
                        if !up {
                            p.client = None;
                        }
                        changed.push((driver.clone(), p.endpoint.display().to_string(), up));
                    }
                }
            }
        }
        for (driver, endpoint, connected) in changed {
            self.emit(Event::Connection {
                driver: driver.clone(),
                endpoint,
                connected,
            });
            self.sync(&driver);
        }
    }
}
