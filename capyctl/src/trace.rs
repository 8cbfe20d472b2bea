//! Request traces: what `capyctl simulate --trace` reads and `capyctl switches --export-trace`
//! writes. One JSON object a line:
//!
//! ```text
//! {"at_ms": 0, "model": "chat", "duration_ms": 1200}
//! {"at_ms": 250, "model": "code", "output_tokens": 64}
//! ```
//!
//! `at_ms`: when it arrives, in milliseconds from the trace's start; `model`: the name a request
//! puts in `model`; and either `duration_ms` (how long it runs once admitted) or
//! `output_tokens` (then it runs `output_tokens / token rate`: see `simulate.rs`). Other keys
//! are ignored: an exported trace also carries what was measured (`waited_ms`, `outcome`,
//! `status`, `arrived_ms`). Blank lines are skipped; lines need not be in order of `at_ms`.

use std::path::Path;
use std::time::Duration;

use serde::Deserialize;

use crate::client::Client;

/// How long a request of the trace runs once admitted.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Size {
    /// `duration_ms`.
    Duration(Duration),
    /// `output_tokens`, at the model's token rate.
    Tokens(u64),
}

/// One request of a trace.
#[derive(Debug, Clone, PartialEq)]
pub struct TraceRequest {
    /// Its line in the file (from 1).
    pub line: usize,
    /// When it arrives, from the trace's start.
    pub at: Duration,
    /// The model it names.
    pub model: String,
    /// How long it runs.
    pub size: Size,
    /// What the trace says it waited (`waited_ms`, an exported trace's), if it says.
    pub waited: Option<Duration>,
    /// What the trace says it ended with (`outcome`), if it says.
    pub outcome: Option<String>,
}

#[derive(Deserialize)]
struct Line {
    at_ms: Option<serde_json::Value>,
    model: Option<serde_json::Value>,
    duration_ms: Option<serde_json::Value>,
    output_tokens: Option<serde_json::Value>,
    waited_ms: Option<u64>,
    outcome: Option<String>,
}

/// The latest arrival a trace may have: a year, in milliseconds (past it the virtual clock
/// would overflow).
pub const MAX_AT_MS: u64 = 365 * 24 * 3600 * 1000;
/// The longest request: a week, in milliseconds.
pub const MAX_DURATION_MS: u64 = 7 * 24 * 3600 * 1000;
/// The most output tokens of one request.
pub const MAX_OUTPUT_TOKENS: u64 = 100_000_000;

fn whole(key: &str, v: &serde_json::Value) -> Result<u64, String> {
    v.as_u64()
        .ok_or_else(|| format!("`{key}` must be a whole number of at least 0, not {v}"))
}

/// [`whole`], at most `max`.
fn at_most(key: &str, v: &serde_json::Value, max: u64) -> Result<u64, String> {
    let n = whole(key, v)?;
    if n > max {
        return Err(format!("`{key}` is {n}; at most {max}"));
    }
    Ok(n)
}

/// Reads a trace's text; `name` names it in errors (`requests.jsonl:3: ...`).
pub fn parse(name: &str, text: &str) -> Result<Vec<TraceRequest>, String> {
    let mut out = Vec::new();
    for (i, raw) in text.lines().enumerate() {
        let line = i + 1;
        let at = |what: String| format!("{name}:{line}: {what}");
        if raw.trim().is_empty() {
            continue;
        }
        let l: Line = serde_json::from_str(raw).map_err(|e| {
            at(format!(
                "not a JSON object ({e}); expected e.g. {{\"at_ms\": 0, \"model\": \"chat\", \"duration_ms\": 1200}}"
            ))
        })?;
        let at_ms = l
            .at_ms
            .as_ref()
            .ok_or_else(|| at("`at_ms` is missing (milliseconds from the trace's start)".into()))
            .and_then(|v| at_most("at_ms", v, MAX_AT_MS).map_err(&at))?;
        let model = match &l.model {
            Some(serde_json::Value::String(s)) if !s.is_empty() => s.clone(),
            Some(v) => return Err(at(format!("`model` must be a non-empty string, not {v}"))),
            None => return Err(at("`model` is missing".into())),
        };
        let size = match (&l.duration_ms, &l.output_tokens) {
            (Some(d), None) => Size::Duration(Duration::from_millis(
                at_most("duration_ms", d, MAX_DURATION_MS).map_err(&at)?,
            )),
            (None, Some(t)) => {
                Size::Tokens(at_most("output_tokens", t, MAX_OUTPUT_TOKENS).map_err(&at)?)
            }
            (Some(_), Some(_)) => {
                return Err(at("give `duration_ms` or `output_tokens`, not both".into()));
            }
            (None, None) => {
                return Err(at(
                    "`duration_ms` or `output_tokens` is missing (how long the request runs)"
                        .into(),
                ));
            }
        };
        out.push(TraceRequest {
            line,
            at: Duration::from_millis(at_ms),
            model,
            size,
            waited: l.waited_ms.map(Duration::from_millis),
            outcome: l.outcome,
        });
    }
    if out.is_empty() {
        return Err(format!("{name}: the trace has no requests"));
    }
    out.sort_by_key(|r| (r.at, r.line));
    Ok(out)
}

