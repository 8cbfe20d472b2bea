//! Asking the engine for a streamed answer's usage on a tenant's behalf, and taking that usage
//! back out of the stream, so that the client receives the bytes it would have without it.
//!
//! NB (design): only for a tenant with `tokens_per_minute` and a streamed request that did not
//! ask for usage itself ([`ask_usage`]): its forwarded body gets
//! `stream_options.include_usage = true` (and loses a `continuous_usage_stats`, which had no
//! effect without `include_usage`, so that the engine does not put usage on every chunk).
//! The engine then ends the stream with one chunk whose `choices` are empty and which carries
//! the `usage`; [`Strip`] watches every event of the answer as it passes and drops that one.
//! Cost: the events whose bytes show no finish reason and no `usage` key with a value (every
//! event but those two) pass as runs, slices of the frame that brought them: a search by a
//! pair of bytes over a frame finds where the next event that may matter begins
//! ([`Strip::plain_events`], [`first_mark`]); that event is found and told from its bytes
//! ([`plainly_other`]) and read by its keys alone ([`read`]). A request of one choice (no `n`:
//! [`single_choice`]) has one `"finish_reason":` in each chunk; its frames are not searched
//! but read event by event where the answer's own scanner found them to end (it measures
//! every event against `max_piece` anyway: [`Strip::known_end`]): until its finish each token
//! chunk told by a comparison where the instance's token chunks have their
//! `"finish_reason":null` ([`Strip::token_run`]), after it each event read (the usage chunk,
//! `[DONE]`); the frames whose ends it does not give (the start held before the first
//! output, a frame cut short, one of more than 512 events) are searched as before.
//! - **The engines' writing, not any JSON** (a product decision, for the cost of a tenant's
//!   streamed request: issue 32 asks for the engine's usage on streamed requests and for under
//!   5% more router CPU per request with keys): the two chunks are found and read as vLLM, SGLang and TensorFold write
//!   them, compact, and where they write them.
//!   - A finishing chunk is one with `"finish_reason":"` (a string right after the key, no
//!     space) and no `"system_fingerprint"` key.
//!   - The usage chunk is one with a `"usage"` key whose value is not `null` (spaces allowed)
//!     and an empty `"choices"` array, **after a finish reason**: the engines send it once
//!     every choice has finished, so a frame of token chunks is searched once, for a finish
//!     reason, not twice. A usage chunk before any finish reason passes to the client, and
//!     the request's tokens are not counted.
//!   - Neither chunk is checked as JSON whole, and a key written with a `\u` escape is not the
//!     key: an invalid chunk with those keys is taken as what its keys say.
//!   - So an engine that spaced its finish reasons (none of the three does) would get no
//!     fingerprint back on its finishing chunks and its usage chunk passed to the client. A
//!     stream that ends with `[DONE]` and no usage chunk taken out is logged as a warning,
//!     once per engine instance ([`Slot::missed_usage`]), so that such an engine is seen.
//!
//!   The strip before this read both chunks whole as `serde_json` would, looked for the usage
//!   chunk anywhere and stopped at every `f` and `\` of the stream: what a tenant's streamed
//!   request cost the listener beyond a plain one went from +21.2k instructions to +14.5k
//!   (callgrind, 16 tokens; README Benchmarks).
//! - What vLLM 0.32 also changes (`chat_completion/serving.py`, `completion/serving.py`): with
//!   `include_usage` it puts `system_fingerprint` on the usage chunk instead of on each chunk
//!   that carries a `finish_reason` (one per choice: `n` of them, among the other choices'
//!   chunks when `n` > 1). The fingerprint is fixed for an engine process (vLLM builds it once,
//!   at start, from its version and configuration), so [`Fingerprints`] keeps the one each
//!   instance (its [`InstanceKey`], new at every fresh start) put on its last usage chunk, and
//!   [`Strip`] writes it last into every finishing chunk without one as it passes (where vLLM
//!   writes the field; nothing waits). Until an instance's is known (its first such stream),
//!   the strip holds the events from the first finishing chunk on until the usage chunk, whose
//!   fingerprint is then written into each finishing chunk held; `[DONE]` or the end of the
//!   answer before any usage chunk releases them unchanged. An instance whose usage chunk has
//!   no fingerprint is known to have none: its chunks pass unchanged.
//! - An event split over frames is held until its end (an SSE client reads nothing of an event
//!   before its blank line). What is held is bounded by `max_piece` (the stream is cut past an
//!   event that long anyway); past the bound the strip gives up and passes everything on
//!   unchanged (with `n` > 1 and choices that finish far apart, on an instance's first stream,
//!   its finishing chunks then lack the fingerprint).

use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, LazyLock, Mutex, PoisonError};

use bytes::{Buf, Bytes, BytesMut};
use capyctl_interfaces::router::InstanceKey;
use memchr::memmem::FinderRev;
use serde::Deserialize;
use serde_json::{Map, Value};

use super::sse::{Data, EventScanner, data_of};
use crate::fast_hash::FastHash;

/// The forwarded body of a streamed request asking for its usage, or `None` when the request
/// is not streamed, already asks for usage, or is not an object this can read (forwarded as it
/// came; the engine answers it).
///
/// NB (cost: this runs for every request of a tenant whose tokens are counted): most bodies are
/// told from their last members ([`stream_at_end`]). Of the others, a body without the bytes
/// `true` cannot say `"stream": true` and is not read at all. Otherwise its
/// top-level `stream` and `stream_options` are read without building the rest ([`Top`]); a
/// streamed request without `stream_options` (the usual one) gets
/// `,"stream_options":{"include_usage":true}` written before its closing brace, its other
/// bytes forwarded as they came. `stream_options` given as `null` or an object is rewritten
/// through a `serde_json` map ([`rewrite`]). The skipped values are checked as JSON but not
/// as strictly as a map reads them (invalid UTF-8 is refused here too; a lone surrogate, a
/// number beyond `f64` or nesting deeper than 128 are not): such a body, which an engine
/// refuses, is then asked for its usage where a strict reading would have forwarded it as it
/// came, and the engine's refusal passes unchanged.
pub(crate) fn ask_usage(body: &[u8]) -> Option<Vec<u8>> {
    ask_usage_reading(body, true)
}

/// [`ask_usage`], its body told from its end ([`stream_at_end`]) or its top level read by
/// [`quick_top`] where those answer (`quick`),
/// else by `serde_json` ([`Top`]).
fn ask_usage_reading(body: &[u8], quick: bool) -> Option<Vec<u8>> {
    if quick && let Some(at_end) = stream_at_end(body) {
        return at_end.map(|close| with_usage_asked(body, close));
    }
    // From the end: a streamed request's `"stream": true` is most often its last field (or
    // before `stream_options`), where the search from the start reads the whole body.
    static TRUE: LazyLock<FinderRev<'static>> = LazyLock::new(|| FinderRev::new(b"true"));
    TRUE.rfind(body)?;
    std::str::from_utf8(body).ok()?;
    let stream_options = match quick.then(|| quick_top(body)).flatten() {
        Some(false) => return None,
        Some(true) => None,
        None => {
            let top: Top = serde_json::from_slice(body).ok()?;
            if top.stream != Some(Value::Bool(true)) {
                return None;
            }
            top.stream_options
        }
    };
    match stream_options {
        None => {
            // An object that read whole ends with its brace (then only whitespace).
            let close = body.iter().rposition(|&b| b == b'}')?;
            Some(with_usage_asked(body, close))
        }
        Some(Value::Null) => rewrite(body),
        Some(Value::Object(options)) => {
            if options.get("include_usage") == Some(&Value::Bool(true)) {
                return None;
            }
            rewrite(body)
        }
        Some(_) => None,
    }
}

/// Whether a request asks for one choice: it has no `n` key (`n` is 1 unless given), found as
/// `"n"` followed by a `:` anywhere in it, and no `\u` escape (which could write one).
///
/// NB: a request with an `n` anywhere (even `1`, even nested) is taken as not single, and its
/// usage strip searches its frames' bytes as before (its events not read by their ends:
/// [`Strip::token_run`]).
pub(crate) fn single_choice(body: &[u8]) -> bool {
    static N: LazyLock<memchr::memmem::Finder<'static>> =
        LazyLock::new(|| memchr::memmem::Finder::new(b"\"n\""));
    no_unicode_escape(body)
        && N.find_iter(body)
            .all(|at| !body[at + 3..].trim_ascii_start().starts_with(b":"))
}

/// `body` with `,"stream_options":{"include_usage":true}` before its closing brace (at `close`),
/// its other bytes as they came.
fn with_usage_asked(body: &[u8], close: usize) -> Vec<u8> {
    const ASK: &[u8] = br#","stream_options":{"include_usage":true}"#;
    let mut out = Vec::with_capacity(body.len() + ASK.len());
    out.extend_from_slice(&body[..close]);
    out.extend_from_slice(ASK);
    out.extend_from_slice(&body[close..]);
    out
}

/// What the end of `body` says of its top-level `stream`, its last members read backwards
/// while each is plain (a string without a `\`, a number, `true`, `false` or `null`), for
/// [`ask_usage`]: `Some(Some(close))` when the last `stream` is `true` and the body is UTF-8
/// and has no `"stream_options"` (`close`: where the object's closing brace is); `Some(None)`
/// when it is `false` or `null`, when no member is `stream` (the object's first reached), or
/// when the body has no `"stream"` at all; `None` (the body is then read from its start) for
/// anything else: a member not plain before the last `stream`, a `stream` of another value,
/// `stream_options` after it, or, where the answer rests on what the rest of the body lacks
/// (no `stream_options` anywhere, no `stream` at all), a `\u` anywhere (an escaped key may be
/// either).
///
/// NB: for a body that is JSON this answers what [`quick_top`] and `serde_json` do (the test
/// `the_end_of_the_body_answers_as_its_reading_whole`); for one that is not, it may ask for
/// usage where they would not, for an engine that refuses the body anyway (as [`ask_usage`]'s
/// note says of skipped values). Backwards, a string is told from its closing quote only when
/// it has no `\`: its opening quote is then the `"` before, unless a `\` precedes that.
///
/// NB (cost): a request whose last member is `stream` (as curl and most examples send it), or
/// whose `stream` only plain members follow, is told from those bytes, and when it streams by
/// a SIMD search of the body for `"stream_options"`, one for a `\` and its UTF-8 checked; a
/// request without `stream` by two SIMD searches (for a `\u`, for `"stream"`). Reading the body
/// from its start cost about 1,200 instructions of the benchmark's 111 bytes (callgrind), and a
/// few more for each byte of a longer prompt; these searches take a fraction of an instruction
/// a byte. A request whose `stream` is followed by a member that is not plain (`tools`, say) is
/// still read from its start.
fn stream_at_end(body: &[u8]) -> Option<Option<usize>> {
    use memchr::memmem::Finder;
    static STREAM: LazyLock<Finder<'static>> = LazyLock::new(|| Finder::new(b"\"stream\""));
    match last_stream(body) {
        Some(Some(close)) => {
            static OPTIONS: PairSearch = PairSearch::new(b"\"stream_options\"", 7, 15);
            // Not UTF-8: refused here too (as `ask_usage` does).
            (OPTIONS.find(body).is_none()
                && no_unicode_escape(body)
                && (body.is_ascii() || std::str::from_utf8(body).is_ok()))
            .then_some(Some(close))
        }
        Some(None) => Some(None),
        None => (no_unicode_escape(body) && STREAM.find(body).is_none()).then_some(None),
    }
}

/// [`stream_at_end`]'s reading of `body`'s last members, backwards: `Some(Some(close))` when
/// the last of them that is `stream` is `true`, `Some(None)` when it is `false` or `null` or
/// when none is (the object's `{` reached), `None` when it cannot tell (neither a `\u` nor a
/// `stream_options` looked for yet).
fn last_stream(body: &[u8]) -> Option<Option<usize>> {
    // JSON's whitespace, skipped backwards from `at`.
    let ws_back = |mut at: usize| {
        while at > 0 && matches!(body[at - 1], b' ' | b'\t' | b'\n' | b'\r') {
            at -= 1;
        }
        at
    };
    // The opening quote of the string whose closing quote is at `close`, when it has no `\`.
    let string_back = |close: usize| {
        let open = memchr::memrchr2(b'"', b'\\', &body[..close])?;
        (body[open] == b'"' && (open == 0 || body[open - 1] != b'\\')).then_some(open)
    };
    let close = ws_back(body.len()).checked_sub(1)?;
    if body[close] != b'}' {
        return None;
    }
    let mut at = close;
    loop {
        // A member backwards: its value, `:`, its key, then `,` or the object's `{`.
        let end = ws_back(at);
        let before = &body[..end];
        // The value's start, and (a literal) whether it is `true`.
        let (start, literal) = match before.last()? {
            b'"' => (string_back(end - 1)?, None),
            b'e' if before.ends_with(b"true") => (end - 4, Some(true)),
            b'e' if before.ends_with(b"false") => (end - 5, Some(false)),
            b'l' if before.ends_with(b"null") => (end - 4, Some(false)),
            b'0'..=b'9' => {
                let digits = before
                    .iter()
                    .rposition(|c| !matches!(c, b'0'..=b'9' | b'.' | b'e' | b'E' | b'+' | b'-'))?;
                (digits + 1, None)
            }
            _ => return None,
        };
        let colon = ws_back(start).checked_sub(1)?;
        let key_close = ws_back(colon).checked_sub(1)?;
        if body[colon] != b':' || body[key_close] != b'"' {
            return None;
        }
        let key_open = string_back(key_close)?;
        match &body[key_open + 1..key_close] {
            b"stream" => return literal.map(|stream| stream.then_some(close)),
            b"stream_options" => return None,
            _ => {}
        }
        let separator = ws_back(key_open).checked_sub(1)?;
        match body[separator] {
            b',' => at = separator,
            b'{' if ws_back(separator) == 0 => return Some(None),
            _ => return None,
        }
    }
}

/// Whether `body` has no `\u` (no key in it can be an escaped `stream` or `stream_options`).
fn no_unicode_escape(body: &[u8]) -> bool {
    static ESCAPE: LazyLock<memchr::memmem::Finder<'static>> =
        LazyLock::new(|| memchr::memmem::Finder::new(b"\\u"));
    memchr::memchr(b'\\', body).is_none() || ESCAPE.find(body).is_none()
}

