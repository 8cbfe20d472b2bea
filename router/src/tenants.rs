//! The inference listener's tenants (DESIGN 4.10): the key table behind
//! [`capyctl_interfaces::tenants::TenantTable`], each tenant's rates and what it used.
//!
//! Decisions:
//! - Keys are kept only as SHA-256 digests. A request's key is digested once, the digest is
//!   looked up in a map of digests, and the digest found is compared again in constant time.
//!   A missing, malformed, unknown or almost-right key all take that same path (one digest,
//!   one lookup, one comparison; see the test `every_refused_key_takes_the_same_path`), and
//!   the lookup's time depends on the digest, which tells nothing about a key's bytes. A
//!   request without a well-formed header is digested as an empty key. A connection's next
//!   request with the key its last one was let in with is that tenant again without a second
//!   digest ([`KnownKey`]); a refused key always takes the whole path.
//! - Only `Authorization: Bearer <key>` counts (one such header); a key in the query string or
//!   another header is not looked at. The header is not forwarded to the engine.
//! - Rates are token buckets refilled continuously: `requests_per_minute` holds that many
//!   requests and refills at that rate per minute; `tokens_per_minute` likewise, charged after
//!   the answer with the engine's usage (so it may go below zero, and the tenant waits until
//!   it is above again). A request is admitted when the request bucket holds one and the
//!   token bucket is above zero; otherwise 429 `rate_limited` with `Retry-After` the seconds
//!   until both hold.
//! - [`Tenants::replace`] swaps the whole set at once. A tenant that keeps its name keeps its
//!   buckets and counters (a rotated key does not reset its rate); requests in flight keep the
//!   tenant they were admitted as.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::Duration;

use capyctl_interfaces::tenants::{Tenant, TenantTable};
use capyctl_spec::errors::ApiError;
use capyctl_spec::tenants::{self as rules, KeyAt, TenantView};
use http::HeaderMap;
use http::header::HeaderValue;
use sha2::{Digest, Sha256};
use tokio::time::Instant;

use crate::fast_hash::FastHash;

/// A key's SHA-256 digest.
type KeyDigest = [u8; 32];

/// One minute, the period of every rate.
const MINUTE: Duration = Duration::from_secs(60);

/// The router's table of tenants. Cheap to read: a request takes the current set with one
/// read lock and an `Arc` clone.
pub struct Tenants {
    current: RwLock<Arc<Set>>,
    /// Replaces, one at a time (the usage by name is carried over under it).
    replacing: Mutex<()>,
}

impl std::fmt::Debug for Tenants {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tenants")
            .field("tenants", &self.set().list.len())
            .finish()
    }
}

/// One set of tenants, as [`Tenants::replace`] installed it.
#[derive(Default)]
struct Set {
    /// NB: hashed with [`FastHash`] rather than SipHash: a digest is already evenly spread,
    /// and a client cannot choose one (only the key it digests), nor add to the map.
    by_digest: HashMap<KeyDigest, Arc<TenantEntry>, FastHash>,
    /// In the order given.
    list: Vec<Arc<TenantEntry>>,
    /// Keys are asked for even with no tenant in `list`: tenants are configured whose keys
    /// are all left out (on Kubernetes, `Tenant` objects whose Secrets are missing).
    required: bool,
}

impl Set {
    /// Whether every request needs a key.
    fn asks_keys(&self) -> bool {
        self.required || !self.list.is_empty()
    }
}

/// One tenant: its settings (fixed for this set) and its usage (kept across sets by name).
pub struct TenantEntry {
    name: Arc<str>,
    models: Option<Vec<String>>,
    requests_per_minute: Option<u64>,
    tokens_per_minute: Option<u64>,
    usage: Arc<Usage>,
}

impl std::fmt::Debug for TenantEntry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TenantEntry")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

/// What a tenant used: its buckets and counters.
#[derive(Default)]
struct Usage {
    buckets: Mutex<Buckets>,
    /// Answers by status.
    answers: Answers,
    /// Tokens counted from the engines' usage.
    tokens: AtomicU64,
    /// Requests of the tenant waiting for their admission now.
    waiting: AtomicI64,
}

/// A tenant's answers by status.
///
/// NB (cost): every answer of a tenant is counted; the statuses the listener answers with
/// most are counted by an atomic add each (no lock, no map), the others in a map.
#[derive(Default)]
struct Answers {
    /// Of each of [`COMMON_STATUSES`], in its order.
    common: [AtomicU64; COMMON_STATUSES.len()],
    other: Mutex<BTreeMap<u16, u64>>,
}

/// The statuses [`Answers`] counts without a lock.
const COMMON_STATUSES: [u16; 8] = [200, 400, 404, 408, 429, 499, 502, 503];

impl Answers {
    fn count(&self, status: u16) {
        match COMMON_STATUSES.iter().position(|&s| s == status) {
            Some(at) => {
                self.common[at].fetch_add(1, Ordering::Relaxed);
            }
            None => {
                *self
                    .other
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .entry(status)
                    .or_default() += 1;
            }
        }
    }

    /// Each status answered at least once, with how many times.
    fn by_status(&self) -> BTreeMap<u16, u64> {
        let mut all = self
            .other
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        for (status, n) in COMMON_STATUSES.iter().zip(&self.common) {
            let n = n.load(Ordering::Relaxed);
            if n > 0 {
                all.insert(*status, n);
            }
        }
        all
    }
}

#[derive(Default)]
struct Buckets {
    requests: Option<Bucket>,
    tokens: Option<Bucket>,
}

/// A token bucket of `capacity` per minute, refilled continuously.
#[derive(Debug, Clone, Copy)]
struct Bucket {
    capacity: f64,
    level: f64,
    at: Instant,
}

impl Bucket {
    fn full(capacity: u64, now: Instant) -> Self {
        Self {
            capacity: capacity as f64,
            level: capacity as f64,
            at: now,
        }
    }

    /// The same bucket with a new capacity (a replaced rate), its level kept within it.
    fn resized(mut self, capacity: u64, now: Instant) -> Self {
        self.refill(now);
        self.capacity = capacity as f64;
        self.level = self.level.min(self.capacity);
        self
    }

