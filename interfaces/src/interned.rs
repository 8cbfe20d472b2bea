//! Interned strings: the `&'static str` fields of the host agent's values (engine steps,
//! refusal reasons, unsupported operations) when they come back over the wire.

use std::collections::HashSet;
use std::sync::{Mutex, OnceLock, PoisonError};

use serde::{Deserialize, Deserializer};

/// How many distinct strings [`intern`] keeps before it stops leaking new ones.
const INTERNED_MAX: usize = 4096;

/// A `&'static str` equal to `s`, for the error fields that are static on the agent's side
/// (engine steps, refusal reasons, unsupported operations). The set is small and fixed on the
/// agent's side, so each distinct string is leaked once; past 4096 distinct strings
/// (a misbehaving peer) new ones become `"(unknown)"`.
pub fn intern(s: &str) -> &'static str {
    static SET: OnceLock<Mutex<HashSet<&'static str>>> = OnceLock::new();
    let mut set = SET
        .get_or_init(|| Mutex::new(HashSet::new()))
        .lock()
        .unwrap_or_else(PoisonError::into_inner);
    if let Some(known) = set.get(s) {
        return known;
    }
    if set.len() >= INTERNED_MAX {
        return "(unknown)";
    }
    let leaked: &'static str = Box::leak(s.to_string().into_boxed_str());
    set.insert(leaked);
    leaked
}

/// Deserialises a list of strings into interned `&'static str`s (`EngineInfo::refused_models`).
pub fn static_strs<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<&'static str>, D::Error> {
    let owned = Vec::<String>::deserialize(d)?;
    Ok(owned.iter().map(|s| intern(s)).collect())
}