/// What [`Top`] reads of a request, read without `serde_json` where this answers exactly
/// (strict JSON as `serde_json` skips it: `null`, `true`, `false`, numbers by JSON's grammar,
/// strings with JSON's escapes and no control character, arrays, objects with plain ASCII
/// keys, nesting up to 64; anything else is left to `serde_json`), for an object without
/// `stream_options` whose `stream`s (if any) are `true`, `false` or `null`: `Some(true)` when
/// its last `stream` is `true`, else `Some(false)`; `None` for any other body (then read by
/// `serde_json`).
///
/// NB (cost): this runs for every request of a tenant whose tokens are counted; through
/// `serde_json` (its map access and a `Value` of `stream`) it was about 3,700 instructions
/// of a usual chat request (callgrind). The test `the_quick_top_is_serde_jsons` holds both
/// to the same answers on mutated bodies.
fn quick_top(body: &[u8]) -> Option<bool> {
    let mut r = Reader { b: body, at: 0 };
    r.open(b'{')?;
    let mut stream = false;
    if !r.close(b'}') {
        loop {
            match r.key()? {
                b"stream" => {
                    stream = match r.peek()? {
                        b't' => r.word(b"true").map(|()| true)?,
                        b'f' => r.word(b"false").map(|()| false)?,
                        b'n' => r.word(b"null").map(|()| false)?,
                        _ => return None,
                    };
                }
                b"stream_options" => return None,
                _ => r.skip(0)?,
            }
            if !r.next(b'}')? {
                break;
            }
        }
    }
    r.end()?;
    Some(stream)
}

/// [`ask_usage`] through a `serde_json` map, for a request whose `stream_options` is `null` or
/// an object not asking for usage: `include_usage` set, `continuous_usage_stats` removed.
fn rewrite(body: &[u8]) -> Option<Vec<u8>> {
    let mut request: Map<String, Value> = serde_json::from_slice(body).ok()?;
    match request.get_mut("stream_options") {
        None | Some(Value::Null) => {
            let mut options = Map::new();
            options.insert("include_usage".into(), Value::Bool(true));
            request.insert("stream_options".into(), Value::Object(options));
        }
        Some(Value::Object(options)) => {
            options.insert("include_usage".into(), Value::Bool(true));
            options.remove("continuous_usage_stats");
        }
        Some(_) => return None,
    }
    serde_json::to_vec(&request).ok()
}

/// The `system_fingerprint` of each engine instance, as its last usage chunk said, shared by
/// the listener's streams (see the module's note).
///
/// NB (cost): a stream finds its instance's [`Slot`] once, when it starts (one lookup, by
/// [`FastHash`]: an instance's key is the lifecycle's, never a client's), and learns into it
/// without a second lookup or a copy of the key.
#[derive(Debug, Default)]
pub(crate) struct Fingerprints(Mutex<HashMap<InstanceKey, Arc<Slot>, FastHash>>);

/// What is known of an instance's fingerprint: `None` nothing yet, `Some(None)` that it has
/// none.
type Known = Option<Option<Arc<Fingerprint>>>;

/// One instance's [`Known`], and whether a stream of it already missed its usage chunk.
#[derive(Debug)]
struct Slot {
    known: Mutex<Known>,
    /// The instance, as the warning names it.
    instance: Box<str>,
    /// A stream that asked for usage ended without the usage chunk taken out (warned once).
    missed: std::sync::atomic::AtomicBool,
    /// The [`Strip::layout`] its last single-choice stream learnt (0: none yet), where the
    /// next one starts from.
    layout: std::sync::atomic::AtomicUsize,
}

/// An engine's `system_fingerprint`, and the field written into a finishing chunk,
/// `,"system_fingerprint":` and the same as a JSON string (made once, when it is learnt, and
/// sent as a piece of its own: [`Sent`]).
#[derive(Debug)]
struct Fingerprint {
    raw: Box<str>,
    field: Bytes,
}

impl Fingerprint {
    fn new(raw: &str) -> Arc<Self> {
        let json = serde_json::to_string(raw).unwrap_or_default();
        Arc::new(Self {
            raw: raw.into(),
            field: Bytes::from([",\"system_fingerprint\":", &json].concat()),
        })
    }
}

/// The instances [`Fingerprints`] keeps at most: past it, it starts over (each instance is
/// learned again from its next stream).
const MAX_INSTANCES: usize = 1024;

impl Fingerprints {
    /// The slot of the instance `key` (a new one when it has none).
    fn slot(&self, key: &InstanceKey) -> Arc<Slot> {
        let mut all = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(slot) = all.get(key) {
            return Arc::clone(slot);
        }
        if all.len() >= MAX_INSTANCES {
            all.clear();
        }
        let slot = Arc::new(Slot {
            known: Mutex::default(),
            instance: format!(
                "{} (index {}, host {}, generation {})",
                key.deployment, key.index, key.host_id, key.generation
            )
            .into(),
            missed: Default::default(),
            layout: Default::default(),
        });
        all.insert(key.clone(), Arc::clone(&slot));
        slot
    }
}

impl Slot {
    fn known(&self) -> Known {
        self.known
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Keeps `fingerprint` as the instance's; returns it as kept.
    fn learn(&self, fingerprint: Option<&str>) -> Option<Arc<Fingerprint>> {
        let mut known = self.known.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(kept) = &*known
            && kept.as_ref().map(|f| &*f.raw) == fingerprint
        {
            return kept.clone();
        }
        let learnt = fingerprint.map(Fingerprint::new);
        *known = Some(learnt.clone());
        learnt
    }

    /// A stream of the instance reached `[DONE]` without its usage chunk taken out: said once
    /// per instance, so that an engine that does not write its chunks as the strip finds them
    /// (the module's note) does not go unseen.
    fn missed_usage(&self) {
        if !self.missed.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                instance = %self.instance,
                "a streamed answer whose usage CapyCTL asked for ended without the engine's usage \
                 chunk after a finish reason written as vLLM, SGLang and TensorFold write it: the \
                 tenant's tokens for it are not counted, and a usage chunk it sent reached the \
                 client (said once per engine instance)"
            );
        }
    }
}

/// The engine instance a stream comes from, for its fingerprint.
pub(crate) struct Engine {
    slot: Arc<Slot>,
    /// Its fingerprint, when known (`Some(None)`: it has none).
    known: Known,
}

impl Engine {
    /// The instance `key`, with what `all` knows of it.
    pub(crate) fn new(all: &Fingerprints, key: &InstanceKey) -> Self {
        let slot = all.slot(key);
        let known = slot.known();
        Self { slot, known }
    }
}

/// What [`ask_usage`] reads of a request: its top-level `stream` and `stream_options` (the
/// last of each, as a map keeps them); every other value is checked and skipped, nothing of
/// it built.
struct Top {
    stream: Option<Value>,
    stream_options: Option<Value>,
}

impl<'de> Deserialize<'de> for Top {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Fields;
        impl<'de> serde::de::Visitor<'de> for Fields {
            type Value = Top;

            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a JSON object")
            }

            fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Top, A::Error> {
                let mut top = Top {
                    stream: None,
                    stream_options: None,
                };
                while let Some(key) = map.next_key::<TopKey>()? {
                    match key {
                        TopKey::Stream => top.stream = Some(map.next_value()?),
                        TopKey::StreamOptions => top.stream_options = Some(map.next_value()?),
                        TopKey::Other => {
                            map.next_value::<serde::de::IgnoredAny>()?;
                        }
                    }
                }
                Ok(top)
            }
        }
        deserializer.deserialize_map(Fields)
    }
}

/// A key of [`Top`], read without keeping it.
enum TopKey {
    Stream,
    StreamOptions,
    Other,
}

impl<'de> Deserialize<'de> for TopKey {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Name;
        impl serde::de::Visitor<'_> for Name {
            type Value = TopKey;

            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a key")
            }

            fn visit_str<E: serde::de::Error>(self, key: &str) -> Result<TopKey, E> {
                Ok(match key {
                    "stream" => TopKey::Stream,
                    "stream_options" => TopKey::StreamOptions,
                    _ => TopKey::Other,
                })
            }
        }
        deserializer.deserialize_str(Name)
    }
}

/// Takes the usage chunk out of a streamed answer (see the module's note).
pub(crate) struct Strip {
    scanner: EventScanner,
    /// The start of the event being read (not ended in the frames so far).
    partial: BytesMut,
    /// From a finishing chunk without a fingerprint on, while the engine's is not known: the
    /// events held until the usage chunk, each with whether it is such a finishing chunk.
    held: Vec<(Bytes, bool)>,
    /// Their bytes.
    held_bytes: usize,
    engine: Engine,
    /// The usage chunk's `total_tokens`, once it passed.
    pub(crate) tokens: Option<u64>,
    /// A finish reason has passed (one of the choices finished): only from then on is a usage
    /// chunk taken for one (the module's note).
    finished: bool,
    /// The usage chunk was taken out.
    took_usage: bool,
    max_piece: usize,
    /// Gave up (an event past `max_piece`): everything passes unchanged.
    off: bool,
    /// The request has one choice ([`single_choice`]): each chunk's one `"finish_reason":` is
    /// its choice's, so that its token chunks are told by where theirs is
    /// ([`Strip::token_chunk`]).
    single: bool,
    /// How far from a token chunk's end its `"finish_reason":null` begins, in the stream's
    /// last token chunk read (at first, in the instance's last stream's: [`Slot::layout`]).
    layout: Option<usize>,
    /// Reads every event (no run of plain events passed whole), for the tests that hold both
    /// to the same bytes.
    #[cfg(test)]
    read_every_event: bool,
}

/// What one event is, to the strip.
#[cfg_attr(test, derive(Debug, PartialEq))]
enum Event<'a> {
    Usage {
        tokens: Option<u64>,
        /// As the chunk has it (its bytes, or what `serde_json` read of an escaped one).
        fingerprint: Option<Cow<'a, str>>,
    },
    /// A chunk with a finish reason and no fingerprint.
    Finishing,
    /// `data: [DONE]`, the stream's last event.
    Done,
    Other,
}

/// What `event` is: [`read`]'s answer, the event read only when its bytes may show a mark
/// or `[DONE]`.
fn classify(event: &[u8]) -> Event<'_> {
    if plainly_other(event) {
        // `data: [DONE]` has neither key either: an event with those bytes is read to tell it.
        static DONE: PairSearch = PairSearch::new(b"[DONE]", 0, 5);
        if DONE.find(event).is_some() && matches!(read(event), Event::Done) {
            return Event::Done;
        }
        return Event::Other;
    }
    read(event)
}

/// What `event` is, from its keys as the engines write them (see the module's note: the
/// chunk is not read whole, nor checked as JSON).
///
/// - The usage chunk: a `"usage"` key not followed by `: null` ([`first_usage`]) and an empty
///   `"choices"` array; its `tokens` the whole number at the start of the value of its last
///   `"total_tokens"` key from the usage key on (as [`super::body::total_tokens`] reads an
///   answer's tail: `5.0` is 5), its fingerprint the string after a `"system_fingerprint"`
///   key.
/// - A finishing chunk: no such usage, a finish reason as the engines write one
///   ([`find_finish`]) and no `"system_fingerprint"` key.
/// - `[DONE]`, and everything else [`Event::Other`].
fn read(event: &[u8]) -> Event<'_> {
    // As the engines end a stream (what the rest would tell, without finding its line).
    if event == b"data: [DONE]\n\n" {
        return Event::Done;
    }
    let Data::One(data) = data_of(event) else {
        return Event::Other;
    };
    if super::sse::is_done(data) {
        return Event::Done;
    }
    const KEY: &[u8] = b"\"system_fingerprint\"";
    // By its `_` and its closing quote (no token chunk has the pair: `memmem`'s own searcher
    // cost twice as much here).
    static FINGERPRINT: PairSearch = PairSearch::new(KEY, 7, 19);
    // The key: its bytes followed by a `:` (not a string of those bytes, a model's name say),
    // the matches taken one after another as `memmem::find_iter` takes them.
    let mut from = 0;
    let fingerprint = loop {
        let Some(found) = FINGERPRINT.find(&data[from..]) else {
            break None;
        };
        let end = from + found + KEY.len();
        if data[end..].trim_ascii_start().starts_with(b":") {
            break Some(end);
        }
        from = end;
    };
    if let Some(usage) = first_usage(data, data.len()) {
        if !empty_choices(data) {
            return Event::Other;
        }
        return Event::Usage {
            tokens: super::body::total_tokens(&data[usage..]),
            fingerprint: fingerprint.and_then(|end| string_after(data, end)),
        };
    }
    if fingerprint.is_none() && find_finish(data).is_some() {
        return Event::Finishing;
    }
    Event::Other
}

/// Whether `data` has a `"choices"` key whose value is an empty array (whitespace allowed).
fn empty_choices(data: &[u8]) -> bool {
    const CHOICES: &[u8] = b"\"choices\"";
    static FINDER: LazyLock<memchr::memmem::Finder<'static>> =
        LazyLock::new(|| memchr::memmem::Finder::new(CHOICES));
    let mut from = 0;
    while let Some(found) = FINDER.find(&data[from..]) {
        let after = from + found + CHOICES.len();
        let rest = data[after..].trim_ascii_start();
        if rest
            .strip_prefix(b":")
            .and_then(|r| r.trim_ascii_start().strip_prefix(b"["))
            .is_some_and(|r| r.trim_ascii_start().starts_with(b"]"))
        {
            return true;
        }
        from = after;
    }
    false
}

/// The string value after the key that ends at `data[key_end..]` (its `:` next, whitespace
/// allowed): its bytes when it has no escape, else as `serde_json` reads it; `None` for
/// `null`, another value or a string that does not read.
fn string_after(data: &[u8], key_end: usize) -> Option<Cow<'_, str>> {
    let rest = data.get(key_end..)?.trim_ascii_start();
    let rest = rest.strip_prefix(b":")?.trim_ascii_start();
    let body = rest.strip_prefix(b"\"")?;
    let stop = string_stop(body, false)?;
    if body[stop] == b'"' {
        return std::str::from_utf8(&body[..stop]).ok().map(Cow::Borrowed);
    }
    let mut r = Reader { b: rest, at: 1 };
    r.skip_string()?;
    serde_json::from_slice::<String>(&rest[..r.at])
        .ok()
        .map(Cow::Owned)
}

/// A cursor over a request's JSON for [`quick_top`] (and an escaped string for
/// [`string_after`]): each step `None` where it leaves the JSON to `serde_json`.
struct Reader<'a> {
    b: &'a [u8],
    at: usize,
}

/// How deep [`Reader::skip`] goes ([`quick_top`] leaves deeper bodies to `serde_json`).
const QUICK_DEPTH: usize = 64;

impl<'a> Reader<'a> {
    /// The next byte after JSON's whitespace, not taken.
    #[inline]
    fn peek(&mut self) -> Option<u8> {
        // Every byte above the space is not whitespace: what follows a key, a value or a
        // comma in the engines' chunks.
        match self.b.get(self.at) {
            Some(&c) if c > b' ' => Some(c),
            _ => self.peek_after_whitespace(),
        }
    }