    fn refill(&mut self, now: Instant) {
        let elapsed = now.saturating_duration_since(self.at).as_secs_f64();
        self.level =
            (self.level + self.capacity * elapsed / MINUTE.as_secs_f64()).min(self.capacity);
        self.at = now;
    }

    /// How long until the level reaches `level` (zero if it has).
    fn until(&self, level: f64) -> Duration {
        if self.level >= level {
            return Duration::ZERO;
        }
        Duration::from_secs_f64((level - self.level) / self.capacity * MINUTE.as_secs_f64())
    }

    /// What is left, whole units.
    fn remaining(&self) -> u64 {
        self.level.max(0.0).floor() as u64
    }
}

/// The rate-limit headers' values of one tenant at one moment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RateHeaders {
    /// (limit, remaining, seconds until full) of the requests, when limited.
    pub requests: Option<(u64, u64, u64)>,
    /// The same of the tokens, when limited.
    pub tokens: Option<(u64, u64, u64)>,
}

impl RateHeaders {
    /// Each header, in the order they are written: its name, its number, and whether the
    /// number is seconds (written `Ns`): `x-ratelimit-limit-*`, `-remaining-*` and `-reset-*`
    /// of the requests, then of the tokens, those of a rate it has.
    pub fn each(&self, mut put: impl FnMut(&'static str, u64, bool)) {
        const NAMES: [[&str; 3]; 2] = [
            [
                "x-ratelimit-limit-requests",
                "x-ratelimit-remaining-requests",
                "x-ratelimit-reset-requests",
            ],
            [
                "x-ratelimit-limit-tokens",
                "x-ratelimit-remaining-tokens",
                "x-ratelimit-reset-tokens",
            ],
        ];
        for (names, values) in NAMES.iter().zip([self.requests, self.tokens]) {
            if let Some((limit, remaining, reset)) = values {
                put(names[0], limit, false);
                put(names[1], remaining, false);
                put(names[2], reset, true);
            }
        }
    }

    /// Adds the headers ([`RateHeaders::each`]) to `headers` (an answer given as an `http`
    /// response; the listener writes them straight into the answer's head).
    pub fn write(&self, headers: &mut HeaderMap) {
        self.each(|name, n, seconds| {
            let value = if seconds {
                HeaderValue::from_str(&format!("{n}s"))
            } else {
                Ok(HeaderValue::from(n))
            };
            if let Ok(value) = value {
                headers.insert(http::HeaderName::from_static(name), value);
            }
        });
    }
}

/// Seconds, rounded up (`Retry-After` and the resets: never 0 for a wait that is not over).
fn ceil_secs(d: Duration) -> u64 {
    let secs = d.as_secs();
    if d.subsec_nanos() > 0 { secs + 1 } else { secs }
}

impl TenantEntry {
    /// Its name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Its name, shared (what the coordinator's fair waiting takes turns by).
    pub fn name_arc(&self) -> Arc<str> {
        Arc::clone(&self.name)
    }

    /// Whether it may use the model `name` (before the model is resolved: a model it may not
    /// use is answered as an unknown one, after the same work).
    pub fn allows(&self, name: &str) -> bool {
        match &self.models {
            None => true,
            Some(patterns) => patterns.iter().any(|p| rules::glob_matches(p, name)),
        }
    }

    fn buckets(&self) -> std::sync::MutexGuard<'_, Buckets> {
        self.usage
            .buckets
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Takes one request from its rate at `now`: `Err` is the 429 to answer (nothing taken).
    pub fn admit(&self, now: Instant) -> Result<(), ApiError> {
        let mut b = self.buckets();
        let mut wait = (Duration::ZERO, "requests", 0);
        if let Some(r) = &mut b.requests {
            r.refill(now);
            let until = r.until(1.0);
            if until > wait.0 {
                wait = (until, "requests", r.capacity as u64);
            }
        }
        if let Some(t) = &mut b.tokens {
            t.refill(now);
            // Above zero: a fraction of a token is enough, so wait for the first whole one.
            let until = if t.level > 0.0 {
                Duration::ZERO
            } else {
                t.until(1.0)
            };
            if until > wait.0 {
                wait = (until, "tokens", t.capacity as u64);
            }
        }
        if wait.0 > Duration::ZERO {
            return Err(ApiError::RateLimited {
                tenant: self.name.to_string(),
                what: wait.1,
                limit: wait.2,
                retry_after: u32::try_from(ceil_secs(wait.0).max(1)).unwrap_or(u32::MAX),
            });
        }
        if let Some(r) = &mut b.requests {
            r.level -= 1.0;
        }
        Ok(())
    }

    /// Whether its tokens are limited (`tokens_per_minute`): only then is a streamed
    /// request asked for its usage.
    pub fn counts_tokens(&self) -> bool {
        self.tokens_per_minute.is_some()
    }

    /// Charges `tokens` (the engine's usage) at `now`.
    pub fn charge_tokens(&self, tokens: u64, now: Instant) {
        self.usage.tokens.fetch_add(tokens, Ordering::Relaxed);
        if let Some(t) = &mut self.buckets().tokens {
            t.refill(now);
            t.level -= tokens as f64;
        }
    }

    /// The rate-limit headers at `now`; `None` when it has no rate.
    pub fn rate_headers(&self, now: Instant) -> Option<RateHeaders> {
        let mut b = self.buckets();
        let read = |bucket: &mut Option<Bucket>| {
            bucket.as_mut().map(|x| {
                x.refill(now);
                (
                    x.capacity as u64,
                    x.remaining(),
                    ceil_secs(x.until(x.capacity)),
                )
            })
        };
        let headers = RateHeaders {
            requests: read(&mut b.requests),
            tokens: read(&mut b.tokens),
        };
        (headers.requests.is_some() || headers.tokens.is_some()).then_some(headers)
    }

    /// Counts an answer with `status`.
    pub fn answered(&self, status: u16) {
        self.usage.answers.count(status);
    }

