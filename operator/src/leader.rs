//! Leader election on a `coordination.k8s.io/v1` Lease: exactly one replica runs the lifecycle
//! and the router; a standby keeps trying and takes over when the leader's Lease expires.
//!
//! The rules are client-go's (`leaderelection`), with the calls the chart's RBAC grants (get,
//! create, update on the one Lease; no patch):
//!
//! - the Lease is missing: create it, holding it (`holderIdentity` = the pod's name);
//! - it is held by another and its record changed within the last `lease_duration` (as this
//!   replica observed it, on its own clock: the holder's clock is never compared with ours):
//!   wait;
//! - it is free (no holder), ours, or its record has not changed for `lease_duration`: write
//!   it with us as holder (an update carrying the `resourceVersion` read, so that of two
//!   replicas racing for it one gets 409 Conflict and stays standby). A standby whose try
//!   failed counts the expiry again from its next read (it could not see renewals meanwhile);
//! - a leader renews every `retry_period`, and steps down when it has not renewed for
//!   `renew_deadline` (shorter than `lease_duration`, so it has stopped switching before a
//!   standby may take over), or at once when the Lease names another holder. As in client-go,
//!   every try is bounded: a leader's by what is left of its renew deadline (a hung call never
//!   keeps a replica leading past it), a standby's by `renew_deadline`; a try past its bound
//!   counts as failed. A renewal counts from when its try began (its write is committed
//!   after that), so a standby, which dates what it observes by when its read answered, never
//!   sees a record older than the leader believes it is;
//! - **hold-over**: a leader whose last try failed because the API server cannot be reached
//!   (a transport error, a try past its bound, 5xx, 429) does not step down at
//!   `renew_deadline`: it is *held over* ([`Leadership::held`]) and keeps serving its ready
//!   instances, but makes no switch (the operator tells the lifecycle so). It keeps trying;
//!   a renewal ends the hold-over, a Lease read that names another holder (or any other
//!   failure: the API server answers, but not as it should) steps it down at once, and it
//!   steps down at `last renewal + renew_deadline + holdover` at the latest. `holdover` 0 is
//!   client-go's rule;
//! - **fence**: a replica that takes over a Lease another replica held and did not release
//!   (it expired) cannot know whether that replica is dead or held over and still forwarding
//!   to the engines it adopts; it reports [`Leadership::fence_until`] (its takeover plus
//!   `holdover`), until which it must not park or stop the instances it adopts as ready. The
//!   old leader's hold-over has ended by then: it began no later than the takeover less
//!   `lease_duration` and lasts at most `renew_deadline + holdover`. A Lease released (no
//!   holder) or taken from nobody gives no fence;
//! - on shutdown the leader releases the Lease (no holder, `leaseDurationSeconds` 1), so that a
//!   standby takes over at its next try instead of after `lease_duration`.
//!
//! **Owner.** Given the name of the operator's own Deployment (apps/v1,
//! `CAPYCTL_OPERATOR_DEPLOYMENT`; the chart sets it), the operator reads it once at start
//! ([`deployment_owner`]) and every replica creates the Lease with an ownerReference to it
//! (`controller: false`, `blockOwnerDeletion: false`), and adds that reference when it writes a
//! Lease found without it. Deleting the Deployment (`helm uninstall`) then lets the garbage
//! collector delete the Lease, even when the leader's release is refused because its RBAC went
//! in the same pass; a Lease a standby creates again after that names an owner whose UID no
//! longer exists and is collected too. The reference changes nothing in the election. Without
//! the setting (run outside the chart), or when the Deployment cannot be read, the Lease has
//! no owner, as before.
//!
//! [`LeaderElector::try_acquire_or_renew`] is one step; [`LeaderElector::run`] loops it and
//! publishes whether this replica leads on a `watch` channel. [`set_leader_label`] labels the
//! leader's own Pod for the Services that select it (`CAPYCTL_LEADER_LABEL`);
//! [`clear_leader_label`] removes it, retrying until it is gone (a replica does so when it
//! starts: a leader killed without a chance to remove it comes back as a standby in the same
//! Pod).

use std::time::Duration;

use k8s_openapi::api::apps::v1::Deployment as AppsDeployment;
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta, OwnerReference};
use k8s_openapi::jiff::Timestamp;
use kube::Api;
use kube::api::{Patch, PatchParams, PostParams};
use tokio::sync::watch;
use tokio::time::Instant;

/// The election's settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseConfig {
    /// The Lease's name (`CAPYCTL_LEASE_NAME`).
    pub name: String,
    /// This replica's identity: its Pod's name (`POD_NAME`).
    pub identity: String,
    /// How long a Lease not renewed stays the holder's (`leaseDurationSeconds`). Default 15 s.
    pub lease_duration: Duration,
    /// A leader that has not renewed for this long steps down. Default 10 s.
    pub renew_deadline: Duration,
    /// Between two tries (renewals of a leader, attempts of a standby). Default 2 s.
    pub retry_period: Duration,
    /// How long past `renew_deadline` a leader that cannot reach the API server stays held
    /// over (serving its ready instances, switching nothing) before it steps down; also the
    /// length of the fence after a takeover (see the module doc). Default 90 s; 0 = step
    /// down at the renew deadline (`CAPYCTL_LEADER_HOLDOVER`).
    pub holdover: Duration,
    /// The operator's own Deployment (apps/v1, in the Lease's namespace), read once at start
    /// and made the Lease's owner (`CAPYCTL_OPERATOR_DEPLOYMENT`); `None`: no owner.
    pub owner_deployment: Option<String>,
}

impl LeaseConfig {
    /// client-go's defaults: 15 s, 10 s, 2 s; a hold-over of 90 s.
    pub fn new(name: impl Into<String>, identity: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            identity: identity.into(),
            lease_duration: Duration::from_secs(15),
            renew_deadline: Duration::from_secs(10),
            retry_period: Duration::from_secs(2),
            holdover: DEFAULT_HOLDOVER,
            owner_deployment: None,
        }
    }

    /// Checks the timing: `lease_duration` > `renew_deadline` > `retry_period` > 0 (the
    /// fence's guarantee needs the first), each naming its setting.
    pub fn validate(&self) -> Result<(), String> {
        if self.retry_period.is_zero() {
            return Err(
                "CAPYCTL_LEASE_RETRY_PERIOD (--lease-retry-period) must be more than 0s".into(),
            );
        }
        if self.renew_deadline <= self.retry_period {
            return Err(format!(
                "CAPYCTL_LEASE_RENEW_DEADLINE (--lease-renew-deadline, {}) must be longer than the retry period ({})",
                capyctl_spec::units::format_duration(self.renew_deadline),
                capyctl_spec::units::format_duration(self.retry_period)
            ));
        }
        if self.lease_duration <= self.renew_deadline {
            return Err(format!(
                "CAPYCTL_LEASE_DURATION (--lease-duration, {}) must be longer than the renew deadline ({})",
                capyctl_spec::units::format_duration(self.lease_duration),
                capyctl_spec::units::format_duration(self.renew_deadline)
            ));
        }
        Ok(())
    }
}

