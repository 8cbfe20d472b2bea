//! The listener's one budget for request bodies: `max_buffered_bytes_total` bytes, shared by
//! every connection of the listener (all its threads), for every body it holds, from its
//! first byte until it is written to the engine or given up (being read, waiting for its
//! admission, being sent). So the memory of bodies is bounded whatever clients send, and the
//! waiting bodies the product page bounds are bounded by the same count (no second one).
//!
//! - A body whose length is declared is checked before anything of it is read (before
//!   `100 Continue`): one over the bound alone is `413 request_too_large`; one that does not
//!   fit beside what others hold now is `429 queue_full` "waiting requests exceed the
//!   buffered-bytes bound" (`Retry-After: 1`). Nothing is taken yet: a client that declares a
//!   large body and then sends nothing (or sends it slowly) must not hold room it has not
//!   used, or one such client would have every other body refused.
//! - Every body then takes what its buffer allocates, before it allocates it, as its bytes
//!   arrive ([`Gather`]): the buffer doubles while the budget has room for that (never past a
//!   declared length), else grows to just what the data needs; when even that does not fit,
//!   the same 413 or 429, while the body is still arriving. So what a body holds is at most
//!   twice its data (its whole length, when declared), and all of it is counted. A body that
//!   came whole with its head takes its length at once.
//! - What a body took is given back exactly once, when its [`Hold`] is dropped: with the
//!   body (written to the engine, refused, answered without it) or with the connection.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;
use capyctl_spec::errors::ApiError;

/// The bytes request bodies may hold at once, and what they hold now.
#[derive(Debug)]
pub(crate) struct Budget {
    limit: u64,
    used: AtomicU64,
}

impl Budget {
    /// A budget of `limit` bytes, none held.
    pub(crate) fn new(limit: u64) -> Arc<Self> {
        Arc::new(Budget {
            limit,
            used: AtomicU64::new(0),
        })
    }

    /// The bytes held now.
    pub(crate) fn used(&self) -> u64 {
        self.used.load(Ordering::Acquire)
    }

    /// Whether a body of `n` bytes fits beside what is held now (nothing is taken): `413` over
    /// the bound alone, `429 queue_full` when others hold the room.
    pub(crate) fn fits_now(&self, n: u64) -> Result<(), ApiError> {
        if n > self.limit {
            return Err(ApiError::RequestTooLarge { limit: self.limit });
        }
        if self.used().saturating_add(n) > self.limit {
            return Err(ApiError::BufferedBytes);
        }
        Ok(())
    }

    /// Takes `n` bytes if they fit beside what is held.
    fn take(&self, n: u64) -> bool {
        self.used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                used.checked_add(n).filter(|&total| total <= self.limit)
            })
            .is_ok()
    }

    fn give(&self, n: u64) {
        self.used.fetch_sub(n, Ordering::AcqRel);
    }
}

/// The bytes of the budget one body holds; dropping it gives them back.
#[derive(Debug)]
pub(crate) struct Hold {
    budget: Arc<Budget>,
    bytes: u64,
}

impl Hold {
    /// Holds nothing yet.
    pub(crate) fn new(budget: &Arc<Budget>) -> Self {
        Hold {
            budget: Arc::clone(budget),
            bytes: 0,
        }
    }

    /// Grows what this body holds to `total` bytes, or says why it cannot: `413` if `total`
    /// alone is over the bound, `429 queue_full` if other bodies hold the room. Nothing is
    /// taken when it fails.
    pub(crate) fn grow_to(&mut self, total: u64) -> Result<(), ApiError> {
        if total <= self.bytes {
            return Ok(());
        }
        let limit = self.budget.limit;
        if total > limit {
            return Err(ApiError::RequestTooLarge { limit });
        }
        if !self.budget.take(total - self.bytes) {
            return Err(ApiError::BufferedBytes);
        }
        self.bytes = total;
        Ok(())
    }

    /// The bytes held.
    #[cfg(test)]
    pub(crate) fn bytes(&self) -> u64 {
        self.bytes
    }
}

impl Drop for Hold {
    fn drop(&mut self) {
        if self.bytes > 0 {
            self.budget.give(self.bytes);
        }
    }
}

/// A request body read whole, holding its part of the budget until it is dropped.
#[derive(Debug, Default)]
pub(crate) struct RequestBody {
    bytes: Bytes,
    /// `None` for a body that holds nothing (empty).
    _hold: Option<Hold>,
}

impl RequestBody {
    /// `bytes`, holding `hold`.
    pub(crate) fn new(bytes: Bytes, hold: Hold) -> Self {
        RequestBody {
            bytes,
            _hold: Some(hold),
        }
    }
}

impl RequestBody {
    /// Other bytes in its place, still holding its part of the budget.
    pub(crate) fn with_bytes(self, bytes: Bytes) -> Self {
        RequestBody {
            bytes,
            _hold: self._hold,
        }
    }
}

impl From<Bytes> for RequestBody {
    /// A body that holds nothing of the budget (an empty one, or one in a test).
    fn from(bytes: Bytes) -> Self {
        RequestBody { bytes, _hold: None }
    }
}

impl std::ops::Deref for RequestBody {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        &self.bytes
    }
}

/// A body gathered piece by piece (its length unknown), its buffer's room taken from the
/// budget before it is allocated.
pub(crate) struct Gather {
    data: Vec<u8>,
    hold: Hold,
    /// The most its buffer grows to by doubling: the declared length, when there is one.
    cap: usize,
}

