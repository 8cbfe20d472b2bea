//! Placeholder: the management listener (being written).
