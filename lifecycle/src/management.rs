//! What the management listener asks of the lifecycle: [`ManagementApi`] implemented by [`Core`].

use std::sync::Arc;
use std::sync::atomic::Ordering;

use capyctl_spec::api::{
    ActionReceipt, DeployReceipt, DeploymentList, DeploymentView, EngineList, EngineView,
    HostDrainReceipt, HostList, LoadReport, StartRequest,
};
use capyctl_spec::documents::DeploymentDoc;
use capyctl_spec::errors::ApiError;
use futures_util::StreamExt;
use tokio::sync::watch;

use crate::api::ManagementApi;
use crate::errors::not_found;
use crate::reads::HOST_CALLS_AT_ONCE;
use crate::state::{Host, Hosts};
use crate::{Core, views};

/// Each host (ID and entry) as owned values, for futures that outlive the borrow.
pub(crate) fn owned(hosts: &Hosts) -> Vec<(String, Arc<Host>)> {
    hosts
        .iter()
        .map(|(id, h)| (id.clone(), Arc::clone(h)))
        .collect()
}

/// `call` of every host, answered in host order: at most [`HOST_CALLS_AT_ONCE`] at once, a new
/// call starting as soon as any one ends (a window that slides, not rounds that each wait for
/// their slowest host, nor a queue that waits for the first host's answer before the next call).
async fn each_host<T, F, Fut>(hosts: Vec<(String, Arc<Host>)>, call: F) -> Vec<T>
where
    F: Fn(String, Arc<Host>) -> Fut,
    Fut: Future<Output = T>,
{
    let mut answers: Vec<Option<T>> = std::iter::repeat_with(|| None).take(hosts.len()).collect();
    let mut calls = futures_util::stream::iter(hosts.into_iter().enumerate())
        .map(|(i, (id, host))| {
            let answer = call(id, host);
            async move { (i, answer.await) }
        })
        .buffer_unordered(HOST_CALLS_AT_ONCE);
    while let Some((i, answer)) = calls.next().await {
        answers[i] = Some(answer);
    }
    // Every call answered: each slot is filled.
    answers.into_iter().flatten().collect()
}

impl ManagementApi for Core {
    fn switches(
        &self,
        mut query: capyctl_spec::api::SwitchQuery,
    ) -> crate::api::BoxFuture<'_, Result<capyctl_spec::api::SwitchList, ApiError>> {
        // A deployment named by its name or ID matches its records by either (the records
        // of a deleted one by what was asked).
        if let Some(d) = &query.deployment
            && let Some(id) = self.read(|inner| inner.by_name_or_id(d).map(|d| d.rec.id.clone()))
        {
            query.deployment = Some(id);
        }
        Box::pin(std::future::ready(Ok(self.switches.list(&query))))
    }

    fn list(&self) -> crate::api::BoxFuture<'_, DeploymentList> {
        Box::pin(async move { self.do_list() })
    }

    fn list_json(&self) -> crate::api::BoxFuture<'_, Result<Vec<u8>, ApiError>> {
        Box::pin(async move { self.do_list_json() })
    }

    fn list_parts(&self) -> crate::api::BoxFuture<'_, Result<crate::api::JsonParts, ApiError>> {
        Box::pin(async move { self.do_list_parts() })
    }

    fn deploy(
        &self,
        doc: DeploymentDoc,
    ) -> crate::api::BoxFuture<'_, Result<DeployReceipt, ApiError>> {
        Box::pin(self.do_deploy(doc))
    }

    fn get<'a>(
        &'a self,
        name_or_id: &'a str,
    ) -> crate::api::BoxFuture<'a, Result<DeploymentView, ApiError>> {
        Box::pin(async move { self.view(name_or_id).ok_or_else(|| not_found(name_or_id)) })
    }

    fn delete<'a>(
        &'a self,
        name_or_id: &'a str,
    ) -> crate::api::BoxFuture<'a, Result<DeploymentView, ApiError>> {
        Box::pin(async move {
            let view = self.do_delete(name_or_id).await?;
            // Router entries go when their deployment goes: its load and counters.
            if let Some(r) = self.router() {
                r.forget(view.id.clone()).await;
            }
            Ok(view)
        })
    }

    fn start<'a>(
        &'a self,
        name_or_id: &'a str,
        request: StartRequest,
    ) -> crate::api::BoxFuture<'a, Result<ActionReceipt, ApiError>> {
        Box::pin(self.do_start(name_or_id, request))
    }

    fn stop<'a>(
        &'a self,
        name_or_id: &'a str,
    ) -> crate::api::BoxFuture<'a, Result<ActionReceipt, ApiError>> {
        Box::pin(self.do_stop(name_or_id))
    }

    fn park<'a>(
        &'a self,
        name_or_id: &'a str,
    ) -> crate::api::BoxFuture<'a, Result<ActionReceipt, ApiError>> {
        Box::pin(self.do_park(name_or_id))
    }

    fn preinitialize<'a>(
        &'a self,
        name_or_id: &'a str,
    ) -> crate::api::BoxFuture<'a, Result<ActionReceipt, ApiError>> {
        Box::pin(self.do_preinitialize(name_or_id))
    }

    fn engines(&self) -> crate::api::BoxFuture<'_, EngineList> {
        Box::pin(async move {
            let per_host: Vec<Vec<EngineView>> =
                each_host(owned(&self.hosts_now()), |host_id, host| async move {
                    host.agent
                        .engines()
                        .await
                        .into_iter()
                        .map(|e| EngineView {
                            command: host.settings.engine(e.engine).command.clone(),
                            engine: e.engine,
                            version: e.version,
                            deep_park: e.deep_park.to_string(),
                            host_id: host_id.clone(),
                        })
                        .collect()
                })
                .await;
            EngineList {
                engines: per_host.into_iter().flatten().collect(),
            }
        })
    }

    fn hosts(&self) -> crate::api::BoxFuture<'_, HostList> {
        Box::pin(async move {
            let hosts = self.hosts_now();
            let inventories = each_host(owned(&hosts), |id, host| async move {
                let inventory = host.agent.inventory().await.ok();
                (id, host, inventory)
            })
            .await;
            let used = self.host_uses(&hosts);
            let cordoned = self.read(|inner| inner.cordoned.clone());
            HostList {
                hosts: inventories
                    .iter()
                    .zip(used)
                    .map(|((id, host, inv), used)| {
                        views::host_view(id, host, inv.as_ref(), used, cordoned.contains(id))
                    })
                    .collect(),
            }
        })
    }

    fn drain_host<'a>(
        &'a self,
        host_id: &'a str,
        drain: bool,
    ) -> crate::api::BoxFuture<'a, Result<HostDrainReceipt, ApiError>> {
        Box::pin(self.do_drain_host(host_id, drain))
    }

    fn load<'a>(
        &'a self,
        deployment: Option<&'a str>,
    ) -> crate::api::BoxFuture<'a, Result<LoadReport, ApiError>> {
        Box::pin(async move { self.do_load(deployment) })
    }

    fn load_json<'a>(
        &'a self,
        deployment: Option<&'a str>,
    ) -> crate::api::BoxFuture<'a, Result<bytes::Bytes, ApiError>> {
        Box::pin(async move { self.do_load_json(deployment) })
    }

    fn ready(&self) -> bool {
        self.ready.load(Ordering::SeqCst)
    }

    fn changes(&self) -> Option<watch::Receiver<u64>> {
        Some(self.changes.subscribe())
    }
}