    /// A request of the tenant begins waiting for its admission; ends with the guard.
    pub fn waiting(self: &Arc<Self>) -> Gauge {
        Gauge::up(Arc::clone(&self.usage), |u| &u.waiting)
    }
}

/// One count of a gauge of a tenant's usage, taken back when dropped.
pub struct Gauge {
    usage: Arc<Usage>,
    which: fn(&Usage) -> &AtomicI64,
}

impl Gauge {
    fn up(usage: Arc<Usage>, which: fn(&Usage) -> &AtomicI64) -> Self {
        which(&usage).fetch_add(1, Ordering::Relaxed);
        Self { usage, which }
    }
}

impl Drop for Gauge {
    fn drop(&mut self) {
        (self.which)(&self.usage).fetch_sub(1, Ordering::Relaxed);
    }
}

/// What a request's `Authorization` says.
#[derive(Debug)]
pub enum Auth {
    /// No tenant is configured: no key is asked for.
    Off,
    /// The key of this tenant.
    Tenant(Arc<TenantEntry>),
    /// Missing, malformed or unknown: 401 `unauthorized`.
    Refused,
}

/// One tenant as `GET /management/v1/tenants` and `capyctl tenants list` show it (never its
/// keys).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct TenantReport {
    /// Its name.
    pub name: String,
    /// Its model patterns; `None`: every model.
    pub models: Option<Vec<String>>,
    /// Its rate of requests per minute; `None`: not limited.
    pub requests_per_minute: Option<u64>,
    /// Its rate of tokens per minute; `None`: not limited.
    pub tokens_per_minute: Option<u64>,
    /// How many keys it has.
    pub keys: usize,
    /// Answers by HTTP status (as text, for JSON), since it was first configured.
    pub answers: BTreeMap<String, u64>,
    /// Tokens counted from the engines' usage.
    pub tokens: u64,
    /// Requests waiting for their admission now.
    pub waiting: i64,
    /// Requests it may still send now (of its rate), when limited.
    pub remaining_requests: Option<u64>,
    /// Tokens it may still use now, when limited.
    pub remaining_tokens: Option<u64>,
}

impl Default for Tenants {
    fn default() -> Self {
        Self::new()
    }
}

impl Tenants {
    /// A table with no tenant: no key is asked for.
    pub fn new() -> Self {
        Self {
            current: RwLock::new(Arc::new(Set::default())),
            replacing: Mutex::new(()),
        }
    }

    fn set(&self) -> Arc<Set> {
        Arc::clone(&self.current.read().unwrap_or_else(PoisonError::into_inner))
    }

    /// Whether any tenant is configured (then every request needs a key).
    pub fn enabled(&self) -> bool {
        self.set().asks_keys()
    }

    /// Checks `tenants` ([`capyctl_spec::tenants::check`]) and installs them; `Err` names
    /// what is wrong (as `tenants[1].keys[0]: ...`, never a key) and changes nothing. No
    /// tenant: no key is asked for.
    pub fn install(&self, tenants: Vec<Tenant>) -> Result<(), String> {
        self.install_requiring(tenants, false)
    }

    /// [`Tenants::install`], asking for keys even when `tenants` is empty if `required`
    /// ([`TenantTable::replace_requiring`]).
    pub fn install_requiring(&self, tenants: Vec<Tenant>, required: bool) -> Result<(), String> {
        let views: Vec<TenantView<'_>> = tenants
            .iter()
            .map(|t| TenantView {
                name: &t.name,
                keys: t
                    .keys
                    .iter()
                    .enumerate()
                    .map(|(index, key)| KeyAt {
                        list: "keys",
                        index,
                        key,
                    })
                    .collect(),
                models: t.models.as_deref(),
                requests_per_minute: t.rate.and_then(|r| r.requests_per_minute.map(u64::from)),
                tokens_per_minute: t.rate.and_then(|r| r.tokens_per_minute),
            })
            .collect();
        rules::check(&views).map_err(|(path, why)| {
            let mut at = capyctl_spec::documents::KeyPath::keys(&["tenants"]);
            at.0.extend(path.0);
            format!("{}: {why}", at.display().unwrap_or_default())
        })?;
        drop(views);
        let _one = self
            .replacing
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let old = self.set();
        let kept: HashMap<&str, &Arc<TenantEntry>> =
            old.list.iter().map(|t| (&*t.name, t)).collect();
        let now = Instant::now();
        let mut set = Set {
            required,
            ..Set::default()
        };
        for t in tenants {
            let rpm = t.rate.and_then(|r| r.requests_per_minute.map(u64::from));
            let tpm = t.rate.and_then(|r| r.tokens_per_minute);
            let usage = kept
                .get(t.name.as_str())
                .map_or_else(Arc::default, |e| Arc::clone(&e.usage));
            {
                let mut b = usage.buckets.lock().unwrap_or_else(PoisonError::into_inner);
                b.requests = rpm.map(|c| {
                    b.requests
                        .map_or(Bucket::full(c, now), |x| x.resized(c, now))
                });
                b.tokens =
                    tpm.map(|c| b.tokens.map_or(Bucket::full(c, now), |x| x.resized(c, now)));
            }
            let entry = Arc::new(TenantEntry {
                name: Arc::from(t.name.as_str()),
                models: t.models,
                requests_per_minute: rpm,
                tokens_per_minute: tpm,
                usage,
            });
            for key in &t.keys {
                set.by_digest
                    .insert(digest(key.as_bytes()), Arc::clone(&entry));
            }
            set.list.push(entry);
        }
        *self.current.write().unwrap_or_else(PoisonError::into_inner) = Arc::new(set);
        Ok(())
    }

    /// Who a request is, from its header lines (`name: value\r\n` each, as the listener keeps
    /// them): only one `Authorization: Bearer <key>` line counts.
    pub fn authenticate(&self, lines: &[u8]) -> Auth {
        self.authenticate_again(lines, &mut KnownKey::default())
    }

