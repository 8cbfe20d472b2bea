//! The operator's `start` (with `--evict`, replicas filled, `--wait`).

use std::collections::BTreeSet;
use std::time::Duration;

use capyctl_interfaces::router::{
    DrainReport, OperatorResult, OperatorStart, Plan, PlanFor, SwitchOrder,
};
use capyctl_spec::InstanceState;
use capyctl_spec::api::{ActionReceipt, StartRequest, Victim};
use capyctl_spec::errors::ApiError;
use tokio::time::Instant;

use crate::Core;
use crate::errors::{internal, not_found};
use crate::state::StartNext;

/// The error of a `start --evict` of deployment `target` (its name) whose victims in
/// `not_released` (ID, name, why) could not be stopped; `None` when every victim was released.
pub(crate) fn evict_failed(
    target: &str,
    not_released: &[(String, String, String)],
) -> Option<ApiError> {
    let ((first, name, why), rest) = not_released.split_first()?;
    let others: Vec<&str> = rest.iter().map(|(_, n, _)| n.as_str()).collect();
    let also = if others.is_empty() {
        String::new()
    } else {
        format!(" (and of {})", others.join(", "))
    };
    Some(ApiError::EngineFailed {
        deployment: first.clone(),
        detail: format!(
            "start --evict of {target} could not stop {name}{also}: {why}; {target} was not started"
        ),
    })
}

impl Core {
    pub(crate) async fn do_start(
        &self,
        key: &str,
        req: StartRequest,
    ) -> Result<ActionReceipt, ApiError> {
        let id = self.find(key)?;
        self.read(|inner| inner.adapter_command_refusal(&id, "start"))?;
        self.read(|inner| inner.held_refusal())?;
        let (wait, evict) = (req.wait, req.evict);
        let next = self
            .on(&id, move |inner, id| {
                inner.start(id, wait, evict, Instant::now())
            })
            .await?;
        self.save_logged(&id).await;
        let mut receipt_victims = Vec::new();
        let mut switch_id = None;
        match next {
            StartNext::Nothing | StartNext::Pending => {}
            StartNext::Up(up) => {
                if req.wait {
                    self.finish_up(&id, up).await?;
                } else {
                    let target = id.clone();
                    self.spawn(move |me| {
                        Box::pin(async move {
                            if let Err(e) = me.finish_up(&target, up).await
                                && let Some(r) = me.router()
                            {
                                r.deployment_refused(target, e).await;
                            }
                        })
                    });
                }
            }
            StartNext::Evict => match self.operator_switch(&id).await? {
                OperatorStart::AlreadyComing => {}
                OperatorStart::Later => {
                    // Nothing can be released for it now: it waits for memory, as a start
                    // without --evict does.
                    let pending = self.on(&id, |inner, id| inner.wait_for_memory(id)).await;
                    if pending {
                        self.save_logged(&id).await;
                    }
                }
                OperatorStart::Switched {
                    switch_id: sw,
                    executed,
                } => {
                    if !executed.released.is_empty() {
                        switch_id = Some(sw);
                        receipt_victims = executed.released;
                    }
                    if req.wait
                        && let Some(bring_up) = executed.bring_up
                    {
                        bring_up
                            .await
                            .unwrap_or_else(|_| Err(internal("the start was given up")))?;
                    }
                }
            },
        }
        if evict {
            self.fill_replicas(&id, req.wait, &mut receipt_victims, &mut switch_id)
                .await?;
        }
        if req.wait {
            self.wait_ready(&id).await?;
        }
        let mut receipt = self.receipt("start", &id)?;
        receipt.switch_id = switch_id;
        receipt.victims = receipt_victims;
        Ok(receipt)
    }

