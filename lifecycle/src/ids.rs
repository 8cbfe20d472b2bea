//! Instance IDs (`<deployment id>-<index>`) and engines' socket addresses.

use std::net::SocketAddr;

/// The ID of a deployment's instance: `<deployment id>-0`.
pub fn instance_id(deployment_id: &str) -> String {
    instance_id_at(deployment_id, 0)
}

/// The ID of a deployment's instance `index`: `<deployment id>-<index>`.
pub fn instance_id_at(deployment_id: &str, index: u32) -> String {
    format!("{deployment_id}-{index}")
}

/// The deployment ID and index an instance ID (`<deployment id>-<index>`) names.
pub fn split_instance_id(instance_id: &str) -> Option<(&str, u32)> {
    let (dep, index) = instance_id.rsplit_once('-')?;
    let index: u32 = index.parse().ok()?;
    (!dep.is_empty()).then_some((dep, index))
}

/// The socket address of an engine's `base_url` (`http://<ip>:<port>`, `http://[<ipv6>]:<port>`);
/// `None` (logged) when it names no IP address and port.
pub(crate) fn engine_addr(base_url: &str) -> Option<SocketAddr> {
    let rest = base_url
        .strip_prefix("http://")
        .unwrap_or(base_url)
        .trim_end_matches('/');
    let addr = rest.parse::<SocketAddr>().ok();
    if addr.is_none() {
        tracing::warn!(
            base_url,
            "an engine's address is not an IP address and port; requests cannot reach it"
        );
    }
    addr
}

#[cfg(test)]
mod tests {
    use super::engine_addr;

    #[test]
    fn an_engines_address_comes_from_its_base_url_loopback_or_pod_ip() {
        assert_eq!(
            engine_addr("http://127.0.0.1:41234"),
            Some(([127, 0, 0, 1], 41234).into())
        );
        assert_eq!(
            engine_addr("http://10.244.3.17:8000/"),
            Some(([10, 244, 3, 17], 8000).into())
        );
        assert_eq!(
            engine_addr("http://[fd00::17]:8000").map(|a| a.to_string()),
            Some("[fd00::17]:8000".to_string())
        );
        assert_eq!(engine_addr("http://engine.local:8000"), None);
    }
}