    /// [`Tenants::authenticate`] for the next request of a connection whose last request was
    /// let in with `known`: the same key of the same set is that tenant again, without a
    /// second digest (see [`KnownKey`]); `known` is then what this request was let in with.
    pub fn authenticate_again(&self, lines: &[u8], known: &mut KnownKey) -> Auth {
        self.authenticate_line(lines, None, known).0
    }

    /// [`Tenants::authenticate_again`], with where the one `Authorization` line is in `lines`
    /// (its bytes and its `\n`) when there is one: as `noted` says when given (the listener
    /// noted it as it gathered the lines), else found ([`bearer_line`]).
    fn authenticate_line(
        &self,
        lines: &[u8],
        noted: Option<&AuthorizationLines>,
        known: &mut KnownKey,
    ) -> (Auth, Option<std::ops::Range<usize>>) {
        let set = self.set();
        if !set.asks_keys() {
            return (Auth::Off, None);
        }
        let found = match noted {
            Some(noted) => noted.bearer(lines),
            None => bearer_line(lines),
        };
        let (given, line) = match found {
            Some((key, line)) => (key, Some(line)),
            None => (&[][..], None),
        };
        let auth = Self::tenant_of(&set, given, known);
        (auth, line)
    }

    /// Who a request whose head's lines are `lines` is, and those lines without its
    /// `Authorization` line when it is a tenant's (the key is not the engine's): a slice of
    /// `lines` when the line is first or last (nothing copied), else a copy.
    ///
    /// `noted`: where the listener found the `Authorization` lines as it gathered `lines`
    /// (`None`: not noted, they are looked for).
    ///
    /// NB (cost): the line is found once (noted by the listener, else by [`bearer_line`]),
    /// and cut out where it was found (a tenant's request has exactly one: the listener's
    /// lines are each `name: value\r\n`, and a second one refuses the key), rather than every
    /// line's name read again to find it ([`without_authorization`]).
    pub fn identify(
        &self,
        lines: &bytes::Bytes,
        noted: Option<&AuthorizationLines>,
        known: &mut KnownKey,
    ) -> (Auth, Option<bytes::Bytes>) {
        let (auth, line) = self.authenticate_line(lines, noted, known);
        let (Auth::Tenant(_), Some(line)) = (&auth, line) else {
            return (auth, None);
        };
        let rest = if line.start == 0 {
            lines.slice(line.end..)
        } else if line.end == lines.len() {
            lines.slice(..line.start)
        } else {
            bytes::Bytes::from([&lines[..line.start], &lines[line.end..]].concat())
        };
        (auth, Some(rest))
    }

    /// The tenant of the key `given` in `set`, `known` the key the connection was let in with.
    fn tenant_of(set: &Arc<Set>, given: &[u8], known: &mut KnownKey) -> Auth {
        if let Some(tenant) = known.of(set, given) {
            return Auth::Tenant(tenant);
        }
        match find(set, &digest(given)) {
            Some(tenant) => {
                known.learn(set, given, &tenant);
                Auth::Tenant(tenant)
            }
            None => {
                known.forget();
                Auth::Refused
            }
        }
    }

    /// Every tenant with its use now, in the order given.
    pub fn report(&self) -> Vec<TenantReport> {
        let set = self.set();
        let now = Instant::now();
        let mut keys: HashMap<&str, usize> = HashMap::new();
        for t in set.by_digest.values() {
            *keys.entry(&t.name).or_default() += 1;
        }
        set.list
            .iter()
            .map(|t| {
                let headers = t.rate_headers(now);
                TenantReport {
                    name: t.name.to_string(),
                    models: t.models.clone(),
                    requests_per_minute: t.requests_per_minute,
                    tokens_per_minute: t.tokens_per_minute,
                    keys: keys.get(&*t.name).copied().unwrap_or(0),
                    answers: t
                        .usage
                        .answers
                        .by_status()
                        .into_iter()
                        .map(|(s, n)| (s.to_string(), n))
                        .collect(),
                    tokens: t.usage.tokens.load(Ordering::Relaxed),
                    waiting: t.usage.waiting.load(Ordering::Relaxed),
                    remaining_requests: headers.and_then(|h| h.requests).map(|r| r.1),
                    remaining_tokens: headers.and_then(|h| h.tokens).map(|r| r.1),
                }
            })
            .collect()
    }
}

impl TenantTable for Tenants {
    fn replace_requiring(&self, tenants: Vec<Tenant>, keys_required: bool) -> Result<(), String> {
        self.install_requiring(tenants, keys_required)
    }
}

/// The key a connection's last request was let in with, and its tenant, so that a keep-alive
/// connection that sends the same `Authorization` again costs no second SHA-256 and lookup.
///
/// NB (keys): the key's bytes are kept for the connection's life (they came over it; they
/// are zeroed when it forgets them) and compared in constant time, over their length, with the
/// next request's; a different length is a different key. Only a key let in is known: a
/// refused key always takes the whole path (digest, lookup, comparison), so a 401 takes the
/// same time whatever the key, whether or not the connection had a valid one before. A set
/// replaced since (a rotation) is not the one it was let in by: the key is digested again.
#[derive(Default)]
pub struct KnownKey {
    /// The set it was found in (weak: an idle connection keeps no replaced set alive; its
    /// allocation, kept by this, is not reused for another set meanwhile).
    set: std::sync::Weak<Set>,
    key: Vec<u8>,
    tenant: Option<Arc<TenantEntry>>,
}

impl KnownKey {
    /// The tenant of `given` when it is the key known, of `set`.
    fn of(&self, set: &Arc<Set>, given: &[u8]) -> Option<Arc<TenantEntry>> {
        let tenant = self.tenant.as_ref()?;
        (std::ptr::eq(self.set.as_ptr(), Arc::as_ptr(set))
            && given.len() == self.key.len()
            && capyctl_spec::auth::constant_time_eq(&self.key, given))
        .then(|| Arc::clone(tenant))
    }

    fn learn(&mut self, set: &Arc<Set>, given: &[u8], tenant: &Arc<TenantEntry>) {
        self.forget();
        self.set = Arc::downgrade(set);
        self.key.extend_from_slice(given);
        self.tenant = Some(Arc::clone(tenant));
    }