    /// An operator's switch (`start --evict`): submitted to the router's coordinator, the one
    /// owner of switches, which runs it alone once the switches in progress have ended,
    /// protects the deployments with waiting requests, asks [`Core::plan_now`] for it,
    /// drains the ready victims and has
    /// [`Core::execute_order`] carry it out.
    ///
    /// NB: a server without a router (some tests) has no requests, waiting or in flight, and
    /// no other switch: the same plan is asked for and executed here directly, with nothing
    /// protected and nothing to drain.
    async fn operator_switch(&self, id: &str) -> OperatorResult {
        if let Some(router) = self.router() {
            return router.operator_start(id.to_string()).await;
        }
        let (switch_id, victims) = match self
            .plan_now(id, &BTreeSet::new(), PlanFor::Operator)
            .await?
        {
            Plan::AlreadyComing => return Ok(OperatorStart::AlreadyComing),
            Plan::Later => return Ok(OperatorStart::Later),
            Plan::BringUp { switch_id } => (switch_id, Vec::new()),
            Plan::Switch {
                switch_id, victims, ..
            } => (switch_id, victims),
        };
        let order = SwitchOrder {
            switch_id: switch_id.clone(),
            target: id.to_string(),
            victims: victims
                .into_iter()
                .map(|k| (k, DrainReport::default()))
                .collect(),
            window: Duration::ZERO,
            drain: Duration::ZERO,
            began: Instant::now(),
            wave: 0,
            operator: true,
        };
        let executed = self.execute_order(order).await?;
        Ok(OperatorStart::Switched {
            switch_id,
            executed,
        })
    }

    /// `start --evict` of a deployment with several instances: after the first, each other
    /// instance a start runs (`replicas`, or `scale.min`) gets room too, one operator's switch
    /// each (victims named as for the first; the receipt lists them all). A switch given back
    /// because another instance came up meanwhile is asked again (at most twice per instance);
    /// `Later` (nothing more can be released) ends it, and the rest come as room frees.
    async fn fill_replicas(
        &self,
        id: &str,
        wait: bool,
        victims: &mut Vec<Victim>,
        switch_id: &mut Option<String>,
    ) -> Result<(), ApiError> {
        let (wanted, _) = self.read(|inner| inner.filled(id));
        for _ in 0..wanted.saturating_mul(2) {
            let (wanted, up) = self.read(|inner| inner.filled(id));
            if wanted <= 1 || up >= wanted {
                break;
            }
            match self.operator_switch(id).await? {
                OperatorStart::AlreadyComing => {}
                OperatorStart::Later => break,
                OperatorStart::Switched {
                    switch_id: sw,
                    executed,
                } => {
                    if !executed.released.is_empty() {
                        switch_id.get_or_insert(sw);
                        victims.extend(executed.released);
                    }
                    if wait && let Some(bring_up) = executed.bring_up {
                        bring_up
                            .await
                            .unwrap_or_else(|_| Err(internal("the start was given up")))?;
                    }
                }
            }
        }
        Ok(())
    }

    /// Waits until deployment `id` serves: one of its instances is ready (with several, the
    /// one the start brought up may not be the first: another may have been taken as a victim
    /// while a sibling serves); its failure once no instance is ready or on its way (failed,
    /// stopped, or parked again since).
    async fn wait_ready(&self, id: &str) -> Result<(), ApiError> {
        let mut rx = self.changes.subscribe();
        loop {
            let now = self.read(|inner| {
                inner.deps.get(id)?;
                let mut error: Option<String> = None;
                let mut settled = true;
                for d in inner.units_of(id) {
                    let busy = d.busy || d.rec.pending_start || d.claim.is_some();
                    match (d.state, busy) {
                        (InstanceState::Ready, _) => return Some(Ok(())),
                        (
                            InstanceState::Failed | InstanceState::Stopped | InstanceState::Parked,
                            false,
                        ) => {
                            if error.is_none() {
                                error.clone_from(&d.last_error);
                            }
                        }
                        _ => settled = false,
                    }
                }
                Some(Err(settled.then_some(error)))
            });
            match now {
                None => return Err(not_found(id)),
                Some(Ok(())) => return Ok(()),
                Some(Err(Some(err))) => {
                    return Err(ApiError::EngineFailed {
                        deployment: id.to_string(),
                        detail: err.unwrap_or_else(|| "it is not running".into()),
                    });
                }
                Some(Err(None)) => {}
            }
            if rx.changed().await.is_err() {
                return Err(internal("the server is shutting down"));
            }
        }
    }
}
