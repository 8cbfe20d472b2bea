//! Asking the engine for a streamed answer's usage on a tenant's behalf, and taking that usage
//! back out of the stream, so that the client receives the bytes it would have without it.
//!
//! NB (design): only for a tenant with `tokens_per_minute` and a streamed request that did not
//! ask for usage itself ([`ask_usage`]): its forwarded body gets
//! `stream_options.include_usage = true` (and loses a `continuous_usage_stats`, which had no
//! effect without `include_usage`, so that the engine does not put usage on every chunk).
//! The engine then ends the stream with one chunk whose `choices` are empty and which carries
//! the `usage`; [`Strip`] reads every event of the answer as it passes and drops that one.
//! - What vLLM 0.32 also changes (`chat_completion/serving.py`, `completion/serving.py`): with
//!   `include_usage` it puts `system_fingerprint` on the usage chunk instead of on the chunk that
//!   carries the `finish_reason`. [`Strip`] holds a chunk with a finish reason and no
//!   fingerprint until the next event: the usage chunk, whose fingerprint is then written last
//!   into it (where vLLM writes the field), or any other event, which releases it unchanged
//!   (with `n` > 1 only the last choice's finishing chunk is followed by the usage chunk; the
//!   others go out without the fingerprint rather than wait). No other event waits.
//! - An event split over frames is held until its end (an SSE client reads nothing of an event
//!   before its blank line). What is held is bounded by `max_piece` (the stream is cut past it
//!   anyway); past the bound the strip gives up and passes everything on unchanged.

use bytes::{Bytes, BytesMut};
use serde::Deserialize;
use serde_json::{Map, Value};

use super::sse::EventScanner;

/// The forwarded body of a streamed request asking for its usage, or `None` when the request
/// is not streamed, already asks for usage, or is not an object this can read (forwarded as it
/// came; the engine answers it).
pub(crate) fn ask_usage(body: &[u8]) -> Option<Vec<u8>> {
    let mut request: Map<String, Value> = serde_json::from_slice(body).ok()?;
    if request.get("stream") != Some(&Value::Bool(true)) {
        return None;
    }
    match request.get_mut("stream_options") {
        None | Some(Value::Null) => {
            let mut options = Map::new();
            options.insert("include_usage".into(), Value::Bool(true));
            request.insert("stream_options".into(), Value::Object(options));
        }
        Some(Value::Object(options)) => {
            if options.get("include_usage") == Some(&Value::Bool(true)) {
                return None;
            }
            options.insert("include_usage".into(), Value::Bool(true));
            options.remove("continuous_usage_stats");
        }
        Some(_) => return None,
    }
    serde_json::to_vec(&request).ok()
}