/// Fuzz target of the trace reader (`fuzz/` and `fuzz-targets/`): arbitrary bytes as a trace.
/// A trace read is in arrival order, every request within the bounds and naming a model, and
/// an error names the trace. Not part of the crate's API.
#[doc(hidden)]
pub fn fuzz(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    match parse("t.jsonl", &text) {
        Ok(requests) => {
            assert!(!requests.is_empty());
            assert!(requests.windows(2).all(|w| w[0].at <= w[1].at));
            for r in &requests {
                assert!(!r.model.is_empty());
                assert!(r.at <= Duration::from_millis(MAX_AT_MS));
                match r.size {
                    Size::Duration(d) => assert!(d <= Duration::from_millis(MAX_DURATION_MS)),
                    Size::Tokens(n) => assert!(n <= MAX_OUTPUT_TOKENS),
                }
            }
        }
        Err(e) => assert!(e.starts_with("t.jsonl"), "{e}"),
    }
}

/// Reads a trace file.
pub fn load(path: &Path) -> Result<Vec<TraceRequest>, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    parse(&path.display().to_string(), &text)
}

/// `capyctl switches --export-trace FILE`: the server's recent requests as a trace, written to
/// `file` (`-`: standard output).
pub async fn export(client: &Client, file: &Path) -> Result<(), String> {
    let answer = client
        .get("/switches/trace")
        .await
        .map_err(|e| e.to_string())?;
    if file == Path::new("-") {
        use std::io::Write;
        let mut out = std::io::stdout().lock();
        out.write_all(&answer.body)
            .and_then(|()| out.flush())
            .map_err(|e| format!("cannot write the trace: {e}"))
    } else {
        std::fs::write(file, &answer.body)
            .map_err(|e| format!("cannot write {}: {e}", file.display()))?;
        let lines = answer.body.iter().filter(|b| **b == b'\n').count();
        eprintln!("{lines} requests written to {}", file.display());
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn a_trace_reads_both_sizes_in_order_of_arrival_and_ignores_measured_keys() {
        let text = "{\"at_ms\": 500, \"model\": \"b\", \"output_tokens\": 64}\n\n\
                    {\"at_ms\": 0, \"model\": \"a\", \"duration_ms\": 1200, \"waited_ms\": 7, \"outcome\": \"ok\"}\n";
        let t = parse("t.jsonl", text).unwrap();
        assert_eq!(t.len(), 2);
        assert_eq!(t[0].model, "a");
        assert_eq!(t[0].line, 3);
        assert_eq!(t[0].size, Size::Duration(Duration::from_millis(1200)));
        assert_eq!(t[0].waited, Some(Duration::from_millis(7)));
        assert_eq!(t[1].size, Size::Tokens(64));
        assert_eq!(t[1].at, Duration::from_millis(500));
    }

    #[test]
    fn a_bad_line_is_named_with_what_is_wrong() {
        let bad = |text: &str| parse("t.jsonl", text).unwrap_err();
        let ok = "{\"at_ms\": 0, \"model\": \"a\", \"duration_ms\": 1}\n";
        let e = bad(&format!("{ok}not json\n"));
        assert!(e.starts_with("t.jsonl:2: not a JSON object"), "{e}");
        let e = bad(&format!("{ok}{{\"model\": \"a\", \"duration_ms\": 1}}\n"));
        assert_eq!(
            e,
            "t.jsonl:2: `at_ms` is missing (milliseconds from the trace's start)"
        );
        let e = bad("{\"at_ms\": -5, \"model\": \"a\", \"duration_ms\": 1}");
        assert!(
            e.starts_with("t.jsonl:1: `at_ms` must be a whole number"),
            "{e}"
        );
        // Past the bounds (the virtual clock would overflow): refused, naming the bound.
        let e = bad("{\"at_ms\": 18446744073709551615, \"model\": \"a\", \"duration_ms\": 1}");
        assert_eq!(
            e,
            format!("t.jsonl:1: `at_ms` is 18446744073709551615; at most {MAX_AT_MS}")
        );
        let e = bad("{\"at_ms\": 1, \"model\": \"a\", \"output_tokens\": 100000001}");
        assert!(e.contains("`output_tokens` is 100000001; at most"), "{e}");
        let e = bad("{\"at_ms\": 1, \"model\": 3, \"duration_ms\": 1}");
        assert!(e.contains("`model` must be a non-empty string"), "{e}");
        let e = bad("{\"at_ms\": 1, \"model\": \"a\"}");
        assert!(
            e.contains("`duration_ms` or `output_tokens` is missing"),
            "{e}"
        );
        let e = bad("{\"at_ms\": 1, \"model\": \"a\", \"duration_ms\": 1, \"output_tokens\": 2}");
        assert!(e.contains("not both"), "{e}");
        assert_eq!(bad("\n\n"), "t.jsonl: the trace has no requests");
    }
}