    fn forget(&mut self) {
        self.key.fill(0);
        std::hint::black_box(&mut self.key);
        self.key.clear();
        self.tenant = None;
        self.set = std::sync::Weak::new();
    }
}

impl Drop for KnownKey {
    fn drop(&mut self) {
        self.forget();
    }
}

impl std::fmt::Debug for KnownKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KnownKey")
            .field("tenant", &self.tenant.as_ref().map(|t| &t.name))
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
thread_local! {
    /// The steps of the key check taken on this thread: (digests, lookups, comparisons).
    static STEPS: std::cell::Cell<(u32, u32, u32)> = const { std::cell::Cell::new((0, 0, 0)) };
}

fn digest(key: &[u8]) -> KeyDigest {
    #[cfg(test)]
    STEPS.with(|s| s.set((s.get().0 + 1, s.get().1, s.get().2)));
    Sha256::digest(key).into()
}

/// The tenant of `digest`: one lookup, and the digest found compared in constant time.
fn find(set: &Set, digest: &KeyDigest) -> Option<Arc<TenantEntry>> {
    #[cfg(test)]
    STEPS.with(|s| s.set((s.get().0, s.get().1 + 1, s.get().2 + 1)));
    let (stored, tenant) = set
        .by_digest
        .get_key_value(digest)
        .map_or((&[0u8; 32], None), |(k, v)| (k, Some(v)));
    let same = capyctl_spec::auth::constant_time_eq(stored, digest);
    tenant.filter(|_| same).cloned()
}

/// Where a request's `Authorization` lines are among its header lines (each
/// `name: value\r\n`), as the listener notes them while it gathers those lines: none, one (its
/// bytes and its `\r\n`), or more than one (no key is then taken: [`bearer_line`]'s rule).
///
/// NB (cost): finding the line again in the gathered lines (each line's end, and the name of
/// each that may be it) was about 550 instructions of every tenant's request (callgrind); the
/// listener compares each name's length as it writes the line, and the name itself only when
/// that is 13.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum AuthorizationLines {
    /// No `Authorization` line.
    #[default]
    None,
    /// One, at this range of the lines.
    One(std::ops::Range<usize>),
    /// More than one.
    Several,
}

impl AuthorizationLines {
    /// The next line, `name`'s, at `line` of the lines.
    ///
    /// NB (cost): every request's lines are noted, keys or not: the name is told by its length
    /// and two words of it, each byte's `0x20` bit set (a byte is a lowercase letter's or its
    /// uppercase's exactly when it then equals the lowercase one), not a byte at a time.
    #[inline]
    pub fn note(&mut self, name: &[u8], line: std::ops::Range<usize>) {
        const CASE: u64 = 0x2020_2020_2020_2020;
        const HEAD: u64 = u64::from_le_bytes(*b"authoriz");
        const TAIL: u64 = u64::from_le_bytes(*b"rization");
        let word = |w: Option<&[u8; 8]>| w.map(|w| u64::from_le_bytes(*w) | CASE);
        if name.len() == 13
            && word(name.first_chunk()) == Some(HEAD)
            && word(name.last_chunk()) == Some(TAIL)
        {
            *self = match self {
                Self::None => Self::One(line),
                _ => Self::Several,
            };
        }
    }

    /// What [`bearer_line`] finds in `lines`, from where the line was noted: its key, when it
    /// is the only such line and a bearer token, and the line.
    pub(crate) fn bearer<'l>(&self, lines: &'l [u8]) -> Option<(&'l [u8], std::ops::Range<usize>)> {
        let Self::One(at) = self else {
            return None;
        };
        let line = lines.get(at.clone())?;
        let line = line.strip_suffix(b"\n").unwrap_or(line);
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        let colon = memchr::memchr(b':', line)?;
        Some((
            capyctl_spec::auth::bearer(line[colon + 1..].trim_ascii())?,
            at.clone(),
        ))
    }
}

/// The key of the one `Authorization: Bearer <key>` line of `lines`, and where that line is
/// in `lines` (with its `\n`, when it has one); `None` when there is none, more than one, or
/// it is not a bearer token.
///
/// NB (cost): a line whose first byte is neither whitespace nor an `a` cannot be it (its name,
/// trimmed, begins with that byte) and is passed without looking for its `:`.
pub(crate) fn bearer_line(lines: &[u8]) -> Option<(&[u8], std::ops::Range<usize>)> {
    let mut found = None;
    let mut start = 0;
    for line in lines_of(lines) {
        let at = start;
        start += line.len() + 1;
        if line
            .first()
            .is_some_and(|&c| !c.is_ascii_whitespace() && !c.eq_ignore_ascii_case(&b'a'))
        {
            continue;
        }
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        let Some(colon) = memchr::memchr(b':', line) else {
            continue;
        };
        if !line[..colon]
            .trim_ascii()
            .eq_ignore_ascii_case(b"authorization")
        {
            continue;
        }
        if found.is_some() {
            return None;
        }
        found = Some((line[colon + 1..].trim_ascii(), at..start.min(lines.len())));
    }
    let (value, line) = found?;
    Some((capyctl_spec::auth::bearer(value)?, line))
}

/// The lines of `bytes` as `bytes.split(|&b| b == b'\n')` gives them (an empty one after a
/// last `\n`), found with `memchr` rather than byte by byte.
pub(crate) fn lines_of(bytes: &[u8]) -> impl Iterator<Item = &[u8]> {
    let mut start = 0;
    memchr::memchr_iter(b'\n', bytes)
        .chain(std::iter::once(bytes.len()))
        .map(move |end| {
            let line = &bytes[start..end];
            start = end + 1;
            line
        })
}