/// The least room a gathered body starts with.
const FIRST_ROOM: usize = 8 * 1024;

impl Gather {
    /// An empty body of unknown length on `budget`.
    pub(crate) fn new(budget: &Arc<Budget>) -> Self {
        Gather {
            data: Vec::new(),
            hold: Hold::new(budget),
            cap: usize::MAX,
        }
    }

    /// An empty body whose length is declared: refused at once when it does not fit now (413
    /// or 429, as [`Budget::fits_now`] says), else its buffer grows as its bytes arrive, to
    /// that length at the most. Nothing is taken yet.
    pub(crate) fn declared(budget: &Arc<Budget>, length: u64) -> Result<Self, ApiError> {
        budget.fits_now(length)?;
        Ok(Gather {
            cap: usize::try_from(length).unwrap_or(usize::MAX),
            ..Gather::new(budget)
        })
    }

    /// The bytes gathered so far.
    pub(crate) fn len(&self) -> usize {
        self.data.len()
    }

    /// Appends `piece`, growing the buffer (and what it holds) first if it has no room.
    pub(crate) fn push(&mut self, piece: &[u8]) -> Result<(), ApiError> {
        let needed = self.data.len() + piece.len();
        if needed > self.data.capacity() {
            let limit = usize::try_from(self.hold.budget.limit).unwrap_or(usize::MAX);
            let doubled = (self.data.capacity() * 2)
                .max(FIRST_ROOM)
                .min(limit)
                .min(self.cap);
            let room = if doubled > needed && self.hold.grow_to(doubled as u64).is_ok() {
                doubled
            } else {
                self.hold.grow_to(needed as u64)?;
                needed
            };
            self.data.reserve_exact(room - self.data.len());
        }
        self.data.extend_from_slice(piece);
        Ok(())
    }

    /// The body whole.
    pub(crate) fn finish(self) -> RequestBody {
        RequestBody::new(Bytes::from(self.data), self.hold)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn a_hold_takes_what_fits_and_gives_it_back_once() {
        let budget = Budget::new(100);
        let mut a = Hold::new(&budget);
        a.grow_to(60).unwrap();
        let mut b = Hold::new(&budget);
        assert_eq!(b.grow_to(41), Err(ApiError::BufferedBytes));
        assert_eq!(
            b.grow_to(101),
            Err(ApiError::RequestTooLarge { limit: 100 })
        );
        assert_eq!(b.bytes(), 0, "nothing taken by a refusal");
        b.grow_to(40).unwrap();
        assert_eq!(budget.used(), 100);
        a.grow_to(50).unwrap();
        assert_eq!(budget.used(), 100, "a hold never shrinks");
        drop(a);
        assert_eq!(budget.used(), 40);
        drop(b);
        assert_eq!(budget.used(), 0);
    }

    #[test]
    fn a_gathered_body_holds_its_buffer_and_no_more_than_twice_its_data() {
        let budget = Budget::new(1 << 20);
        let mut g = Gather::new(&budget);
        let piece = vec![7u8; 3000];
        for _ in 0..100 {
            g.push(&piece).unwrap();
            let held = g.hold.bytes();
            assert_eq!(held, g.data.capacity() as u64);
            assert!(held <= 2 * g.data.len() as u64 + FIRST_ROOM as u64);
            assert_eq!(budget.used(), held);
        }
        let body = g.finish();
        assert_eq!(body.len(), 300_000);
        assert!(body.iter().all(|&b| b == 7));
        drop(body);
        assert_eq!(budget.used(), 0);
    }

    #[test]
    fn a_declared_body_holds_what_arrived_not_what_it_declared() {
        let budget = Budget::new(100_000);
        let mut g = Gather::declared(&budget, 60_000).unwrap();
        assert_eq!(budget.used(), 0, "a declared length alone takes nothing");
        // Another declared body fits while the first has sent nothing.
        let other = Gather::declared(&budget, 90_000).unwrap();
        assert_eq!(
            Gather::declared(&budget, 100_001).err(),
            Some(ApiError::RequestTooLarge { limit: 100_000 })
        );
        g.push(&[1; 40_000]).unwrap();
        g.push(&[2; 20_000]).unwrap();
        // Doubling stops at the declared length.
        assert_eq!(budget.used(), 60_000);
        assert_eq!(
            Gather::declared(&budget, 50_000).err(),
            Some(ApiError::BufferedBytes),
            "refused while the room is held"
        );
        drop(other);
        let body = g.finish();
        assert_eq!(body.len(), 60_000);
        drop(body);
        assert_eq!(budget.used(), 0);
    }

    #[test]
    fn a_gathered_body_grows_to_just_what_it_needs_when_the_budget_is_short() {
        let budget = Budget::new(10_000);
        let mut other = Hold::new(&budget);
        other.grow_to(1_000).unwrap();
        let mut g = Gather::new(&budget);
        g.push(&[1; 8_000]).unwrap();
        // Doubling to 16,000 does not fit; just the 9,000 needed does.
        g.push(&[2; 1_000]).unwrap();
        assert_eq!(budget.used(), 10_000);
        assert_eq!(g.push(&[3; 1]), Err(ApiError::BufferedBytes));
        drop(other);
        assert_eq!(
            g.push(&[3; 2_000]),
            Err(ApiError::RequestTooLarge { limit: 10_000 })
        );
        drop(g);
        assert_eq!(budget.used(), 0);
    }
}
