//! The recent requests: a bounded ring of the last [`DEFAULT_CAPACITY`] requests that named a
//! model, each written once when it ends, for `GET /management/v1/switches/trace` (`capyctl
//! switches --export-trace`): a trace `capyctl simulate` can replay, with what each request
//! really waited.
//!
//! NB (cost on the request path): an append takes a ticket (one atomic add) and writes its own
//! slot under that slot's mutex; two appends contend only when they are a whole ring apart, so
//! the mutex is uncontended in practice (no shared lock, no allocation beyond the model name's
//! copy). A read copies every slot, one lock at a time, and sorts by ticket: it is the rare
//! side.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::Serialize;

use capyctl_interfaces::router::RequestEvent;

/// How many requests the ring keeps by default.
pub const DEFAULT_CAPACITY: usize = 10_000;

/// One ended request, as the ring keeps it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecentRequest {
    /// Its ticket: the order of the ends.
    pub seq: u64,
    /// The body's `model`.
    pub model: String,
    /// When it arrived (asked for its admission), in Unix milliseconds: its end less its
    /// service and its wait.
    pub arrived_ms: u64,
    /// How long it waited for its admission.
    pub waited: Duration,
    /// From its admission (its dispatch to the engine) to its end; zero if it was never
    /// admitted.
    pub served: Duration,
    /// The status sent.
    pub status: u16,
    /// Why it ended abnormally (see [`RequestEvent::code`]); `None` for a normal end.
    pub code: Option<&'static str>,
}

/// The ring (see the module doc).
pub struct RecentRequests {
    slots: Box<[Mutex<Option<RecentRequest>>]>,
    next: AtomicU64,
}

impl std::fmt::Debug for RecentRequests {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RecentRequests")
            .field("capacity", &self.slots.len())
            .field("recorded", &self.next.load(Ordering::Relaxed))
            .finish()
    }
}

impl Default for RecentRequests {
    fn default() -> Self {
        Self::new(DEFAULT_CAPACITY)
    }
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

impl RecentRequests {
    /// A ring keeping the last `capacity` requests (at least one).
    pub fn new(capacity: usize) -> Self {
        Self {
            slots: (0..capacity.max(1)).map(|_| Mutex::new(None)).collect(),
            next: AtomicU64::new(0),
        }
    }

    /// Records one ended request; one that named no model (a bad body, another route) is not
    /// kept: a trace could not replay it.
    pub fn record(&self, event: &RequestEvent) {
        let Some(model) = &event.model else {
            return;
        };
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default();
        let arrived = now
            .saturating_sub(event.served)
            .saturating_sub(event.waited);
        let seq = self.next.fetch_add(1, Ordering::Relaxed);
        let slot = &self.slots[(seq % self.slots.len() as u64) as usize];
        let entry = RecentRequest {
            seq,
            model: model.clone(),
            arrived_ms: millis(arrived),
            waited: event.waited,
            served: event.served,
            status: event.status,
            code: event.code,
        };
        let mut slot = slot.lock().unwrap_or_else(PoisonError::into_inner);
        // A slower writer of an older ticket never overwrites a newer one.
        if slot.as_ref().is_none_or(|old| old.seq < seq) {
            *slot = Some(entry);
        }
    }

    /// The requests kept, in order of arrival.
    pub fn snapshot(&self) -> Vec<RecentRequest> {
        let mut all: Vec<RecentRequest> = self
            .slots
            .iter()
            .filter_map(|s| s.lock().unwrap_or_else(PoisonError::into_inner).clone())
            .collect();
        all.sort_by_key(|r| (r.arrived_ms, r.seq));
        all
    }

