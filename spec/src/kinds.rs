//! The small closed vocabularies shared by documents, the API and Kubernetes objects: engine
//! kinds, residency, activation and instance states. All are written in `snake_case`.

use std::fmt;
use std::str::FromStr;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

macro_rules! string_enum {
    ($(#[$meta:meta])* $name:ident { $($(#[$vmeta:meta])* $variant:ident => $text:literal),+ $(,)? }) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, JsonSchema)]
        #[serde(rename_all = "snake_case")]
        pub enum $name {
            $($(#[$vmeta])* $variant),+
        }

        impl $name {
            /// Every value, in declaration order.
            pub const ALL: &'static [$name] = &[$($name::$variant),+];

            /// The value as written in documents and on the wire.
            pub const fn as_str(self) -> &'static str {
                match self {
                    $($name::$variant => $text),+
                }
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl FromStr for $name {
            type Err = UnknownValue;

            fn from_str(s: &str) -> Result<Self, Self::Err> {
                match s {
                    $($text => Ok($name::$variant),)+
                    _ => Err(UnknownValue {
                        value: s.to_string(),
                        expected: &[$($text),+],
                    }),
                }
            }
        }
    };
}

/// A string that names none of an enum's values.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("`{value}` is not valid; expected one of {}", expected.join(", "))]
pub struct UnknownValue {
    /// The text given.
    pub value: String,
    /// The accepted values.
    pub expected: &'static [&'static str],
}

string_enum! {
    /// The inference engine a deployment runs on.
    EngineKind {
        /// vLLM (`vllm serve`).
        Vllm => "vllm",
        /// SGLang (`python3 -m sglang.launch_server`).
        Sglang => "sglang",
        /// TensorFold (`tensorfold serve`); it never parks.
        Tensorfold => "tensorfold",
    }
}

string_enum! {
    /// Where a parked deployment's weights go; unset lets CapyCTL pick from the hardware.
    Residency {
        /// Weights are copied to host RAM (discrete cards only); a wake copies them back.
        HostBacked => "host_backed",
        /// Weights are dropped; a wake reloads them from disk.
        Deep => "deep",
        /// Never park: stop instead.
        RestartOnly => "restart_only",
    }
}

string_enum! {
    /// Who may start, stop, park and wake a model.
    Activation {
        /// Requests and memory pressure may start, wake, park and stop it (the default).
        OnDemand => "on_demand",
        /// Only an operator's command moves it; requests for it are answered 409 while it is not running.
        Explicit => "explicit",
    }
}

// The derives come from `string_enum!`, shared with enums that have no default.
#[allow(clippy::derivable_impls)]
impl Default for Activation {
    fn default() -> Self {
        Self::OnDemand
    }
}

string_enum! {
    /// How a deployment's requests are spread over its ready instances (`routing:`).
    Routing {
        /// To the instance with the least load: CapyCTL's requests on it plus the requests its
        /// engine has waiting (the default).
        LeastLoaded => "least_loaded",
        /// Prompts that share a prefix go to one instance while its load stays within a bound
        /// (consistent hashing with bounded load), so the engine's prefix cache is reused.
        Prefix => "prefix",
    }
}

// The derives come from `string_enum!`, shared with enums that have no default.
#[allow(clippy::derivable_impls)]
impl Default for Routing {
    fn default() -> Self {
        Self::LeastLoaded
    }
}

string_enum! {
    /// The state of one instance (one engine process of a deployment on one host).
    InstanceState {
        /// Not running.
        Stopped => "stopped",
        /// Waiting for the checkpoint measurement before it may start.
        AwaitingMeasurement => "awaiting_measurement",
        /// The engine is starting.
        Starting => "starting",
        /// Serving requests.
        Ready => "ready",
        /// Taking no new requests while the running ones finish (the drain).
        Closed => "closed",
        /// Giving back its GPU memory.
        Parking => "parking",
        /// Engine up, GPU memory given back.
        Parked => "parked",
        /// Taking its GPU memory back.
        Waking => "waking",
        /// The engine is stopping.
        Stopping => "stopping",
        /// The engine failed (start, wake or check).
        Failed => "failed",
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn values_round_trip_through_text_and_serde() {
        for s in InstanceState::ALL {
            assert_eq!(s.as_str().parse::<InstanceState>().unwrap(), *s);
            assert_eq!(
                serde_json::to_string(s).unwrap(),
                format!("\"{}\"", s.as_str())
            );
        }
        assert_eq!(Residency::HostBacked.to_string(), "host_backed");
        assert_eq!(Activation::default(), Activation::OnDemand);
        assert_eq!(
            "gpu".parse::<EngineKind>().unwrap_err().to_string(),
            "`gpu` is not valid; expected one of vllm, sglang, tensorfold"
        );
    }
}
