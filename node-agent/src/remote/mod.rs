//! The host agent over HTTP: the node agent's server ([`router`], [`serve`]) and its client
//! [`RemoteHostAgent`], a [`HostAgent`](crate::HostAgent) for the lifecycle on another machine.
//!
//! Every route under `/agent/v1` needs `Authorization: Bearer <agent token>` (compared in
//! constant time), else 401 `{"code": "unauthorized", ...}`. Bodies are JSON. A failed call
//! answers `{"code", "message", "retryable", "error"}` ([`wire::ErrorBody`]): `code` is
//! [`AgentError::metric_label`](crate::AgentError::metric_label), `message` the error's text,
//! `error` the variant and its fields, from which the client rebuilds the same
//! [`AgentError`](crate::AgentError) with the same message.
//!
//! | route | body | answer | status of an error |
//! |---|---|---|---|
//! | `GET /healthz` (no token) | | `{"status": "ok"}` | |
//! | `GET /agent/v1/info` | | [`wire::AgentInfo`] (node, host ID, runtime, version, timing) | |
//! | `GET /agent/v1/inventory` | | [`Inventory`](crate::inventory::Inventory) | 500 |
//! | `GET /agent/v1/engines` | | `[EngineInfo]` | |
//! | `POST /agent/v1/measure` | [`InstanceSpec`](crate::spec::InstanceSpec) | [`Measurement`](crate::measure::Measurement) | 422, 500 |
//! | `POST /agent/v1/parkability` | `InstanceSpec` | [`ParkChoice`](crate::tier::ParkChoice) | 422 (`capability_missing_deep_park`, `residency_refused`) |
//! | `POST /agent/v1/instances/{id}/start` | `InstanceSpec` | [`StartedInstance`](crate::agent::StartedInstance) | 409 (already running), 422, 502, 504 |
//! | `POST /agent/v1/instances/{id}/park` | | [`ParkResult`](crate::agent::ParkResult) | 404 (unknown instance), 409, 502, 504 |
//! | `POST /agent/v1/instances/{id}/wake` | | [`WakeReport`](crate::agent::WakeReport) (a failed check is a 200 with its outcome) | 404, 409 |
//! | `POST /agent/v1/instances/{id}/stop` | | `{"instance": id, "stopped": true}` | 404, 500 |
//! | `GET /agent/v1/instances/{id}/sample` | | [`LoadSample`](crate::load::LoadSample) | 404 when none is held |
//! | `GET /agent/v1/samples` | | [`wire::SamplesPage`]: `{"samples": {id: LoadSample}, "now_ms": the agent's clock}`, every instance's latest | |
//! | `POST /agent/v1/instances/{id}/adapters` | [`wire::AdapterLoad`] `{name, path}` | `{"instance", "adapter", "loaded": true}` once the engine has it | 404, 409 (parked, starting or waking), 422 (started without `adapters`), 502 (the engine refused: its reason in the message), 504 |
//! | `POST /agent/v1/instances/{id}/adapters/{name}/unload` | | `{"instance", "adapter", "loaded": false}` (also when the engine did not have it) | 404, 409, 422, 502 |
//! | `GET /agent/v1/instances/{id}/adapters` | | [`wire::AdaptersPage`] `{"adapters": [name]}`, as the engine lists them | 404, 409, 422, 502 |
//! | `POST /agent/v1/recover` | | [`RecoveryReport`](crate::agent::RecoveryReport) | 500 |
//! | `GET /agent/v1/exits?after=N&epoch=E&wait_ms=W` | | [`wire::ExitsPage`] | |
//!
//! Exits are a long poll: the server numbers every [`EngineExit`](crate::EngineExit) from its
//! start and holds the last 1024. Without `after` it answers at once with the cursor where
//! "from now on" begins (`next`); with `after` it answers as soon as an exit numbered `after`
//! or later is held, or after `wait_ms` (default 25 s, at most 60 s) with none; `missed`
//! counts exits no longer held. `epoch` identifies the server's life: a cursor of another life
//! (the agent restarted) is answered at once from the oldest exit held, and the client, seeing
//! a new epoch (or `missed`), has its host reconciled again ([`crate::HostAgent::subscribe_health`]:
//! the new life drives no engine until a recovery). Engine operations run to their end
//! in a task of their own even when the caller goes away.

pub mod client;
pub mod server;
pub mod wire;

pub use client::{RemoteConfig, RemoteHostAgent, RemoteTimeouts};
pub use server::{ServerOptions, router, serve};