/// `lines` without its `Authorization` lines, every line's name read (what
/// [`Tenants::identify`] gives a tenant's request, held to it by a test).
#[cfg(test)]
fn without_authorization(lines: &bytes::Bytes) -> bytes::Bytes {
    let is_authorization = |line: &[u8]| {
        let name = line.split(|&b| b == b':').next().unwrap_or_default();
        name.trim_ascii().eq_ignore_ascii_case(b"authorization")
    };
    // The span from the first `Authorization` line to the last; `split`: others between.
    let mut span: Option<(usize, usize)> = None;
    let (mut gap, mut split) = (false, false);
    let mut at = 0;
    for line in lines.split_inclusive(|&b| b == b'\n') {
        let end = at + line.len();
        if is_authorization(line) {
            split |= gap;
            gap = false;
            span = Some(span.map_or((at, end), |(start, _)| (start, end)));
        } else if span.is_some() {
            gap = true;
        }
        at = end;
    }
    match span {
        None => return lines.clone(),
        Some((0, end)) if !split => return lines.slice(end..),
        Some((start, end)) if !split && end == lines.len() => return lines.slice(..start),
        Some(_) => {}
    }
    let mut out = Vec::with_capacity(lines.len());
    for line in lines.split_inclusive(|&b| b == b'\n') {
        if !is_authorization(line) {
            out.extend_from_slice(line);
        }
    }
    bytes::Bytes::from(out)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use capyctl_interfaces::tenants::TenantRate;

    fn tenant(name: &str, keys: &[&str], rpm: Option<u32>, tpm: Option<u64>) -> Tenant {
        Tenant {
            name: name.into(),
            keys: keys.iter().map(|k| (*k).to_string()).collect(),
            models: Some(vec!["chat-*".into(), "bot".into()]),
            rate: Some(TenantRate {
                requests_per_minute: rpm,
                tokens_per_minute: tpm,
            }),
        }
    }

    fn bearer(key: &str) -> Vec<u8> {
        format!("content-type: application/json\r\nauthorization: Bearer {key}\r\n").into_bytes()
    }

    fn who(t: &Tenants, lines: &[u8]) -> Option<String> {
        match t.authenticate(lines) {
            Auth::Tenant(e) => Some(e.name().to_string()),
            Auth::Refused => None,
            Auth::Off => Some("<off>".into()),
        }
    }

    #[test]
    fn only_one_bearer_authorization_header_counts() {
        let t = Tenants::new();
        assert_eq!(who(&t, b""), Some("<off>".into()));
        t.replace(vec![tenant("a", &["sk-a"], None, None)]).unwrap();
        assert_eq!(who(&t, &bearer("sk-a")), Some("a".into()));
        assert_eq!(
            who(&t, b"Authorization:bearer   sk-a  \r\n"),
            Some("a".into())
        );
        for refused in [
            &b""[..],
            b"x-api-key: sk-a\r\n",
            b"api-key: Bearer sk-a\r\n",
            b"authorization: sk-a\r\n",
            b"authorization: Basic sk-a\r\n",
            b"authorization: Bearersk-a\r\n",
            b"authorization: Bearer sk-b\r\n",
            b"authorization: Bearer sk-a\r\nauthorization: Bearer sk-a\r\n",
        ] {
            assert_eq!(
                who(&t, refused),
                None,
                "{}",
                String::from_utf8_lossy(refused)
            );
        }
        // An empty set turns keys off again.
        t.replace(Vec::new()).unwrap();
        assert_eq!(who(&t, b""), Some("<off>".into()));
        assert!(!t.enabled());
    }

    /// Tenants configured whose keys are all left out (a Kubernetes `Tenant` whose Secret is
    /// missing): every request needs a key still, and none is accepted; the listener never
    /// falls open.
    /// A tenant's request loses its `Authorization` line wherever it is, and nothing else;
    /// a request refused keeps its lines.
    #[test]
    fn identify_cuts_out_the_authorization_line_wherever_it_is() {
        let t = Tenants::new();
        t.install(vec![tenant("a", &["k1"], None, None)]).unwrap();
        let others = [
            "content-type: application/json\r\n",
            "x-a:1\r\n",
            "accept: */*\r\n",
        ];
        for key in ["k1", "k2"] {
            for at in 0..=others.len() {
                let mut lines: Vec<String> = others.iter().map(|l| (*l).to_string()).collect();
                lines.insert(at, format!("Authorization:  Bearer {key} \r\n"));
                let lines = bytes::Bytes::from(lines.concat());
                let (auth, rest) = t.identify(&lines, None, &mut KnownKey::default());
                if key == "k1" {
                    assert!(matches!(auth, Auth::Tenant(_)), "{at}");
                    let rest = rest.unwrap();
                    assert_eq!(rest, without_authorization(&lines), "{at}");
                    assert_eq!(rest, others.concat().as_bytes(), "{at}");
                } else {
                    assert!(matches!(auth, Auth::Refused), "{at}");
                    assert!(rest.is_none());
                }
            }
        }
        // The last line without its CRLF, as a oneshot request's may be.
        let lines = bytes::Bytes::from_static(b"x-a: 1\r\nauthorization: Bearer k1");
        let (_, rest) = t.identify(&lines, None, &mut KnownKey::default());
        assert_eq!(rest.unwrap(), &b"x-a: 1\r\n"[..]);
    }

    /// A name is noted as an `Authorization` line's exactly when it is `authorization` in any
    /// case: every byte at every place of it, and every length around it.
    #[test]
    fn a_name_is_noted_as_authorization_as_a_case_blind_comparison_tells() {
        let noted = |name: &[u8]| {
            let mut lines = AuthorizationLines::None;
            lines.note(name, 0..1);
            lines == AuthorizationLines::One(0..1)
        };
        let mut names = vec![b"Authorization".to_vec(), b"AUTHORIZATION".to_vec()];
        for at in 0..13 {
            for byte in 0..=255u8 {
                let mut name = b"authorization".to_vec();
                name[at] = byte;
                names.push(name);
            }
        }
        for len in 0..20 {
            names.push(b"authorizationauthorization"[..len].to_vec());
        }
        for name in &names {
            assert_eq!(
                noted(name),
                name.eq_ignore_ascii_case(b"authorization"),
                "{name:?}"
            );
        }
        // A second one: several, whatever came first.
        let mut lines = AuthorizationLines::None;
        lines.note(b"authorization", 0..5);
        lines.note(b"accept", 5..9);
        assert_eq!(lines, AuthorizationLines::One(0..5));
        lines.note(b"AUTHORIZATION", 9..20);
        assert_eq!(lines, AuthorizationLines::Several);
    }

    /// The `Authorization` line is found as reading every line's name finds it, whatever the
    /// lines around it and however its name is written.
    #[test]
    fn the_authorization_line_is_found_as_every_names_reading_finds_it() {
        let lines = [
            "Authorization: Bearer k1\r\n",
            " authorization : Bearer k1\r\n",
            "\tAUTHORIZATION:Bearer k1\r\n",
            "authorizatio: Bearer k1\r\n",
            "aauthorization: Bearer k1\r\n",
            "Accept: */*\r\n",
            "a\r\n",
            ":x\r\n",
            "x-authorization: Bearer k1\r\n",
            "host: h\r\n",
            "\r\n",
        ];
        let is_authorization = |line: &str| {
            line.split_once(':')
                .is_some_and(|(name, _)| name.trim_ascii().eq_ignore_ascii_case("authorization"))
        };
        let mut found = 0;
        for a in lines {
            for b in lines {
                let head = format!("{a}{b}");
                let expected = match (is_authorization(a), is_authorization(b)) {
                    (true, false) => Some((b"k1".as_slice(), 0..a.len())),
                    (false, true) => Some((b"k1".as_slice(), a.len()..head.len())),
                    _ => None,
                };
                assert_eq!(bearer_line(head.as_bytes()), expected, "{head:?}");
                found += usize::from(expected.is_some());
            }
        }
        assert!(found > lines.len(), "{found}");
    }

    #[test]
    fn keys_required_with_no_tenant_refuses_every_request() {
        let t = Tenants::new();
        t.replace_requiring(vec![tenant("a", &["sk-a"], None, None)], true)
            .unwrap();
        assert_eq!(who(&t, &bearer("sk-a")), Some("a".into()));
        t.replace_requiring(Vec::new(), true).unwrap();
        assert!(t.enabled());
        for lines in [&b""[..], &bearer("sk-a"), &bearer("sk-b")] {
            assert_eq!(who(&t, lines), None, "{}", String::from_utf8_lossy(lines));
        }
        // The Tenant objects gone: no key asked for.
        t.replace_requiring(Vec::new(), false).unwrap();
        assert_eq!(who(&t, b""), Some("<off>".into()));
    }

    #[test]
    fn every_refused_key_takes_the_same_path() {
        let t = Tenants::new();
        t.replace(vec![tenant("a", &["sk-aaaaaaaa"], None, None)])
            .unwrap();
        let steps = |lines: &[u8]| {
            STEPS.with(|s| s.set((0, 0, 0)));
            let refused = matches!(t.authenticate(lines), Auth::Refused);
            (refused, STEPS.with(std::cell::Cell::get))
        };
        let wrong = steps(&bearer("sk-aaaaaaab"));
        let unknown = steps(&bearer("zz-unknown!"));
        let missing = steps(b"");
        let other_header = steps(b"x-api-key: sk-aaaaaaaa\r\n");
        assert_eq!(wrong, (true, (1, 1, 1)));
        assert_eq!(unknown, wrong);
        assert_eq!(missing, wrong);
        assert_eq!(other_header, wrong);
        // The right key: the same steps, found.
        assert_eq!(steps(&bearer("sk-aaaaaaaa")), (false, (1, 1, 1)));
    }

    /// A connection's next request with the same key: no second digest; any other key, or a
    /// set replaced meanwhile: the whole path again.
    #[test]
    fn a_connection_sending_its_key_again_is_not_digested_again() {
        let t = Tenants::new();
        t.replace(vec![
            tenant("a", &["sk-aaaaaaaa"], None, None),
            tenant("b", &["sk-bbbbbbbb"], None, None),
        ])
        .unwrap();
        let mut known = KnownKey::default();
        let mut steps = |lines: &[u8]| {
            STEPS.with(|s| s.set((0, 0, 0)));
            let who = match t.authenticate_again(lines, &mut known) {
                Auth::Tenant(e) => Some(e.name().to_string()),
                _ => None,
            };
            (who, STEPS.with(std::cell::Cell::get))
        };
        let a = Some("a".to_string());
        assert_eq!(steps(&bearer("sk-aaaaaaaa")), (a.clone(), (1, 1, 1)));
        assert_eq!(steps(&bearer("sk-aaaaaaaa")), (a.clone(), (0, 0, 0)));
        assert_eq!(
            steps(b"x-a: 1\r\nauthorization: Bearer sk-aaaaaaaa\r\n"),
            (a.clone(), (0, 0, 0))
        );
        // Another tenant's key, a wrong one of the same length, none: the whole path.
        assert_eq!(steps(&bearer("sk-bbbbbbbb")), (Some("b".into()), (1, 1, 1)));
        assert_eq!(steps(&bearer("sk-aaaaaaab")), (None, (1, 1, 1)));
        assert_eq!(steps(&bearer("sk-aaaaaaaa")), (a.clone(), (1, 1, 1)));
        assert_eq!(steps(b""), (None, (1, 1, 1)));
        // A refused key forgot the known one.
        assert_eq!(steps(&bearer("sk-aaaaaaaa")), (a.clone(), (1, 1, 1)));
        // A set replaced: digested again, even when it keeps the key; a key rotated away is
        // refused at once, also on the connection that used it.
        t.replace(vec![tenant("a", &["sk-aaaaaaaa"], None, None)])
            .unwrap();
        assert_eq!(steps(&bearer("sk-aaaaaaaa")), (a.clone(), (1, 1, 1)));
        t.replace(vec![tenant("a", &["sk-a2a2a2a2"], None, None)])
            .unwrap();
        assert_eq!(steps(&bearer("sk-aaaaaaaa")), (None, (1, 1, 1)));
    }

    #[test]
    fn a_bad_set_changes_nothing_and_names_the_place() {
        let t = Tenants::new();
        t.replace(vec![tenant("a", &["sk-a"], None, None)]).unwrap();
        let e = t
            .replace(vec![
                tenant("a", &["sk-new"], None, None),
                tenant("b", &["sk-new"], None, None),
            ])
            .unwrap_err();
        assert!(
            e.starts_with("tenants[1].keys[0]: this key is already a key of tenant a"),
            "{e}"
        );
        assert!(!e.contains("sk-new"));
        assert_eq!(who(&t, &bearer("sk-a")), Some("a".into()));
        let e = t
            .replace(vec![tenant("a", &["sk-a"], Some(0), None)])
            .unwrap_err();
        assert!(
            e.starts_with("tenants[0].rate.requests_per_minute: 0 is out of range"),
            "{e}"
        );
    }

    #[test]
    fn models_are_names_or_globs() {
        let t = Tenants::new();
        t.replace(vec![tenant("a", &["sk-a"], None, None)]).unwrap();
        let Auth::Tenant(a) = t.authenticate(&bearer("sk-a")) else {
            panic!("a");
        };
        assert!(a.allows("chat-1"));
        assert!(a.allows("bot"));
        assert!(!a.allows("bots"));
        assert!(!a.allows("prod-model"));
    }

    #[tokio::test(start_paused = true)]
    async fn the_request_rate_refills_over_the_minute() {
        let t = Tenants::new();
        t.replace(vec![tenant("a", &["sk-a"], Some(6), None)])
            .unwrap();
        let Auth::Tenant(a) = t.authenticate(&bearer("sk-a")) else {
            panic!("a");
        };
        for _ in 0..6 {
            a.admit(Instant::now()).unwrap();
        }
        let h = a.rate_headers(Instant::now()).unwrap();
        // Empty: full again in a minute.
        assert_eq!(h.requests, Some((6, 0, 60)));
        let Err(ApiError::RateLimited {
            what, retry_after, ..
        }) = a.admit(Instant::now())
        else {
            panic!("limited");
        };
        // One request comes back every 10 s.
        assert_eq!((what, retry_after), ("requests", 10));
        tokio::time::advance(Duration::from_secs(9)).await;
        let Err(ApiError::RateLimited { retry_after, .. }) = a.admit(Instant::now()) else {
            panic!("limited");
        };
        assert_eq!(retry_after, 1);
        tokio::time::advance(Duration::from_secs(1)).await;
        a.admit(Instant::now()).unwrap();
        // A rotation keeps the bucket: the new key is still at the same rate's bottom.
        t.replace(vec![tenant("a", &["sk-a2"], Some(6), None)])
            .unwrap();
        let Auth::Tenant(a2) = t.authenticate(&bearer("sk-a2")) else {
            panic!("a2");
        };
        assert!(a2.admit(Instant::now()).is_err());
        assert!(matches!(t.authenticate(&bearer("sk-a")), Auth::Refused));
        tokio::time::advance(Duration::from_secs(60)).await;
        assert_eq!(
            a2.rate_headers(Instant::now()).unwrap().requests,
            Some((6, 6, 0))
        );
    }

    #[tokio::test(start_paused = true)]
    async fn tokens_are_charged_after_the_answer_and_the_tenant_waits_until_above_zero() {
        let t = Tenants::new();
        t.replace(vec![tenant("a", &["sk-a"], None, Some(600))])
            .unwrap();
        let Auth::Tenant(a) = t.authenticate(&bearer("sk-a")) else {
            panic!("a");
        };
        a.admit(Instant::now()).unwrap();
        // 900 tokens: 300 below zero; 10 tokens a second come back, so 31 s until one is there.
        a.charge_tokens(900, Instant::now());
        let Err(ApiError::RateLimited {
            what, retry_after, ..
        }) = a.admit(Instant::now())
        else {
            panic!("limited");
        };
        assert_eq!((what, retry_after), ("tokens", 31));
        let h = a.rate_headers(Instant::now()).unwrap();
        assert_eq!(h.tokens, Some((600, 0, 90)));
        assert_eq!(h.requests, None);
        tokio::time::advance(Duration::from_secs(31)).await;
        a.admit(Instant::now()).unwrap();
        assert_eq!(t.report()[0].tokens, 900);
        let mut headers = HeaderMap::new();
        a.rate_headers(Instant::now()).unwrap().write(&mut headers);
        assert_eq!(headers["x-ratelimit-limit-tokens"], "600");
        assert_eq!(headers["x-ratelimit-remaining-tokens"], "10");
        assert!(!headers.contains_key("x-ratelimit-limit-requests"));
    }

    #[test]
    fn lines_are_split_as_split_does() {
        for bytes in [
            &b""[..],
            b"\n",
            b"\n\n",
            b"a",
            b"a\n",
            b"data: x\r\n\r\n",
            b"a\nb\n\nc",
        ] {
            let split: Vec<&[u8]> = bytes.split(|&b| b == b'\n').collect();
            assert_eq!(lines_of(bytes).collect::<Vec<_>>(), split);
        }
    }

    #[test]
    fn the_authorization_line_is_not_forwarded() {
        let cases: [(&[u8], &str); 6] = [
            (
                b"content-type: application/json\r\nAuthorization: Bearer sk\r\nx-a: 1\r\n",
                "content-type: application/json\r\nx-a: 1\r\n",
            ),
            (b"authorization: Bearer sk\r\nx-a: 1\r\n", "x-a: 1\r\n"),
            (b"x-a: 1\r\nauthorization: Bearer sk\r\n", "x-a: 1\r\n"),
            (
                b"authorization: a\r\nx-a: 1\r\nauthorization: b\r\n",
                "x-a: 1\r\n",
            ),
            (
                b"x-a: 1\r\nAUTHORIZATION : a\r\nauthorization: b\r\n",
                "x-a: 1\r\n",
            ),
            (
                b"x-a: 1\r\nx-authorization: a\r\n",
                "x-a: 1\r\nx-authorization: a\r\n",
            ),
        ];
        for (lines, forwarded) in cases {
            let lines = bytes::Bytes::from_static(lines);
            assert_eq!(without_authorization(&lines), forwarded);
        }
    }
}
