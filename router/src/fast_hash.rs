//! A fast hasher for the maps the listener looks up on every request: the idle engine
//! connections by address and the coordinator's lanes by deployment ID.
//!
//! NB: std's SipHash resists collisions chosen by an attacker, at about 200 instructions per
//! lookup; these keys are not chosen by clients (the addresses are the lifecycle's instances,
//! the IDs its deployments; a request's `model` is never a key), so the multiply-rotate hash
//! of rustc's `FxHasher` does, at a tenth of that.

use std::hash::{BuildHasherDefault, Hasher};

/// `HashMap<K, V, FastHash>`.
pub(crate) type FastHash = BuildHasherDefault<FxHasher>;

/// rustc's `FxHasher`: each word is mixed in with a rotate, an xor and a multiply.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct FxHasher {
    hash: u64,
}

const SEED: u64 = 0x51_7c_c1_b7_27_22_0a_95;

impl FxHasher {
    fn add(&mut self, word: u64) {
        self.hash = (self.hash.rotate_left(5) ^ word).wrapping_mul(SEED);
    }
}

impl Hasher for FxHasher {
    fn write(&mut self, bytes: &[u8]) {
        let mut chunks = bytes.chunks_exact(8);
        for chunk in &mut chunks {
            let mut word = [0u8; 8];
            word.copy_from_slice(chunk);
            self.add(u64::from_le_bytes(word));
        }
        let rest = chunks.remainder();
        if !rest.is_empty() {
            let mut word = [0u8; 8];
            word[..rest.len()].copy_from_slice(rest);
            self.add(u64::from_le_bytes(word));
        }
    }

    fn write_u8(&mut self, i: u8) {
        self.add(u64::from(i));
    }

    fn write_u16(&mut self, i: u16) {
        self.add(u64::from(i));
    }

    fn write_u32(&mut self, i: u32) {
        self.add(u64::from(i));
    }

    fn write_u64(&mut self, i: u64) {
        self.add(i);
    }

    fn write_usize(&mut self, i: usize) {
        self.add(i as u64);
    }

    fn finish(&self) -> u64 {
        self.hash
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::hash::BuildHasher;
    use std::net::SocketAddr;

    use super::*;

    #[test]
    fn equal_keys_hash_equal_and_near_keys_apart() {
        let hash = |addr: &str| FastHash::default().hash_one(addr.parse::<SocketAddr>().ok());
        assert_eq!(hash("127.0.0.1:8000"), hash("127.0.0.1:8000"));
        assert_ne!(hash("127.0.0.1:8000"), hash("127.0.0.1:8001"));
        assert_ne!(hash("127.0.0.1:8000"), hash("127.0.0.2:8000"));
        let id = |s: &str| FastHash::default().hash_one(s);
        assert_ne!(id("01KCHAT-A"), id("01KCHAT-B"));
        // A remainder shorter than a word counts too.
        assert_ne!(id("01KCHAT-A1"), id("01KCHAT-A2"));
    }

    #[test]
    fn a_map_finds_what_it_holds() {
        let mut map: HashMap<String, usize, FastHash> = HashMap::default();
        for i in 0..1000 {
            map.insert(format!("deployment-{i}"), i);
        }
        assert!((0..1000).all(|i| map[&format!("deployment-{i}")] == i));
        assert_eq!(map.get("deployment-1000"), None);
    }
}
