//! The plugin: a [`Driver`] served to kubelet, its devices published.

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::Arc;
use std::time::Instant;

use kube::runtime::watcher;
use kubelet_api::serve::ListenError;
use support::error_chain;
use tokio::sync::{watch, Notify};

use crate::batch::{batch, complete};
use crate::claim::{read_claims, ClaimRef, Ticket};
use crate::config::{Config, ConfigError};
use crate::driver::{Answers, Call, CallKind, ClaimError, Driver, PreparedDevice};
use crate::grpc::{self, Calls, WireAnswers};
use crate::health::HealthReports;
use crate::publish::{AbortOnDrop, Publisher, Republish};
use crate::ready::Readiness;
use crate::slices::{SliceError, Slices};

/// The API server connections the plugin uses.
#[derive(Clone)]
pub struct Clients {
    /// For claim reads and slice writes.
    pub client: kube::Client,
    /// For the watch of the driver's own ResourceSlices: its reads must wait past
    /// the watch's server timeout.
    pub watch_client: kube::Client,
    /// That watch's settings (its server timeout).
    pub watch_config: watcher::Config,
}

impl Clients {
    /// One client for everything, and kube's default watch settings.
    pub fn new(client: kube::Client) -> Self {
        Self {
            watch_client: client.clone(),
            client,
            watch_config: watcher::Config::default(),
        }
    }
}

