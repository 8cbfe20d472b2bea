//! Placeholder: standalone assembly (being written).