    /// [`Reader::peek`], whitespace skipped first.
    fn peek_after_whitespace(&mut self) -> Option<u8> {
        while let Some(&c) = self.b.get(self.at) {
            if !matches!(c, b' ' | b'\t' | b'\n' | b'\r') {
                return Some(c);
            }
            self.at += 1;
        }
        None
    }

    /// Takes `c`, the next byte after whitespace.
    #[inline]
    fn open(&mut self, c: u8) -> Option<()> {
        (self.peek()? == c).then(|| self.at += 1)
    }

    /// Takes `c` when it is next (an empty array or object's end).
    #[inline]
    fn close(&mut self, c: u8) -> bool {
        self.open(c).is_some()
    }

    /// After a member: `true` at a `,` (another follows), `false` at `end`.
    #[inline]
    fn next(&mut self, end: u8) -> Option<bool> {
        match self.peek()? {
            b',' => {
                self.at += 1;
                Some(true)
            }
            c if c == end => {
                self.at += 1;
                Some(false)
            }
            _ => None,
        }
    }

    /// Only whitespace is left.
    fn end(&mut self) -> Option<()> {
        self.peek().is_none().then_some(())
    }

    /// Takes `word` (`null`, `true`, `false`).
    #[inline]
    fn word(&mut self, word: &[u8]) -> Option<()> {
        let rest = self.b.get(self.at..)?;
        rest.starts_with(word).then(|| self.at += word.len())
    }

    /// A string's bytes (after its `"`, taken) when it has no escape and no control
    /// character, nor (`ascii`) a byte past ASCII.
    #[inline]
    fn plain(&mut self, ascii: bool) -> Option<&'a [u8]> {
        let rest = self.b.get(self.at..)?;
        let end = string_stop(rest, ascii)?;
        if rest[end] != b'"' {
            return None;
        }
        self.at += end + 1;
        Some(&rest[..end])
    }

    /// An object's key (plain ASCII) and its `:`.
    #[inline]
    fn key(&mut self) -> Option<&'a [u8]> {
        self.open(b'"')?;
        let key = self.plain(true)?;
        self.open(b':')?;
        Some(key)
    }

    /// Skips a string, after its `"`, as `serde_json` does (escapes checked, bytes not).
    #[inline]
    fn skip_string(&mut self) -> Option<()> {
        loop {
            let rest = self.b.get(self.at..)?;
            let at = string_stop(rest, false)?;
            self.at += at + 1;
            match rest[at] {
                b'"' => return Some(()),
                b'\\' => {
                    let e = *self.b.get(self.at)?;
                    self.at += 1;
                    match e {
                        b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't' => {}
                        b'u' => {
                            let hex = self.b.get(self.at..self.at + 4)?;
                            if !hex.iter().all(u8::is_ascii_hexdigit) {
                                return None;
                            }
                            self.at += 4;
                        }
                        _ => return None,
                    }
                }
                _ => return None,
            }
        }
    }

    /// Skips digits; how many.
    fn digits(&mut self) -> usize {
        let rest = self.b.get(self.at..).unwrap_or_default();
        let n = rest.iter().take_while(|c| c.is_ascii_digit()).count();
        self.at += n;
        n
    }

    /// Skips a number (its first byte next), by JSON's grammar.
    fn skip_number(&mut self) -> Option<()> {
        if self.b.get(self.at) == Some(&b'-') {
            self.at += 1;
        }
        match self.b.get(self.at)? {
            b'0' => {
                self.at += 1;
                if self.b.get(self.at).is_some_and(u8::is_ascii_digit) {
                    return None;
                }
            }
            b'1'..=b'9' => {
                self.digits();
            }
            _ => return None,
        }
        if self.b.get(self.at) == Some(&b'.') {
            self.at += 1;
            if self.digits() == 0 {
                return None;
            }
        }
        if matches!(self.b.get(self.at), Some(b'e' | b'E')) {
            self.at += 1;
            if matches!(self.b.get(self.at), Some(b'+' | b'-')) {
                self.at += 1;
            }
            if self.digits() == 0 {
                return None;
            }
        }
        Some(())
    }

    /// Skips one value, at nesting `depth`.
    fn skip(&mut self, depth: usize) -> Option<()> {
        if depth > QUICK_DEPTH {
            return None;
        }
        match self.peek()? {
            b'n' => self.word(b"null"),
            b't' => self.word(b"true"),
            b'f' => self.word(b"false"),
            b'"' => {
                self.at += 1;
                self.skip_string()
            }
            b'-' | b'0'..=b'9' => self.skip_number(),
            b'[' => {
                self.at += 1;
                if self.close(b']') {
                    return Some(());
                }
                loop {
                    self.skip(depth + 1)?;
                    if !self.next(b']')? {
                        return Some(());
                    }
                }
            }
            b'{' => {
                self.at += 1;
                if self.close(b'}') {
                    return Some(());
                }
                loop {
                    self.open(b'"')?;
                    self.skip_string()?;
                    self.open(b':')?;
                    self.skip(depth + 1)?;
                    if !self.next(b'}')? {
                        return Some(());
                    }
                }
            }
            _ => None,
        }
    }
}

/// Where the first byte of `s` is that ends a run of a JSON string's plain bytes: `"`, `\`, a
/// control character, or (`ascii`) a byte past ASCII.
///
/// NB (cost): eight bytes at a time (each kind of byte found by the usual bit test for a
/// zero or a smaller byte in a word; the lowest byte it flags is always a true one, so the
/// first of them is exact), then byte by byte for the last few; keys and values of the
/// engines' chunks and requests are 5 to 40 bytes, read byte by byte they were most of a
/// reading of a chunk whole (which the strip did before it read chunks by their keys alone).
#[inline]
fn string_stop(s: &[u8], ascii: bool) -> Option<usize> {
    const ONES: u64 = 0x0101_0101_0101_0101;
    const HIGH: u64 = 0x8080_8080_8080_8080;
    let mut words = s.chunks_exact(8);
    for (n, word) in words.by_ref().enumerate() {
        let mut bytes = [0; 8];
        bytes.copy_from_slice(word);
        let w = u64::from_le_bytes(bytes);
        let quote = w ^ (ONES * u64::from(b'"'));
        let backslash = w ^ (ONES * u64::from(b'\\'));
        let mut found = (quote.wrapping_sub(ONES) & !quote)
            | (backslash.wrapping_sub(ONES) & !backslash)
            | (w.wrapping_sub(ONES * 0x20) & !w);
        if ascii {
            found |= w;
        }
        found &= HIGH;
        if found != 0 {
            return Some(n * 8 + found.trailing_zeros() as usize / 8);
        }
    }
    let done = s.len() - words.remainder().len();
    words
        .remainder()
        .iter()
        .position(|&c| c == b'"' || c == b'\\' || c < 0x20 || (ascii && c >= 0x80))
        .map(|at| done + at)
}

/// Whether `event` is [`Event::Other`] whatever its JSON says, seen from its bytes alone: it
/// has no mark ([`first_mark`]). Every event of a stream but the finishing and the usage ones
/// is told this way.
fn plainly_other(event: &[u8]) -> bool {
    first_mark(event, true).is_none()
}

/// Where the first mark of `json` is: a `"usage"` key not followed by `: null`, or (`finish`)
/// a finish reason as the engines write one ([`find_finish`]). Around the usage key's `:`
/// only ` `, `\t` and `\r` are taken as whitespace, never a newline (which would reach into
/// the next event): a key followed by another is a mark too, and its event is read.
///
/// NB (cost): no token chunk has either mark (vLLM's and TensorFold's have no `usage`,
/// SGLang's a `"usage":null`; each has `"finish_reason":null`), so a search by a pair of bytes
/// ([`PairSearch`]) finds no place to stop at in a frame of them, where the pass before it
/// stopped at every `f` (the finish reason's key, whatever its value) and every `\` (a key
/// might be escaped). Before a finish reason, only the finish reason is searched for
/// ([`first_mark_unfinished`]).
fn first_mark(json: &[u8], finish: bool) -> Option<usize> {
    let other = finish.then(|| find_finish(json)).flatten();
    let end = other.map_or(json.len(), |at| json.len().min(at + USAGE.len() - 1));
    first_usage(json, end).or(other)
}

/// [`first_mark`] of a stream that has had no finish reason before `json`, and the first
/// finish reason of `json` (where one of its choices finished): a usage key is a mark only
/// after that finish reason, and the first finish reason is the first mark when (`finish`)
/// it is one.
///
/// NB (cost): the engines send the usage chunk after every choice has finished (the module's
/// note), so a frame of token chunks is searched once, for a finish reason, not twice.
fn first_mark_unfinished(json: &[u8], finish: bool) -> (Option<usize>, Option<usize>) {
    let first_finish = find_finish(json);
    let mark = match first_finish {
        Some(at) if !finish => {
            let after = &json[at..];
            first_usage(after, after.len()).map(|usage| usage + at)
        }
        other => other,
    };
    (mark, first_finish)
}

/// The `"usage"` key, quoted.
const USAGE: &[u8] = b"\"usage\"";

/// The finish reason's key and its `:`, as the engines write it.
const FINISH_KEY: &[u8] = b"\"finish_reason\":";

/// A finish reason as the engines (vLLM, SGLang, TensorFold) write one that is not `null`: a
/// string right after its key's `:`.
const FINISH: &[u8] = b"\"finish_reason\":\"";
const _: () = assert!(
    FINISH.len() == 17,
    "find_finish's pair is its bytes 7 and 16"
);

/// Where the first `"usage"` key of `json` that begins in `json[..end]`, whole, and is not
/// followed by `: null` is.
fn first_usage(json: &[u8], end: usize) -> Option<usize> {
    let within = &json[..end];
    let mut from = 0;
    while let Some(found) = find_usage(&within[from..]) {
        let at = from + found;
        if let Some(mark) = key_not_null(json, at + 1, USAGE, 1) {
            return Some(mark);
        }
        from = at + 1;
    }
    None
}

/// Where the first [`USAGE`] of `haystack` is, by the pair of its `u` and its `g`.
fn find_usage(haystack: &[u8]) -> Option<usize> {
    static SEARCH: PairSearch = PairSearch::new(USAGE, 1, 4);
    SEARCH.find(haystack)
}

/// Where the first [`FINISH`] of `haystack` is, by the pair of its `_` and its last `"`
/// (every token chunk's `"finish_reason":null` has an `n` there, so that a frame of them has
/// no place to look at).
///
/// NB (cost): about 20 instructions for each 32 bytes of the stream. `memchr` for the `f`
/// (128 bytes a step, then the needle compared at each `f`: one a token chunk) was about 1,000
/// instructions more a request of 16 tokens (callgrind), its set-up paid again at each `f`.
fn find_finish(haystack: &[u8]) -> Option<usize> {
    static SEARCH: PairSearch = PairSearch::new(FINISH, 7, 16);
    SEARCH.find(haystack)
}

/// A needle searched for by two of its bytes (at `first` and `second`): with AVX2 by a
/// searcher made at the first search and called directly (`memmem`'s own prefilter stops at
/// every `"`, about 600 instructions a frame); without it, or in a haystack too short for
/// it, by a Rabin-Karp searcher also made once when the haystack is shorter than [`SHORT`]
/// (`memmem::find` makes its searcher at every call: several hundred instructions for the few
/// bytes left of a frame after a mark), else by `memmem`.
struct PairSearch {
    needle: &'static [u8],
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    first: u8,
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    second: u8,
    #[cfg(target_arch = "x86_64")]
    avx2: std::sync::OnceLock<Option<memchr::arch::x86_64::avx2::packedpair::Finder>>,
    short: std::sync::OnceLock<memchr::arch::all::rabinkarp::Finder>,
}

/// The haystacks [`PairSearch`] searches with its Rabin-Karp searcher are shorter than this
/// (it reads a byte at a time): what is left of a frame after a mark; a longer one without
/// AVX2 goes to `memmem`, whose own searcher (with NEON on aarch64) does better on a frame.
const SHORT: usize = 64;

impl PairSearch {
    const fn new(needle: &'static [u8], first: u8, second: u8) -> Self {
        Self {
            needle,
            first,
            second,
            #[cfg(target_arch = "x86_64")]
            avx2: std::sync::OnceLock::new(),
            short: std::sync::OnceLock::new(),
        }
    }

    /// Where the first needle of `haystack` is.
    fn find(&self, haystack: &[u8]) -> Option<usize> {
        #[cfg(target_arch = "x86_64")]
        {
            use memchr::arch::all::packedpair::Pair;
            use memchr::arch::x86_64::avx2::packedpair::Finder;
            let avx2 = self.avx2.get_or_init(|| {
                let pair = Pair::with_indices(self.needle, self.first, self.second)?;
                Finder::with_pair(self.needle, pair)
            });
            if let Some(finder) = avx2
                && haystack.len() >= finder.min_haystack_len()
            {
                return finder.find(haystack, self.needle);
            }
        }
        if haystack.len() < self.needle.len() {
            return None;
        }
        if haystack.len() >= SHORT {
            return memchr::memmem::find(haystack, self.needle);
        }
        self.short
            .get_or_init(|| memchr::arch::all::rabinkarp::Finder::new(self.needle))
            .find(haystack, self.needle)
    }
}

/// Where `key` is in `json` when its byte `into` bytes in is at `hit` and it is not followed
/// by `: null` (only ` `, `\t` and `\r` taken as whitespace).
///
/// NB (cost): the key's closing quote and a following `:null` (SGLang's `"usage":null` on
/// every chunk) are looked at first, before the whole key is compared.
fn key_not_null(json: &[u8], hit: usize, key: &[u8], into: usize) -> Option<usize> {
    fn trim(s: &[u8]) -> &[u8] {
        let n = s
            .iter()
            .take_while(|&&c| matches!(c, b' ' | b'\t' | b'\r'))
            .count();
        &s[n..]
    }
    let at = hit.checked_sub(into)?;
    let end = at + key.len();
    if json.get(end - 1) != Some(&b'"') || json.get(end..end + 5) == Some(b":null") {
        return None;
    }
    let after = json[at..].strip_prefix(key)?;
    let null = trim(after)
        .strip_prefix(b":")
        .is_some_and(|value| trim(value).starts_with(b"null"));
    (!null).then_some(at)
}

/// The end of the last event of `events` that ends at or before `before` (0 when none does),
/// `events` beginning where an event begins: just past the last blank line (only `\r`s
/// between two newlines, or between its start and a newline) there, as [`EventScanner`]
/// finds them.
fn event_end_before(events: &[u8], before: usize) -> usize {
    let upto = events.get(..before).unwrap_or_default();
    // The usual frame's end: a blank line just before.
    if upto.ends_with(b"\n\n") {
        return before;
    }
    for newline in memchr::memrchr_iter(b'\n', upto) {
        let line_start = memchr::memrchr(b'\n', &upto[..newline]).map_or(0, |n| n + 1);
        if upto[line_start..newline].iter().all(|&b| b == b'\r') {
            return newline + 1;
        }
    }
    0
}