    /// The requests kept as a trace, one JSON object a line (see [`TraceLine`]), `at_ms` from
    /// the first one's arrival.
    pub fn trace_lines(&self) -> String {
        let all = self.snapshot();
        let first = all.first().map_or(0, |r| r.arrived_ms);
        let mut out = String::with_capacity(all.len() * 128);
        for r in &all {
            let line = TraceLine {
                at_ms: r.arrived_ms - first,
                model: &r.model,
                duration_ms: millis(r.served),
                waited_ms: millis(r.waited),
                outcome: r.code.unwrap_or("ok"),
                status: r.status,
                arrived_ms: r.arrived_ms,
            };
            if let Ok(text) = serde_json::to_string(&line) {
                out.push_str(&text);
                out.push('\n');
            }
        }
        out
    }
}

/// One line of an exported trace: what `capyctl simulate --trace` reads (`at_ms`, `model`,
/// `duration_ms`), and what was measured (`waited_ms`, `outcome`, `status`, `arrived_ms`),
/// which the simulation ignores.
#[derive(Debug, Serialize)]
pub struct TraceLine<'a> {
    /// From the trace's first arrival, in milliseconds.
    pub at_ms: u64,
    /// The body's `model`.
    pub model: &'a str,
    /// From its admission to its end, in milliseconds (0 if never admitted).
    pub duration_ms: u64,
    /// How long it waited for its admission, in milliseconds.
    pub waited_ms: u64,
    /// `ok`, or the error's code.
    pub outcome: &'a str,
    /// The status sent.
    pub status: u16,
    /// When it arrived, in Unix milliseconds.
    pub arrived_ms: u64,
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn event(model: Option<&str>, waited_ms: u64, served_ms: u64) -> RequestEvent {
        RequestEvent {
            deployment_id: Some("01K".into()),
            model: model.map(str::to_string),
            status: 200,
            code: None,
            waited: Duration::from_millis(waited_ms),
            served: Duration::from_millis(served_ms),
            streamed: false,
        }
    }

    #[test]
    fn the_ring_keeps_the_last_requests_in_order_of_arrival() {
        let ring = RecentRequests::new(3);
        ring.record(&event(None, 0, 0));
        for i in 0..5u64 {
            // Later requests waited less: arrivals are in the order recorded (or equal).
            ring.record(&event(Some(&format!("m{i}")), 0, 0));
        }
        let kept = ring.snapshot();
        let models: Vec<&str> = kept.iter().map(|r| r.model.as_str()).collect();
        assert_eq!(models, ["m2", "m3", "m4"]);
        assert_eq!(kept[0].seq, 2);
    }

    #[test]
    fn a_trace_line_says_when_it_arrived_how_long_it_waited_and_ran() {
        let ring = RecentRequests::new(10);
        ring.record(&event(Some("a"), 5_000, 1_000));
        let mut late = event(Some("b"), 0, 200);
        late.status = 503;
        late.code = Some("unavailable");
        ring.record(&late);
        let text = ring.trace_lines();
        let lines: Vec<serde_json::Value> = text
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(lines.len(), 2);
        assert_eq!(lines[0]["model"], "a");
        assert_eq!(lines[0]["at_ms"], 0);
        assert_eq!(lines[0]["waited_ms"], 5_000);
        assert_eq!(lines[0]["duration_ms"], 1_000);
        assert_eq!(lines[0]["outcome"], "ok");
        assert_eq!(lines[1]["model"], "b");
        assert_eq!(lines[1]["outcome"], "unavailable");
        assert_eq!(lines[1]["status"], 503);
        // b arrived about 5.8 s after a (it ended right after a ended, and ran 0.2 s).
        let at = lines[1]["at_ms"].as_u64().unwrap();
        assert!((5_700..=5_900).contains(&at), "{at}");
    }

    #[test]
    fn appends_from_many_threads_are_all_kept() {
        let ring = std::sync::Arc::new(RecentRequests::new(1000));
        let threads: Vec<_> = (0..4)
            .map(|t| {
                let ring = ring.clone();
                std::thread::spawn(move || {
                    for i in 0..200 {
                        ring.record(&event(Some(&format!("t{t}-{i}")), 0, 0));
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        let kept = ring.snapshot();
        assert_eq!(kept.len(), 800);
        let mut seqs: Vec<u64> = kept.iter().map(|r| r.seq).collect();
        seqs.sort_unstable();
        assert_eq!(seqs, (0..800).collect::<Vec<_>>());
    }
}