/// Why serving stopped.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ServeError {
    /// A socket could not be bound at start.
    #[error(transparent)]
    Listen(#[from] ListenError),
    /// The serving task failed.
    #[error("the kubelet API server task failed")]
    Task(#[source] tokio::task::JoinError),
}

/// A [`Driver`] served to kubelet (registration, both DRA API versions, health)
/// and, with [`Plugin::run`], its devices published as this node's ResourceSlices.
pub struct Plugin {
    config: Arc<Config>,
    clients: Clients,
    readiness: Arc<Readiness>,
    republish: Republish,
}

/// What the gRPC side calls.
struct Inner<D: Driver> {
    config: Arc<Config>,
    driver: Arc<D>,
    client: kube::Client,
    readiness: Arc<Readiness>,
    /// Notified each time kubelet accepts a registration.
    registered: Arc<Notify>,
}

impl Plugin {
    /// A plugin for `config`. A ready file left by an earlier process is removed:
    /// this one is not registered yet.
    pub fn new(config: Config, clients: Clients) -> Result<Self, ConfigError> {
        config.check()?;
        let config = Arc::new(config);
        let readiness = Arc::new(Readiness::new(config.ready_file.clone(), config.sockets()));
        Ok(Self {
            config,
            clients,
            readiness,
            republish: Republish::default(),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// A handle the driver tells when its devices change: the next publication
    /// pass asks [`Driver::devices`] again.
    pub fn republish(&self) -> Republish {
        self.republish.clone()
    }

    /// Serves `driver` to kubelet until `shutdown` completes, publishing nothing.
    pub async fn serve<D: Driver>(
        &self,
        driver: Arc<D>,
        shutdown: impl Future<Output = ()>,
    ) -> Result<(), ServeError> {
        self.serve_with(self.inner(driver), shutdown).await
    }

    /// Serves `driver` to kubelet and keeps this node's ResourceSlices equal to its
    /// devices until `shutdown` completes. The slices stay (a restart keeps them;
    /// [`Self::delete_slices`] is for an uninstall).
    pub async fn run<D: Driver>(
        &self,
        driver: Arc<D>,
        shutdown: impl Future<Output = ()>,
    ) -> Result<(), ServeError> {
        let inner = self.inner(driver);
        let publisher = Arc::new(Publisher {
            driver: inner.driver.clone(),
            slices: tokio::sync::Mutex::new(self.slices()),
            watch_client: self.clients.watch_client.clone(),
            watch_config: self.clients.watch_config.clone(),
            max_backoff: self.config.max_retry,
            readiness: self.readiness.clone(),
            republish: self.republish.clone(),
            registered: inner.registered.clone(),
            seen: Default::default(),
        });
        let _publishing = AbortOnDrop(tokio::spawn(publisher.run()));
        self.serve_with(inner, shutdown).await
    }

    fn inner<D: Driver>(&self, driver: Arc<D>) -> Arc<Inner<D>> {
        Arc::new(Inner {
            config: self.config.clone(),
            driver,
            client: self.clients.client.clone(),
            readiness: self.readiness.clone(),
            registered: Arc::default(),
        })
    }

    async fn serve_with<D: Driver>(
        &self,
        inner: Arc<Inner<D>>,
        shutdown: impl Future<Output = ()>,
    ) -> Result<(), ServeError> {
        let calls: Arc<dyn Calls> = inner;
        let result = grpc::serve(self.config.clone(), calls, shutdown).await;
        self.readiness.reset();
        result.map_err(ServeError::from)
    }

    /// This node's ResourceSlices of the driver.
    pub(crate) fn slices(&self) -> Slices {
        Slices::new(
            self.clients.client.clone(),
            &self.config.driver_name,
            &self.config.node_name,
        )
    }

    /// Deletes this node's ResourceSlices of the driver (an uninstall); the names
    /// deleted.
    pub async fn delete_slices(&self) -> Result<Vec<String>, SliceError> {
        self.slices().delete_all().await
    }

    /// Whether the API server serves [`RESOURCE_API`](crate::RESOURCE_API) with
    /// ResourceSlices and ResourceClaims (its discovery document): `Ok(false)` when
    /// it answers 404 or lists neither (a server before 1.34, or one with the group
    /// version turned off), an error when it could not be asked. A driver asks at
    /// start to refuse a cluster it cannot work with, in words.
    pub async fn resource_api_served(&self) -> Result<bool, SliceError> {
        crate::slices::resource_api_served(&self.clients.client).await
    }
}

impl<D: Driver> Inner<D> {
    fn deadline(&self) -> tokio::time::Instant {
        tokio::time::Instant::now() + self.config.call_timeout
    }

    /// Tells the driver the call's outcome, logs it, and gives kubelet's answers.
    fn answered<T>(
        &self,
        kind: CallKind,
        started: Instant,
        asked: &[ClaimRef],
        answers: Answers<T, ClaimError<D::Error>>,
    ) -> WireAnswers<T> {
        let call = Call {
            kind,
            took: started.elapsed(),
            claims: asked
                .iter()
                .map(|c| (c, answers.get(&c.uid).and_then(|a| a.as_ref().err())))
                .collect(),
        };
        self.driver.answered(&call);
        let name = match kind {
            CallKind::Prepare => "NodePrepareResources",
            CallKind::Unprepare => "NodeUnprepareResources",
        };
        let failed = call.claims.iter().filter(|(_, e)| e.is_some()).count();
        tracing::info!(claims = asked.len(), failed, "{name}");
        for (claim, e) in &call.claims {
            if let Some(e) = e {
                tracing::warn!(claim = %claim, error = %error_chain(e), "{name}: claim failed");
            }
        }
        answers
            .into_iter()
            .map(|(uid, a)| (uid, a.map_err(|e| error_chain(&e))))
            .collect()
    }
}

/// The claims kubelet named, checked, and the refusals as answers.
fn checked<T, E: std::error::Error>(
    claims: Vec<ClaimRef>,
) -> (Vec<ClaimRef>, Vec<ClaimRef>, Answers<T, ClaimError<E>>) {
    let b = batch(claims);
    let mut asked = b.claims.clone();
    let mut answers = BTreeMap::new();
    for (uid, (claim, why)) in b.refused {
        asked.push(claim);
        answers.insert(uid, Err(ClaimError::Request(why)));
    }
    (b.claims, asked, answers)
}

/// Runs one of the driver's calls on `asked` and completes its answers ([`complete`]).
/// The call runs in its own task, so a call kubelet gives up on does not cut the
/// driver's work off halfway; a driver that panics answers no claim.
async fn run_driver<T, E>(
    asked: &[ClaimRef],
    call: impl Future<Output = Answers<T, E>> + Send + 'static,
) -> Answers<T, ClaimError<E>>
where
    T: Send + 'static,
    E: std::error::Error + Send + 'static,
{
    let done = match tokio::spawn(call).await {
        Ok(a) => a,
        Err(e) => {
            tracing::error!(error = %e, "the driver failed on a request");
            BTreeMap::new()
        }
    };
    let answers = done
        .into_iter()
        .map(|(uid, a)| (uid, a.map_err(ClaimError::Driver)))
        .collect();
    complete(asked, answers)
}

#[tonic::async_trait]
impl<D: Driver> Calls for Inner<D> {
    /// One deadline for the whole call: claim reads and the driver's work alike.
    async fn prepare(&self, claims: Vec<ClaimRef>) -> WireAnswers<Vec<PreparedDevice>> {
        let started = Instant::now();
        let deadline = self.deadline();
        // Taken on arrival: an unprepare that answers after this is later.
        let arrived = Ticket::now();
        let (claims, asked, mut answers) = checked(claims);
        let mut admitted = Vec::new();
        for c in claims {
            match self.driver.admit(&c) {
                Ok(()) => admitted.push((c, arrived)),
                Err(e) => {
                    answers.insert(c.uid, Err(ClaimError::Driver(e)));
                }
            }
        }
        let reads = read_claims(
            &self.client,
            admitted,
            &self.config.driver_name,
            &self.config.node_name,
            deadline,
            self.config.call_timeout,
        )
        .await;
        let mut read = Vec::new();
        let mut uids = Vec::new();
        for (claim, r) in reads {
            match r {
                Ok(c) => {
                    uids.push(claim);
                    read.push(c);
                }
                Err(e) => {
                    answers.insert(claim.uid, Err(ClaimError::Read(e)));
                }
            }
        }
        if !read.is_empty() {
            let driver = self.driver.clone();
            let call = async move { driver.prepare(read, deadline).await };
            answers.extend(run_driver(&uids, call).await);
        }
        self.answered(CallKind::Prepare, started, &asked, answers)
    }

    async fn unprepare(&self, claims: Vec<ClaimRef>) -> WireAnswers<()> {
        let started = Instant::now();
        let deadline = self.deadline();
        let (claims, asked, mut answers) = checked(claims);
        if !claims.is_empty() {
            let driver = self.driver.clone();
            let sent = claims.clone();
            let call = async move { driver.unprepare(sent, deadline).await };
            answers.extend(run_driver(&claims, call).await);
        }
        self.answered(CallKind::Unprepare, started, &asked, answers)
    }

    fn registration_status(&self, registered: bool) {
        self.readiness.registered(registered);
        if registered {
            self.registered.notify_one();
        }
    }

    fn health(&self) -> Option<watch::Receiver<HealthReports>> {
        self.driver.health()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn claim(uid: &str) -> ClaimRef {
        ClaimRef {
            uid: uid.into(),
            namespace: "ns".into(),
            name: "x".into(),
        }
    }

    #[tokio::test]
    async fn a_panicking_driver_gives_errors_not_a_crash() {
        let call = async move {
            if true {
                panic!("driver bug");
            }
            Answers::<(), std::io::Error>::new()
        };
        let answers = run_driver(&[claim("a")], call).await;
        assert!(matches!(answers["a"], Err(ClaimError::NoAnswer)));
    }

    #[tokio::test]
    async fn the_driver_s_errors_are_its_own_and_strangers_dropped() {
        let call = async move {
            Answers::from([
                ("a".to_owned(), Err(std::io::Error::other("busy"))),
                ("stranger".to_owned(), Ok(())),
            ])
        };
        let answers = run_driver(&[claim("a"), claim("b")], call).await;
        assert_eq!(answers.keys().collect::<Vec<_>>(), ["a", "b"]);
        assert!(matches!(&answers["a"], Err(ClaimError::Driver(e)) if e.to_string() == "busy"));
        assert!(matches!(answers["b"], Err(ClaimError::NoAnswer)));
    }
}