/// The ends among a frame's `ends` (in order) of its events from `at` on (those before end at
/// or before it: passed or read already), while they end within the frame (`len` bytes) and
/// no more than `max_piece` past `at`.
fn ends_from(
    ends: &[usize],
    at: usize,
    len: usize,
    max_piece: usize,
) -> impl Iterator<Item = usize> + '_ {
    ends[ends.partition_point(|&e| e <= at)..]
        .iter()
        .copied()
        .take_while(move |&e| e <= len && e - at <= max_piece)
}

/// Sends the event `piece` (`data: {...}` and its blank line) with
/// `"system_fingerprint":<fingerprint>` as its object's last field: the event cut before its
/// closing brace, the field between (nothing copied: [`Sent`]).
fn push_with_fingerprint(out: &mut Out<'_, '_>, piece: Piece, fingerprint: &Fingerprint) {
    let data = out.data;
    let event = match &piece {
        Piece::Of(start, end) => &data[*start..*end],
        Piece::Held(whole) => &whole[..],
    };
    let Some(close) = memchr::memrchr(b'}', event) else {
        piece.send(out);
        return;
    };
    match piece {
        Piece::Of(start, end) => {
            out.pass(start, start + close);
            out.push(fingerprint.field.clone());
            out.pass(start + close, end);
        }
        Piece::Held(whole) => {
            out.push(whole.slice(..close));
            out.push(fingerprint.field.clone());
            out.push(whole.slice(close..));
        }
    }
}

impl Strip {
    /// A strip for a stream of `engine`, holding at most `max_piece` bytes.
    pub(crate) fn new(max_piece: usize, engine: Engine) -> Self {
        let layout = engine.slot.layout.load(Ordering::Relaxed);
        Self {
            scanner: EventScanner::new(max_piece),
            partial: BytesMut::new(),
            held: Vec::new(),
            held_bytes: 0,
            engine,
            tokens: None,
            finished: false,
            took_usage: false,
            max_piece,
            off: false,
            single: false,
            layout: (layout > 0).then_some(layout),
            #[cfg(test)]
            read_every_event: false,
        }
    }

    /// The same strip, for a request with one choice ([`single_choice`]) when `single`.
    pub(crate) fn single_choice(mut self, single: bool) -> Self {
        self.single = single;
        self
    }

    /// Whether it reads a frame's events by where they end, when the answer's own scanner
    /// gives that ([`Strip::pass_with`]).
    pub(crate) fn reads_events(&self) -> bool {
        self.single
    }

    /// Whether it gave up (an event past `max_piece`): everything passes unchanged since, its
    /// usage chunk too.
    pub(crate) fn gave_up(&self) -> bool {
        self.off
    }

    /// Whether it holds bytes not sent yet.
    pub(crate) fn holds(&self) -> bool {
        !self.partial.is_empty() || !self.held.is_empty()
    }

    /// What to send of the next frame `data` (possibly nothing, for now), in one piece.
    #[cfg(test)]
    pub(crate) fn pass(&mut self, data: Bytes) -> Bytes {
        self.pass_whole(data, None)
    }

    /// [`Strip::pass_with`], what it sends in one piece.
    #[cfg(test)]
    fn pass_whole(&mut self, data: Bytes, ends: Option<&[usize]>) -> Bytes {
        let mut sent = Sent::default();
        self.pass_with(data, ends, &mut sent);
        sent.concat()
    }

    /// [`Strip::finish`], what it sends in one piece.
    #[cfg(test)]
    fn finish_whole(&mut self) -> Bytes {
        let mut sent = Sent::default();
        self.finish(&mut sent);
        sent.concat()
    }

    /// What to send of the next frame `data` (possibly nothing, for now), into `sent` (whose
    /// pieces were all given), with where the frame's events end when that is known (`ends`:
    /// every one of them, in order, as the answer's own [`EventScanner`] found them: the same
    /// ends as the strip's, since both read the same bytes from the stream's start).
    pub(crate) fn pass_with(&mut self, data: Bytes, ends: Option<&[usize]>, sent: &mut Sent) {
        sent.clear();
        if self.off {
            sent.add(data);
            return;
        }
        let mut out = Out::new(&data, sent);
        let mut at = 0;
        let mut marks = Marks::default();
        loop {
            if self.partial.is_empty() && self.held.is_empty() {
                let plain = self.plain_events(&data, at, &mut marks, ends);
                out.pass(at, plain);
                at = plain;
            }
            if at == data.len() {
                // Nothing left of the frame (the scanner would take nothing from it).
                break;
            }
            if let Some(end) = self.known_end(ends, at, data.len()) {
                // A single-choice stream's event where the answer's scanner ended it: read
                // (the strip's own scanner stays where an event begins, as after any event).
                let start = at;
                at = end;
                self.event(Piece::Of(start, end), true, &mut out);
                continue;
            }
            match self.scanner.next_end(&data, at) {
                Ok(Some(end)) => {
                    let start = at;
                    at = end;
                    if self.partial.is_empty() {
                        // The event that the run stopped before has a mark: read at once.
                        let marked = marks.at.is_some_and(|m| (start..end).contains(&m));
                        self.event(Piece::Of(start, end), marked, &mut out);
                    } else {
                        self.partial.extend_from_slice(&data[start..end]);
                        let whole = std::mem::take(&mut self.partial).freeze();
                        self.event(Piece::Held(whole), false, &mut out);
                    }
                }
                Ok(None) => {
                    self.partial.extend_from_slice(&data[at..]);
                    break;
                }
                Err(_) => {
                    self.off = true;
                    self.partial.extend_from_slice(&data[at..]);
                    break;
                }
            }
        }
        if self.off || self.partial.len() + self.held_bytes > self.max_piece {
            self.off = true;
            self.release(&mut out, None);
            out.push(std::mem::take(&mut self.partial).freeze());
        }
        // The engines end a stream with `[DONE]`, at a frame's end: one that came with no usage
        // chunk taken out is said (once per instance).
        if !self.took_usage && data.ends_with(b"data: [DONE]\n\n") {
            self.engine.slot.missed_usage();
        }
        // A run of the frame unchanged: the frame itself, cut there (not a second handle on it
        // made by slicing; `Bytes::truncate` may still share a frame built from a `Vec`).
        if out.copy.is_none() && out.sent.is_empty() {
            let (from, same) = (out.from, out.same);
            let sent = out.sent;
            let mut data = data;
            data.truncate(same);
            data.advance(from);
            sent.add(data);
            return;
        }
        out.finish();
    }

    /// Where the run of whole events of `data` from `at` ends that pass as they came without
    /// being read one by one (`at` itself when there is none): `at` is where an event starts
    /// and nothing is held. The run ends where the first event begins whose bytes may show a
    /// usage or a finish reason other than `null` (only where that matters: unless the
    /// engine is known to have no fingerprint, when a finishing chunk passes unchanged too),
    /// else at the last event's end. Each event of the run is one that [`Strip::event`] would
    /// send unchanged: one [`plainly_other`] tells, `[DONE]`, and, before a finish reason, a
    /// usage chunk (not the engine's: the module's note), or, from an engine known to have no
    /// fingerprint, a finishing chunk (whose passing sets `finished`, as reading it would); its
    /// scanner ends where it began; the run is no longer than `max_piece`, so that no event of
    /// it is.
    ///
    /// NB (cost): the engine's frames carry many events each (the stream's body gathers what
    /// the engine already sent), nearly all of them tokens; reading every event (its end
    /// found, its bytes tested) was most of a tenant's streamed request beyond the router's
    /// own work. This is a search by a pair of bytes over the frame (two once a finish reason
    /// has passed: [`first_mark_unfinished`], [`first_mark`]), and a step back from the first
    /// event that may matter to where it begins.
    /// `marks`: what the frame's earlier calls found (each search goes on from there rather
    /// than over the frame again).
    fn plain_events(
        &mut self,
        data: &[u8],
        at: usize,
        marks: &mut Marks,
        ends: Option<&[usize]>,
    ) -> usize {
        #[cfg(test)]
        if self.read_every_event {
            return at;
        }
        if self.single
            && let Some(ends) = ends
        {
            // After its finish, each event is read (the usage chunk, `[DONE]`: no run).
            return if self.finished {
                at
            } else {
                self.token_run(data, at, ends)
            };
        }
        let fingerprint_matters = !matches!(self.engine.known, Some(None));
        let first = marks
            .first(data, at, fingerprint_matters, self.finished)
            .unwrap_or(data.len());
        let rest = data.get(at..).unwrap_or_default();
        let end = event_end_before(rest, first.saturating_sub(at));
        if end > self.max_piece {
            return at;
        }
        // A finish reason passed in the run (where finishing chunks are not marks).
        self.finished |= marks.finish_at.is_some_and(|f| f < at + end);
        at + end
    }

    /// [`Strip::plain_events`] of a single-choice stream before a finish reason, where the
    /// frame's events end is known (`ends`): the run ends where the first event begins that is
    /// not a token chunk ([`Strip::token_chunk`]: the finishing chunk), else at the last event's
    /// end, and before an event that would take it past `max_piece`. Each event of it is one that the search of the
    /// frame's bytes would have passed in a run: one choice per chunk, one `"finish_reason":`,
    /// whose `"` after it is the only mark before a finish reason.
    ///
    /// NB (cost): the frame's bytes are not searched: each event's `"finish_reason":null` is
    /// looked for where the last token chunk had its (the same distance from the event's end:
    /// what follows a token chunk's finish reason is the same in each of a stream's token
    /// chunks), a comparison of 20 bytes, and searched for only where it is not there. The
    /// search of the frame for a pair of bytes cost about 16 instructions for each 32 bytes of
    /// the stream (a sixth of what a tenant's streamed request of 128 tokens cost the
    /// listener beyond a plain one, callgrind), where the answer's own scanner already finds
    /// every event's end.
    fn token_run(&mut self, data: &[u8], at: usize, ends: &[usize]) -> usize {
        let mut end = at;
        // The run stops short of `max_piece` (the next call goes on from its end).
        for next in ends_from(ends, at, data.len(), self.max_piece) {
            if !self.token_chunk(&data[end..next]) {
                break;
            }
            end = next;
        }
        end
    }

    /// Where the event of a single-choice stream that begins at `at` ends, from the frame's
    /// `ends` (`None`: not known, or the start of the event is held from an earlier frame, or
    /// it is longer than `max_piece`: the strip's own scanner then finds it). Each such event
    /// is read: the one a token run stopped before (it has a finish reason, or the run would
    /// have passed `max_piece`); after the finish, every event ([`Strip::plain_events`]).
    ///
    /// NB (cost): the scanner would find again where the answer's own found the event to end,
    /// and the frame's search for marks after the finish would look again at the bytes of the
    /// two events read anyway (the usage chunk, `[DONE]`): about 1,500 instructions of a
    /// tenant's streamed request (callgrind, 16 tokens).
    fn known_end(&self, ends: Option<&[usize]>, at: usize, len: usize) -> Option<usize> {
        if !self.single || !self.partial.is_empty() {
            return None;
        }
        ends_from(ends?, at, len, self.max_piece).next()
    }

    /// Whether `event` (a whole event of a single-choice stream) is no finishing chunk: its one
    /// `"finish_reason":` is not followed by a `"` (or it has none), seen where the stream's
    /// last token chunk (at first, the instance's last stream's) had its `"finish_reason":null`
    /// ([`Strip::layout`]) or else found, and then learnt when it is `null`.
    fn token_chunk(&mut self, event: &[u8]) -> bool {
        const NULL: &[u8] = b"\"finish_reason\":null";
        if let Some(back) = self.layout
            && let Some(at) = event.len().checked_sub(back)
            && event[at..].starts_with(NULL)
        {
            return true;
        }
        static KEY: PairSearch = PairSearch::new(FINISH_KEY, 7, 15);
        let Some(at) = KEY.find(event) else {
            return true;
        };
        let value = &event[at + FINISH_KEY.len()..];
        if value.starts_with(b"null") {
            let layout = event.len() - at;
            self.layout = Some(layout);
            // Kept for the instance's next stream (written only when it changed).
            if self.engine.slot.layout.load(Ordering::Relaxed) != layout {
                self.engine.slot.layout.store(layout, Ordering::Relaxed);
            }
        }
        !value.starts_with(b"\"")
    }

    /// Sends, holds or takes out one complete event; `marked`: it is read without
    /// [`classify`]'s byte test (it has a mark, [`first_mark`], or is a single-choice stream's
    /// event read where it ends, [`Strip::known_end`]); the test only spares the reading of an
    /// event without one: the reading answers the same for every event.
    fn event(&mut self, piece: Piece, marked: bool, out: &mut Out<'_, '_>) {
        let data = out.data;
        let event = match &piece {
            Piece::Of(start, end) => &data[*start..*end],
            Piece::Held(whole) => &whole[..],
        };
        let mut kind = if marked { read(event) } else { classify(event) };
        if !self.finished {
            if matches!(kind, Event::Usage { .. }) {
                // Before any finish reason: not the engine's usage chunk (the module's note).
                kind = Event::Other;
            }
            self.finished = matches!(kind, Event::Finishing) || find_finish(event).is_some();
        }
        match kind {
            Event::Usage {
                tokens,
                fingerprint,
            } => {
                self.tokens = tokens;
                self.took_usage = true;
                let learnt = self.engine.slot.learn(fingerprint.as_deref());
                self.release(out, learnt.as_deref());
                self.engine.known = Some(learnt);
            }
            Event::Finishing if self.held.is_empty() => match &self.engine.known {
                Some(Some(fingerprint)) => push_with_fingerprint(out, piece, fingerprint),
                Some(None) => piece.send(out),
                None => self.hold(piece.bytes(data), true),
            },
            Event::Finishing => self.hold(piece.bytes(data), true),
            Event::Done => {
                self.release(out, None);
                piece.send(out);
            }
            Event::Other if self.held.is_empty() => piece.send(out),
            Event::Other => self.hold(piece.bytes(data), false),
        }
    }

    fn hold(&mut self, event: Bytes, finishing: bool) {
        self.held_bytes += event.len();
        self.held.push((event, finishing));
    }

    /// Sends what it holds, `fingerprint` written into the finishing chunks.
    fn release(&mut self, out: &mut Out<'_, '_>, fingerprint: Option<&Fingerprint>) {
        for (event, finishing) in self.held.drain(..) {
            match fingerprint {
                Some(fp) if finishing => push_with_fingerprint(out, Piece::Held(event), fp),
                _ => out.push(event),
            }
        }
        self.held_bytes = 0;
    }

    /// What it still holds, at the answer's end, into `sent` (whose pieces were all given).
    pub(crate) fn finish(&mut self, sent: &mut Sent) {
        sent.clear();
        let none = Bytes::new();
        let mut out = Out::new(&none, sent);
        self.release(&mut out, None);
        out.push(std::mem::take(&mut self.partial).freeze());
        out.finish();
    }
}

