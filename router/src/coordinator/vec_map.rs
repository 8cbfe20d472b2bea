//! [`KeyedVec`]: a small map kept as a vector sorted by key (each value holds its own key),
//! with the subset of `BTreeMap`'s methods the coordinator uses and the same order.
//!
//! NB (memory at scale): a deployment's instances are one in most deployments and at most a few
//! dozen, and a `BTreeMap` of one entry allocates a whole leaf node of eleven: about 1.6 KB per
//! deployment used (160 MB with 100,000 used), against one entry's size here. The vector grows
//! one entry at a time for the same reason; look-ups are binary searches.

/// A value that holds its own key (so that a [`KeyedVec`] keeps no copy of it).
pub(crate) trait Keyed<K> {
    fn key(&self) -> &K;
}

/// A map as a vector of values sorted by the keys they hold ([`Keyed`]): `BTreeMap`'s answers
/// and order, without a second copy of each key.
///
/// NB (memory at scale): the router's instances are keyed by `InstanceKey` (two strings, the
/// deployment's and the host's ID), which each instance's shared `Upstream` holds already: a
/// copy beside it cost some 130 bytes per deployment used.
#[derive(Debug, Clone)]
pub(crate) struct KeyedVec<V> {
    entries: Vec<V>,
}

impl<V> Default for KeyedVec<V> {
    fn default() -> Self {
        KeyedVec {
            entries: Vec::new(),
        }
    }
}

impl<V> KeyedVec<V> {
    fn find<K: Ord>(&self, key: &K) -> Result<usize, usize>
    where
        V: Keyed<K>,
    {
        self.entries.binary_search_by(|v| v.key().cmp(key))
    }

    pub(crate) fn get<K: Ord>(&self, key: &K) -> Option<&V>
    where
        V: Keyed<K>,
    {
        self.find(key).ok().map(|i| &self.entries[i])
    }

    /// NB: the value's key must stay as it is (it places the value).
    pub(crate) fn get_mut<K: Ord>(&mut self, key: &K) -> Option<&mut V>
    where
        V: Keyed<K>,
    {
        self.find(key).ok().map(|i| &mut self.entries[i])
    }

    /// Inserts `value` at its key; the value it replaces, if any.
    pub(crate) fn insert<K: Ord>(&mut self, value: V) -> Option<V>
    where
        V: Keyed<K>,
    {
        match self.find(value.key()) {
            Ok(i) => Some(std::mem::replace(&mut self.entries[i], value)),
            Err(i) => {
                self.entries.reserve_exact(1);
                self.entries.insert(i, value);
                None
            }
        }
    }

    pub(crate) fn remove<K: Ord>(&mut self, key: &K) -> Option<V>
    where
        V: Keyed<K>,
    {
        let i = self.find(key).ok()?;
        let value = self.entries.remove(i);
        if self.entries.is_empty() {
            self.entries.shrink_to_fit();
        }
        Some(value)
    }

    /// The entries in key order.
    pub(crate) fn iter<'a, K: 'a>(&'a self) -> impl Iterator<Item = (&'a K, &'a V)> + Clone
    where
        V: Keyed<K>,
    {
        self.entries.iter().map(|v| (v.key(), v))
    }

    /// The values in key order.
    pub(crate) fn values(&self) -> impl Iterator<Item = &V> + Clone {
        self.entries.iter()
    }

    /// The values in key order (NB: their keys must stay as they are).
    pub(crate) fn values_mut(&mut self) -> impl Iterator<Item = &mut V> {
        self.entries.iter_mut()
    }

    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    /// A value with its key in it, for [`KeyedVec`].
    #[derive(Debug, Clone, PartialEq)]
    struct Entry(String, u32);

    impl super::Keyed<String> for Entry {
        fn key(&self) -> &String {
            &self.0
        }
    }

    /// The same operations on a `KeyedVec` and a `BTreeMap` give the same answers and the
    /// same order.
    #[test]
    fn a_keyed_vec_answers_as_a_btree_map_does() {
        let mut ours: super::KeyedVec<Entry> = super::KeyedVec::default();
        let mut theirs: BTreeMap<String, Entry> = BTreeMap::new();
        let keys = ["d", "b", "a", "c", "b", "e", "a"];
        for (n, k) in keys.iter().enumerate() {
            let e = Entry(k.to_string(), n as u32);
            assert_eq!(ours.insert(e.clone()), theirs.insert(k.to_string(), e));
        }
        let c = "c".to_string();
        let zz = "zz".to_string();
        assert_eq!(ours.remove(&c), theirs.remove(&c));
        assert_eq!(ours.remove(&zz), theirs.remove(&zz));
        let d = "d".to_string();
        if let (Some(a), Some(b)) = (ours.get_mut(&d), theirs.get_mut(&d)) {
            a.1 += 10;
            b.1 += 10;
        }
        for v in ours.values_mut() {
            v.1 += 1;
        }
        for v in theirs.values_mut() {
            v.1 += 1;
        }
        assert_eq!(ours.len(), theirs.len());
        let b = "b".to_string();
        assert_eq!(ours.get(&b), theirs.get(&b));
        assert_eq!(ours.get(&c), None);
        let a: Vec<(&String, &Entry)> = ours.iter().collect();
        let b: Vec<(&String, &Entry)> = theirs.iter().collect();
        assert_eq!(a, b);
        assert!(ours.values().eq(theirs.values()));
        for k in ["a", "b", "d", "e"] {
            let k = k.to_string();
            assert_eq!(ours.remove(&k), theirs.remove(&k));
        }
        assert!(ours.is_empty());
    }
}
