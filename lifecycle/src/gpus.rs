//! Which of its host's GPUs an engine uses (`CUDA_VISIBLE_DEVICES`, read from the host's
//! inventory).

use crate::state::{Dep, State};

/// The UUIDs of the GPUs `d`'s engine uses on its host (those its `CUDA_VISIBLE_DEVICES`
/// names, the deployment's or the host's engine setting, else every GPU of the host), where
/// the host's inventory knows them.
pub(crate) fn gpus_of(inner: &State, d: &Dep) -> Vec<String> {
    const VAR: &str = VISIBLE_DEVICES;
    let Some(host) = d.host.as_deref().and_then(|h| inner.hosts.get(h)) else {
        return Vec::new();
    };
    let spec = d.launch_spec();
    let visible = spec
        .env
        .get(VAR)
        .or_else(|| host.settings.engine(d.engine()).env.get(VAR))
        .map(|v| v.trim())
        .filter(|v| !v.is_empty());
    let used = |g: &capyctl_interfaces::inventory::GpuInfo| {
        visible.is_none_or(|v| {
            v.split(',')
                .map(str::trim)
                .any(|name| match name.parse::<u32>() {
                    Ok(index) => g.index == index,
                    Err(_) => g
                        .uuid
                        .as_deref()
                        .is_some_and(|u| u.eq_ignore_ascii_case(name)),
                })
        })
    };
    host.gpus
        .iter()
        .filter(|g| used(g))
        .filter_map(|g| g.uuid.clone())
        .collect()
}

/// The variable that gives an engine its GPUs.
pub(crate) const VISIBLE_DEVICES: &str = "CUDA_VISIBLE_DEVICES";