/// The hold-over's default (`CAPYCTL_LEADER_HOLDOVER`, the chart's `leaderElection.holdover`).
pub const DEFAULT_HOLDOVER: Duration = Duration::from_secs(90);

/// What [`LeaderElector::run`] publishes: whether this replica leads, whether it is held over,
/// and the fence of its takeover.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Leadership {
    /// This replica leads (renewing, or held over).
    pub leading: bool,
    /// It leads held over: its renewals fail because the API server cannot be reached; it
    /// serves its ready instances and switches nothing (see the module doc).
    pub held: bool,
    /// It took the Lease over from a replica that did not release it: until then it must not
    /// park or stop the instances it adopts as ready (see the module doc).
    pub fence_until: Option<Instant>,
}

/// Whether `e` says the API server cannot be reached (or cannot answer now): a transport
/// error, 5xx or 429. Such failures hold a leader over; any other steps it down.
pub fn unreachable(e: &kube::Error) -> bool {
    match e {
        kube::Error::Api(s) => s.code >= 500 || s.code == 429,
        kube::Error::HyperError(_) | kube::Error::Service(_) | kube::Error::ReadEvents(_) => true,
        _ => false,
    }
}

/// The Lease's owner reference to Deployment `deployment` (apps/v1): not its controller, and
/// blocking nothing (`blockOwnerDeletion: false` needs no right on the Deployment's
/// finalizers). `None` when the object has no name or UID.
pub fn owner_reference(deployment: &AppsDeployment) -> Option<OwnerReference> {
    Some(OwnerReference {
        api_version: "apps/v1".to_string(),
        kind: "Deployment".to_string(),
        name: deployment.metadata.name.clone().filter(|n| !n.is_empty())?,
        uid: deployment.metadata.uid.clone().filter(|u| !u.is_empty())?,
        controller: Some(false),
        block_owner_deletion: Some(false),
    })
}

/// Reads the operator's own Deployment `name` once, within `bound`, for the Lease's owner
/// reference ([`owner_reference`]). A Deployment that cannot be read (missing, refused, the API
/// server down or slow) is logged and gives `None`: the Lease is then made without an owner,
/// as outside the chart, since the election must not wait on, nor fail for, what only decides
/// whether `helm uninstall` leaves the Lease behind.
pub async fn deployment_owner(
    deployments: &Api<AppsDeployment>,
    name: &str,
    bound: Duration,
) -> Option<OwnerReference> {
    let read = match tokio::time::timeout(bound, deployments.get(name)).await {
        Ok(Ok(d)) => owner_reference(&d).ok_or_else(|| "it has no UID".to_string()),
        Ok(Err(e)) => Err(e.to_string()),
        Err(_) => Err(format!(
            "no answer within {}",
            capyctl_spec::units::format_duration(bound)
        )),
    };
    match read {
        Ok(owner) => {
            tracing::info!(deployment = %name, uid = %owner.uid, "the Lease is owned by the operator's Deployment");
            Some(owner)
        }
        Err(error) => {
            tracing::warn!(deployment = %name, %error, "the operator's Deployment (CAPYCTL_OPERATOR_DEPLOYMENT) cannot be read: the Lease gets no owner, and is left behind when the Deployment is deleted");
            None
        }
    }
}

/// What one try found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Attempt {
    /// This replica holds the Lease (acquired or renewed).
    Held,
    /// Another replica holds it and it has not expired.
    HeldBy(String),
    /// Another replica wrote the Lease between our read and our write (409): nothing changed
    /// for us; the next try reads it again.
    Conflict,
}

/// The record as last observed, and when (on our clock).
#[derive(Debug, Clone)]
struct Observed {
    holder: Option<String>,
    resource_version: Option<String>,
    renew_time: Option<Timestamp>,
    duration: Duration,
    at: Instant,
}

/// One replica's side of the election.
#[derive(Debug)]
pub struct LeaderElector {
    api: Api<Lease>,
    config: LeaseConfig,
    observed: Option<Observed>,
    /// When this replica last wrote the Lease as its holder (when that try began).
    last_renew: Option<Instant>,
    /// The last try failed because the API server cannot be reached: past the renew deadline
    /// the leader is held over rather than stepping down.
    unreachable: bool,
    /// The fence of this replica's takeover (see [`Leadership::fence_until`]).
    fence_until: Option<Instant>,
    /// The Lease's owner (see the module doc); `None`: none.
    owner: Option<OwnerReference>,
}

fn holder_of(lease: &Lease) -> Option<String> {
    lease
        .spec
        .as_ref()
        .and_then(|s| s.holder_identity.clone())
        .filter(|h| !h.is_empty())
}

fn seconds(d: Duration) -> i32 {
    i32::try_from(d.as_secs().max(1)).unwrap_or(i32::MAX)
}

impl LeaderElector {
    /// An elector for the Lease of `config` through `api` (the operator's namespace).
    pub fn new(api: Api<Lease>, config: LeaseConfig) -> Self {
        Self {
            api,
            config,
            observed: None,
            last_renew: None,
            unreachable: false,
            fence_until: None,
            owner: None,
        }
    }

    /// The same elector making the Lease with owner `owner` (see the module doc).
    pub fn with_owner(mut self, owner: Option<OwnerReference>) -> Self {
        self.owner = owner;
        self
    }

    /// Adds this replica's owner to `meta` when it is not there (by UID); keeps the others.
    fn add_owner(&self, meta: &mut ObjectMeta) {
        let Some(owner) = &self.owner else { return };
        let owners = meta.owner_references.get_or_insert_with(Vec::new);
        if !owners.iter().any(|o| o.uid == owner.uid) {
            owners.push(owner.clone());
        }
    }

    /// The settings.
    pub fn config(&self) -> &LeaseConfig {
        &self.config
    }

    /// Whether this replica may act as leader now: it holds the Lease and renewed it within
    /// `renew_deadline`, or within `renew_deadline + holdover` while its last try could not
    /// reach the API server (held over).
    pub fn is_leading(&self) -> bool {
        self.lead_left().is_some()
    }

    /// Whether this replica leads held over (see the module doc).
    pub fn is_held(&self) -> bool {
        self.is_leading()
            && self
                .last_renew
                .is_some_and(|t| t.elapsed() >= self.config.renew_deadline)
    }

    /// What this replica publishes now.
    pub fn leadership(&self) -> Leadership {
        let leading = self.is_leading();
        Leadership {
            leading,
            held: self.is_held(),
            fence_until: self.fence_until.filter(|_| leading),
        }
    }