/// Where the first mark ([`first_mark`], or [`first_mark_unfinished`] before a finish reason
/// passed) of a frame is, as [`Strip::plain_events`] searched for it from `from` (`None`:
/// none after it; not `searched` yet: unknown), with `finish` and `finished`.
#[derive(Default)]
struct Marks {
    searched: bool,
    from: usize,
    finish: bool,
    finished: bool,
    at: Option<usize>,
    /// The first finish reason from `from` (searched for only while not `finished`).
    finish_at: Option<usize>,
}

impl Marks {
    /// Where the first mark at or after `from` in `data` is (`finish`: a finish reason is one;
    /// `finished`: one has passed): what was found before when that answers (searched from no
    /// later, with the same flags, and found none or one no earlier), else searched for now.
    fn first(&mut self, data: &[u8], from: usize, finish: bool, finished: bool) -> Option<usize> {
        let known = self.searched
            && self.finish == finish
            && self.finished == finished
            && self.from <= from
            && self.at.is_none_or(|at| at >= from);
        if !known {
            let rest = data.get(from..).unwrap_or_default();
            let (at, finish_at) = if finished {
                (first_mark(rest, finish), None)
            } else {
                first_mark_unfinished(rest, finish)
            };
            *self = Marks {
                searched: true,
                from,
                finish,
                finished,
                at: at.map(|at| at + from),
                finish_at: finish_at.map(|at| at + from),
            };
        }
        self.at
    }
}

/// One complete event of a frame: `data[start..end]` of the frame, or the bytes held across
/// frames that it ends.
enum Piece {
    Of(usize, usize),
    Held(Bytes),
}

impl Piece {
    /// Its bytes, to keep (`data` is the frame it came in).
    fn bytes(self, data: &Bytes) -> Bytes {
        match self {
            Piece::Of(start, end) => data.slice(start..end),
            Piece::Held(whole) => whole,
        }
    }

    /// Sends it unchanged.
    fn send(self, out: &mut Out<'_, '_>) {
        match self {
            Piece::Of(start, end) => out.pass(start, end),
            Piece::Held(whole) => out.push(whole),
        }
    }
}

/// The pieces [`Sent`] holds at most: a frame's runs around a finishing chunk given its
/// fingerprint and a usage chunk taken out, `[DONE]` after them (four), and one to spare.
pub(crate) const PIECES: usize = 5;

/// What the strip sends of one frame, in order: slices of the frame (the runs of it that pass
/// unchanged), the fingerprint written into a finishing chunk, events held from earlier
/// frames. The listener writes them together, as one frame (one write, one chunk:
/// [`super::body::ProxyBody::queued`]).
///
/// NB (cost): a single-choice stream's tokens and its finishing chunk come in one frame (the
/// one after its first output, about 3 KiB at 16 tokens): sent as one copy with the
/// fingerprint written into it, that frame was copied whole into a new buffer at every request
/// (about 1,000 instructions of a tenant's streamed request, and its cache lines, callgrind).
#[derive(Default)]
pub(crate) struct Sent {
    pieces: [Bytes; PIECES],
    /// The next piece to give.
    next: usize,
    len: usize,
}

impl Sent {
    /// Empty, for the next frame (its pieces were given: none is held).
    fn clear(&mut self) {
        debug_assert!(self.is_empty());
        (self.next, self.len) = (0, 0);
    }

    fn add(&mut self, bytes: Bytes) {
        if !bytes.is_empty() {
            self.pieces[self.len] = bytes;
            self.len += 1;
        }
    }

    /// Whether every piece was given.
    pub(crate) fn is_empty(&self) -> bool {
        self.next == self.len
    }

    /// The next piece.
    pub(crate) fn pop(&mut self) -> Option<Bytes> {
        let piece = self.pieces.get_mut(self.next..self.len)?.first_mut()?;
        self.next += 1;
        Some(std::mem::take(piece))
    }

    /// The pieces not given yet.
    pub(crate) fn rest(&self) -> &[Bytes] {
        &self.pieces[self.next..self.len]
    }

    /// Gives every piece (the listener wrote them).
    pub(crate) fn given(&mut self) {
        while self.pop().is_some() {}
    }

    /// Its bytes in one piece (the piece itself when there is one).
    #[cfg(test)]
    pub(crate) fn concat(mut self) -> Bytes {
        if self.len - self.next <= 1 {
            return self.pop().unwrap_or_default();
        }
        Bytes::from(self.rest().concat())
    }
}

/// What [`Strip::pass_with`] sends of one frame, as it is made: the pieces so far and the run
/// of the frame being passed unchanged; past [`PIECES`], a copy.
struct Out<'a, 's> {
    data: &'a Bytes,
    /// The run being sent: `data[from..same]` (while `copy` is `None`).
    from: usize,
    same: usize,
    /// What is sent before the run.
    sent: &'s mut Sent,
    /// Everything sent, in one copy, once it would take more than [`PIECES`] pieces (it is
    /// then sent there as it comes).
    copy: Option<BytesMut>,
}

impl<'a, 's> Out<'a, 's> {
    fn new(data: &'a Bytes, sent: &'s mut Sent) -> Self {
        Self {
            data,
            from: 0,
            same: 0,
            sent,
            copy: None,
        }
    }

    /// Sends `data[start..end]`.
    fn pass(&mut self, start: usize, end: usize) {
        if let Some(copy) = &mut self.copy {
            copy.extend_from_slice(&self.data[start..end]);
        } else if self.same == start {
            self.same = end;
        } else {
            self.close_run();
            (self.from, self.same) = (start, end);
        }
    }

    /// Sends `bytes`, a piece of its own.
    fn push(&mut self, bytes: Bytes) {
        if bytes.is_empty() {
            return;
        }
        self.close_run();
        self.add(bytes);
    }

    /// The run so far as a piece (a slice of the frame); the next run starts after it.
    fn close_run(&mut self) {
        if self.from < self.same {
            let run = self.data.slice(self.from..self.same);
            self.from = self.same;
            self.add(run);
        }
    }

    fn add(&mut self, bytes: Bytes) {
        if self.copy.is_none() && self.sent.len == PIECES {
            // More pieces than the listener writes together: all of it in one copy.
            let mut copy = BytesMut::with_capacity(self.data.len() + 128);
            while let Some(piece) = self.sent.pop() {
                copy.extend_from_slice(&piece);
            }
            self.sent.clear();
            self.copy = Some(copy);
        }
        match &mut self.copy {
            Some(copy) => copy.extend_from_slice(&bytes),
            None => self.sent.add(bytes),
        }
    }

