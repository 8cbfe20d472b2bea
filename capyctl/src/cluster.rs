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
//! `deploy model` and `delete deployment` write the `Deployment` objects instead
//! (`deploy_object`, `delete_object`), with the user's own rights (get, create, update and
//! delete on `deployments.capyctl.io`): on Kubernetes the objects say what is deployed.
//!
//! With `operator.tls.secretName` the management listener serves HTTPS, and the chart marks the
//! Service's port `appProtocol: https`; the plugin reads the Service and asks the service proxy
//! for `https:<service>:management` then. A Service it may not read is taken as plain HTTP.

use std::time::Duration;

use capyctl_crds::api::{DeployOutcome, DeployReceipt, DeploymentView};
use capyctl_crds::documents::DeploymentDoc;
use capyctl_crds::k8s::Deployment;
use k8s_openapi::api::core::v1::{Secret, Service};
use kube::Api;
use kube::api::{DeleteParams, PostParams};

use crate::CommandError;
use crate::client::{Client, ClientError, segment};

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
    let base = proxy_base(&namespace, release, scheme);
    Ok(Client::through_kube(client, namespace, base, token))
}

/// The field manager of the `Deployment` objects `kubectl capyctl deploy model` writes.
pub const FIELD_MANAGER: &str = "kubectl-capyctl";

/// How often the plugin looks whether the operator has taken an object.
const POLL: Duration = Duration::from_millis(250);

/// `kubectl capyctl deploy model`: on Kubernetes the `Deployment` objects say what is deployed
/// (the operator's management API refuses deploys), so the document becomes the object's whole
/// spec, with the user's own rights (create, or update of the object read, retried when it
/// changed meanwhile). Then the operator's reconciler deploys it: the answer is the receipt
/// once the object's `status.observedGeneration` has reached the written generation, within
/// `timeout`.
pub(crate) async fn deploy_object(
    client: &Client,
    doc: &DeploymentDoc,
    timeout: Duration,
) -> Result<DeployReceipt, CommandError> {
    let (api, namespace) = objects(client)?;
    let name = doc.name.as_str();
    let before = view_of(client, name).await?;
    let object = format!("Deployment object {namespace}/{name}");
    let fail = |what: &str, e: kube::Error| {
        CommandError::Failed(format!("cannot {what} the {object}: {}", kube_message(&e)))
    };
    let written = loop {
        let params = PostParams {
            field_manager: Some(FIELD_MANAGER.to_string()),
            ..PostParams::default()
        };
        match api.get_opt(name).await.map_err(|e| fail("read", e))? {
            None => match api.create(&params, &Deployment::from_document(doc)).await {
                Ok(o) => break o,
                // Created by someone else just now: update that one.
                Err(kube::Error::Api(s)) if s.is_already_exists() => continue,
                Err(e) => return Err(fail("create", e)),
            },
            Some(mut current) => {
                current.spec = Deployment::from_document(doc).spec;
                match api.replace(name, &params, &current).await {
                    Ok(o) => break o,
                    // Changed since it was read: read it again.
                    Err(kube::Error::Api(s)) if s.is_conflict() => continue,
                    Err(e) => return Err(fail("update", e)),
                }
            }
        }
    };
    let generation = written.metadata.generation.unwrap_or(0);
    // A refusal already there before this write says nothing of this generation.
    let refused_before = refusal(&written);
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let current = api.get(name).await.map_err(|e| fail("read", e))?;
        let status = current.status.as_ref();
        if let Some(why) = refusal(&current)
            && Some(&why) != refused_before.as_ref()
        {
            return Err(CommandError::Failed(format!(
                "the operator did not accept the {object}: {why}"
            )));
        }
        if status
            .and_then(|s| s.observed_generation)
            .is_some_and(|g| g >= generation)
            && let Some(after) = view_of(client, name).await?
        {
            let outcome = match &before {
                Some(b) if b.id == after.id && b.revision == after.revision => {
                    DeployOutcome::Unchanged
                }
                Some(b) if b.id == after.id => DeployOutcome::Updated,
                _ => DeployOutcome::Created,
            };
            return Ok(DeployReceipt {
                outcome,
                deployment: after,
            });
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(CommandError::Failed(match refusal(&current) {
                Some(why) => format!("the operator did not accept the {object}: {why}"),
                None => format!(
                    "the operator has not taken the {object} (generation {generation}) within {} s; is it running? (kubectl -n {namespace} describe cdeploy {name})",
                    timeout.as_secs()
                ),
            }));
        }
        tokio::time::sleep(POLL).await;
    }
}

/// `kubectl capyctl delete deployment`: deletes the `Deployment` object (its finalizer stops
/// the engines), then waits, within `timeout`, until the operator has forgotten the
/// deployment. Answers its view from before.
pub(crate) async fn delete_object(
    client: &Client,
    name_or_id: &str,
    timeout: Duration,
) -> Result<DeploymentView, CommandError> {
    let (api, namespace) = objects(client)?;
    let answer = client
        .get(&format!("/deployments/{}", segment(name_or_id)))
        .await?;
    let view: DeploymentView = answer.json(client.server())?;
    let object = format!("Deployment object {namespace}/{}", view.name);
    match api.delete(&view.name, &DeleteParams::default()).await {
        Ok(_) => {}
        Err(kube::Error::Api(s)) if s.is_not_found() => {
            return Err(CommandError::Failed(format!(
                "there is no {object}: the operator serves a deployment no object asks for; it goes at the operator's next restart"
            )));
        }
        Err(e) => {
            return Err(CommandError::Failed(format!(
                "cannot delete the {object}: {}",
                kube_message(&e)
            )));
        }
    }
    let deadline = tokio::time::Instant::now() + timeout;
    while view_of(client, &view.id).await?.is_some() {
        if tokio::time::Instant::now() >= deadline {
            return Err(CommandError::Failed(format!(
                "the {object} is being deleted, but the operator has not let the deployment go within {} s (kubectl -n {namespace} describe cdeploy {})",
                timeout.as_secs(),
                view.name
            )));
        }
        tokio::time::sleep(POLL).await;
    }
    Ok(view)
}

/// The `Deployment` objects of the namespace the plugin works in, and that namespace.
fn objects(client: &Client) -> Result<(Api<Deployment>, &str), CommandError> {
    let (kube, namespace) = client
        .cluster()
        .ok_or_else(|| CommandError::Failed("not under kubectl".to_string()))?;
    Ok((Api::namespaced(kube, namespace), namespace))
}

/// Why the operator does not take the object's spec (its `Accepted=False` condition).
fn refusal(object: &Deployment) -> Option<String> {
    object
        .status
        .as_ref()?
        .conditions
        .iter()
        .find(|c| c.type_ == "Accepted" && c.status == "False")
        .map(|c| c.message.clone())
}

/// The deployment's view, `None` when the server does not know it.
async fn view_of(
    client: &Client,
    name_or_id: &str,
) -> Result<Option<DeploymentView>, CommandError> {
    match client
        .get(&format!("/deployments/{}", segment(name_or_id)))
        .await
    {
        Ok(answer) => Ok(Some(answer.json(client.server())?)),
        Err(ClientError::Api { code, .. }) if code == "not_found" => Ok(None),
        Err(e) => Err(e.into()),
    }
}

/// What the API server said, in a line.
fn kube_message(e: &kube::Error) -> String {
    match e {
        kube::Error::Api(s) => format!("{} ({})", s.message, s.reason),
        other => other.to_string(),
    }
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