    /// How long this replica may still lead without a renewal; `None` when it does not lead.
    fn lead_left(&self) -> Option<Duration> {
        let ours = self
            .observed
            .as_ref()
            .is_some_and(|o| o.holder.as_deref() == Some(self.config.identity.as_str()));
        let since = self.last_renew?.elapsed();
        let bound = if self.unreachable {
            self.config.renew_deadline + self.config.holdover
        } else {
            self.config.renew_deadline
        };
        (ours && since < bound).then(|| bound - since)
    }

    fn observe(&mut self, lease: &Lease) {
        let spec = lease.spec.clone().unwrap_or_default();
        let holder = holder_of(lease);
        let resource_version = lease.metadata.resource_version.clone();
        let renew_time = spec.renew_time.map(|t| t.0);
        let duration = spec
            .lease_duration_seconds
            .and_then(|s| u64::try_from(s).ok())
            .map(Duration::from_secs)
            .unwrap_or(self.config.lease_duration);
        let changed = match &self.observed {
            Some(o) => {
                o.holder != holder
                    || o.renew_time != renew_time
                    || o.resource_version != resource_version
            }
            None => true,
        };
        if changed {
            self.observed = Some(Observed {
                holder,
                resource_version,
                renew_time,
                duration,
                at: Instant::now(),
            });
        }
    }

    fn our_spec(&self, previous: Option<&LeaseSpec>) -> LeaseSpec {
        let now = MicroTime(Timestamp::now());
        let ours = previous
            .and_then(|p| p.holder_identity.as_deref())
            .is_some_and(|h| h == self.config.identity);
        let transitions = previous.and_then(|p| p.lease_transitions).unwrap_or(0);
        LeaseSpec {
            holder_identity: Some(self.config.identity.clone()),
            lease_duration_seconds: Some(seconds(self.config.lease_duration)),
            acquire_time: if ours {
                previous.and_then(|p| p.acquire_time.clone())
            } else {
                Some(now.clone())
            },
            renew_time: Some(now),
            lease_transitions: Some(if ours || previous.is_none() {
                transitions
            } else {
                transitions.saturating_add(1)
            }),
            ..previous.cloned().unwrap_or_default()
        }
    }

    fn held(&mut self, written: &Lease, began: Instant, from: Option<&str>) -> Attempt {
        self.observe(written);
        if self.last_renew.is_none() {
            // Taken over from a replica that did not release it: fenced (see the module doc);
            // taken free or created: not.
            self.fence_until = from.map(|_| Instant::now() + self.config.holdover);
        }
        self.last_renew = Some(began);
        self.unreachable = false;
        Attempt::Held
    }

    /// One try: acquire the Lease when it is missing, free, ours or expired, renew it when it is
    /// ours (see the module doc).
    pub async fn try_acquire_or_renew(&mut self) -> Result<Attempt, kube::Error> {
        let began = Instant::now();
        let current = match self.api.get_opt(&self.config.name).await? {
            Some(l) => l,
            None => {
                let mut lease = Lease {
                    metadata: ObjectMeta {
                        name: Some(self.config.name.clone()),
                        ..ObjectMeta::default()
                    },
                    spec: Some(self.our_spec(None)),
                };
                self.add_owner(&mut lease.metadata);
                return match self.api.create(&PostParams::default(), &lease).await {
                    Ok(written) => Ok(self.held(&written, began, None)),
                    Err(kube::Error::Api(s)) if s.is_already_exists() || s.is_conflict() => {
                        Ok(Attempt::Conflict)
                    }
                    Err(e) => Err(e),
                };
            }
        };
        self.observe(&current);
        let holder = holder_of(&current);
        let ours = holder.as_deref() == Some(self.config.identity.as_str());
        if let (Some(other), false) = (holder.as_ref(), ours) {
            let expired = self
                .observed
                .as_ref()
                .is_some_and(|o| o.at.elapsed() >= o.duration);
            if !expired {
                return Ok(Attempt::HeldBy(other.clone()));
            }
            tracing::info!(lease = %self.config.name, previous = %other, "the Lease expired; taking it over");
        }
        let from = holder.filter(|_| !ours);
        let mut lease = current.clone();
        lease.spec = Some(self.our_spec(current.spec.as_ref()));
        self.add_owner(&mut lease.metadata);
        match self
            .api
            .replace(&self.config.name, &PostParams::default(), &lease)
            .await
        {
            Ok(written) => Ok(self.held(&written, began, from.as_deref())),
            Err(kube::Error::Api(s)) if s.is_conflict() => Ok(Attempt::Conflict),
            Err(e) => Err(e),
        }
    }

    /// Gives the Lease up if this replica holds it (no holder, `leaseDurationSeconds` 1), so a
    /// standby takes over at its next try.
    pub async fn release(&mut self) -> Result<(), kube::Error> {
        let Some(mut lease) = self.api.get_opt(&self.config.name).await? else {
            return Ok(());
        };
        if holder_of(&lease).as_deref() != Some(self.config.identity.as_str()) {
            return Ok(());
        }
        let mut spec = lease.spec.clone().unwrap_or_default();
        spec.holder_identity = None;
        spec.lease_duration_seconds = Some(1);
        spec.renew_time = Some(MicroTime(Timestamp::now()));
        lease.spec = Some(spec);
        self.api
            .replace(&self.config.name, &PostParams::default(), &lease)
            .await?;
        self.last_renew = None;
        self.observed = None;
        Ok(())
    }

    /// What is left of the renew deadline while this replica leads (of its hold-over while
    /// held over); `None` while it does not lead.
    fn renew_left(&self) -> Option<Duration> {
        let left = self.lead_left()?;
        if self.is_held() {
            return Some(left);
        }
        self.last_renew
            .map(|t| self.config.renew_deadline.saturating_sub(t.elapsed()))
    }

    /// One try bounded as the module doc says; `Err(None)` when it ran past its bound. Notes
    /// whether a failure says the API server cannot be reached (see [`unreachable`]).
    async fn bounded_try(&mut self) -> Result<Attempt, Option<kube::Error>> {
        let bound = self
            .renew_left()
            .unwrap_or(self.config.renew_deadline)
            .min(self.config.renew_deadline);
        let outcome = match tokio::time::timeout(bound, self.try_acquire_or_renew()).await {
            Ok(r) => r.map_err(Some),
            Err(_) => Err(None),
        };
        match &outcome {
            Ok(Attempt::Held) => {}
            Ok(_) => self.unreachable = false,
            Err(None) => self.unreachable = true,
            Err(Some(e)) => self.unreachable = unreachable(e),
        }
        if outcome.is_err() && !self.is_leading() {
            // A standby that could not read the Lease cannot tell whether its holder renewed
            // meanwhile: it counts the expiry again from its next read, so that a leader held
            // over by the same outage has a whole `lease_duration` after it to renew.
            self.observed = None;
        }
        outcome
    }

