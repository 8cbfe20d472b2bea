//! The coordinator as the lifecycle sees it ([`capyctl_interfaces::router::Router`]): the
//! assembly (`capyctl_server::assembly`) gives the lifecycle the handle through that trait,
//! so that the lifecycle depends on the interfaces only. Each method is the handle's own.

use std::sync::Arc;

use capyctl_interfaces::router::{self, BoxFuture, DeploymentId, InstanceKey, Upstream};
use capyctl_spec::errors::ApiError;
use tokio::time::Instant;

use super::{
    CoordinatorHandle, IdleRelease, LastUses, LoadsInOrder, OperatorResult, ReleaseResult,
};

impl router::Router for CoordinatorHandle {
    fn instance_ready(&self, upstream: Upstream) -> BoxFuture<'_, ()> {
        Box::pin(CoordinatorHandle::instance_ready(self, upstream))
    }

    fn instance_gone(&self, key: InstanceKey) -> BoxFuture<'_, ()> {
        Box::pin(CoordinatorHandle::instance_gone(self, key))
    }

    fn deployment_refused(&self, deployment: DeploymentId, error: ApiError) -> BoxFuture<'_, ()> {
        Box::pin(CoordinatorHandle::deployment_refused(
            self, deployment, error,
        ))
    }

    fn replan(&self) -> BoxFuture<'_, ()> {
        Box::pin(CoordinatorHandle::replan(self))
    }

    fn forget(&self, deployment: DeploymentId) -> BoxFuture<'_, ()> {
        Box::pin(CoordinatorHandle::forget(self, deployment))
    }

    fn release(&self, victims: Vec<InstanceKey>) -> BoxFuture<'_, ReleaseResult> {
        Box::pin(CoordinatorHandle::release(self, victims))
    }

    fn operator_start(&self, deployment: DeploymentId) -> BoxFuture<'_, OperatorResult> {
        Box::pin(CoordinatorHandle::operator_start(self, deployment))
    }

    fn release_if_idle(
        &self,
        deployment: DeploymentId,
        victims: Vec<InstanceKey>,
        idle_since: Instant,
    ) -> BoxFuture<'_, IdleRelease> {
        Box::pin(CoordinatorHandle::release_if_idle(
            self, deployment, victims, idle_since,
        ))
    }

    fn note_engine_load(&self, key: InstanceKey, waiting: usize, at: Instant) -> bool {
        CoordinatorHandle::note_engine_load(self, key, waiting, at)
    }

    fn each_load(&self, each: &mut dyn FnMut(&str, &router::LoadFigures)) {
        CoordinatorHandle::each_load(self, each);
    }

    fn figures_of(&self, deployment: &str) -> Option<router::LoadFigures> {
        CoordinatorHandle::figures_of(self, deployment)
    }

    fn loads_in_order(&self) -> Box<dyn router::LoadsInOrder> {
        Box::new(CoordinatorHandle::loads_in_order(self))
    }

    fn last_uses(&self) -> Arc<dyn router::LastUses> {
        Arc::new(CoordinatorHandle::last_uses(self))
    }
}

impl router::LastUses for LastUses {
    fn of(&self, deployment: &str) -> Option<Instant> {
        LastUses::of(self, deployment)
    }

    fn in_flight_of(&self, deployment: &str, index: u32) -> usize {
        LastUses::in_flight_of(self, deployment, index)
    }
}

impl router::LoadsInOrder for LoadsInOrder {
    fn get(&mut self, deployment: &str) -> Option<&router::LoadFigures> {
        LoadsInOrder::get(self, deployment)
    }
}
