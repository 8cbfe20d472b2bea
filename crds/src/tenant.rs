//! [`Tenant`] (namespaced, short name `ctenant`): a tenant of the inference listener on
//! Kubernetes (DESIGN 4.10), the standalone document's `server.inference_auth.tenants[]` entry
//! with its keys in Secrets. `metadata.name` is the tenant's name.
//!
//! ```yaml
//! apiVersion: capyctl.io/v1alpha1
//! kind: Tenant
//! metadata: {name: team-a}
//! spec:
//!   keySecrets:                       # one or more; several allow rotation
//!     - {name: team-a-keys, key: key-1}
//!   models: ["chat-*", "support-bot"] # optional: names or globs; every model when absent
//!   rate: {requestsPerMinute: 600, tokensPerMinute: 200000}   # optional
//! ```
//!
//! Each `keySecrets` entry names a Secret of the Tenant's namespace and one key of its `data`;
//! that value (surrounding whitespace, such as the newline a file leaves, trimmed) is an API
//! key. The operator's tenant watcher (`capyctl_operator::tenants`) reads the objects and their
//! Secrets, and writes whether the tenant is in use in `status` (condition `Accepted`).

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

// The bounds of a rate and the rule of a model pattern are the standalone document's
// (`capyctl_spec::tenants`): the schema's ranges and `TenantSpec::check` read them from there.
use capyctl_spec::tenants::{
    MAX_REQUESTS_PER_MINUTE, MAX_TOKENS_PER_MINUTE, check_model_pattern, check_rate,
};

/// Condition type of a `Tenant`: whether its keys are in the router's table.
pub const ACCEPTED: &str = "Accepted";

/// A tenant of the inference listener: API keys (from Secrets) that may use some models at
/// some rate. `metadata.name` is the tenant's name.
// NB: clippy reads the repeated `type_ = ...` of the printer columns as duplicated attributes.
#[allow(clippy::duplicated_attributes)]
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[kube(
    group = "capyctl.io",
    version = "v1alpha1",
    kind = "Tenant",
    plural = "tenants",
    singular = "tenant",
    namespaced,
    status = "TenantStatus",
    derive = "PartialEq",
    shortname = "ctenant",
    category = "capyctl",
    printcolumn(
        name = "Accepted",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Accepted\")].status",
        description = "Whether the tenant's keys are in use"
    ),
    printcolumn(
        name = "Keys",
        type_ = "integer",
        json_path = ".status.keys",
        description = "Keys in use"
    ),
    printcolumn(
        name = "Reason",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Accepted\")].reason",
        description = "Why (or why not)"
    ),
    doc = "A CapyCTL tenant: API keys from Secrets that may use some models at some rate."
)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct TenantSpec {
    /// Where the tenant's API keys are: each entry a Secret of this namespace and one key of
    /// its data (the value, trimmed, is an API key). At least one; several allow rotation.
    #[schemars(length(min = 1))]
    pub key_secrets: Vec<KeySecretRef>,
    /// Model names or globs (`*`, `?`) the tenant may use; every model when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub models: Option<Vec<String>>,
    /// Requests and tokens per minute; not limited when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rate: Option<TenantRateSpec>,
}

/// One key of a Secret's data.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct KeySecretRef {
    /// The Secret's name (in the Tenant's namespace).
    #[schemars(length(min = 1))]
    pub name: String,
    /// The key of its data that holds the API key.
    #[schemars(length(min = 1))]
    pub key: String,
}

/// A tenant's rates.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct TenantRateSpec {
    /// Requests admitted per minute (1 to the schema's maximum); not limited when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = MAX_REQUESTS_PER_MINUTE))]
    pub requests_per_minute: Option<u64>,
    /// Tokens (prompt and completion) per minute (1 to the schema's maximum); not limited
    /// when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = MAX_TOKENS_PER_MINUTE))]
    pub tokens_per_minute: Option<u64>,
}

/// What the operator reports about a tenant.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Default, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct TenantStatus {
    /// Its keys in use now (0 while it is not accepted).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub keys: Option<u32>,
    /// `Accepted`: True when its keys are in the router's table; False with the reason
    /// (`Invalid`, `SecretMissing`, `KeyMissing`, `KeyRepeated`, `Refused`) and what is wrong.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
    /// The metadata.generation this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
}

impl TenantSpec {
    /// The rules of the spec alone (the Secrets aside), each refusal naming its field
    /// (`spec.models[1]: ...`): at least one key Secret, each naming a Secret and a key;
    /// `models`, when given, at least one non-empty pattern; rates within their bounds.
    pub fn check(&self) -> Result<(), String> {
        if self.key_secrets.is_empty() {
            return Err(
                "spec.keySecrets: a tenant needs at least one key (a Secret and a key of its data)"
                    .into(),
            );
        }
        for (i, r) in self.key_secrets.iter().enumerate() {
            if r.name.trim().is_empty() {
                return Err(format!("spec.keySecrets[{i}].name: names no Secret"));
            }
            if r.key.trim().is_empty() {
                return Err(format!(
                    "spec.keySecrets[{i}].key: names no key of the Secret"
                ));
            }
        }
        if let Some(models) = &self.models {
            if models.is_empty() {
                return Err(
                    "spec.models: names no model; leave it out to allow every model".into(),
                );
            }
            for (i, m) in models.iter().enumerate() {
                check_model_pattern(m).map_err(|why| format!("spec.models[{i}]: {why}"))?;
            }
        }
        if let Some(rate) = self.rate {
            for (what, value, max) in [
                (
                    "requestsPerMinute",
                    rate.requests_per_minute,
                    MAX_REQUESTS_PER_MINUTE,
                ),
                (
                    "tokensPerMinute",
                    rate.tokens_per_minute,
                    MAX_TOKENS_PER_MINUTE,
                ),
            ] {
                if let Some(v) = value {
                    check_rate(v, max).map_err(|why| format!("spec.rate.{what}: {why}"))?;
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn spec(yaml: &str) -> TenantSpec {
        serde_yaml_ng::from_str(yaml).unwrap()
    }

    #[test]
    fn the_spec_is_checked_naming_the_field() {
        let ok = spec(
            "keySecrets: [{name: s, key: k}]\nmodels: [\"chat-*\"]\nrate: {requestsPerMinute: 60}\n",
        );
        assert_eq!(ok.check(), Ok(()));
        for (yaml, want) in [
            (
                "keySecrets: []\n",
                "spec.keySecrets: a tenant needs at least one key",
            ),
            (
                "keySecrets: [{name: '', key: k}]\n",
                "spec.keySecrets[0].name: names no Secret",
            ),
            (
                "keySecrets: [{name: s, key: k}]\nmodels: []\n",
                "spec.models: names no model",
            ),
            (
                "keySecrets: [{name: s, key: k}]\nmodels: [a, '']\n",
                "spec.models[1]: an empty pattern",
            ),
            (
                "keySecrets: [{name: s, key: k}]\nmodels: [a, Chat/x]\n",
                "spec.models[1]: `Chat/x` matches no deployment name",
            ),
            (
                "keySecrets: [{name: s, key: k}]\nrate: {requestsPerMinute: 0}\n",
                "spec.rate.requestsPerMinute: 0 is out of range (1 to 1000000)",
            ),
            (
                "keySecrets: [{name: s, key: k}]\nrate: {tokensPerMinute: 10000000001}\n",
                "spec.rate.tokensPerMinute: 10000000001 is out of range (1 to 10000000000)",
            ),
        ] {
            let e = spec(yaml).check().unwrap_err();
            assert!(e.starts_with(want), "{yaml}: {e}");
        }
    }
}
