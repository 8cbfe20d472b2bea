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
        self.measure_ends(data, 0, None).map(|_| ())
    }

    /// [`EventScanner::measure`], putting where each event ends in `data` (plus `base`) last
    /// in `ends` when given, while it holds fewer than its bound; whether it held them all
    /// (`true` without `ends`).
    pub(crate) fn measure_ends(
        &mut self,
        data: &[u8],
        base: usize,
        mut ends: Option<(&mut Vec<usize>, usize)>,
    ) -> Result<bool, Oversized> {
        let mut at = 0;
        let mut all = true;
        while let Some(end) = self.next_end(data, at)? {
            if let Some((ends, bound)) = &mut ends {
                if ends.len() < *bound {
                    ends.push(base + end);
                } else {
                    all = false;
                }
            }
            at = end;
        }
        Ok(all)
    }
}

/// The `data:` lines of one SSE event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Data<'a> {
    /// None (a comment, a keep-alive).
    None,
    /// One: its value.
    One(&'a [u8]),
    /// Several (multi-line data): the first one's value.
    Several(&'a [u8]),
}

/// The `data:` lines of `event` (one whole event), each value without the line's `\r` ending
/// and one leading space; looked for up to the second one. The one reading of them for the
/// stream's first output ([`is_output`]), the usage strip and a stream's adapter error
/// (`lost`); its lines found with `memchr`.
pub(crate) fn data_of(event: &[u8]) -> Data<'_> {
    one_line_data(event).map_or_else(|| data_of_lines(event), Data::One)
}

/// The data of `event` when it is the engines' usual `data: <data>\n\n` (its only newlines
/// the two that end it, no `\r` before them): what [`data_of_lines`] finds there, without
/// going through its lines.
pub(crate) fn one_line_data(event: &[u8]) -> Option<&[u8]> {
    let data = event.strip_prefix(b"data: ")?.strip_suffix(b"\n\n")?;
    if data.last() == Some(&b'\r') || memchr::memchr(b'\n', data).is_some() {
        return None;
    }
    Some(data)
}

/// [`data_of`] read line by line, whatever the event's form.
pub(crate) fn data_of_lines(event: &[u8]) -> Data<'_> {
    let mut first = None;
    for line in crate::tenants::lines_of(event) {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        if let Some(rest) = line.strip_prefix(b"data:") {
            let value = rest.strip_prefix(b" ").unwrap_or(rest);
            match first {
                None => first = Some(value),
                Some(first) => return Data::Several(first),
            }
        }
    }
    first.map_or(Data::None, Data::One)
}

/// Whether an event's data is `[DONE]`, the engines' end of a stream (whitespace around it
/// allowed, as the usage strip reads a chunk's keys): the rule for an event read, for the
/// stream's first output ([`is_output`]) and the usage strip. (The strip's warning of a stream
/// that ended without its usage chunk looks only at whether a frame ends with the engines'
/// exact `data: [DONE]\n\n`.)
pub(crate) fn is_done(data: &[u8]) -> bool {
    data.trim_ascii() == b"[DONE]"
}

/// Whether one complete SSE event is output: anything but a comment, a `[DONE]`, or a chunk
/// whose choices only name the role (`"delta":{"role":"assistant"}`, possibly with an empty
/// `content`) and carry no finish reason.
///
/// NB: something that is not JSON counts as output: the engine said something.
pub(crate) fn is_output(event: &[u8]) -> bool {
    let data = match data_of(event) {
        // A comment, a keep-alive or an event with no data.
        Data::None => return false,
        // Multi-line data: rare for engines; an answer in any case.
        Data::Several(_) => return true,
        Data::One(data) => data,
    };
    if is_done(data) {
        return false;
    }
    // Anything that does not read as a chunk (not JSON, no `choices` array, a choice that is
    // not an object, a `delta` that is not one) is output.
    match serde_json::from_slice::<Chunk>(data) {
        Ok(chunk) => !chunk.choices.is_some_and(|all| all.0),
        Err(_) => true,
    }
}

// NB: read with these types rather than into a `serde_json::Value`, which builds a map and a
// string for every field of the chunk only to look at three: that was about a fifth of the
// listener's instructions for a streamed answer of 16 pieces (callgrind), for the one or two
// events before the first output. These allocate nothing. On a well-formed chunk they answer
// as the `Value` reading did (the tests hold both to the same answers); on a malformed one they
// may not (a field repeated inside `delta` counts if any of its values is not empty, a repeated
// field of the wrong type fails the chunk, a value they skip is not checked), which only moves
// when a malformed stream is counted as having begun.

