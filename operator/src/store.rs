//! Placeholder: the store (being written).
