//! Just enough of Server-Sent Events to find the pieces of a streamed answer and to tell the
//! opening role chunk from real output.
//!
//! A *piece* is one SSE event: its bytes up to and including the blank line that ends it. The
//! scanner keeps its place across frames, so an event split over several frames is measured
//! whole, and a frame holding many events is measured event by event.

/// Finds event ends in a byte stream, one frame at a time, and measures the event being read.
#[derive(Debug)]
pub(crate) struct EventScanner {
    /// Bytes of the current (unfinished) event seen so far.
    current: usize,
    /// Whether the last byte ended a line (so a line ending now ends the event).
    at_line_start: bool,
    /// The largest event allowed, in bytes.
    max_piece: usize,
}

/// An event grew past the piece bound.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Oversized;

impl EventScanner {
    /// A scanner at the start of a stream.
    pub(crate) fn new(max_piece: usize) -> Self {
        Self {
            current: 0,
            at_line_start: true,
            max_piece,
        }
    }

    /// Scans `data[from..]`. Returns the index just past the first event end found there, or
    /// `None` when no event ends in it (the current event then continues in the next frame).
    /// An event ends with a blank line (`\n\n`, `\r\n\r\n`); lines are found with `memchr`.
    pub(crate) fn next_end(
        &mut self,
        data: &[u8],
        from: usize,
    ) -> Result<Option<usize>, Oversized> {
        let rest = data.get(from..).unwrap_or_default();
        let mut at = 0;
        for newline in memchr::memchr_iter(b'\n', rest) {
            let line = rest.get(at..newline).unwrap_or_default();
            let blank = self.at_line_start && line.iter().all(|&b| b == b'\r');
            self.current += newline + 1 - at;
            if self.current > self.max_piece {
                return Err(Oversized);
            }
            self.at_line_start = true;
            at = newline + 1;
            if blank {
                self.current = 0;
                return Ok(Some(from + at));
            }
        }
        let tail = rest.get(at..).unwrap_or_default();
        self.current += tail.len();
        if self.current > self.max_piece {
            return Err(Oversized);
        }
        if tail.iter().any(|&b| b != b'\r') {
            self.at_line_start = false;
        }
        Ok(None)
    }

    /// Scans a whole frame, only measuring (after the first output).
    pub(crate) fn measure(&mut self, data: &[u8]) -> Result<(), Oversized> {
        let mut at = 0;
        while let Some(end) = self.next_end(data, at)? {
            at = end;
        }
        Ok(())
    }
}

/// Whether one complete SSE event is output: anything but a comment, a `[DONE]`, or a chunk
/// whose choices only name the role (`"delta":{"role":"assistant"}`, possibly with an empty
/// `content`) and carry no finish reason.
///
/// NB: something that is not JSON counts as output: the engine said something.
pub(crate) fn is_output(event: &[u8]) -> bool {
    let mut data: Option<&[u8]> = None;
    let mut several = false;
    for line in event.split(|&b| b == b'\n') {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        if let Some(rest) = line.strip_prefix(b"data:") {
            let rest = rest.strip_prefix(b" ").unwrap_or(rest);
            if data.is_some() {
                several = true;
            }
            data = Some(rest);
        }
    }
    let Some(data) = data else {
        // A comment, a keep-alive or an event with no data.
        return false;
    };
    if several {
        // Multi-line data: rare for engines; an answer in any case.
        return true;
    }
    if data == b"[DONE]" {
        return false;
    }
    let Ok(value) = serde_json::from_slice::<serde_json::Value>(data) else {
        return true;
    };
    let Some(choices) = value.get("choices").and_then(|c| c.as_array()) else {
        return true;
    };
    !choices.iter().all(role_only)
}

/// A choice that carries nothing but the role.
fn role_only(choice: &serde_json::Value) -> bool {
    let Some(choice) = choice.as_object() else {
        return false;
    };
    if !choice
        .get("finish_reason")
        .is_none_or(serde_json::Value::is_null)
    {
        return false;
    }
    if choice.get("text").is_some_and(|t| !empty(t)) {
        return false;
    }
    match choice.get("delta") {
        None => true,
        Some(serde_json::Value::Object(delta)) => delta
            .iter()
            .all(|(key, value)| key == "role" || empty(value)),
        Some(_) => false,
    }
}

/// `null`, `""` or `[]`.
fn empty(value: &serde_json::Value) -> bool {
    match value {
        serde_json::Value::Null => true,
        serde_json::Value::String(s) => s.is_empty(),
        serde_json::Value::Array(a) => a.is_empty(),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn finds_event_ends_across_frames() {
        let mut s = EventScanner::new(1024);
        assert_eq!(s.next_end(b"data: a\n", 0), Ok(None));
        assert_eq!(s.next_end(b"\ndata: b\n\n", 0), Ok(Some(1)));
        assert_eq!(s.next_end(b"\ndata: b\n\n", 1), Ok(Some(10)));
        assert_eq!(s.next_end(b"data: c\r\n\r\n", 0), Ok(Some(11)));
    }

    #[test]
    fn an_event_split_anywhere_is_found_whole() {
        let stream = b"data: one\n\ndata: two\r\n\r\n: c\n\ndata: x\ndata: y\n\n";
        let whole: Vec<usize> = {
            let mut s = EventScanner::new(1024);
            let mut ends = Vec::new();
            let mut at = 0;
            while let Some(end) = s.next_end(stream, at).unwrap() {
                ends.push(end);
                at = end;
            }
            ends
        };
        assert_eq!(whole, [11, 24, 29, 46]);
        for cut in 0..stream.len() {
            let mut s = EventScanner::new(1024);
            let mut ends = Vec::new();
            for (offset, part) in [(0, &stream[..cut]), (cut, &stream[cut..])] {
                let mut at = 0;
                while let Some(end) = s.next_end(part, at).unwrap() {
                    ends.push(offset + end);
                    at = end;
                }
            }
            assert_eq!(ends, whole, "split at {cut}");
        }
    }

    #[test]
    fn measures_each_event_not_the_frame() {
        let mut s = EventScanner::new(16);
        let many = b"data: 123456\n\n".repeat(100);
        assert_eq!(s.measure(&many), Ok(()));
        let mut s = EventScanner::new(16);
        assert_eq!(s.measure(b"data: 12345678"), Ok(()));
        assert_eq!(s.measure(b"12345678\n\n"), Err(Oversized));
    }

    #[test]
    fn role_chunk_is_not_output() {
        let role = br#"data: {"id":"x","choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]}

"#;
        assert!(!is_output(role));
        let role_only = br#"data: {"choices":[{"index":0,"delta":{"role":"assistant"}}]}

"#;
        assert!(!is_output(role_only));
        assert!(!is_output(b": keep-alive\n\n"));
        assert!(!is_output(b"data: [DONE]\n\n"));
    }

    #[test]
    fn content_and_errors_are_output() {
        assert!(is_output(
            br#"data: {"choices":[{"index":0,"delta":{"content":"Hi"},"finish_reason":null}]}

"#
        ));
        assert!(is_output(
            br#"data: {"choices":[{"index":0,"delta":{"role":"assistant","content":"Hi"}}]}

"#
        ));
        assert!(is_output(
            br#"data: {"choices":[{"index":0,"text":"Hi","finish_reason":null}]}

"#
        ));
        assert!(is_output(
            br#"data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}

"#
        ));
        assert!(is_output(
            br#"data: {"error":{"message":"boom"}}

"#
        ));
        assert!(is_output(b"data: not json\n\n"));
    }
}