/// An OpenAI-style streamed chunk, as far as `is_output` needs it.
#[derive(Default)]
struct Chunk {
    /// `None`: no `choices` (or `null`).
    choices: Option<AllRoleOnly>,
}

/// Whether every choice of an array only names the role.
struct AllRoleOnly(bool);

/// What a choice carries besides the role: a finish reason, a `text` that is not empty, a
/// `delta` with more than the role. A field given twice counts as its last, as in a
/// `serde_json::Value`.
#[derive(Default)]
struct Choice {
    finish_reason: bool,
    text: bool,
    delta: bool,
}

/// Whether a `delta` has a field, but `role`, that is not empty.
#[derive(Default)]
struct Delta {
    carries: bool,
}

/// The field names `is_output` looks at, read without allocating (a key with escapes too).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Key {
    Choices,
    FinishReason,
    Text,
    Delta,
    Role,
    Other,
}

impl<'de> serde::Deserialize<'de> for Key {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visit;
        impl serde::de::Visitor<'_> for Visit {
            type Value = Key;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a field name")
            }
            fn visit_str<E>(self, key: &str) -> Result<Key, E> {
                Ok(match key {
                    "choices" => Key::Choices,
                    "finish_reason" => Key::FinishReason,
                    "text" => Key::Text,
                    "delta" => Key::Delta,
                    "role" => Key::Role,
                    _ => Key::Other,
                })
            }
        }
        deserializer.deserialize_str(Visit)
    }
}

/// Whether a value is empty: `null`, `""` or `[]`.
struct Empty(bool);

/// A JSON object read field by field: the chunk, a choice, a delta. An object only (derived
/// `Deserialize` would take an array too; anything else, `null` included, fails the chunk,
/// which makes it output).
trait Object: Default {
    /// What the error says was expected.
    const WHAT: &'static str;

    /// Takes the value of the field `key` from `map`, or skips it.
    fn field<'de, A: serde::de::MapAccess<'de>>(
        &mut self,
        key: Key,
        map: &mut A,
    ) -> Result<(), A::Error>;
}

/// Reads an [`Object`], field by field.
fn deserialize_object<'de, D: serde::Deserializer<'de>, T: Object>(
    deserializer: D,
) -> Result<T, D::Error> {
    struct Visit<T>(std::marker::PhantomData<T>);
    impl<'de, T: Object> serde::de::Visitor<'de> for Visit<T> {
        type Value = T;
        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str(T::WHAT)
        }
        fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<T, A::Error> {
            let mut object = T::default();
            while let Some(key) = map.next_key::<Key>()? {
                object.field(key, &mut map)?;
            }
            Ok(object)
        }
    }
    deserializer.deserialize_map(Visit(std::marker::PhantomData))
}

impl Object for Chunk {
    const WHAT: &'static str = "a chunk";

    fn field<'de, A: serde::de::MapAccess<'de>>(
        &mut self,
        key: Key,
        map: &mut A,
    ) -> Result<(), A::Error> {
        if key == Key::Choices {
            self.choices = map.next_value::<Option<AllRoleOnly>>()?;
        } else {
            map.next_value::<serde::de::IgnoredAny>()?;
        }
        Ok(())
    }
}

impl Object for Choice {
    const WHAT: &'static str = "a choice";

    fn field<'de, A: serde::de::MapAccess<'de>>(
        &mut self,
        key: Key,
        map: &mut A,
    ) -> Result<(), A::Error> {
        match key {
            Key::FinishReason => {
                self.finish_reason = map.next_value::<Option<serde::de::IgnoredAny>>()?.is_some();
            }
            Key::Text => self.text = !map.next_value::<Empty>()?.0,
            Key::Delta => self.delta = map.next_value::<Delta>()?.carries,
            _ => {
                map.next_value::<serde::de::IgnoredAny>()?;
            }
        }
        Ok(())
    }
}

impl Object for Delta {
    const WHAT: &'static str = "a delta";

    fn field<'de, A: serde::de::MapAccess<'de>>(
        &mut self,
        key: Key,
        map: &mut A,
    ) -> Result<(), A::Error> {
        if key == Key::Role {
            map.next_value::<serde::de::IgnoredAny>()?;
        } else {
            self.carries |= !map.next_value::<Empty>()?.0;
        }
        Ok(())
    }
}

impl<'de> serde::Deserialize<'de> for Chunk {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserialize_object(deserializer)
    }
}

impl<'de> serde::Deserialize<'de> for Choice {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserialize_object(deserializer)
    }
}

