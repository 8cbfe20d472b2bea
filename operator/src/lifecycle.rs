//! Placeholder: the lifecycle (being written).
