//! The operator's `park`.

use std::collections::BTreeSet;

use capyctl_spec::InstanceState;
use capyctl_spec::api::{ActionReceipt, SwitchCause};
use capyctl_spec::errors::ApiError;

use crate::errors::not_found;
use crate::state::unit_instance;
use crate::{Core, views};
use tokio::time::Instant;

impl Core {
    pub(crate) async fn do_park(&self, key: &str) -> Result<ActionReceipt, ApiError> {
        let id = self.find(key)?;
        self.read(|inner| inner.adapter_command_refusal(&id, "park"))?;
        self.read(|inner| inner.command_refusal(&id, Instant::now()))?;
        if self.read(|inner| inner.units_of(&id).nth(1).is_none()) {
            return self.park_unit(&id).await;
        }
        // Several instances: every ready one parks, and those on their way up once they are
        // ready; the deployment is marked parked by its operator (the scaler brings none back
        // until it is used again), in the same turn that reads which instances run, so that
        // none the scaler brings up meanwhile is missed. The operator's park also ends the
        // operator's start (as for one instance).
        let marked = self.on(&id, |inner, id| inner.operator_park(id)).await;
        let units = match marked {
            Ok(units) => units,
            Err(unit) => return self.park_unit(&unit).await,
        };
        let (ready, coming): (Vec<_>, Vec<_>) = units
            .into_iter()
            .filter(|(_, s)| {
                matches!(
                    s,
                    InstanceState::Ready | InstanceState::Starting | InstanceState::Waking
                )
            })
            .partition(|(_, s)| *s == InstanceState::Ready);
        let parks = ready.iter().map(|(u, _)| self.park_unit(u));
        for r in futures_util::future::join_all(parks).await {
            if let Err(e) = r {
                self.end_operator_park(&id).await;
                return Err(e);
            }
        }
        let asked: BTreeSet<String> = ready.into_iter().map(|(u, _)| u).collect();
        let coming: BTreeSet<String> = coming.into_iter().map(|(u, _)| u).collect();
        let dep = id.clone();
        self.spawn(move |me| {
            Box::pin(async move { me.follow_operator_park(&dep, asked, coming).await })
        });
        self.receipt("park", &id)
    }

    /// Follows an operator's park of deployment `dep` (several instances; see
    /// [`Core::do_park`]) until it has taken: parks each instance of `coming` once its start
    /// or wake has ended ready, and ends the operator's mark when a park does not take (an
    /// instance `asked` to park is ready again: its drain passed the bound, or its park was
    /// refused): the deployment is in use then, and the scaler must keep its instances. Ends
    /// at once when the mark is gone (a request or a start brought an instance up).
    async fn follow_operator_park(
        &self,
        dep: &str,
        mut asked: BTreeSet<String>,
        mut coming: BTreeSet<String>,
    ) {
        let mut rx = self.changes.subscribe();
        loop {
            rx.borrow_and_update();
            let now = self.read(|inner| {
                if !inner.operator_parked.contains(dep) {
                    return None;
                }
                let of = |unit: &String| {
                    inner
                        .deps
                        .get(unit)
                        .map(|d| (d.state, d.busy || d.reserved.is_some() || d.claim.is_some()))
                };
                let came: Vec<(String, bool)> = coming
                    .iter()
                    .filter_map(|u| {
                        let (state, held) = of(u).unwrap_or((InstanceState::Stopped, false));
                        (!held).then(|| (u.clone(), state == InstanceState::Ready))
                    })
                    .collect();
                let back = asked
                    .iter()
                    .any(|u| of(u).is_some_and(|(s, held)| s == InstanceState::Ready && !held));
                let settled = asked.iter().all(|u| of(u).is_none_or(|(_, held)| !held));
                Some((came, back, settled))
            });
            let Some((came, back, settled)) = now else {
                return;
            };
            if back {
                tracing::info!(deployment = %dep, "an instance did not park: in use again");
                self.end_operator_park(dep).await;
                return;
            }
            let mut asked_now = false;
            for (unit, ready) in came {
                coming.remove(&unit);
                if !ready {
                    continue;
                }
                if let Err(e) = self.park_unit(&unit).await {
                    tracing::warn!(instance = %unit_instance(&unit), error = %e, "park failed");
                    self.end_operator_park(dep).await;
                    return;
                }
                asked.insert(unit);
                asked_now = true;
            }
            // Done once every park has ended (and taken) and nothing else is on its way.
            if coming.is_empty() && settled && !asked_now {
                return;
            }
            if rx.changed().await.is_err() {
                return;
            }
        }
    }

    /// Ends deployment `dep`'s operator's park mark: the scaler keeps its instances again.
    async fn end_operator_park(&self, dep: &str) {
        let dep = dep.to_string();
        self.write(move |inner| inner.end_operator_park(&dep)).await;
    }

    /// [`Core::do_park`] of one instance (`id`: its unit).
    async fn park_unit(&self, id: &str) -> Result<ActionReceipt, ApiError> {
        let id = id.to_string();
        let spec = self
            .read(|inner| inner.deps.get(&id).map(|d| (d.spec(), d.state)))
            .ok_or_else(|| not_found(&id))?;
        match spec.1 {
            InstanceState::Parked | InstanceState::Parking => return self.receipt("park", &id),
            InstanceState::Ready => {}
            _ => {
                let name = self.read(|inner| {
                    inner
                        .deps
                        .get(&id)
                        .map(|d| (d.name().to_string(), views::shown_state(d)))
                });
                let (name, state) = name.ok_or_else(|| not_found(&id))?;
                return Err(ApiError::Conflict {
                    detail: format!("deployment {name} is {state}; only a ready deployment parks"),
                });
            }
        }
        if let Err(e) = self.agent_of(&id)?.parkability(&spec.0).await
            && let Some(api) = e.to_api_error(&id)
        {
            return Err(api);
        }
        // Refused at once (and it serves on) when only explicit parked copies hold the room.
        self.make_parked_room(&id).await?;
        let rid = self.fresh_id("park");
        let r = rid.clone();
        let down = self
            .on(&id, move |inner, id| inner.park(id, &r, Instant::now()))
            .await?;
        if down.is_none() {
            return self.receipt("park", &id);
        }
        self.save_logged(&id).await;
        let receipt = self.receipt("park", &id)?;
        let target = id.clone();
        self.spawn(move |me| {
            Box::pin(async move {
                let result = me
                    .take_down_recorded(SwitchCause::Release, &target, &rid, down, false)
                    .await;
                me.write(move |inner| inner.release_reservation(&rid)).await;
                if let Err(e) = result {
                    tracing::warn!(deployment = %target, error = %e, "park failed");
                }
            })
        });
        Ok(receipt)
    }
}
