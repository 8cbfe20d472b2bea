//! Tenants of the inference listener (DESIGN 4.10), as whoever reads them (the standalone
//! document's `server.inference_auth`, or the `Tenant` objects and their Secrets on Kubernetes)
//! hands them to the router's key check ([`TenantTable::replace`]).

/// One tenant, its keys resolved (from the document, key files or Secrets).
#[derive(Clone, PartialEq, Eq)]
pub struct Tenant {
    /// The tenant's name (as metrics, the load read and `capyctl tenants list` show it).
    pub name: String,
    /// Its API keys, in clear: the table keeps only their hashes. Several allow rotation.
    pub keys: Vec<String>,
    /// Model names or globs it may use; `None`: every model.
    pub models: Option<Vec<String>>,
    /// Its rates; `None`: not limited.
    pub rate: Option<TenantRate>,
}

impl std::fmt::Debug for Tenant {
    // Keys are never shown, also not in a debug print or a log line.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tenant")
            .field("name", &self.name)
            .field("keys", &format_args!("<{} keys>", self.keys.len()))
            .field("models", &self.models)
            .field("rate", &self.rate)
            .finish()
    }
}

/// `rate: {requests_per_minute, tokens_per_minute}` of a tenant.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TenantRate {
    /// Requests admitted per minute; `None`: not limited.
    pub requests_per_minute: Option<u32>,
    /// Tokens (prompt and completion, as the engine counts them) per minute; `None`: not
    /// limited.
    pub tokens_per_minute: Option<u64>,
}

/// Where tenants go: the inference listener's key check. `replace` swaps the whole set at once
/// (a rotated key works from the next request; requests in flight keep their tenant).
pub trait TenantTable: Send + Sync + 'static {
    /// Replaces every tenant. `Err` names what is wrong (an empty or repeated key, a tenant
    /// with no models, a rate of 0) and changes nothing. With `keys_required` every request
    /// needs a key even when `tenants` is empty (tenants are configured whose keys are all
    /// left out, e.g. a `Tenant` object whose Secret is missing: its keys get 401 like any
    /// other, and the listener does not fall open); without it, no tenant means no key.
    fn replace_requiring(&self, tenants: Vec<Tenant>, keys_required: bool) -> Result<(), String>;

    /// [`TenantTable::replace_requiring`] where the tenants given are all there is: keys are
    /// asked for while there is a tenant.
    fn replace(&self, tenants: Vec<Tenant>) -> Result<(), String> {
        self.replace_requiring(tenants, false)
    }
}