    fn finish(mut self) {
        self.close_run();
        if let Some(copy) = self.copy {
            self.sent.add(copy.freeze());
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use crate::proxy::sse::{data_of_lines, one_line_data};

    const WITH_USAGE: &str = concat!(
        "data: {\"id\":\"c\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hi\"},\"finish_reason\":null}]}\n\n",
        "data: {\"id\":\"c\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"!\"},\"finish_reason\":\"stop\"}]}\n\n",
        "data: {\"id\":\"c\",\"choices\":[],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":2,\"total_tokens\":5},\"system_fingerprint\":\"vllm-x\"}\n\n",
        "data: [DONE]\n\n",
    );
    const WITHOUT: &str = concat!(
        "data: {\"id\":\"c\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hi\"},\"finish_reason\":null}]}\n\n",
        "data: {\"id\":\"c\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"!\"},\"finish_reason\":\"stop\"}],\"system_fingerprint\":\"vllm-x\"}\n\n",
        "data: [DONE]\n\n",
    );

    /// vLLM with `n: 2` asked for usage: the finishing chunks (one per choice, apart) lose the
    /// fingerprint to the usage chunk.
    const WITH_USAGE_N2: &str = concat!(
        "data: {\"id\":\"c\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hi\"},\"finish_reason\":null}]}\n\n",
        "data: {\"id\":\"c\",\"choices\":[{\"index\":1,\"delta\":{\"content\":\"Yo\"},\"finish_reason\":null}]}\n\n",
        "data: {\"id\":\"c\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"!\"},\"finish_reason\":\"stop\"}]}\n\n",
        "data: {\"id\":\"c\",\"choices\":[{\"index\":1,\"delta\":{\"content\":\" you\"},\"finish_reason\":null}]}\n\n",
        "data: {\"id\":\"c\",\"choices\":[{\"index\":1,\"delta\":{\"content\":\".\"},\"finish_reason\":\"length\"}]}\n\n",
        "data: {\"id\":\"c\",\"choices\":[],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":6,\"total_tokens\":9},\"system_fingerprint\":\"vllm-x\"}\n\n",
        "data: [DONE]\n\n",
    );
    /// The same without usage: every finishing chunk has the fingerprint.
    const WITHOUT_N2: &str = concat!(
        "data: {\"id\":\"c\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hi\"},\"finish_reason\":null}]}\n\n",
        "data: {\"id\":\"c\",\"choices\":[{\"index\":1,\"delta\":{\"content\":\"Yo\"},\"finish_reason\":null}]}\n\n",
        "data: {\"id\":\"c\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"!\"},\"finish_reason\":\"stop\"}],\"system_fingerprint\":\"vllm-x\"}\n\n",
        "data: {\"id\":\"c\",\"choices\":[{\"index\":1,\"delta\":{\"content\":\" you\"},\"finish_reason\":null}]}\n\n",
        "data: {\"id\":\"c\",\"choices\":[{\"index\":1,\"delta\":{\"content\":\".\"},\"finish_reason\":\"length\"}],\"system_fingerprint\":\"vllm-x\"}\n\n",
        "data: [DONE]\n\n",
    );

    fn key(generation: u64) -> InstanceKey {
        InstanceKey {
            deployment: "d".into(),
            index: 0,
            host_id: "h".into(),
            generation,
        }
    }

    /// A strip for instance `key(generation)` of `all`.
    fn strip(all: &Arc<Fingerprints>, generation: u64) -> Strip {
        Strip::new(64 * 1024, Engine::new(all, &key(generation)))
    }

    /// `frames` through a strip of a new instance.
    fn run(frames: &[&[u8]]) -> (Vec<u8>, Option<u64>) {
        run_on(&mut strip(&Arc::default(), 1), frames)
    }

    fn run_on(strip: &mut Strip, frames: &[&[u8]]) -> (Vec<u8>, Option<u64>) {
        let mut out = Vec::new();
        for f in frames {
            out.extend_from_slice(&strip.pass(Bytes::copy_from_slice(f)));
        }
        out.extend_from_slice(&strip.finish_whole());
        (out, strip.tokens)
    }

    #[test]
    fn the_usage_chunk_is_taken_out_and_its_fingerprint_put_back_whatever_the_frames() {
        let whole = WITH_USAGE.as_bytes();
        let (out, tokens) = run(&[whole]);
        assert_eq!(String::from_utf8_lossy(&out), WITHOUT);
        assert_eq!(tokens, Some(5));
        // Byte by byte, and in frames of 7.
        let bytes: Vec<&[u8]> = whole.chunks(1).collect();
        assert_eq!(run(&bytes), (WITHOUT.as_bytes().to_vec(), Some(5)));
        let sevens: Vec<&[u8]> = whole.chunks(7).collect();
        assert_eq!(run(&sevens), (WITHOUT.as_bytes().to_vec(), Some(5)));
    }

    #[test]
    fn with_n_choices_every_finishing_chunk_gets_the_fingerprint_back() {
        let whole = WITH_USAGE_N2.as_bytes();
        let expected = (WITHOUT_N2.as_bytes().to_vec(), Some(9));
        assert_eq!(run(&[whole]), expected);
        let bytes: Vec<&[u8]> = whole.chunks(1).collect();
        assert_eq!(run(&bytes), expected);
        let sevens: Vec<&[u8]> = whole.chunks(7).collect();
        assert_eq!(run(&sevens), expected);
    }

    #[test]
    fn once_an_instances_fingerprint_is_known_no_event_waits() {
        let all = Arc::default();
        let events: Vec<&str> = WITH_USAGE_N2.split_inclusive("\n\n").collect();
        let without: Vec<&str> = WITHOUT_N2.split_inclusive("\n\n").collect();
        // The first stream of instance 1: the events from the first finishing chunk on wait
        // for the usage chunk.
        let mut first = strip(&all, 1);
        assert_eq!(first.pass(Bytes::from(events[0])), events[0].as_bytes());
        assert!(first.pass(Bytes::from(events[2])).is_empty());
        assert!(first.pass(Bytes::from(events[3])).is_empty());
        assert_eq!(
            first.pass(Bytes::from(events[5])),
            [without[2], without[3]].concat().as_bytes()
        );
        // The next stream of the same instance: each event passes at once, the fingerprint
        // written in; the usage chunk still taken out.
        let mut next = strip(&all, 1);
        for (event, expected) in [(0, 0), (1, 1), (2, 2), (3, 3), (4, 4)] {
            assert_eq!(
                next.pass(Bytes::from(events[event])),
                without[expected].as_bytes(),
                "{event}"
            );
            assert!(!next.holds());
        }
        assert!(next.pass(Bytes::from(events[5])).is_empty());
        assert_eq!(next.tokens, Some(9));
        assert_eq!(next.pass(Bytes::from(events[6])), without[5].as_bytes());
        // The same instance started afresh (a new generation) is not known yet.
        let mut restarted = strip(&all, 2);
        assert!(restarted.pass(Bytes::from(events[2])).is_empty());
        assert!(restarted.holds());
        // An instance whose usage chunk has no fingerprint is known to have none.
        let bare = WITH_USAGE_N2.replace(",\"system_fingerprint\":\"vllm-x\"", "");
        let (out, _) = run_on(&mut strip(&all, 3), &[bare.as_bytes()]);
        assert_eq!(out, WITH_USAGE_N2.replace(events[5], "").as_bytes());
        let mut bare_next = strip(&all, 3);
        assert_eq!(bare_next.pass(Bytes::from(events[2])), events[2].as_bytes());
    }

    /// A frame whose finishing chunk gets the fingerprint and whose usage chunk is taken out
    /// is sent as pieces, the frame's own bytes not copied: the runs are slices of it, the
    /// fingerprint the one made when it was learnt. Past [`PIECES`] (`n` choices finishing in
    /// one frame), one copy.
    #[test]
    fn a_frame_changed_is_sent_as_pieces_of_it_not_a_copy() {
        let all = Arc::default();
        run_on(&mut strip(&all, 1), &[WITH_USAGE.as_bytes()]);
        let frame = Bytes::from_static(WITH_USAGE.as_bytes());
        let within = |piece: &Bytes| {
            let start = frame.as_ptr() as usize;
            let at = piece.as_ptr() as usize;
            at >= start && at + piece.len() <= start + frame.len()
        };
        let mut next = strip(&all, 1);
        let mut sent = Sent::default();
        next.pass_with(frame.clone(), None, &mut sent);
        let pieces = sent.rest().to_vec();
        // The tokens and the finishing chunk to its brace, the field, the brace on, `[DONE]`.
        assert_eq!(pieces.len(), 4);
        assert!(within(&pieces[0]) && within(&pieces[2]) && within(&pieces[3]));
        assert_eq!(&pieces[1][..], b",\"system_fingerprint\":\"vllm-x\"");
        assert_eq!(pieces.concat(), WITHOUT.as_bytes());
        assert_eq!(next.tokens, Some(5));
        // Given one by one, in order, then nothing.
        for piece in &pieces {
            assert_eq!(sent.pop().as_ref(), Some(piece));
        }
        assert!(sent.is_empty() && sent.pop().is_none());

        // Two choices finishing in one frame: more pieces than a write takes, one copy.
        run_on(&mut strip(&all, 2), &[WITH_USAGE_N2.as_bytes()]);
        let frame = Bytes::from_static(WITH_USAGE_N2.as_bytes());
        let mut sent = Sent::default();
        strip(&all, 2).pass_with(frame, None, &mut sent);
        assert_eq!(sent.rest().len(), 1);
        assert_eq!(sent.concat(), WITHOUT_N2.as_bytes());
    }

    #[test]
    fn only_chunks_with_a_usage_or_a_finish_reason_are_parsed() {
        assert!(plainly_other(
            br#"{"choices":[{"index":0,"finish_reason":null}]}"#
        ));
        assert!(plainly_other(
            br#"{"choices":[{"finish_reason" : null}],"x":"\"usage\""}"#
        ));
        assert!(!plainly_other(br#"{"choices":[{"finish_reason":"stop"}]}"#));
        assert!(!plainly_other(
            br#"{"choices":[{"index":0,"finish_reason":null},{"index":1,"finish_reason":"length"}]}"#
        ));
        assert!(!plainly_other(
            br#"{"choices":[],"usage":{"total_tokens":3}}"#
        ));
        // A spaced usage chunk is still found and taken as one.
        let spaced = "data: {\"choices\": [ ], \"usage\" : {\"total_tokens\": 3}}\n\n";
        assert!(matches!(
            classify(spaced.as_bytes()),
            Event::Usage {
                tokens: Some(3),
                fingerprint: None
            }
        ));
        // A spaced finish reason is not written as the engines write one (the module's note).
        assert!(plainly_other(br#"{"choices":[{"finish_reason": "stop"}]}"#));
    }

    /// Chunks as the engines write them (vLLM's chat and completions, SGLang's, TensorFold's),
    /// and others written compact as they do.
    const USUAL: [&str; 13] = [
        r#"{"id":"chatcmpl-1","object":"chat.completion.chunk","created":1733,"model":"m","choices":[{"index":0,"delta":{"content":"Hi"},"logprobs":null,"finish_reason":null}]}"#,
        r#"{"id":"chatcmpl-1","object":"chat.completion.chunk","created":1733,"model":"m","choices":[{"index":0,"delta":{"content":"!"},"logprobs":null,"finish_reason":"stop","stop_reason":null}]}"#,
        r#"{"id":"c","object":"chat.completion.chunk","created":1,"model":"m","choices":[],"usage":{"prompt_tokens":3,"total_tokens":5,"completion_tokens":2,"prompt_tokens_details":null},"system_fingerprint":"vllm-0.32-abcd1234"}"#,
        r#"{"id":"c","choices":[{"index":0,"delta":{},"finish_reason":"stop"}],"system_fingerprint":"vllm-x"}"#,
        r#"{"id":"s","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"role":null,"content":null,"reasoning_content":null,"tool_calls":null},"logprobs":null,"finish_reason":"stop","matched_stop":2}],"usage":null}"#,
        r#"{"choices":[{"index":0,"logprobs":{"content":[{"token":"a","logprob":-0.25,"bytes":[97],"top_logprobs":[]}]},"finish_reason":"stop"}]}"#,
        r#"{"choices":[{"delta":{"content":"a\"b\\c\u00e9\n\/"},"finish_reason":"stop"}]}"#,
        r#"{"choices":[],"usage":{"total_tokens":null}}"#,
        r#"{"choices":[{"index":0,"finish_reason":null},{"index":1,"finish_reason":"length"}]}"#,
        r#"{"choices":[{"delta":{"content":"é ü"},"finish_reason":null}]}"#,
        r#"{"id":"cmpl-1","object":"text_completion","created":1,"model":"m","choices":[{"index":0,"text":"!","logprobs":null,"finish_reason":"stop","stop_reason":null}],"usage":null}"#,
        "{}",
        r#"{"created":1.5e+10,"x":[true,false,null,-0,0.0,1E3,{}],"choices":[],"usage":{"total_tokens":0},"system_fingerprint":"a\u00e9\"b"}"#,
    ];

    /// Calls `check` with `seed` and every text made from it by cutting it, deleting a byte,
    /// adding one of `bytes` or changing a byte to one of them.
    fn each_mutation(seed: &[u8], bytes: &[u8], check: &mut impl FnMut(&[u8])) {
        check(seed);
        for at in 0..=seed.len() {
            check(&seed[..at]);
            if at < seed.len() {
                check(&[&seed[..at], &seed[at + 1..]].concat());
            }
            for &b in bytes {
                check(&[&seed[..at], &[b], &seed[at..]].concat());
                if at < seed.len() {
                    check(&[&seed[..at], &[b], &seed[at + 1..]].concat());
                }
            }
        }
    }

    /// [`one_line_data`] answers the usual event, and where it answers (on it and every event
    /// made from it by cutting, deleting, changing or adding a byte), it finds what
    /// [`data_of_lines`] finds (so [`data_of`], which asks it first, finds the same).
    #[test]
    fn the_one_line_data_is_data_ofs() {
        let usual = format!("data: {}\n\n", USUAL[2]);
        assert_eq!(one_line_data(usual.as_bytes()), Some(USUAL[2].as_bytes()));
        let mut answered = 0;
        each_mutation(usual.as_bytes(), b"\r\n :a", &mut |event| {
            if let Some(data) = one_line_data(event) {
                assert_eq!(data_of_lines(event), Data::One(data), "{event:?}");
                answered += 1;
            }
        });
        let mut short = 0;
        each_mutation(b"data: x\n\n", b"\r\n :a", &mut |event| {
            if let Some(data) = one_line_data(event) {
                assert_eq!(data_of_lines(event), Data::One(data), "{event:?}");
                short += 1;
            }
        });
        assert!(answered > 1000 && short > 10, "{answered} {short}");
    }

    #[derive(Deserialize)]
    struct Chunk {
        choices: Option<Vec<Choice>>,
        #[serde(default)]
        usage: Option<Usage>,
        #[serde(default)]
        system_fingerprint: Option<String>,
    }

    #[derive(Deserialize)]
    struct Choice {
        #[serde(default)]
        finish_reason: Option<serde::de::IgnoredAny>,
    }

    #[derive(Deserialize)]
    struct Usage {
        total_tokens: Option<u64>,
    }

    /// What the chunk `data` is, read whole by `serde_json` (how the strip read both chunks
    /// before it read them by their keys).
    fn read_whole(data: &[u8]) -> Event<'static> {
        let Ok(chunk) = serde_json::from_slice::<Chunk>(data) else {
            return Event::Other;
        };
        match (chunk.choices, chunk.usage) {
            (Some(choices), Some(usage)) if choices.is_empty() => Event::Usage {
                tokens: usage.total_tokens,
                fingerprint: chunk.system_fingerprint.map(Cow::Owned),
            },
            (Some(choices), None)
                if chunk.system_fingerprint.is_none()
                    && choices.iter().any(|c| c.finish_reason.is_some()) =>
            {
                Event::Finishing
            }
            _ => Event::Other,
        }
    }

    /// On the chunks as the engines write them, the reading by keys answers what a reading of
    /// the whole JSON answers (each kind of answer among them); where they differ, it is by
    /// the module's note: a spaced finish reason, an escaped key, JSON that does not read.
    #[test]
    fn the_engines_chunks_read_by_their_keys_as_read_whole() {
        let mut kinds = Vec::new();
        for chunk in USUAL {
            let event = format!("data: {chunk}\n\n");
            let whole = read_whole(chunk.as_bytes());
            assert_eq!(read(event.as_bytes()), whole, "{chunk}");
            assert_eq!(classify(event.as_bytes()), whole, "{chunk}");
            kinds.push(whole);
        }
        assert!(kinds.contains(&Event::Finishing) && kinds.contains(&Event::Other));
        assert!(kinds.contains(&Event::Usage {
            tokens: Some(0),
            fingerprint: Some(Cow::Borrowed("a\u{e9}\"b"))
        }));
        for (chunk, by_keys) in [
            (
                "{ \"choices\" : [ { \"index\" : 0 , \"finish_reason\" : \"length\" } ] }",
                Event::Other,
            ),
            (
                r#"{"choices":[{"finish\u005freason":"stop"}]}"#,
                Event::Other,
            ),
            (
                r#"{"choices":[],"us\u0061ge":{"total_tokens":1}}"#,
                Event::Other,
            ),
            (
                r#"{"choices":[{"finish_reason":"stop"}],}"#,
                Event::Finishing,
            ),
            (
                r#"{"choices":[],"usage":{"total_tokens":5}} x"#,
                Event::Usage {
                    tokens: Some(5),
                    fingerprint: None,
                },
            ),
        ] {
            assert_ne!(read_whole(chunk.as_bytes()), by_keys, "{chunk}");
            let event = format!("data: {chunk}\n\n");
            assert_eq!(read(event.as_bytes()), by_keys, "{chunk}");
        }
        // The fingerprint's key is a key (followed by its `:`), not a value of those bytes.
        let named = r#"{"model":"system_fingerprint","choices":[{"finish_reason":"stop"}]}"#;
        assert_eq!(read_whole(named.as_bytes()), Event::Finishing);
        assert_eq!(
            read(format!("data: {named}\n\n").as_bytes()),
            Event::Finishing
        );
    }

    /// The reading by keys never panics, whatever an engine sends: every chunk made from the
    /// usual ones by cutting, deleting, changing or adding a byte is read; on those that are
    /// compact JSON as the engines write it (no whitespace, no escape, a `choices` key, none of
    /// the keys read given twice, a plain whole `total_tokens`) it answers what the whole
    /// reading answers.
    #[test]
    fn the_reading_by_keys_holds_on_mutated_chunks() {
        let bytes = b"\"\\,:{}[]n0-1 e.E+\x01\xff\tu_";
        let (mut tried, mut compared) = (0, 0);
        let mut check = |chunk: &[u8]| {
            tried += 1;
            let event = [b"data: ", chunk, b"\n\n"].concat();
            let by_keys = read(&event);
            assert_eq!(
                classify(&event),
                by_keys,
                "{}",
                String::from_utf8_lossy(chunk)
            );
            let plain = !chunk
                .iter()
                .any(|b| matches!(b, b' ' | b'\t' | b'\n' | b'\r' | b'\\'));
            let Ok(value) = serde_json::from_slice::<Value>(chunk) else {
                return;
            };
            let text = String::from_utf8_lossy(chunk);
            let odd = [
                "choices",
                "usage",
                "finish_reason",
                "system_fingerprint",
                "total_tokens",
            ]
            .iter()
            .any(|k| text.matches(&format!("\"{k}\"")).count() > 1)
                || !text.contains("\"choices\":");
            let total = &value["usage"]["total_tokens"];
            if plain && !odd && (total.is_u64() || total.is_null()) && value.is_object() {
                compared += 1;
                assert_eq!(by_keys, read_whole(chunk), "{text}");
            }
        };
        for chunk in USUAL {
            each_mutation(chunk.as_bytes(), bytes, &mut check);
        }
        assert!(compared * 10 > tried, "{compared} of {tried}");
    }

    /// SGLang's chunks (`usage: null` on each, the finish reason with `matched_stop`, the
    /// usage chunk without a fingerprint), one event per frame as it writes them.
    const SGLANG: &str = concat!(
        "data: {\"id\":\"s\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{\"role\":null,\"content\":\"Hi\",\"reasoning_content\":null,\"tool_calls\":null},\"logprobs\":null,\"finish_reason\":null,\"matched_stop\":null}],\"usage\":null}\n\n",
        "data: {\"id\":\"s\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{\"role\":null,\"content\":null,\"reasoning_content\":null,\"tool_calls\":null},\"logprobs\":null,\"finish_reason\":\"stop\",\"matched_stop\":2}],\"usage\":null}\n\n",
        "data: {\"id\":\"s\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"m\",\"choices\":[],\"usage\":{\"prompt_tokens\":3,\"total_tokens\":5,\"completion_tokens\":2,\"prompt_tokens_details\":null}}\n\n",
        "data: [DONE]\n\n",
    );

    /// The events of `stream` sent in every grouping into frames (each frame whole events),
    /// through a strip of instance `generation` of `all`, each strip new: what comes out.
    fn every_grouping(stream: &str, all: &Arc<Fingerprints>, generation: u64) -> Vec<Vec<u8>> {
        let events: Vec<&str> = stream.split_inclusive("\n\n").collect();
        let cuts = events.len() - 1;
        (0..1u32 << cuts)
            .map(|mask| {
                let mut frames: Vec<String> = vec![events[0].to_string()];
                for (i, event) in events.iter().enumerate().skip(1) {
                    if mask & (1 << (i - 1)) != 0 {
                        frames.push((*event).to_string());
                    } else if let Some(last) = frames.last_mut() {
                        last.push_str(event);
                    }
                }
                let frames: Vec<&[u8]> = frames.iter().map(String::as_bytes).collect();
                run_on(&mut strip(all, generation), &frames).0
            })
            .collect()
    }

    /// Frames of whole events pass as they came when they show no usage and no finish reason
    /// (or the engine is known to have no fingerprint), and every grouping of the events into
    /// frames gives the bytes event-by-event reading gives: vLLM's `n` = 1 and 2, SGLang's.
    #[test]
    fn frames_of_plain_events_pass_whole_in_any_grouping() {
        let all = Arc::default();
        for (with, without) in [(WITH_USAGE, WITHOUT), (WITH_USAGE_N2, WITHOUT_N2)] {
            // Unknown first (the events wait for the usage chunk), then known.
            for _ in 0..2 {
                for out in every_grouping(with, &all, 1) {
                    assert_eq!(String::from_utf8_lossy(&out), without);
                }
            }
        }
        let sglang_without = SGLANG.replace(SGLANG.split_inclusive("\n\n").nth(2).unwrap(), "");
        for _ in 0..2 {
            for out in every_grouping(SGLANG, &all, 2) {
                assert_eq!(String::from_utf8_lossy(&out), sglang_without);
            }
        }
        // SGLang's instance is known to have no fingerprint: its finishing chunk passes whole.
        let events: Vec<&str> = SGLANG.split_inclusive("\n\n").collect();
        let mut known_none = strip(&all, 2);
        let frame = Bytes::from(format!("{}{}", events[0], events[1]));
        let out = known_none.pass(frame.clone());
        assert_eq!(out.as_ptr(), frame.as_ptr(), "not copied");
        assert_eq!(out, frame);
        // vLLM's is known to have one: its finishing chunk is read, the fingerprint put back.
        let mut known = strip(&all, 1);
        let events: Vec<&str> = WITH_USAGE.split_inclusive("\n\n").collect();
        let plain = Bytes::from(events[0]);
        assert_eq!(known.pass(plain.clone()).as_ptr(), plain.as_ptr());
        assert_eq!(
            known.pass(Bytes::from(events[1])),
            WITHOUT.split_inclusive("\n\n").nth(1).unwrap().as_bytes()
        );
    }

    /// A frame that does not end where an event ends, or whose usage key's value is spaced
    /// over lines, is read event by event: the usage chunk is still taken out wherever its
    /// key is split across frames.
    #[test]
    fn a_usage_key_split_across_frames_is_still_taken_out() {
        let all = Arc::default();
        for at in 0..WITH_USAGE.len() {
            let (a, b) = WITH_USAGE.as_bytes().split_at(at);
            let (out, tokens) = run_on(&mut strip(&all, 1), &[a, b]);
            assert_eq!(String::from_utf8_lossy(&out), WITHOUT, "split at {at}");
            assert_eq!(tokens, Some(5));
        }
        // A stream one of whose choices has finished: a usage chunk is looked for.
        let mut strip = strip(&all, 1);
        strip.finished = true;
        let plain = "data: {\"choices\":[{\"finish_reason\": \tnull}],\"usage\":null}\n\n";
        assert_eq!(
            strip.plain_events(plain.as_bytes(), 0, &mut Marks::default(), None),
            plain.len()
        );
        for not_plain in [
            "data: {\"choices\":[{\"finish_reason\":null}]}\n",
            "data: {\"choices\":[{\"finish_reason\":\"stop\"}]}\n\n",
            "data: {\"choices\":[],\"usage\":{\"total_tokens\":5}}\n\n",
            "data: {\"x\":\"usage\"\n\n:null}\n\n",
            "data: {\"choices\":[],\"usage\"\r\n:null}\r\n\r\n",
        ] {
            // The run ends where that event begins, after the plain one.
            let frame = format!("{plain}: comment\r\n\r\n{not_plain}");
            assert_eq!(
                strip.plain_events(frame.as_bytes(), 0, &mut Marks::default(), None),
                frame.len() - not_plain.len(),
                "{not_plain}"
            );
        }
    }

    /// [`first_mark`] as a pass for each mark finds it: `memmem` for each key, the first of
    /// them.
    fn first_mark_by_memmem(json: &[u8], finish: bool) -> Option<usize> {
        let usage = memchr::memmem::find_iter(json, USAGE).find(|&at| {
            let trim = |s: &[u8]| {
                let n = s
                    .iter()
                    .take_while(|&&c| matches!(c, b' ' | b'\t' | b'\r'))
                    .count();
                s[n..].to_vec()
            };
            !trim(&json[at + USAGE.len()..])
                .strip_prefix(b":")
                .is_some_and(|value| trim(value).starts_with(b"null"))
        });
        let finish = finish.then(|| memchr::memmem::find(json, FINISH)).flatten();
        [usage, finish].into_iter().flatten().min()
    }

    /// The marks found by one pass ([`first_mark`]) are those a pass for each found: on chunks
    /// with keys next to, inside and overlapping each other, and every text made from them by
    /// deleting a byte or adding or changing one.
    #[test]
    fn the_marks_found_in_one_pass_are_those_of_a_pass_for_each() {
        let base = concat!(
            "data: {\"choices\":[{\"finish_reason\":null,\"stop_reason\":null}],\"usage\":null}\n\n",
            "data: {\"choices\":[{\"finish_reason\" :\tnull}],\"usage\" :\r null,\"logprobs\":1}\n\n",
            "data: {\"x\":\"finish_reason\"finish_reason\":\"\",\"finish_reason\":\"stop\"}\n\n",
            "data: {\"x\":\"usage\"usage\":null,\"a\\u0067\":\"\\\\u\",\"usage\":{\"total_tokens\":1}}\n\n",
        );
        let mut cases = vec![base.to_string()];
        for at in 0..base.len() {
            for b in ["", "_", "g", "\\", "\"", "n", "u", ":", "\n"] {
                cases.push(format!("{}{b}{}", &base[..at], &base[at + 1..]));
                cases.push(format!("{}{b}{}", &base[..at], &base[at..]));
            }
        }
        let mut found = 0;
        for case in &cases {
            let json = case.as_bytes();
            for finish in [false, true] {
                let mark = first_mark(json, finish);
                assert_eq!(mark, first_mark_by_memmem(json, finish), "{finish} {case}");
                for from in [0, 9, 70, 150] {
                    let rest = json.get(from..).unwrap_or_default();
                    assert_eq!(first_mark(rest, finish), first_mark_by_memmem(rest, finish));
                }
                // Before a finish reason: the first one, or a usage key only after it.
                let first_finish = memchr::memmem::find(json, FINISH);
                let unfinished = first_finish.and_then(|at| match finish {
                    true => Some(at),
                    false => first_mark_by_memmem(&json[at..], false).map(|u| u + at),
                });
                assert_eq!(
                    first_mark_unfinished(json, finish),
                    (unfinished, first_finish),
                    "{finish} {case}"
                );
                found += usize::from(mark.is_some());
            }
        }
        assert!(found > cases.len(), "{found} of {}", cases.len() * 2);
    }

    /// [`string_stop`], eight bytes at a time, finds the byte a byte-by-byte search finds:
    /// each stopping byte at each place among others, in strings of every length up to 40.
    #[test]
    fn a_strings_end_is_found_as_byte_by_byte() {
        let byte_by_byte = |s: &[u8], ascii: bool| {
            s.iter()
                .position(|&c| c == b'"' || c == b'\\' || c < 0x20 || (ascii && c >= 0x80))
        };
        let fillers: [&[u8]; 3] = [
            b"abcdefgh",
            b" !#[]\x7f~}",
            b"\x21\x5b\x5d\x23\x41\x7e\x30\x39",
        ];
        let stops = [
            b'"', b'\\', 0, 0x1f, 0x0a, 0x80, 0xff, 0xc3, 0x20, 0x21, 0x5b, 0x7f,
        ];
        for filler in fillers {
            for len in 0..=40 {
                let plain: Vec<u8> = filler.iter().copied().cycle().take(len).collect();
                for ascii in [false, true] {
                    assert_eq!(string_stop(&plain, ascii), byte_by_byte(&plain, ascii));
                    for at in 0..len {
                        for &stop in &stops {
                            let mut s = plain.clone();
                            s[at] = stop;
                            assert_eq!(string_stop(&s, ascii), byte_by_byte(&s, ascii), "{s:?}");
                            // A second stopping byte after it changes nothing.
                            s.push(b'"');
                            assert_eq!(string_stop(&s, ascii), byte_by_byte(&s, ascii), "{s:?}");
                        }
                    }
                }
            }
        }
    }

    /// Where the events of a frame are found by [`event_end_before`], as the scanner finds
    /// them.
    #[test]
    fn event_ends_are_found_backwards_as_the_scanner_finds_them() {
        let stream = b"data: a\n\n: c\r\n\r\ndata: b\r\ndata: c\n\r\n\ndata: d\n";
        let mut scanner = EventScanner::new(1024);
        let mut ends = vec![0];
        let mut at = 0;
        while let Some(end) = scanner.next_end(stream, at).unwrap() {
            ends.push(end);
            at = end;
        }
        for before in 0..=stream.len() {
            let expected = ends.iter().copied().filter(|&e| e <= before).max().unwrap();
            assert_eq!(event_end_before(stream, before), expected, "{before}");
        }
    }

    /// The usual streams, and those made from them by deleting a byte, or adding or changing
    /// one to a byte that matters to the strip, every third byte.
    fn mutated_streams() -> Vec<Vec<u8>> {
        let mutations = b"\n\r\\u\":{}n ";
        let mut streams = Vec::new();
        for base in [WITH_USAGE, WITH_USAGE_N2, SGLANG] {
            let base = base.as_bytes();
            streams.push(base.to_vec());
            for at in (0..base.len()).step_by(3) {
                streams.push([&base[..at], &base[at + 1..]].concat());
                for &b in mutations {
                    streams.push([&base[..at], &[b], &base[at..]].concat());
                    streams.push([&base[..at], &[b], &base[at + 1..]].concat());
                }
            }
        }
        streams
    }

    /// Streams made from the usual ones by changing, adding or deleting a byte, in frames of
    /// several sizes: the strip that passes runs of plain events whole sends what the strip
    /// reading every event sends, and counts the same tokens.
    #[test]
    fn runs_of_plain_events_pass_as_every_event_read_would() {
        let all = Arc::default();
        let streams = mutated_streams();
        for (n, stream) in streams.iter().enumerate() {
            for size in [stream.len(), 7, 64] {
                let frames: Vec<&[u8]> = stream.chunks(size).collect();
                let generation = (n % 3) as u64;
                let mut quick = strip(&all, generation);
                let mut every = strip(&all, generation);
                every.read_every_event = true;
                let (q, e) = (run_on(&mut quick, &frames), run_on(&mut every, &frames));
                assert_eq!(q, e, "{}", String::from_utf8_lossy(stream));
            }
        }
    }

    /// `frames` through `strip` as the listener passes them, each with where its events end
    /// as the answer's own scanner finds them, but the first one when `first_without` (the
    /// start held before the first output, measured but given without its ends).
    fn run_by_ends(
        strip: &mut Strip,
        frames: &[&[u8]],
        first_without: bool,
    ) -> (Vec<u8>, Option<u64>) {
        let mut scanner = EventScanner::new(64 * 1024);
        let (mut out, mut ends) = (Vec::new(), Vec::new());
        for (i, f) in frames.iter().enumerate() {
            ends.clear();
            assert!(
                scanner
                    .measure_ends(f, 0, Some((&mut ends, usize::MAX)))
                    .unwrap()
            );
            let given = (i > 0 || !first_without).then_some(&ends[..]);
            out.extend_from_slice(&strip.pass_whole(Bytes::copy_from_slice(f), given));
        }
        out.extend_from_slice(&strip.finish_whole());
        (out, strip.tokens)
    }

    /// The streams of [`mutated_streams`] whose chunks each have at most one
    /// `"finish_reason":` (one choice a chunk, as the engines write them), in frames of several
    /// sizes: a single-choice strip that reads their events by where they end sends what the
    /// strip reading every event sends, and counts the same tokens; and it reads them so (its
    /// layout learnt) for the usual streams.
    #[test]
    fn events_read_by_their_ends_pass_as_every_event_read_would() {
        let all = Arc::default();
        let streams = mutated_streams();
        // Each event (as the scanner ends them) with at most one finish reason's key.
        let one_key_a_chunk = |stream: &[u8]| {
            let mut ends = vec![0];
            EventScanner::new(64 * 1024)
                .measure_ends(stream, 0, Some((&mut ends, usize::MAX)))
                .unwrap();
            ends.push(stream.len());
            ends.windows(2)
                .all(|w| memchr::memmem::find_iter(&stream[w[0]..w[1]], FINISH_KEY).count() <= 1)
        };
        let mut tried = 0;
        for (n, stream) in streams.iter().enumerate() {
            if !one_key_a_chunk(stream) {
                continue;
            }
            tried += 1;
            for size in [stream.len(), 1, 7, 64] {
                let frames: Vec<&[u8]> = stream.chunks(size).collect();
                let generation = (n % 3) as u64;
                let mut by_ends = strip(&all, generation).single_choice(true);
                let mut every = strip(&all, generation);
                every.read_every_event = true;
                let q = run_by_ends(&mut by_ends, &frames, n % 2 == 0);
                let e = run_on(&mut every, &frames);
                assert_eq!(q, e, "{}", String::from_utf8_lossy(stream));
            }
        }
        assert!(tried * 2 > streams.len(), "{tried} of {}", streams.len());
        // Runs bounded by a small `max_piece` (each stops short of it; an event past it gives
        // the strip up), in any frames.
        for stream in [WITH_USAGE, WITH_USAGE_N2, SGLANG] {
            for max_piece in [40, 100, 150, 400] {
                for size in [stream.len(), 7, 64] {
                    let frames: Vec<&[u8]> = stream.as_bytes().chunks(size).collect();
                    let new = || Strip::new(max_piece, Engine::new(&all, &key(7)));
                    let mut by_ends = new().single_choice(true);
                    let mut every = new();
                    every.read_every_event = true;
                    let q = run_by_ends(&mut by_ends, &frames, false);
                    let e = run_on(&mut every, &frames);
                    assert_eq!(q, e, "max_piece {max_piece}, frames of {size}");
                }
            }
        }
        // The usual stream, whole: its token chunks told by their layout, which the
        // instance's next stream starts from; a layout that is not the stream's is no harm.
        let all = Arc::default();
        let mut by_ends = strip(&all, 1).single_choice(true);
        let (out, tokens) = run_by_ends(&mut by_ends, &[WITH_USAGE.as_bytes()], false);
        assert_eq!(tokens, Some(5));
        assert!(by_ends.layout.is_some());
        assert_eq!(String::from_utf8_lossy(&out), WITHOUT);
        let next = strip(&all, 1).single_choice(true);
        assert_eq!(next.layout, by_ends.layout);
        assert_eq!(strip(&all, 2).layout, None);
        // The layout of another stream's chunks (a longer tail after the finish reason).
        let wrong = strip(&all, 1).single_choice(true);
        let other = by_ends.layout.unwrap() + 9;
        wrong.engine.slot.layout.store(other, Ordering::Relaxed);
        let mut wrong = strip(&all, 1).single_choice(true);
        assert_eq!(wrong.layout, Some(other));
        let (out, tokens) = run_by_ends(&mut wrong, &[WITH_USAGE.as_bytes()], false);
        assert_eq!(
            (String::from_utf8_lossy(&out).as_ref(), tokens),
            (WITHOUT, Some(5))
        );
        assert_eq!(wrong.layout, by_ends.layout);
    }

    #[test]
    fn one_choice_is_a_request_without_n() {
        assert!(single_choice(
            br#"{"model":"m","messages":[],"stream":true}"#
        ));
        assert!(single_choice(
            br#"{"model":"m","messages":[{"content":"n"}]}"#
        ));
        assert!(!single_choice(br#"{"model":"m","n":2,"stream":true}"#));
        assert!(!single_choice(br#"{"model":"m","n" : 1}"#));
        assert!(!single_choice(br#"{"model":"m","\u006e":2}"#));
    }

    /// A usage chunk before any finish reason is not the engine's (which sends it after every
    /// choice finished): it passes, in any frames, and counts nothing; after one it is taken
    /// out, whether finishing chunks matter (the fingerprint) or not.
    #[test]
    fn only_a_usage_chunk_after_a_finish_reason_is_taken_out() {
        let all = Arc::default();
        let events: Vec<&str> = WITH_USAGE.split_inclusive("\n\n").collect();
        let early = [events[0], events[2], events[1], events[3]].concat();
        for size in [early.len(), 1, 7, 64] {
            let frames: Vec<&[u8]> = early.as_bytes().chunks(size).collect();
            let (out, tokens) = run_on(&mut strip(&all, 9), &frames);
            assert_eq!(String::from_utf8_lossy(&out), early, "frames of {size}");
            assert_eq!(tokens, None);
        }
        // SGLang's instance, known to have no fingerprint: its finishing chunk is no mark, the
        // usage chunk after it still is.
        let sglang: Vec<&str> = SGLANG.split_inclusive("\n\n").collect();
        run_on(&mut strip(&all, 8), &[SGLANG.as_bytes()]);
        let mut known_none = strip(&all, 8);
        assert_eq!(
            known_none.engine.known.as_ref().map(Option::is_none),
            Some(true)
        );
        let (out, tokens) = run_on(&mut known_none, &[SGLANG.as_bytes()]);
        assert_eq!(String::from_utf8_lossy(&out), SGLANG.replace(sglang[2], ""));
        assert_eq!(tokens, Some(5));
        let early = [sglang[0], sglang[2], sglang[1], sglang[3]].concat();
        let (out, tokens) = run_on(&mut strip(&all, 8), &[early.as_bytes()]);
        assert_eq!(String::from_utf8_lossy(&out), early);
        assert_eq!(tokens, None);
    }

    /// A stream that ends with `[DONE]` and no usage chunk taken out is said once for its
    /// instance (an engine writing otherwise would not go unseen); one whose usage chunk was
    /// taken out, or that was cut before `[DONE]`, is not.
    #[test]
    fn a_stream_done_without_its_usage_chunk_is_said() {
        let all = Arc::default();
        let missed = |strip: &Strip| {
            strip
                .engine
                .slot
                .missed
                .load(std::sync::atomic::Ordering::Relaxed)
        };
        let mut taken = strip(&all, 1);
        run_on(&mut taken, &[WITH_USAGE.as_bytes()]);
        assert!(!missed(&taken));
        let events: Vec<&str> = WITH_USAGE.split_inclusive("\n\n").collect();
        let mut cut = strip(&all, 1);
        run_on(&mut cut, &[[events[0], events[1]].concat().as_bytes()]);
        assert!(!missed(&cut));
        let spaced =
            WITH_USAGE.replace("\"finish_reason\":\"stop\"", "\"finish_reason\": \"stop\"");
        let mut other = strip(&all, 1);
        let (out, tokens) = run_on(&mut other, &[spaced.as_bytes()]);
        assert_eq!(String::from_utf8_lossy(&out), spaced, "passed as it came");
        assert_eq!(tokens, None);
        assert!(missed(&other));
        // The same instance's next strip shares the flag (said once); another's does not.
        assert!(missed(&strip(&all, 1)));
        assert!(!missed(&strip(&all, 2)));
    }

    #[test]
    fn a_complete_event_is_never_held_before_a_finishing_one() {
        let mut strip = strip(&Arc::default(), 1);
        let first = WITH_USAGE.split_inclusive("\n\n").next().unwrap();
        assert_eq!(strip.pass(Bytes::from(first)), first.as_bytes());
        // An unfinished event waits for its end, and no longer.
        assert!(strip.pass(Bytes::from_static(b"data: {\"choi")).is_empty());
        assert_eq!(
            strip.pass(Bytes::from_static(b"ces\":[]}\n\n")),
            &b"data: {\"choices\":[]}\n\n"[..]
        );
        assert!(!strip.holds());
    }

    #[test]
    fn a_stream_without_a_usage_chunk_passes_unchanged_and_memory_is_bounded() {
        let (out, tokens) = run(&[WITHOUT.as_bytes()]);
        assert_eq!(String::from_utf8_lossy(&out), WITHOUT);
        assert_eq!(tokens, None);
        // An event past the bound: given up, everything passes.
        let mut strip = Strip::new(16, Engine::new(&Fingerprints::default(), &key(1)));
        let long = Bytes::from_static(b"data: 0123456789012345678901234567890");
        assert_eq!(strip.pass(long.clone()), long);
        assert!(!strip.holds());
    }

    #[test]
    fn only_the_finishing_and_usage_events_are_read_and_the_others_told_as_read() {
        let events = [
            "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hi\"},\"finish_reason\":null}]}\n\n",
            "data: {\"choices\":[{\"finish_reason\" : null,\"text\":\"say \\\"usage\\\": 1\"}],\"usage\":null}\n\n",
            "data: {\"choices\":[{\"finish_reason\":\"stop\"}]}\n\n",
            "data: {\"choices\":[{\"finish_reason\":\"stop\"}],\"system_fingerprint\":\"f\"}\n\n",
            "data: {\"choices\":[],\"usage\":{\"total_tokens\":5}}\n\n",
            "data: {\"choices\":[],\"usage\" :\t{\"total_tokens\":5}}\n\n",
            "data: {\"choices\":[{\"finish\\u005freason\":\"stop\"}]}\n\n",
            "data: {\"choices\":[],\"\\u0075sage\":{\"total_tokens\":5}}\n\n",
            "data: {\"choices\":[{\"finish_reason\":nul}]}\n\n",
            "data: {\"choices\":[{\"finish_reason\": \"stop\"}]}\n\n",
            "data: [DONE]\n\n",
            ": keep-alive\n\n",
            "id: 18446744073709551615\ndata:   [DONE]  \n\n",
        ];
        let mut plain = 0;
        for event in events {
            let e = event.as_bytes();
            assert_eq!(classify(e), read(e), "{event}");
            plain += usize::from(plainly_other(e));
        }
        // The token chunks, the escaped keys, the invalid and the spaced finish reasons,
        // `[DONE]` (however long its event) and a comment are told without reading.
        assert_eq!(plain, 9);
        assert_eq!(classify(events[12].as_bytes()), Event::Done);
        for (at, event) in [
            (2, Event::Finishing),
            (3, Event::Other),
            (
                5,
                Event::Usage {
                    tokens: Some(5),
                    fingerprint: None,
                },
            ),
            (6, Event::Other),
            (9, Event::Other),
        ] {
            assert_eq!(read(events[at].as_bytes()), event, "{}", events[at]);
        }
    }

    #[test]
    fn a_frame_of_plain_events_passes_as_it_came() {
        let mut strip = Strip::new(64 * 1024, Engine::new(&Fingerprints::default(), &key(1)));
        let first = WITH_USAGE.split_inclusive("\n\n").next().unwrap();
        let frame = Bytes::from(format!("{first}{first}"));
        let out = strip.pass(frame.clone());
        assert_eq!(out, frame);
        assert_eq!(out.as_ptr(), frame.as_ptr(), "not copied");
        // Its start, while the rest waits for its end.
        let frame = Bytes::from(format!("{first}data: {{\"cho"));
        let out = strip.pass(frame.clone());
        assert_eq!(out, first.as_bytes());
        assert_eq!(out.as_ptr(), frame.as_ptr(), "not copied");
    }

    /// The spliced body says what the old rewrite through a map said, and keeps the client's
    /// bytes otherwise.
    #[test]
    fn the_body_asking_for_usage_is_the_clients_with_the_option_added() {
        let spliced = ask_usage(b"{\"model\":\"m\", \"stream\" : true }\n").unwrap();
        assert_eq!(
            String::from_utf8_lossy(&spliced),
            "{\"model\":\"m\", \"stream\" : true ,\"stream_options\":{\"include_usage\":true}}\n"
        );
        for body in [
            &br#"{"model":"m","stream":true,"messages":[{"role":"user","content":"a \"}\" \u00e9"}]}"#[..],
            br#"{"stream":false,"stream":true}"#,
            br#"{"model":"m","stream":true,"stream_options":null}"#,
            br#"{"model":"m","stream":true,"stream_options":{"include_usage":false,"x":1}}"#,
        ] {
            let asked: Value = serde_json::from_slice(&ask_usage(body).unwrap()).unwrap();
            let mut expected: Map<String, Value> = serde_json::from_slice(body).unwrap();
            let options = expected
                .entry("stream_options")
                .or_insert(Value::Null);
            if !options.is_object() {
                *options = serde_json::json!({});
            }
            options["include_usage"] = Value::Bool(true);
            assert_eq!(asked, Value::Object(expected), "{}", String::from_utf8_lossy(body));
        }
        for not_asked in [
            &br#"{"stream":true,"stream":false}"#[..],
            br#"{"stream":false,"echo":true}"#,
            br#"{"stream":"true"}"#,
            br#"{"stream":true,"stream_options":[]}"#,
            br#"{"stream":true} x"#,
            br#"[{"stream":true}]"#,
            b"{\"stream\":true,\"x\":\"\xff\"}",
        ] {
            assert_eq!(
                ask_usage(not_asked),
                None,
                "{}",
                String::from_utf8_lossy(not_asked)
            );
        }
    }

    /// Where [`quick_top`] answers (on usual bodies, odd ones and every body made from them
    /// by cutting, deleting, changing or adding a byte), [`ask_usage`] answers what it answers
    /// through `serde_json` alone.
    #[test]
    fn the_quick_top_is_serde_jsons() {
        const BODIES: [&str; 9] = [
            r#"{"model":"m","messages":[{"role":"user","content":"Tell me \"more\" \u00e9"}],"max_tokens":16,"stream":true}"#,
            r#"{"model":"m","prompt":"a","stream":false,"n":2,"temperature":0.5e-1}"#,
            r#"{ "stream" : true , "stream" : null, "x": [true, {"stream": false}] }"#,
            r#"{"stream":false,"stream":true,"logit_bias":{"1":-100}}"#,
            r#"{"stream":true,"stream_options":{"include_usage":false}}"#,
            r#"{"stream":true,"stream_options":null}"#,
            r#"{"stream":"true"}"#,
            r#"{"stream":1,"stream":true}"#,
            r#"{"st\u0072eam":true}"#,
        ];
        for body in &BODIES[..2] {
            assert!(quick_top(body.as_bytes()).is_some(), "{body}");
        }
        let bytes = b"\"\\,:{}[]tn0-1 e.E+\x01\xff\tu";
        let (mut tried, mut answered) = (0, 0);
        let mut check = |body: &[u8]| {
            tried += 1;
            if quick_top(body).is_some() {
                answered += 1;
                assert_eq!(
                    ask_usage(body),
                    ask_usage_reading(body, false),
                    "{}",
                    String::from_utf8_lossy(body)
                );
            }
        };
        for body in BODIES {
            each_mutation(body.as_bytes(), bytes, &mut check);
        }
        assert!(answered * 4 > tried, "{answered} of {tried}");
    }

    /// Where the end of a body answers ([`stream_at_end`]), it answers what reading the body
    /// whole does, on each of these and every body made from them by cutting, deleting,
    /// changing or adding a byte that is JSON; and the usual requests are answered there.
    #[test]
    fn the_end_of_the_body_answers_as_its_reading_whole() {
        const BODIES: [&str; 8] = [
            r#"{"model":"m","messages":[{"role":"user","content":"Tell me"}],"max_tokens":16,"stream":true}"#,
            r#"{"model":"m","prompt":"a","stream":false}"#,
            r#"{"messages":[],"model":"m","stream":true,"temperature":0.7,"top_p":1,"user":"u"}"#,
            r#"{"model":"m","stream":true,"stream_options":{"include_usage":false},"n":1}"#,
            r#"{"stream":true,"tools":[{"stream":false}],"x":null}"#,
            r#"{"x":{"stream":true},"y":"a\"b","stream":null}"#,
            r#" { "stream" : true , "model" : "m" } "#,
            r#"{"model":"m","max_tokens":16}"#,
        ];
        let end = |body: &str| stream_at_end(body.as_bytes());
        assert_eq!(end(BODIES[0]), Some(Some(BODIES[0].len() - 1)));
        assert_eq!(end(BODIES[1]), Some(None));
        assert_eq!(end(BODIES[2]), Some(Some(BODIES[2].len() - 1)));
        assert_eq!(end(BODIES[6]), Some(Some(BODIES[6].len() - 2)));
        assert_eq!(end(BODIES[7]), Some(None));
        // Read from the start: `stream_options`, a member not plain after `stream`, an escape.
        assert_eq!(end(BODIES[3]), None);
        assert_eq!(end(BODIES[4]), None);
        assert_eq!(end(r#"{"st\u0072eam":true}"#), None);
        let bytes = b"\"\\,:{}[]tn0-1 e.Eu";
        let (mut json, mut answered) = (0, 0);
        let mut check = |body: &[u8]| {
            if serde_json::from_slice::<Value>(body).is_err() {
                return;
            }
            json += 1;
            if let Some(at_end) = stream_at_end(body) {
                answered += 1;
                assert_eq!(
                    at_end.map(|close| with_usage_asked(body, close)),
                    ask_usage_reading(body, false),
                    "{}",
                    String::from_utf8_lossy(body)
                );
            }
        };
        for body in BODIES {
            each_mutation(body.as_bytes(), bytes, &mut check);
        }
        assert!(answered * 2 > json, "{answered} of {json}");
    }

    #[test]
    fn the_body_asks_for_usage_only_when_streamed_and_not_asked() {
        let asked = ask_usage(
            br#"{"model":"m","stream":true,"stream_options":{"continuous_usage_stats":true}}"#,
        )
        .unwrap();
        let v: Value = serde_json::from_slice(&asked).unwrap();
        assert_eq!(
            v["stream_options"],
            serde_json::json!({"include_usage": true})
        );
        let asked = ask_usage(br#"{"model":"m","stream":true}"#).unwrap();
        let v: Value = serde_json::from_slice(&asked).unwrap();
        assert_eq!(v["stream_options"]["include_usage"], true);
        assert_eq!(v["model"], "m");
        assert!(ask_usage(br#"{"model":"m","stream":false}"#).is_none());
        assert!(ask_usage(br#"{"model":"m"}"#).is_none());
        assert!(
            ask_usage(br#"{"model":"m","stream":true,"stream_options":{"include_usage":true}}"#)
                .is_none()
        );
        assert!(ask_usage(b"not json").is_none());
    }
}
