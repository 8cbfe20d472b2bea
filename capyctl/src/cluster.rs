//! `kubectl capyctl`: the management API through the Kubernetes API server's service proxy.
//!
//! The cluster comes from the kubeconfig (`KUBECONFIG`, `~/.kube/config`, or in-cluster), the
//! namespace from `--namespace` / `CAPYCTL_NAMESPACE` or the kubeconfig's context; the Helm
//! release (`--release`, default `capyctl`) names the Service `<fullname>-management` (port
//! `management`) and the Secret `<fullname>-admin-token`, with the chart's naming rule:
//! `<fullname>` is the release name when it contains `capyctl`, else `<release>-capyctl`.
//! The API server authenticates the user (RBAC: `services/proxy` in the namespace, `get` on the
//! Service, and `get` on the Secret unless `--token` is given); the admin token travels in
//! `X-CapyCTL-Token`.
//!
//! With `operator.tls.secretName` the management listener serves HTTPS, and the chart marks the
//! Service's port `appProtocol: https`; the plugin reads the Service and asks the service proxy
//! for `https:<service>:management` then. A Service it may not read is taken as plain HTTP.

use k8s_openapi::api::core::v1::{Secret, Service};
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

/// The scheme of the management listener.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scheme {
    /// Plain HTTP (the chart's default).
    Http,
    /// TLS (`operator.tls.secretName`).
    Https,
}

/// The service-proxy path of the management Service, with `scheme`.
pub fn proxy_base(namespace: &str, release: &str, scheme: Scheme) -> String {
    let prefix = match scheme {
        Scheme::Http => "",
        Scheme::Https => "https:",
    };
    format!(
        "/api/v1/namespaces/{namespace}/services/{prefix}{}-management:management/proxy",
        fullname(release)
    )
}

/// The scheme of a management Service: `https` when its `management` port says
/// `appProtocol: https`.
pub fn scheme_of(service: &Service) -> Scheme {
    let https = service
        .spec
        .as_ref()
        .and_then(|s| s.ports.as_ref())
        .into_iter()
        .flatten()
        .any(|p| {
            p.name.as_deref() == Some("management") && p.app_protocol.as_deref() == Some("https")
        });
    if https { Scheme::Https } else { Scheme::Http }
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
    let service = format!("{}-management", fullname(release));
    let scheme = match Api::<Service>::namespaced(client.clone(), &namespace)
        .get_opt(&service)
        .await
    {
        Ok(Some(s)) => scheme_of(&s),
        // Missing, or not readable: plain HTTP; the service proxy says the rest.
        Ok(None) | Err(_) => Scheme::Http,
    };
    Ok(Client::through_kube(
        client,
        proxy_base(&namespace, release, scheme),
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
            proxy_base("gpu", "capyctl", Scheme::Http),
            "/api/v1/namespaces/gpu/services/capyctl-management:management/proxy"
        );
        assert_eq!(
            proxy_base("gpu", "capyctl", Scheme::Https),
            "/api/v1/namespaces/gpu/services/https:capyctl-management:management/proxy"
        );
    }

    #[test]
    fn the_scheme_is_the_management_ports_app_protocol() {
        let service = |app: &str| -> Service {
            serde_json::from_value(serde_json::json!({
                "metadata": {"name": "capyctl-management"},
                "spec": {"ports": [{"name": "management", "port": 7443, "appProtocol": app}]},
            }))
            .unwrap_or_default()
        };
        assert_eq!(scheme_of(&service("https")), Scheme::Https);
        assert_eq!(scheme_of(&service("http")), Scheme::Http);
        assert_eq!(scheme_of(&Service::default()), Scheme::Http);
    }
}
