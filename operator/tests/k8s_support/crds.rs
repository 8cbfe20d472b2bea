//! The chart's CRDs for the `needs cluster` tests (included with `#[path]` beside
//! `k8s_support/mod.rs`).
#![allow(dead_code, clippy::unwrap_used)]

use std::time::Duration;

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Patch, PatchParams};
use kube::{Api, Client, ResourceExt};

/// Applies the chart's CRDs (server-side apply: a rerun is harmless) and waits until they are
/// established.
pub async fn install_crds(client: &Client) {
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    let dir = capyctl_crds::chart_crd_dir();
    let mut names = Vec::new();
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        let text = std::fs::read_to_string(&path).unwrap();
        let crd: CustomResourceDefinition = serde_yaml_ng::from_str(&text).unwrap();
        let name = crd.name_any();
        crds.patch(
            &name,
            &PatchParams::apply("capyctl-tests").force(),
            &Patch::Apply(&crd),
        )
        .await
        .unwrap();
        names.push(name);
    }
    for name in names {
        tokio::time::timeout(
            Duration::from_secs(30),
            kube::runtime::wait::await_condition(
                crds.clone(),
                &name,
                kube::runtime::wait::conditions::is_crd_established(),
            ),
        )
        .await
        .unwrap()
        .unwrap();
    }
}
