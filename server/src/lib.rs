//! CapyCTL's one assembly of lifecycle, router and listeners ([`assembly::assemble`], which
//! standalone, the operator and `capyctl simulate` build the same way), the `/management/v1`
//! listener (its token, health, readiness and Prometheus metrics) and `capyctl start
//! standalone` (server and one host in one process). The Kubernetes operator
//! (`capyctl-operator`) serves the same management listener over its lifecycle.

pub mod assembly;
pub mod management;
pub mod standalone;
