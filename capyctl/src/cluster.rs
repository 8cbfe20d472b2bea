//! `kubectl capyctl`: the management API through the Kubernetes API server's service proxy.
//!
//! The cluster comes from the kubeconfig (`KUBECONFIG`, `~/.kube/config`, or in-cluster), the
//! namespace of the Deployment objects from `--namespace` / `CAPYCTL_NAMESPACE` or the
//! kubeconfig's context, the release's namespace from `--release-namespace` /
//! `CAPYCTL_RELEASE_NAMESPACE` (default: the same); the Helm
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
//! The operator takes them only from the namespaces it watches (the chart's
//! `operator.watchNamespaces`), which the chart writes on the management Service as the
//! annotation [`WATCH_ANNOTATION`]: `deploy model` in a namespace it does not watch writes
//! nothing and says where models go ([`Target::unwatched`]), and `list deployments` says so
//! on standard error with the objects ignored there, or names the objects of a watched
//! namespace the operator refuses (`Accepted=False`) and why ([`list_notes`]).
//!
//! With `operator.tls.secretName` the management listener serves HTTPS, and the chart marks the
//! Service's port `appProtocol: https`; the plugin reads the Service and asks the service proxy
//! for `https:<service>:management` then. A Service it may not read is taken as plain HTTP.

use std::time::Duration;

use capyctl_crds::Deployment;
use capyctl_spec::api::{DeployOutcome, DeployReceipt, DeploymentView};
use capyctl_spec::documents::DeploymentDoc;
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

/// Where `kubectl capyctl` works: the namespace of the user's Deployment objects, the
/// release's, and the namespaces the release's operator takes objects from (the management
/// Service's annotation `capyctl.io/watch-namespaces`, which the chart writes from
/// `operator.watchNamespaces`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    /// The namespace of the Deployment objects the plugin writes and reads (`--namespace`).
    pub namespace: String,
    /// The Helm release.
    pub release: String,
    /// The release's namespace (`--release-namespace`; default `namespace`).
    pub release_namespace: String,
    /// The watched namespaces, comma-separated, or `*`; `None` when the Service does not say
    /// (an older chart, or a Service the user may not read).
    pub watched: Option<String>,
}

/// The management Service's annotation naming the namespaces the operator watches.
pub const WATCH_ANNOTATION: &str = "capyctl.io/watch-namespaces";

impl Target {
    /// Whether the operator takes Deployment objects from `namespace`; `None` when unknown.
    pub fn watches(&self, namespace: &str) -> Option<bool> {
        let watched = self.watched.as_deref()?;
        Some(watched.trim() == "*" || watched.split(',').any(|n| n.trim() == namespace))
    }

    /// Where models go, when the operator does not take the objects of the plugin's
    /// namespace: one line naming the watched namespaces and how to deploy there. `None` when
    /// the namespace is watched, or when that is not known.
    pub fn unwatched(&self) -> Option<String> {
        if self.watches(&self.namespace) != Some(false) {
            return None;
        }
        let watched: Vec<&str> = self
            .watched
            .as_deref()
            .unwrap_or_default()
            .split(',')
            .map(str::trim)
            .filter(|n| !n.is_empty())
            .collect();
        let first = watched.first().copied().unwrap_or(&self.release_namespace);
        Some(format!(
            "the CapyCTL operator of release {} (namespace {}) does not watch namespace {}: it takes Deployment objects from {} only; deploy in one of those (kubectl capyctl -n {first} --release-namespace {} deploy model --file F), or add {} to the chart value operator.watchNamespaces",
            self.release,
            self.release_namespace,
            self.namespace,
            watched.join(", "),
            self.release_namespace,
            self.namespace,
        ))
    }
}