    /// Sends what this replica is now on `leading` when it changed, with a log line.
    fn publish(&self, leading: &watch::Sender<Leadership>) {
        let now = self.leadership();
        let was = *leading.borrow();
        if now != was {
            if now.leading && !was.leading {
                tracing::info!(lease = %self.config.name, identity = %self.config.identity, fence_until = ?now.fence_until, "leading");
            } else if !now.leading {
                tracing::warn!(lease = %self.config.name, identity = %self.config.identity, "no longer leading");
            } else if now.held {
                tracing::warn!(lease = %self.config.name, holdover = ?self.config.holdover, "the API server cannot be reached: held over (serving ready models, switching nothing)");
            } else {
                tracing::info!(lease = %self.config.name, "the Lease is renewed again: the hold-over ends");
            }
            leading.send_replace(now);
        }
    }

    /// Tries every `retry_period` until `shutdown` turns `true`, sending on `leading` whether
    /// this replica leads, is held over, and its fence (see the module doc); on shutdown a
    /// leader releases the Lease and [`Leadership::default`] is sent. A standby keeps trying
    /// for as long as it runs.
    pub async fn run(
        mut self,
        leading: watch::Sender<Leadership>,
        mut shutdown: watch::Receiver<bool>,
    ) {
        loop {
            if *shutdown.borrow() {
                break;
            }
            // Before the try too: a try may take up to its bound, and the hold-over begins (or
            // the leadership ends) at the renew deadline, not when the try gives up.
            self.publish(&leading);
            let attempt = self.bounded_try().await;
            match &attempt {
                Ok(Attempt::Held) => {}
                Ok(Attempt::HeldBy(other)) => {
                    if leading.borrow().leading {
                        tracing::warn!(lease = %self.config.name, holder = %other, "another replica holds the Lease; stepping down");
                    }
                    self.last_renew = None;
                }
                Ok(Attempt::Conflict) => {}
                Err(Some(e)) => {
                    tracing::warn!(lease = %self.config.name, error = %e, "the Lease could not be read or written");
                }
                Err(None) => {
                    tracing::warn!(lease = %self.config.name, "a Lease call did not finish within its bound (the renew deadline)");
                }
            }
            self.publish(&leading);
            // A leader tries again no later than its renew deadline (its hold-over's end), so
            // that it is held over or steps down on time even when its last tries failed fast.
            let pause = match self.renew_left() {
                Some(left) if left.is_zero() => self.config.retry_period,
                Some(left) => self.config.retry_period.min(left),
                None => self.config.retry_period,
            };
            tokio::select! {
                _ = tokio::time::sleep(pause) => {}
                _ = super::until(&mut shutdown, true) => break,
            }
        }
        leading.send_replace(Leadership::default());
        if self.last_renew.is_some() {
            match tokio::time::timeout(self.config.renew_deadline, self.release()).await {
                Ok(Ok(())) => tracing::info!(lease = %self.config.name, "released the Lease"),
                Ok(Err(e)) => {
                    tracing::warn!(lease = %self.config.name, error = %e, "releasing the Lease failed")
                }
                Err(_) => {
                    tracing::warn!(lease = %self.config.name, "releasing the Lease took too long; it expires by itself")
                }
            }
        }
    }
}

/// Sets (`leading`) or removes the leader label `label` (`capyctl.io/leader=true`) on Pod
/// `pod`: the router and management Services select the leader by it.
pub async fn set_leader_label(
    pods: &Api<Pod>,
    pod: &str,
    label: &str,
    leading: bool,
) -> Result<(), kube::Error> {
    let value = if leading {
        serde_json::Value::String("true".to_string())
    } else {
        serde_json::Value::Null
    };
    let patch = serde_json::json!({"metadata": {"labels": {label: value}}});
    pods.patch(pod, &PatchParams::default(), &Patch::Merge(&patch))
        .await?;
    Ok(())
}