impl<'de> serde::Deserialize<'de> for Delta {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserialize_object(deserializer)
    }
}

impl<'de> serde::Deserialize<'de> for AllRoleOnly {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visit;
        impl<'de> serde::de::Visitor<'de> for Visit {
            type Value = AllRoleOnly;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("an array of choices")
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> Result<AllRoleOnly, A::Error> {
                let mut all = true;
                while let Some(choice) = seq.next_element::<Choice>()? {
                    all &= !(choice.finish_reason || choice.text || choice.delta);
                }
                Ok(AllRoleOnly(all))
            }
        }
        deserializer.deserialize_seq(Visit)
    }
}

impl<'de> serde::Deserialize<'de> for Empty {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visit;
        impl<'de> serde::de::Visitor<'de> for Visit {
            type Value = Empty;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("any value")
            }
            fn visit_unit<E>(self) -> Result<Empty, E> {
                Ok(Empty(true))
            }
            fn visit_none<E>(self) -> Result<Empty, E> {
                Ok(Empty(true))
            }
            fn visit_str<E>(self, s: &str) -> Result<Empty, E> {
                Ok(Empty(s.is_empty()))
            }
            fn visit_bool<E>(self, _: bool) -> Result<Empty, E> {
                Ok(Empty(false))
            }
            fn visit_i64<E>(self, _: i64) -> Result<Empty, E> {
                Ok(Empty(false))
            }
            fn visit_u64<E>(self, _: u64) -> Result<Empty, E> {
                Ok(Empty(false))
            }
            fn visit_f64<E>(self, _: f64) -> Result<Empty, E> {
                Ok(Empty(false))
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> Result<Empty, A::Error> {
                let mut empty = true;
                while seq.next_element::<serde::de::IgnoredAny>()?.is_some() {
                    empty = false;
                }
                Ok(Empty(empty))
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> Result<Empty, A::Error> {
                while map
                    .next_entry::<serde::de::IgnoredAny, serde::de::IgnoredAny>()?
                    .is_some()
                {}
                Ok(Empty(false))
            }
        }
        deserializer.deserialize_any(Visit)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use crate::proxy::fuzz::is_output_by_value;

    #[test]
    fn finds_event_ends_across_frames() {
        let mut s = EventScanner::new(1024);
        assert_eq!(s.next_end(b"data: a\n", 0), Ok(None));
        assert_eq!(s.next_end(b"\ndata: b\n\n", 0), Ok(Some(1)));
        assert_eq!(s.next_end(b"\ndata: b\n\n", 1), Ok(Some(10)));
        assert_eq!(s.next_end(b"data: c\r\n\r\n", 0), Ok(Some(11)));
    }

    /// `measure_ends` puts the ends `next_end` finds, from `base`, up to its bound.
    #[test]
    fn measured_ends_are_the_scanners() {
        let stream = b"data: a\n\ndata: b\r\n\r\n: c\n\ndata: d";
        let mut s = EventScanner::new(1024);
        let mut ends = vec![1];
        assert_eq!(s.measure_ends(stream, 10, Some((&mut ends, 8))), Ok(true));
        assert_eq!(ends, [1, 19, 30, 35]);
        let mut s = EventScanner::new(1024);
        let mut ends = Vec::new();
        assert_eq!(s.measure_ends(stream, 0, Some((&mut ends, 2))), Ok(false));
        assert_eq!(ends, [9, 20]);
        assert_eq!(s.measure_ends(b"\n\n", 0, Some((&mut ends, 8))), Ok(true));
        assert_eq!(ends, [9, 20, 2]);
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
    fn a_chunk_is_output_exactly_when_its_json_says_so() {
        let cases = [
            r#"{"id":"x","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]}"#,
            r#"{"choices":[{"index":0,"delta":{"role":"assistant","content":null,"tool_calls":[]}}]}"#,
            r#"{"choices":[{"index":0,"delta":{"role":"assistant","tool_calls":[{"id":"t"}]}}]}"#,
            r#"{"choices":[{"index":0,"delta":{"role":"assistant","reasoning_content":"hm"}}]}"#,
            r#"{"choices":[{"index":0,"delta":{"content":"Hi \"there\"\u00e9"}}]}"#,
            r#"{"choices":[{"index":0,"delta":{"content":"\u0000"}}]}"#,
            r#"{"choices":[{"index":0,"delta":{"n":0}}]}"#,
            r#"{"choices":[{"index":0,"delta":{"b":false}}]}"#,
            r#"{"choices":[{"index":0,"delta":{"o":{}}}]}"#,
            r#"{"choices":[{"index":0,"delta":{"f":1.5}}]}"#,
            r#"{"choices":[{"index":0,"delta":null}]}"#,
            r#"{"choices":[{"index":0,"delta":"x"}]}"#,
            r#"{"choices":[{"index":0,"delta":[]}]}"#,
            r#"{"choices":[{"index":0}]}"#,
            r#"{"choices":[{"index":0,"text":""}]}"#,
            r#"{"choices":[{"index":0,"text":null}]}"#,
            r#"{"choices":[{"index":0,"text":[]}]}"#,
            r#"{"choices":[{"index":0,"text":"a"}]}"#,
            r#"{"choices":[{"index":0,"text":0}]}"#,
            r#"{"choices":[{"index":0,"finish_reason":"stop"}]}"#,
            r#"{"choices":[{"index":0,"finish_reason":null}]}"#,
            r#"{"choices":[{"index":0,"finish_reason":0}]}"#,
            r#"{"choices":[{"delta":{"role":"assistant"}},{"delta":{"content":"x"}}]}"#,
            r#"{"choices":[{"delta":{"role":"assistant"}},{"delta":{"role":"assistant"}}]}"#,
            r#"{"choices":[]}"#,
            r#"{"choices":null}"#,
            r#"{"choices":{}}"#,
            r#"{"choices":"x"}"#,
            r#"{"choices":[1]}"#,
            r#"{"choices":[null]}"#,
            r#"{"choices":[[]]}"#,
            r#"{"choices":[{"delta":{"content":"x"},"delta":{"role":"assistant"}}]}"#,
            r#"{"choices":[{"delta":{"role":"assistant"}}],"choices":null}"#,
            r#"{"ch\u006fices":[{"delta":{"role":"assistant"}}]}"#,
            r#"{"choices":[{"delta":{"r\u006fle":"assistant","content":""}}]}"#,
            r#"{"usage":{"total_tokens":3}}"#,
            r#"{"error":{"message":"boom"}}"#,
            r#"[1,2]"#,
            r#""s""#,
            r#"null"#,
            r#"{"choices":[{"delta":{"role":"assistant"}}]"#,
            r#"{"choices":[{"delta":{"role":"assistant"}}]} trailing"#,
            "not json",
            "",
        ];
        for case in cases {
            let event = format!("data: {case}\n\n");
            assert_eq!(
                is_output(event.as_bytes()),
                is_output_by_value(case.as_bytes()),
                "{case}"
            );
        }
    }

    /// The data lines are read as splitting the event at every `\n` reads them: none, the
    /// value of one, or the first of several, with `\r` endings, spaces and other fields.
    #[test]
    fn the_data_lines_are_those_of_the_events_lines() {
        fn by_split(event: &[u8]) -> Data<'_> {
            let values: Vec<&[u8]> = event
                .split(|&b| b == b'\n')
                .filter_map(|line| line.strip_prefix(b"data:"))
                .map(|v| v.strip_suffix(b"\r").unwrap_or(v))
                .map(|v| v.strip_prefix(b" ").unwrap_or(v))
                .collect();
            match values[..] {
                [] => Data::None,
                [one] => Data::One(one),
                [first, ..] => Data::Several(first),
            }
        }
        let lines = [
            "data: {\"a\":1}",
            "data:{\"a\":2}\r",
            "data:  x",
            "data:",
            ": comment",
            "event: e",
            " data: y",
            "data: [DONE]\r",
            "",
        ];
        let mut several = 0;
        for a in lines {
            for b in lines {
                for end in ["\n\n", "\r\n\r\n", "\n"] {
                    let event = format!("{a}\n{b}{end}");
                    let data = data_of(event.as_bytes());
                    assert_eq!(data, by_split(event.as_bytes()), "{event:?}");
                    several += usize::from(matches!(data, Data::Several(_)));
                }
            }
        }
        assert!(several > 0);
        assert_eq!(data_of(b"data: a\r\n\r\n"), Data::One(b"a"));
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

    /// `[DONE]` is told by one rule, whitespace around it allowed (the usage strip's reading too).
    #[test]
    fn done_is_told_with_the_whitespace_around_it() {
        for event in [
            "data: [DONE]\n\n",
            "data:  [DONE] \r\n\r\n",
            "data:[DONE]\t\n\n",
        ] {
            assert!(!is_output(event.as_bytes()), "{event:?}");
        }
        for event in [
            "data: [DONE]x\n\n",
            "data: [DON]\n\n",
            "data: \"[DONE]\"\n\n",
        ] {
            assert!(is_output(event.as_bytes()), "{event:?}");
        }
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