/// A client for the release's management Service; the token is `token`, else read from the
/// release's admin token Secret. The Deployment objects go to `namespace` (default the
/// kubeconfig's); the release is in `release_namespace` (default `namespace`).
pub async fn connect(
    namespace: Option<String>,
    release_namespace: Option<String>,
    release: &str,
    token: Option<String>,
) -> Result<Client, String> {
    let mut config = kube::Config::infer()
        .await
        .map_err(|e| format!("cannot find the cluster (kubeconfig or in-cluster): {e}"))?;
    // No retries of 503, 504 and 429 answers: through the service proxy they are the
    // management API's answers (or the proxy's, for a release with no operator ready) and
    // are printed at once; kube's default retries them up to 15 times with a backoff growing
    // to minutes (a `list` against a release whose operator is down took 380 s), and would
    // send a refused `start` again.
    config.default_retry = false;
    let objects_namespace = namespace
        .filter(|n| !n.is_empty())
        .unwrap_or_else(|| config.default_namespace.clone());
    let namespace = release_namespace
        .filter(|n| !n.is_empty())
        .unwrap_or_else(|| objects_namespace.clone());
    let client =
        kube::Client::try_from(config).map_err(|e| format!("cannot use the kubeconfig: {e}"))?;
    let service = format!("{}-management", fullname(release));
    // Missing, or not readable: plain HTTP, nothing known of the watched namespaces; the
    // service proxy says the rest.
    let found = Api::<Service>::namespaced(client.clone(), &namespace)
        .get_opt(&service)
        .await
        .ok()
        .flatten();
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
    let scheme = found.as_ref().map(scheme_of).unwrap_or(Scheme::Http);
    let watched = found.as_ref().and_then(|s| {
        s.metadata
            .annotations
            .as_ref()?
            .get(WATCH_ANNOTATION)
            .cloned()
    });
    let base = proxy_base(&namespace, release, scheme);
    let target = Target {
        namespace: objects_namespace,
        release: release.to_string(),
        release_namespace: namespace,
        watched,
    };
    Ok(Client::through_kube(client, target, base, token))
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
    let (api, target) = objects(client)?;
    // An object no operator takes would wait for nothing: say where models go instead.
    if let Some(why) = target.unwatched() {
        return Err(CommandError::Failed(why));
    }
    let namespace = target.namespace.as_str();
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

/// What `kubectl capyctl delete deployment` deleted.
#[derive(Debug)]
pub(crate) enum Deleted {
    /// The object of a served deployment, whose view from before this is.
    Served(Box<DeploymentView>),
    /// An object the operator did not serve: `object` (`namespace/name`), and why not.
    NotServed {
        /// `namespace/name`.
        object: String,
        /// Why it was not served (its namespace is not watched, or its name is another
        /// namespace's object's).
        why: String,
    },
}

/// `kubectl capyctl delete deployment`: deletes the `Deployment` object (its finalizer stops
/// the engines), then waits, within `timeout`, until the operator has forgotten the
/// deployment. An object the operator does not serve (in a namespace it does not watch, or
/// refused because another namespace's object holds its name) is deleted without waiting, and
/// the deployment of that name, another namespace's, is left alone.
pub(crate) async fn delete_object(
    client: &Client,
    name_or_id: &str,
    timeout: Duration,
) -> Result<Deleted, CommandError> {
    let (api, target) = objects(client)?;
    let namespace = target.namespace.as_str();
    let unserved = match api.get_opt(name_or_id).await {
        Ok(Some(o)) => match target.unwatched() {
            Some(_) => Some(format!("the operator does not watch namespace {namespace}")),
            None => name_taken(&o),
        },
        _ => None,
    };
    if let Some(why) = unserved {
        let object = format!("Deployment object {namespace}/{name_or_id}");
        return match api.delete(name_or_id, &DeleteParams::default()).await {
            Ok(_) => Ok(Deleted::NotServed {
                object: format!("{namespace}/{name_or_id}"),
                why,
            }),
            Err(e) => Err(CommandError::Failed(format!(
                "cannot delete the {object}: {}",
                kube_message(&e)
            ))),
        };
    }
    let answer = client
        .get(&format!("/deployments/{}", segment(name_or_id)))
        .await?;
    let view: DeploymentView = answer.json(client.server())?;
    let object = format!("Deployment object {namespace}/{}", view.name);
    match api.delete(&view.name, &DeleteParams::default()).await {
        Ok(_) => {}
        Err(kube::Error::Api(s)) if s.is_not_found() => {
            return Err(CommandError::Failed(format!(
                "there is no {object}: deployment {} is served from another namespace's object (delete it with -n NAMESPACE), or from none, and then it goes at the operator's next restart",
                view.name
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
    Ok(Deleted::Served(Box::new(view)))
}

/// Why the operator refuses `object` for its name (`Accepted=False`, reason `name_taken`).
fn name_taken(object: &Deployment) -> Option<String> {
    object
        .status
        .as_ref()?
        .conditions
        .iter()
        .find(|c| c.type_ == "Accepted" && c.status == "False" && c.reason == "name_taken")
        .map(|c| c.message.clone())
}

/// The `Deployment` objects of the namespace the plugin works in, and where it works.
fn objects(client: &Client) -> Result<(Api<Deployment>, &Target), CommandError> {
    let (kube, target) = client
        .cluster()
        .ok_or_else(|| CommandError::Failed("not under kubectl".to_string()))?;
    Ok((Api::namespaced(kube, &target.namespace), target))
}

/// What `kubectl capyctl list deployments` adds on standard error about the plugin's
/// namespace: that the operator does not watch it, and which of its objects it therefore
/// ignores (where models go instead); or which of its objects the operator refuses, and why
/// (a spec refused, a name another namespace's object holds). Nothing when all is well or
/// the objects cannot be read.
pub(crate) async fn list_notes(client: &Client) -> Vec<String> {
    let Ok((api, target)) = objects(client) else {
        return Vec::new();
    };
    let objects = api
        .list(&kube::api::ListParams::default())
        .await
        .map(|l| l.items)
        .unwrap_or_default();
    let namespace = &target.namespace;
    if let Some(why) = target.unwatched() {
        let mut notes = vec![format!("note: {why}")];
        if !objects.is_empty() {
            let names: Vec<String> = objects.iter().map(kube::ResourceExt::name_any).collect();
            notes.push(format!(
                "note: so the Deployment objects of {namespace} are not served: {}",
                names.join(", ")
            ));
        }
        return notes;
    }
    objects
        .iter()
        .filter_map(|o| {
            let why = refusal(o)?;
            Some(format!(
                "note: the Deployment object {namespace}/{} is not accepted: {why}",
                kube::ResourceExt::name_any(o)
            ))
        })
        .collect()
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

    fn target(namespace: &str, watched: Option<&str>) -> Target {
        Target {
            namespace: namespace.into(),
            release: "capyctl".into(),
            release_namespace: "capyctl-system".into(),
            watched: watched.map(str::to_string),
        }
    }

    #[test]
    fn an_unwatched_namespace_is_told_where_models_go() {
        let t = target("team-x", Some("capyctl-system,team-a"));
        assert_eq!(t.watches("team-x"), Some(false));
        assert_eq!(t.watches("team-a"), Some(true));
        assert_eq!(
            t.unwatched().as_deref(),
            Some(
                "the CapyCTL operator of release capyctl (namespace capyctl-system) does not watch namespace team-x: it takes Deployment objects from capyctl-system, team-a only; deploy in one of those (kubectl capyctl -n capyctl-system --release-namespace capyctl-system deploy model --file F), or add team-x to the chart value operator.watchNamespaces"
            )
        );
        assert_eq!(
            target("team-a", Some("capyctl-system,team-a")).unwatched(),
            None
        );
        // Every namespace, or not known (an older chart, a Service not readable): nothing said.
        assert_eq!(target("team-x", Some("*")).unwatched(), None);
        assert_eq!(target("team-x", None).watches("team-x"), None);
        assert_eq!(target("team-x", None).unwatched(), None);
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