/// Removes the leader label from Pod `pod`, retrying every `retry` until it is gone (a Pod
/// that does not exist has none: out of a cluster, the identity names no Pod). `true` once it
/// is gone; `false` when `stop` turned `true` first.
pub async fn clear_leader_label(
    pods: &Api<Pod>,
    pod: &str,
    label: &str,
    retry: Duration,
    mut stop: watch::Receiver<bool>,
) -> bool {
    loop {
        match set_leader_label(pods, pod, label, false).await {
            Ok(()) => return true,
            Err(kube::Error::Api(s)) if s.is_not_found() => return true,
            Err(e) => {
                tracing::warn!(%pod, %label, error = %e, "the leader label could not be removed from this replica's Pod; not ready until it is");
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(retry) => {}
            _ = super::until(&mut stop, true) => return false,
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use http::Method;

    use super::super::mock::{self, Exchange, status_body};
    use super::*;

    const PATH: &str = "/apis/coordination.k8s.io/v1/namespaces/capyctl/leases/capyctl-operator";
    const COLLECTION: &str = "/apis/coordination.k8s.io/v1/namespaces/capyctl/leases";

    fn elector(client: kube::Client) -> LeaderElector {
        LeaderElector::new(
            Api::namespaced(client, "capyctl"),
            LeaseConfig::new("capyctl-operator", "operator-a"),
        )
    }

    /// An elector with hold-over `holdover` (0: client-go's rule).
    fn elector_with(client: kube::Client, holdover: Duration) -> LeaderElector {
        let mut config = LeaseConfig::new("capyctl-operator", "operator-a");
        config.holdover = holdover;
        LeaderElector::new(Api::namespaced(client, "capyctl"), config)
    }

    /// What the fake Lease server of [`lease_server`] does now.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    enum ApiMode {
        /// Keeps the Lease: get, create, replace.
        Up,
        /// Answers every call 503 (the API server cannot answer).
        Down,
        /// Answers every call 403 (it answers, but refuses).
        Forbidden,
        /// The Lease is another replica's (read: held by operator-b, renewed every read).
        OtherHolder,
    }

    /// A fake API server keeping one Lease, whose behaviour the test switches.
    fn lease_server(
        api: mock::MockApi,
    ) -> (
        std::sync::Arc<std::sync::Mutex<ApiMode>>,
        tokio::task::JoinHandle<Vec<mock::Seen>>,
    ) {
        let mode = std::sync::Arc::new(std::sync::Mutex::new(ApiMode::Up));
        let m = mode.clone();
        let mut stored: Option<serde_json::Value> = None;
        let mut rv = 10u64;
        let server = api.serve_with(move |call| {
            let now = *m.lock().unwrap();
            match now {
                ApiMode::Down => {
                    return mock::Answer::Json {
                        status: 503,
                        body: status_body(503, "ServiceUnavailable", "the server is down"),
                    };
                }
                ApiMode::Forbidden => {
                    return mock::Answer::Json {
                        status: 403,
                        body: status_body(403, "Forbidden", "leases is forbidden"),
                    };
                }
                ApiMode::OtherHolder => {
                    rv += 1;
                    return mock::Answer::Json {
                        status: 200,
                        body: lease(
                            Some("operator-b"),
                            &rv.to_string(),
                            "2026-12-01T10:00:00.000000Z",
                        ),
                    };
                }
                ApiMode::Up => {}
            }
            match (call.method.clone(), stored.clone()) {
                (Method::GET, None) => mock::Answer::Json {
                    status: 404,
                    body: status_body(404, "NotFound", "not found"),
                },
                (Method::GET, Some(l)) => mock::Answer::Json {
                    status: 200,
                    body: l,
                },
                _ => {
                    rv += 1;
                    let mut l = call.body.clone();
                    l["metadata"]["resourceVersion"] = rv.to_string().into();
                    stored = Some(l.clone());
                    mock::Answer::Json {
                        status: if call.method == Method::POST {
                            201
                        } else {
                            200
                        },
                        body: l,
                    }
                }
            }
        });
        (mode, server)
    }

    fn set(mode: &std::sync::Mutex<ApiMode>, to: ApiMode) {
        *mode.lock().unwrap() = to;
    }

    /// An elector with hold-over `holdover` running against [`lease_server`], leading.
    struct Leading {
        mode: std::sync::Arc<std::sync::Mutex<ApiMode>>,
        leading: watch::Receiver<Leadership>,
        stop: watch::Sender<bool>,
        run: tokio::task::JoinHandle<()>,
    }

    impl Leading {
        async fn start(holdover: Duration) -> Leading {
            let (client, handle) = mock::client();
            let (mode, _server) = lease_server(handle);
            let (leading_tx, mut leading) = watch::channel(Leadership::default());
            let (stop, stopped) = watch::channel(false);
            let run = tokio::spawn(elector_with(client, holdover).run(leading_tx, stopped));
            leading.wait_for(|l| l.leading).await.unwrap();
            Leading {
                mode,
                leading,
                stop,
                run,
            }
        }

        fn set(&self, to: ApiMode) {
            set(&self.mode, to);
        }

        async fn finish(self) {
            self.stop.send_replace(true);
            self.run.await.unwrap();
        }
    }

    #[tokio::test(start_paused = true)]
    async fn an_unreachable_api_server_holds_the_leader_over_and_a_renewal_ends_it() {
        let mut l = Leading::start(Duration::from_secs(30)).await;
        assert!(!l.leading.borrow().held);
        // Renewed at least once more, then the API server goes.
        tokio::time::sleep(Duration::from_secs(3)).await;
        l.set(ApiMode::Down);
        let down = Instant::now();
        l.leading.wait_for(|l| l.held).await.unwrap();
        // Held over at the renew deadline (10 s after the last renewal began, at most 2 s
        // before the API server went), not stepped down.
        let after = down.elapsed();
        assert!(after <= Duration::from_secs(10), "held after {after:?}");
        assert!(after >= Duration::from_secs(8), "held after {after:?}");
        assert!(l.leading.borrow().leading);
        // 20 s into the hold-over: still leading, held.
        tokio::time::sleep(Duration::from_secs(20)).await;
        assert_eq!(
            *l.leading.borrow(),
            Leadership {
                leading: true,
                held: true,
                fence_until: None
            }
        );
        // Back: the next renewal ends the hold-over.
        l.set(ApiMode::Up);
        let back = Instant::now();
        l.leading.wait_for(|l| !l.held).await.unwrap();
        assert!(
            back.elapsed() <= Duration::from_secs(2),
            "{:?}",
            back.elapsed()
        );
        assert!(l.leading.borrow().leading);
        l.finish().await;
    }

    #[tokio::test(start_paused = true)]
    async fn the_holdover_ends_at_the_renew_deadline_plus_the_holdover_at_the_latest() {
        let mut l = Leading::start(Duration::from_secs(30)).await;
        l.set(ApiMode::Down);
        let down = Instant::now();
        l.leading.wait_for(|l| l.held).await.unwrap();
        l.leading.wait_for(|l| !l.leading).await.unwrap();
        // The last renewal began at most 2 s before the API server went: stepped down at its
        // 10 s + 30 s.
        let after = down.elapsed();
        assert!(
            after <= Duration::from_secs(40),
            "stepped down after {after:?}"
        );
        assert!(
            after >= Duration::from_secs(38),
            "stepped down after {after:?}"
        );
        l.finish().await;
    }

    #[tokio::test(start_paused = true)]
    async fn another_holder_read_during_the_holdover_steps_the_leader_down_at_once() {
        let mut l = Leading::start(Duration::from_secs(90)).await;
        l.set(ApiMode::Down);
        l.leading.wait_for(|l| l.held).await.unwrap();
        l.set(ApiMode::OtherHolder);
        let read = Instant::now();
        l.leading.wait_for(|l| !l.leading).await.unwrap();
        // At the next try (every 2 s), not at the hold-over's end.
        assert!(
            read.elapsed() <= Duration::from_secs(2),
            "{:?}",
            read.elapsed()
        );
        l.finish().await;
    }

    #[tokio::test(start_paused = true)]
    async fn a_refusal_that_is_not_an_outage_steps_the_leader_down_at_the_renew_deadline() {
        let mut l = Leading::start(Duration::from_secs(90)).await;
        // The API server answers, but refuses (RBAC taken away): no hold-over.
        l.set(ApiMode::Forbidden);
        let refused = Instant::now();
        l.leading.wait_for(|l| !l.leading || l.held).await.unwrap();
        assert!(!l.leading.borrow().leading, "{:?}", *l.leading.borrow());
        assert!(refused.elapsed() <= Duration::from_secs(10));
        l.finish().await;
    }

    fn lease(holder: Option<&str>, rv: &str, renew: &str) -> serde_json::Value {
        serde_json::json!({
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {"name": "capyctl-operator", "namespace": "capyctl", "resourceVersion": rv},
            "spec": {
                "holderIdentity": holder,
                "leaseDurationSeconds": 15,
                "acquireTime": "2026-12-01T10:00:00.000000Z",
                "renewTime": renew,
                "leaseTransitions": 3,
            }
        })
    }

    fn not_found() -> Exchange {
        Exchange::new(
            Method::GET,
            PATH,
            404,
            status_body(404, "NotFound", "leases \"capyctl-operator\" not found"),
        )
    }

    #[tokio::test(start_paused = true)]
    async fn a_missing_lease_is_created_and_held() {
        let (client, handle) = mock::client();
        let mut written = lease(Some("operator-a"), "10", "2026-12-01T10:00:00.000000Z");
        written["spec"]["leaseTransitions"] = 0.into();
        let server = mock::serve(
            handle,
            vec![
                not_found(),
                Exchange::new(Method::POST, COLLECTION, 201, written),
            ],
        );
        let mut e = elector(client);
        assert_eq!(e.try_acquire_or_renew().await.unwrap(), Attempt::Held);
        assert!(e.is_leading());
        assert_eq!(e.leadership().fence_until, None);
        let seen = server.await.unwrap();
        let body = &seen[1].body;
        assert_eq!(body["spec"]["holderIdentity"], "operator-a");
        assert_eq!(body["spec"]["leaseDurationSeconds"], 15);
        assert!(body["spec"]["renewTime"].is_string());
        assert_eq!(body["metadata"]["name"], "capyctl-operator");
        // Without the operator's Deployment (run outside the chart): no owner.
        assert!(body["metadata"]["ownerReferences"].is_null(), "{body}");
    }

    const DEPLOYMENT_PATH: &str = "/apis/apps/v1/namespaces/capyctl/deployments/capyctl-operator";
    const UID: &str = "5d8c0a4e-0000-4000-8000-00000000beef";

    fn operator_deployment() -> serde_json::Value {
        serde_json::json!({
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": "capyctl-operator", "namespace": "capyctl", "uid": UID},
        })
    }

    /// The owner read from the operator's Deployment through the mock API server.
    async fn owner_from(answer: Exchange) -> (Option<OwnerReference>, Vec<mock::Seen>) {
        let (client, handle) = mock::client();
        let server = mock::serve(handle, vec![answer]);
        let owner = deployment_owner(
            &Api::namespaced(client, "capyctl"),
            "capyctl-operator",
            Duration::from_secs(10),
        )
        .await;
        (owner, server.await.unwrap())
    }

    fn the_owner() -> serde_json::Value {
        serde_json::json!([{
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "name": "capyctl-operator",
            "uid": UID,
            "controller": false,
            "blockOwnerDeletion": false,
        }])
    }

    #[tokio::test(start_paused = true)]
    async fn the_lease_is_created_owned_by_the_operators_deployment() {
        let (owner, seen) = owner_from(Exchange::ok(
            Method::GET,
            DEPLOYMENT_PATH,
            operator_deployment(),
        ))
        .await;
        assert_eq!(seen.len(), 1);
        assert!(owner.is_some());
        let (client, handle) = mock::client();
        let server = mock::serve(
            handle,
            vec![
                not_found(),
                Exchange::new(
                    Method::POST,
                    COLLECTION,
                    201,
                    lease(Some("operator-a"), "10", "2026-12-01T10:00:00.000000Z"),
                ),
            ],
        );
        let mut e = elector(client).with_owner(owner);
        assert_eq!(e.try_acquire_or_renew().await.unwrap(), Attempt::Held);
        let seen = server.await.unwrap();
        assert_eq!(seen[1].body["metadata"]["ownerReferences"], the_owner());
    }

    #[tokio::test(start_paused = true)]
    async fn a_lease_found_without_the_owner_gets_it_once_with_its_write() {
        let owner = owner_reference(&serde_json::from_value(operator_deployment()).unwrap());
        let (client, handle) = mock::client();
        // Ours without an owner (made before the chart set it), then with it: one reference.
        let mut owned = lease(Some("operator-a"), "9", "2026-12-01T10:00:02.000000Z");
        owned["metadata"]["ownerReferences"] = the_owner();
        let server = mock::serve(
            handle,
            vec![
                Exchange::ok(
                    Method::GET,
                    PATH,
                    lease(Some("operator-a"), "8", "2026-12-01T10:00:00.000000Z"),
                ),
                Exchange::ok(Method::PUT, PATH, owned.clone()),
                Exchange::ok(Method::GET, PATH, owned.clone()),
                Exchange::ok(Method::PUT, PATH, owned),
            ],
        );
        let mut e = elector(client).with_owner(owner);
        assert_eq!(e.try_acquire_or_renew().await.unwrap(), Attempt::Held);
        assert_eq!(e.try_acquire_or_renew().await.unwrap(), Attempt::Held);
        let seen = server.await.unwrap();
        assert_eq!(seen[1].body["metadata"]["ownerReferences"], the_owner());
        assert_eq!(seen[3].body["metadata"]["ownerReferences"], the_owner());
    }

    #[tokio::test(start_paused = true)]
    async fn a_deployment_that_cannot_be_read_gives_no_owner() {
        for (status, reason) in [
            (403, "Forbidden"),
            (404, "NotFound"),
            (503, "ServiceUnavailable"),
        ] {
            let answer = Exchange::new(
                Method::GET,
                DEPLOYMENT_PATH,
                status,
                status_body(status, reason, "deployments.apps \"capyctl-operator\""),
            );
            let (owner, seen) = owner_from(answer).await;
            assert_eq!(owner, None, "{status}");
            assert_eq!(seen.len(), 1, "{status}");
        }
        // Nor one without a UID.
        let mut no_uid = operator_deployment();
        no_uid["metadata"]["uid"] = serde_json::Value::Null;
        let (owner, _) = owner_from(Exchange::ok(Method::GET, DEPLOYMENT_PATH, no_uid)).await;
        assert_eq!(owner, None);
    }

    #[tokio::test(start_paused = true)]
    async fn a_deployment_read_that_does_not_answer_gives_no_owner_at_its_bound() {
        let (client, handle) = mock::client();
        let server = tokio::spawn(async move {
            let mut handle = handle;
            let (call, reply) = handle.next_call().await.unwrap();
            (call.path, reply, handle)
        });
        let began = Instant::now();
        let owner = deployment_owner(
            &Api::namespaced(client, "capyctl"),
            "capyctl-operator",
            Duration::from_secs(10),
        )
        .await;
        assert_eq!(owner, None);
        assert_eq!(began.elapsed(), Duration::from_secs(10));
        let (path, _reply, _handle) = server.await.unwrap();
        assert_eq!(path, DEPLOYMENT_PATH);
    }

    #[tokio::test(start_paused = true)]
    async fn a_free_lease_is_taken_with_its_resource_version() {
        let (client, handle) = mock::client();
        let server = mock::serve(
            handle,
            vec![
                Exchange::ok(
                    Method::GET,
                    PATH,
                    lease(None, "7", "2026-12-01T10:00:00.000000Z"),
                ),
                Exchange::ok(
                    Method::PUT,
                    PATH,
                    lease(Some("operator-a"), "8", "2026-12-01T10:00:05.000000Z"),
                ),
            ],
        );
        let mut e = elector(client);
        assert_eq!(e.try_acquire_or_renew().await.unwrap(), Attempt::Held);
        // Released (no holder): nobody may still serve from it, no fence.
        assert_eq!(e.leadership().fence_until, None);
        let seen = server.await.unwrap();
        let put = &seen[1].body;
        assert_eq!(put["metadata"]["resourceVersion"], "7");
        assert_eq!(put["spec"]["holderIdentity"], "operator-a");
        // A new holder: one more transition, a new acquire time.
        assert_eq!(put["spec"]["leaseTransitions"], 4);
        assert_ne!(put["spec"]["acquireTime"], "2026-12-01T10:00:00.000000Z");
    }

    #[tokio::test(start_paused = true)]
    async fn a_held_lease_is_not_taken_before_it_expires_then_is() {
        let (client, handle) = mock::client();
        let held = lease(Some("operator-b"), "7", "2026-12-01T10:00:00.000000Z");
        let server = mock::serve(
            handle,
            vec![
                Exchange::ok(Method::GET, PATH, held.clone()),
                Exchange::ok(Method::GET, PATH, held.clone()),
                Exchange::ok(Method::GET, PATH, held),
                Exchange::ok(
                    Method::PUT,
                    PATH,
                    lease(Some("operator-a"), "8", "2026-12-01T10:00:20.000000Z"),
                ),
            ],
        );
        let mut e = elector(client);
        assert_eq!(
            e.try_acquire_or_renew().await.unwrap(),
            Attempt::HeldBy("operator-b".into())
        );
        assert!(!e.is_leading());
        // 14 s without a change: still the holder's.
        tokio::time::advance(Duration::from_secs(14)).await;
        assert_eq!(
            e.try_acquire_or_renew().await.unwrap(),
            Attempt::HeldBy("operator-b".into())
        );
        // Past 15 s without a change: expired, taken over.
        tokio::time::advance(Duration::from_secs(2)).await;
        assert_eq!(e.try_acquire_or_renew().await.unwrap(), Attempt::Held);
        assert!(e.is_leading());
        // Taken from a holder that did not release it: fenced for the hold-over (90 s), as
        // that holder may be held over and still serving.
        assert_eq!(
            e.leadership().fence_until,
            Some(Instant::now() + Duration::from_secs(90))
        );
        let seen = server.await.unwrap();
        assert_eq!(seen.len(), 4);
        assert_eq!(seen[3].body["spec"]["holderIdentity"], "operator-a");
        assert_eq!(seen[3].body["spec"]["leaseTransitions"], 4);
    }

    #[tokio::test(start_paused = true)]
    async fn a_standby_that_could_not_read_counts_the_expiry_again_from_its_next_read() {
        let (client, handle) = mock::client();
        let held = lease(Some("operator-b"), "7", "2026-12-01T10:00:00.000000Z");
        let down = Exchange::new(
            Method::GET,
            PATH,
            503,
            status_body(503, "ServiceUnavailable", "the server is down"),
        );
        let server = mock::serve(
            handle,
            vec![
                Exchange::ok(Method::GET, PATH, held.clone()),
                down,
                // Back after 20 s (longer than the Lease): the same record, which the holder,
                // held over by the same outage, has not been able to renew.
                Exchange::ok(Method::GET, PATH, held.clone()),
                Exchange::ok(Method::GET, PATH, held),
                Exchange::ok(
                    Method::PUT,
                    PATH,
                    lease(Some("operator-a"), "8", "2026-12-01T10:00:40.000000Z"),
                ),
            ],
        );
        let mut e = elector(client);
        assert!(e.bounded_try().await.is_ok());
        tokio::time::advance(Duration::from_secs(5)).await;
        assert!(e.bounded_try().await.is_err());
        tokio::time::advance(Duration::from_secs(15)).await;
        // Not taken at once: the holder gets a whole Lease duration from this read.
        assert_eq!(
            e.bounded_try().await.unwrap(),
            Attempt::HeldBy("operator-b".into())
        );
        tokio::time::advance(Duration::from_secs(16)).await;
        assert_eq!(e.bounded_try().await.unwrap(), Attempt::Held);
        server.await.unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn a_renewed_lease_is_not_expired_for_the_standby() {
        let (client, handle) = mock::client();
        let server = mock::serve(
            handle,
            vec![
                Exchange::ok(
                    Method::GET,
                    PATH,
                    lease(Some("operator-b"), "7", "2026-12-01T10:00:00.000000Z"),
                ),
                // The holder renewed meanwhile: a new record, a new observation.
                Exchange::ok(
                    Method::GET,
                    PATH,
                    lease(Some("operator-b"), "9", "2026-12-01T10:00:10.000000Z"),
                ),
            ],
        );
        let mut e = elector(client);
        e.try_acquire_or_renew().await.unwrap();
        tokio::time::advance(Duration::from_secs(16)).await;
        assert_eq!(
            e.try_acquire_or_renew().await.unwrap(),
            Attempt::HeldBy("operator-b".into())
        );
        server.await.unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn the_leader_renews_keeping_its_acquire_time() {
        let (client, handle) = mock::client();
        let ours = lease(Some("operator-a"), "8", "2026-12-01T10:00:00.000000Z");
        let server = mock::serve(
            handle,
            vec![
                Exchange::ok(Method::GET, PATH, ours.clone()),
                Exchange::ok(
                    Method::PUT,
                    PATH,
                    lease(Some("operator-a"), "9", "2026-12-01T10:00:02.000000Z"),
                ),
            ],
        );
        let mut e = elector(client);
        assert_eq!(e.try_acquire_or_renew().await.unwrap(), Attempt::Held);
        let seen = server.await.unwrap();
        let put = &seen[1].body;
        assert_eq!(put["metadata"]["resourceVersion"], "8");
        assert_eq!(put["spec"]["acquireTime"], "2026-12-01T10:00:00.000000Z");
        assert_eq!(put["spec"]["leaseTransitions"], 3);
        assert_ne!(put["spec"]["renewTime"], ours["spec"]["renewTime"]);
    }

    #[tokio::test(start_paused = true)]
    async fn a_conflict_leaves_the_replica_standing_by() {
        let (client, handle) = mock::client();
        let server = mock::serve(
            handle,
            vec![
                Exchange::ok(
                    Method::GET,
                    PATH,
                    lease(None, "7", "2026-12-01T10:00:00.000000Z"),
                ),
                Exchange::new(
                    Method::PUT,
                    PATH,
                    409,
                    status_body(409, "Conflict", "the object has been modified"),
                ),
            ],
        );
        let mut e = elector(client);
        assert_eq!(e.try_acquire_or_renew().await.unwrap(), Attempt::Conflict);
        assert!(!e.is_leading());
        server.await.unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn a_lost_create_race_is_a_conflict() {
        let (client, handle) = mock::client();
        let server = mock::serve(
            handle,
            vec![
                not_found(),
                Exchange::new(
                    Method::POST,
                    COLLECTION,
                    409,
                    status_body(
                        409,
                        "AlreadyExists",
                        "leases \"capyctl-operator\" already exists",
                    ),
                ),
            ],
        );
        let mut e = elector(client);
        assert_eq!(e.try_acquire_or_renew().await.unwrap(), Attempt::Conflict);
        assert!(!e.is_leading());
        server.await.unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn without_holdover_a_leader_that_cannot_renew_steps_down_within_the_renew_deadline() {
        let (client, handle) = mock::client();
        let mut script = vec![
            not_found(),
            Exchange::new(
                Method::POST,
                COLLECTION,
                201,
                lease(Some("operator-a"), "10", "2026-12-01T10:00:00.000000Z"),
            ),
        ];
        // Every renewal then fails (the API server answers 500).
        for _ in 0..6 {
            script.push(Exchange::new(
                Method::GET,
                PATH,
                500,
                status_body(500, "InternalError", "etcd is down"),
            ));
        }
        let server = mock::serve(handle, script);
        let (leading_tx, mut leading) = watch::channel(Leadership::default());
        let (stop_tx, stop) = watch::channel(false);
        let run = tokio::spawn(elector_with(client, Duration::ZERO).run(leading_tx, stop));
        leading.wait_for(|l| l.leading).await.unwrap();
        let since = Instant::now();
        leading.wait_for(|l| !l.leading).await.unwrap();
        let after = since.elapsed();
        assert!(
            after <= Duration::from_secs(10),
            "stepped down after {after:?}"
        );
        assert!(
            after >= Duration::from_secs(8),
            "stepped down after {after:?}"
        );
        stop_tx.send_replace(true);
        run.await.unwrap();
        let seen = server.await.unwrap();
        // Five failed renewals, then the release's read (it fails too).
        assert_eq!(seen.len(), 2 + 6);
    }

    #[tokio::test(start_paused = true)]
    async fn without_holdover_a_hung_renewal_steps_the_leader_down_at_its_renew_deadline() {
        let (client, handle) = mock::client();
        let server = tokio::spawn(async move {
            let mut handle = handle;
            // Acquired: the Lease is missing, then created.
            handle
                .answer(Exchange::new(
                    Method::GET,
                    PATH,
                    404,
                    status_body(404, "NotFound", "not found"),
                ))
                .await;
            handle
                .answer(Exchange::new(
                    Method::POST,
                    COLLECTION,
                    201,
                    lease(Some("operator-a"), "10", "2026-12-01T10:00:00.000000Z"),
                ))
                .await;
            // The renewal's read never gets an answer.
            let (hung, reply) = handle.next_call().await.unwrap();
            (hung.path, reply, handle)
        });
        let (leading_tx, mut leading) = watch::channel(Leadership::default());
        let (stop_tx, stop) = watch::channel(false);
        let run = tokio::spawn(elector_with(client, Duration::ZERO).run(leading_tx, stop));
        leading.wait_for(|l| l.leading).await.unwrap();
        let since = Instant::now();
        leading.wait_for(|l| !l.leading).await.unwrap();
        // Stepped down exactly at the renew deadline, although the call still hangs (before
        // the Lease's 15 s, after which a standby may take it).
        assert_eq!(since.elapsed(), Duration::from_secs(10));
        let (path, _reply, _handle) = server.await.unwrap();
        assert_eq!(path, PATH);
        stop_tx.send_replace(true);
        run.abort();
    }

    #[tokio::test(start_paused = true)]
    async fn a_standby_clears_a_stale_leader_label_before_it_is_ready() {
        let (client, handle) = mock::client();
        let pod_path = "/api/v1/namespaces/capyctl/pods/operator-a";
        let pod = serde_json::json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "operator-a"}});
        let server = mock::serve(
            handle,
            vec![
                Exchange::new(
                    Method::PATCH,
                    pod_path,
                    500,
                    status_body(500, "InternalError", "etcd is down"),
                ),
                Exchange::ok(Method::PATCH, pod_path, pod),
            ],
        );
        let pods: Api<Pod> = Api::namespaced(client, "capyctl");
        let (_stop_tx, stop) = watch::channel(false);
        let began = Instant::now();
        let cleared = clear_leader_label(
            &pods,
            "operator-a",
            "capyctl.io/leader",
            Duration::from_secs(2),
            stop,
        )
        .await;
        assert!(cleared);
        // Once after the failed try and its retry pause.
        assert_eq!(began.elapsed(), Duration::from_secs(2));
        let seen = server.await.unwrap();
        assert!(seen[1].body["metadata"]["labels"]["capyctl.io/leader"].is_null());
    }

    #[tokio::test(start_paused = true)]
    async fn shutdown_releases_the_lease() {
        let (client, handle) = mock::client();
        let ours = lease(Some("operator-a"), "10", "2026-12-01T10:00:00.000000Z");
        let server = mock::serve(
            handle,
            vec![
                not_found(),
                Exchange::new(Method::POST, COLLECTION, 201, ours.clone()),
                Exchange::ok(Method::GET, PATH, ours),
                Exchange::ok(
                    Method::PUT,
                    PATH,
                    lease(None, "11", "2026-12-01T10:00:01.000000Z"),
                ),
            ],
        );
        let (leading_tx, mut leading) = watch::channel(Leadership::default());
        let (stop_tx, stop) = watch::channel(false);
        let run = tokio::spawn(elector(client).run(leading_tx, stop));
        leading.wait_for(|l| l.leading).await.unwrap();
        stop_tx.send_replace(true);
        run.await.unwrap();
        assert!(!leading.borrow().leading);
        let seen = server.await.unwrap();
        let put = &seen[3].body;
        assert!(put["spec"]["holderIdentity"].is_null());
        assert_eq!(put["spec"]["leaseDurationSeconds"], 1);
    }

    #[tokio::test]
    async fn the_leader_label_is_set_and_removed_by_merge_patch() {
        let (client, handle) = mock::client();
        let pod_path = "/api/v1/namespaces/capyctl/pods/operator-a";
        let pod = serde_json::json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "operator-a"}});
        let server = mock::serve(
            handle,
            vec![
                Exchange::ok(Method::PATCH, pod_path, pod.clone()),
                Exchange::ok(Method::PATCH, pod_path, pod),
            ],
        );
        let pods: Api<Pod> = Api::namespaced(client, "capyctl");
        set_leader_label(&pods, "operator-a", "capyctl.io/leader", true)
            .await
            .unwrap();
        set_leader_label(&pods, "operator-a", "capyctl.io/leader", false)
            .await
            .unwrap();
        let seen = server.await.unwrap();
        assert_eq!(
            seen[0].body["metadata"]["labels"]["capyctl.io/leader"],
            "true"
        );
        assert!(seen[1].body["metadata"]["labels"]["capyctl.io/leader"].is_null());
        assert_eq!(
            seen[0].content_type.as_deref(),
            Some("application/merge-patch+json")
        );
    }
}
