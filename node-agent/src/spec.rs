//! What the agent is asked to run: a deployment's launch-relevant fields and the host's engine
//! commands (`capyctl_interfaces::spec`'s values, re-exported here), and how the launch reads
//! its flags.

pub use capyctl_interfaces::spec::{
    DecisionSpec, DeclaredResources, EngineLaunch, GpuOverride, HostSettings, InstanceSpec,
};

/// A flag in `args`: alone or as `flag=value`, and its value (the last one wins).
pub use capyctl_spec::engine_args::{flag_value, has_flag};
