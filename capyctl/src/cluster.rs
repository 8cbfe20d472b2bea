//! `kubectl capyctl`: the management API through the Kubernetes API server's service proxy.
//!
//! The cluster comes from the kubeconfig (`KUBECONFIG`, `~/.kube/config`, or in-cluster), the
//! namespace from `--namespace` / `CAPYCTL_NAMESPACE` or the kubeconfig's context; the Helm
//! release (`--release`, default `capyctl`) names the Service `<fullname>-management` (port
//! `management`) and the Secret `<fullname>-admin-token`, with the chart's naming rule:
//! `<fullname>` is the release name when it contains `capyctl`, else `<release>-capyctl`.
//! The API server authenticates the user (RBAC: `services/proxy` in the namespace, and `get`
//! on the Secret unless `--token` is given); the admin token travels in `X-CapyCTL-Token`.

use k8s_openapi::api::core::v1::Secret;
use kube::Api;

use crate::client::Client;

/// The chart's `capyctl.fullname` for release `release` (no overrides).
pub fn fullname(release: &str) -> String {
    let name = if release.contains("capyctl") {
        release.to_string()
    } else {
        format!("{release}-capyctl")
    };
    name.chars()
        .take(40)
        .collect::<String>()
        .trim_end_matches('-')
        .to_string()
}

/// The service-proxy path of the management Service.
pub fn proxy_base(namespace: &str, release: &str) -> String {
    format!(
        "/api/v1/namespaces/{namespace}/services/{}-management:management/proxy",
        fullname(release)
    )
}

/// A client for the release's management Service; the token is `token`, else read from the
/// release's admin token Secret.
pub async fn connect(
    namespace: Option<String>,
    release: &str,
    token: Option<String>,
) -> Result<Client, String> {
    let config = kube::Config::infer()
        .await
        .map_err(|e| format!("cannot find the cluster (kubeconfig or in-cluster): {e}"))?;
    let namespace = namespace.unwrap_or_else(|| config.default_namespace.clone());
    let client =
        kube::Client::try_from(config).map_err(|e| format!("cannot use the kubeconfig: {e}"))?;
    let token = match token
        .map(|t| t.trim().to_string())
        .filter(|t| !t.is_empty())
    {
        Some(t) => t,
        None => {
            let name = format!("{}-admin-token", fullname(release));
            let secret = Api::<Secret>::namespaced(client.clone(), &namespace)
                .get(&name)
                .await
                .map_err(|e| {
                    format!(
                        "cannot read the admin token Secret {namespace}/{name}: {e}; pass --token or set CAPYCTL_ADMIN_TOKEN"
                    )
                })?;
            let bytes = secret
                .data
                .as_ref()
                .and_then(|d| d.get("token"))
                .map(|b| b.0.clone())
                .ok_or_else(|| format!("the Secret {namespace}/{name} has no key `token`"))?;
            String::from_utf8(bytes)
                .map_err(|_| format!("the Secret {namespace}/{name}: `token` is not text"))?
                .trim()
                .to_string()
        }
    };
    Ok(Client::through_kube(
        client,
        proxy_base(&namespace, release),
        token,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_the_chart() {
        assert_eq!(fullname("capyctl"), "capyctl");
        assert_eq!(fullname("my-capyctl"), "my-capyctl");
        assert_eq!(fullname("prod"), "prod-capyctl");
        assert_eq!(
            proxy_base("gpu", "capyctl"),
            "/api/v1/namespaces/gpu/services/capyctl-management:management/proxy"
        );
    }
}
