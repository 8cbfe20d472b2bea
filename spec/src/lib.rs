//! CapyCTL's documents, settings and API types, without Kubernetes: the single source of truth
//! every other part builds on (the custom resources, in `capyctl-crds`, are built from them).
//!
//! - [`units`]: durations (`2s`) and byte sizes (`64MiB`) as written in documents;
//! - [`settings`]: the effective, typed settings (defaults and ranges of the product page's
//!   "Settings" table, per [`settings::Mode`]), fixed constants and the multi-host rule;
//! - [`documents`]: the YAML documents (deployment, host, server, standalone), their loaders and
//!   the one error type that names file, line and key;
//! - [`engine_args`]: the engine flags read in `extra_args` (speculative decoding, the flags
//!   CapyCTL passes itself), for the document checks and the node agent;
//! - [`overrides`]: `--set a.b=c` and `CAPYCTL_SET__A__B=c`;
//! - [`api`]: the management API's JSON bodies, shared by server and CLI;
//! - [`errors`]: the HTTP error catalogue of the product page;
//! - [`tenants`]: the rules of the inference listener's tenants and keys;
//! - the shared vocabularies [`EngineKind`], [`Residency`], [`Activation`], [`InstanceState`].
//!
//! Nothing here does I/O beyond reading a document file and the hostname.

pub mod api;
pub mod auth;
pub mod documents;
pub mod engine_args;
pub mod errors;
#[doc(hidden)]
pub mod fuzz;
mod kinds;
pub mod overrides;
pub mod settings;
pub mod tenants;
pub mod units;

pub use kinds::{Activation, EngineKind, InstanceState, Residency, Routing, UnknownValue};