/// Takes the usage chunk out of a streamed answer (see the module's note).
pub(crate) struct Strip {
    scanner: EventScanner,
    /// The start of the event being read (not ended in the frames so far).
    partial: BytesMut,
    /// A chunk with a finish reason and no fingerprint, waiting for the next event.
    finishing: Option<Bytes>,
    /// The usage chunk's `total_tokens`, once it passed.
    pub(crate) tokens: Option<u64>,
    max_piece: usize,
    /// Gave up (an event past `max_piece`): everything passes unchanged.
    off: bool,
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

/// What one event is, to the strip.
enum Event {
    Usage {
        tokens: Option<u64>,
        fingerprint: Option<String>,
    },
    Finishing,
    Other,
}

fn classify(event: &[u8]) -> Event {
    let mut data = None;
    for line in event.split(|&b| b == b'\n') {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        if let Some(rest) = line.strip_prefix(b"data:") {
            if data.is_some() {
                return Event::Other;
            }
            data = Some(rest.strip_prefix(b" ").unwrap_or(rest));
        }
    }
    let Some(Ok(chunk)) = data.map(serde_json::from_slice::<Chunk>) else {
        return Event::Other;
    };
    match (chunk.choices, chunk.usage) {
        (Some(choices), Some(usage)) if choices.is_empty() => Event::Usage {
            tokens: usage.total_tokens,
            fingerprint: chunk.system_fingerprint,
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

/// `event` (`data: {...}` and its blank line) with `"system_fingerprint":<fingerprint>` as its
/// object's last field.
fn with_fingerprint(event: &[u8], fingerprint: &str) -> Bytes {
    let Some(close) = memchr::memrchr(b'}', event) else {
        return Bytes::copy_from_slice(event);
    };
    let value = serde_json::to_string(fingerprint).unwrap_or_default();
    let mut out = BytesMut::with_capacity(event.len() + value.len() + 24);
    out.extend_from_slice(&event[..close]);
    out.extend_from_slice(b",\"system_fingerprint\":");
    out.extend_from_slice(value.as_bytes());
    out.extend_from_slice(&event[close..]);
    out.freeze()
}

impl Strip {
    pub(crate) fn new(max_piece: usize) -> Self {
        Self {
            scanner: EventScanner::new(max_piece),
            partial: BytesMut::new(),
            finishing: None,
            tokens: None,
            max_piece,
            off: false,
        }
    }

    /// Whether it holds bytes not sent yet.
    pub(crate) fn holds(&self) -> bool {
        !self.partial.is_empty() || self.finishing.is_some()
    }

    /// What to send of the next frame `data` (possibly nothing, for now).
    pub(crate) fn pass(&mut self, data: Bytes) -> Bytes {
        if self.off {
            return data;
        }
        let mut out = BytesMut::new();
        let mut at = 0;
        loop {
            match self.scanner.next_end(&data, at) {
                Ok(Some(end)) => {
                    let piece = &data[at..end];
                    at = end;
                    if self.partial.is_empty() {
                        self.event(piece, &mut out);
                    } else {
                        self.partial.extend_from_slice(piece);
                        let whole = std::mem::take(&mut self.partial);
                        self.event(&whole, &mut out);
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
        if self.off
            || self.partial.len() + self.finishing.as_ref().map_or(0, Bytes::len) > self.max_piece
        {
            self.off = true;
            if let Some(f) = self.finishing.take() {
                out.extend_from_slice(&f);
            }
            out.extend_from_slice(&std::mem::take(&mut self.partial));
        }
        out.freeze()
    }

    fn event(&mut self, event: &[u8], out: &mut BytesMut) {
        match classify(event) {
            Event::Usage {
                tokens,
                fingerprint,
            } => {
                self.tokens = tokens;
                if let Some(f) = self.finishing.take() {
                    match &fingerprint {
                        Some(fp) => out.extend_from_slice(&with_fingerprint(&f, fp)),
                        None => out.extend_from_slice(&f),
                    }
                }
            }
            Event::Finishing => {
                if let Some(f) = self.finishing.take() {
                    out.extend_from_slice(&f);
                }
                self.finishing = Some(Bytes::copy_from_slice(event));
            }
            Event::Other => {
                if let Some(f) = self.finishing.take() {
                    out.extend_from_slice(&f);
                }
                out.extend_from_slice(event);
            }
        }
    }

    /// What it still holds, at the answer's end.
    pub(crate) fn finish(&mut self) -> Option<Bytes> {
        let mut out = BytesMut::new();
        if let Some(f) = self.finishing.take() {
            out.extend_from_slice(&f);
        }
        out.extend_from_slice(&std::mem::take(&mut self.partial));
        (!out.is_empty()).then(|| out.freeze())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

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

    fn run(frames: &[&[u8]]) -> (Vec<u8>, Option<u64>) {
        let mut strip = Strip::new(64 * 1024);
        let mut out = Vec::new();
        for f in frames {
            out.extend_from_slice(&strip.pass(Bytes::copy_from_slice(f)));
        }
        out.extend_from_slice(&strip.finish().unwrap_or_default());
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
    fn a_complete_event_is_never_held_except_a_finishing_one_until_the_next() {
        let mut strip = Strip::new(64 * 1024);
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
        let mut strip = Strip::new(16);
        let long = Bytes::from_static(b"data: 0123456789012345678901234567890");
        assert_eq!(strip.pass(long.clone()), long);
        assert!(!strip.holds());
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
