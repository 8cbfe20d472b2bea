//! What an engine can do, the values: the `capyctl engine list` rows ([`EngineInfo`],
//! [`DeepPark`]). The refusal table they list is `capyctl_engine_rules::capability`.

use capyctl_spec::EngineKind;

/// An engine's `DEEP PARK` column in `capyctl engine list`.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case", tag = "status", content = "reason")]
pub enum DeepPark {
    /// The engine parks (models in the refusal table excepted).
    Enabled,
    /// The engine does not park, and why.
    Unavailable(String),
}

impl std::fmt::Display for DeepPark {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DeepPark::Enabled => f.write_str("enabled"),
            DeepPark::Unavailable(why) => f.write_str(why),
        }
    }
}

/// One row of `capyctl engine list`.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct EngineInfo {
    /// The engine.
    pub engine: EngineKind,
    /// Its version: declared in the host settings, or reported by a running engine.
    pub version: Option<String>,
    /// Whether it parks.
    pub deep_park: DeepPark,
    /// The refusal table's reasons for this engine (models it will not park). NB: the
    /// management API's engine row ([`capyctl_spec::api::EngineView`]) has no field for them,
    /// so [`EngineInfo::view`] leaves them out; users meet a reason in the
    /// `capability_missing:deep_park` error and the `Parkable` condition of the model concerned.
    #[serde(deserialize_with = "crate::interned::static_strs")]
    pub refused_models: Vec<&'static str>,
}

impl EngineInfo {
    /// The management API's row for host `host_id`, whose launch command of this engine is
    /// `command`.
    pub fn view(&self, host_id: &str, command: &[String]) -> capyctl_spec::api::EngineView {
        capyctl_spec::api::EngineView {
            engine: self.engine,
            version: self.version.clone(),
            command: command.to_vec(),
            deep_park: self.deep_park.to_string(),
            host_id: host_id.to_string(),
        }
    }
}
