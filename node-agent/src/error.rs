//! The host agent's errors: the one error type ([`AgentError`], `capyctl_interfaces::error`'s,
//! re-exported here), and how a failed start names the engine's own error line from its log
//! ([`StartFailure::not_ready`], [`engine_error_line`]).

use capyctl_spec::EngineKind;

pub use capyctl_interfaces::error::AgentError;

/// How much of the end of an engine's log [`engine_error_line`] reads.
const ERROR_LINE_TAIL: u64 = 64 * 1024;
/// The longest error line quoted (in characters); a longer one is cut, marked with `…`.
const ERROR_LINE_MAX: usize = 400;

/// The engine's own error line in its log file `log` (the last [`ERROR_LINE_TAIL`] bytes): the
/// last line that names an error (`error`, `exception`, case aside: vLLM's `vllm: error:
/// unrecognized arguments: ...`, a Python traceback's `OSError: ...`), else the last line that
/// is not empty; `None` when the file cannot be read (a Pod's log) or holds nothing.
pub fn engine_error_line(log: &str) -> Option<String> {
    use std::io::{Read, Seek, SeekFrom};
    let mut file = std::fs::File::open(log).ok()?;
    let len = file.metadata().ok()?.len();
    file.seek(SeekFrom::Start(len.saturating_sub(ERROR_LINE_TAIL)))
        .ok()?;
    let mut tail = Vec::new();
    file.take(ERROR_LINE_TAIL).read_to_end(&mut tail).ok()?;
    let text = String::from_utf8_lossy(&tail);
    let clean = |l: &str| -> String {
        l.chars()
            .filter(|c| !c.is_control())
            .collect::<String>()
            .trim()
            .to_string()
    };
    let lines: Vec<String> = text.lines().map(clean).filter(|l| !l.is_empty()).collect();
    // A frame of a stack trace printed after the error (a Rust backtrace's `16: name` and
    // `at file:line`, a Python traceback's `File "x.py", line 1`) names no error of its own.
    let frame = |l: &str| {
        l.starts_with("at ")
            || l.starts_with("File \"")
            || l.split_once(": ")
                .is_some_and(|(n, _)| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
    };
    let names_error = |l: &&String| {
        let lower = l.to_ascii_lowercase();
        (lower.contains("error") || lower.contains("exception")) && !frame(l)
    };
    let line = lines
        .iter()
        .rev()
        .find(names_error)
        .or_else(|| lines.last())?;
    Some(if line.chars().count() > ERROR_LINE_MAX {
        let cut: String = line.chars().take(ERROR_LINE_MAX).collect();
        format!("{cut}…")
    } else {
        line.clone()
    })
}

/// The wrapping of a start's failure ([`StartFailure::not_ready`]).
pub trait StartFailure {
    /// Wraps the failure of a start (readiness, first answer) so that it names the engine's
    /// log; an exit gets the log itself.
    fn not_ready(self, engine: EngineKind, instance: &str, log: Option<String>) -> Self;
}

impl StartFailure for AgentError {
    fn not_ready(self, engine: EngineKind, instance: &str, log: Option<String>) -> Self {
        match self {
            AgentError::EngineExited {
                engine,
                instance,
                status,
                log: None,
            } => {
                // An engine that exits while it starts said why in its log: its own line goes
                // into the error (an unknown flag, a model that is not there, a port taken).
                let status = match log.as_deref().and_then(engine_error_line) {
                    Some(line) => format!("{status}; its last error: {line}"),
                    None => status,
                };
                AgentError::EngineExited {
                    engine,
                    instance,
                    status,
                    log,
                }
            }
            e @ (AgentError::EngineExited { .. }
            | AgentError::EngineNotReady { .. }
            | AgentError::Cancelled { .. }) => e,
            e => AgentError::EngineNotReady {
                engine,
                instance: instance.to_string(),
                log,
                source: Box::new(e),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn log_with(name: &str, text: &str) -> String {
        let dir = capyctl_test_support::temp_dir(&format!("error-line-{name}"));
        let path = dir.join("engine.log");
        std::fs::write(&path, text).unwrap_or_else(|e| panic!("{e}"));
        path.display().to_string()
    }

    #[test]
    fn an_engine_that_exits_while_starting_is_named_by_its_own_error_line() {
        // What the real vLLM 0.32 prints for an unknown flag (its usage, then argparse's line).
        let log = log_with(
            "flag",
            "INFO 12-06 11:55:01 [__init__.py:239] Automatically detected platform cpu.\n\
             usage: vllm serve [model_tag] [options]\n\
             vllm: error: unrecognized arguments: --no-such-flag\n\n",
        );
        let e = AgentError::EngineExited {
            engine: EngineKind::Vllm,
            instance: "i-0".into(),
            status: "exit status: 2".into(),
            log: None,
        }
        .not_ready(EngineKind::Vllm, "i-0", Some(log.clone()));
        assert_eq!(
            e.to_string(),
            format!(
                "vllm engine of instance i-0 exited: exit status: 2; its last error: vllm: error: \
                 unrecognized arguments: --no-such-flag; the engine's output is in {log}"
            )
        );
        // A traceback: its last line, not a frame's.
        let log = log_with(
            "traceback",
            "Traceback (most recent call last):\n  File \"x.py\", line 1, in <module>\n\
             OSError: [Errno 98] Address already in use\n",
        );
        assert_eq!(
            engine_error_line(&log).as_deref(),
            Some("OSError: [Errno 98] Address already in use")
        );
        // A Rust program's error followed by its backtrace: the error, not a frame naming
        // `anyhow::Error`.
        let log = log_with(
            "backtrace",
            "Error: cannot listen on 127.0.0.1:37637\n\nCaused by:\n    Address already in use \
             (os error 98)\n\nStack backtrace:\n   0: <E as anyhow::context::ext::StdError>::ext_context\n\
             \x20            at /src/anyhow/src/backtrace.rs:10:14\n  16: {closure#0}<core::result::Result<(), anyhow::Error>>\n",
        );
        assert_eq!(
            engine_error_line(&log).as_deref(),
            Some("Address already in use (os error 98)")
        );
        // No line naming an error: the last one; an unreadable log: nothing.
        let log = log_with("plain", "starting\nKilled\n");
        assert_eq!(engine_error_line(&log).as_deref(), Some("Killed"));
        assert_eq!(engine_error_line("/nonexistent/capyctl/engine.log"), None);
        let e = AgentError::EngineExited {
            engine: EngineKind::Vllm,
            instance: "i-0".into(),
            status: "exit status: 1".into(),
            log: None,
        }
        .not_ready(EngineKind::Vllm, "i-0", None);
        assert_eq!(
            e.to_string(),
            "vllm engine of instance i-0 exited: exit status: 1"
        );
    }

    #[test]
    fn a_long_error_line_is_cut() {
        let log = log_with("long", &format!("RuntimeError: {}\n", "x".repeat(1000)));
        let line = engine_error_line(&log).unwrap_or_default();
        assert_eq!(line.chars().count(), ERROR_LINE_MAX + 1);
        assert!(
            line.starts_with("RuntimeError: x") && line.ends_with('…'),
            "{line}"
        );
    }
}
