//! The one error type of documents, overrides and Kubernetes specs: it names where the bad value
//! came from (file and line, an override, or an object), the key path, and what is wrong.

use std::fmt;

/// Where a bad value came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Origin {
    /// A document, by the name it was loaded under, and the 1-based line where known.
    File {
        /// The file name (or the name given to `parse_*_str`).
        name: String,
        /// The line of the key, when it could be found.
        line: Option<usize>,
    },
    /// An override, written as given: `--set a.b=c` or `CAPYCTL_SET__A__B=c`.
    Override(String),
    /// A Kubernetes object, e.g. `Deployment default/my-model`.
    Object(String),
}

impl fmt::Display for Origin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Origin::File {
                name,
                line: Some(line),
            } => write!(f, "{name}:{line}"),
            Origin::File { name, line: None } => f.write_str(name),
            Origin::Override(source) | Origin::Object(source) => f.write_str(source),
        }
    }
}

/// What is wrong with a document, an override or a spec.
#[derive(Debug, thiserror::Error)]
pub enum Problem {
    /// The file could not be read.
    #[error("cannot read the file: {0}")]
    Read(#[source] std::io::Error),
    /// The document holds nothing.
    #[error("the document is empty; expected a mapping of keys")]
    Empty,
    /// The text is not YAML.
    #[error("not valid YAML: {0}")]
    Syntax(String),
    /// The document is YAML but not a mapping at the top level.
    #[error("the document is {0}, not a mapping of keys")]
    NotAMapping(&'static str),
    /// The text is not JSON (a body sent as JSON).
    #[error("not valid JSON: {0}")]
    Json(String),
    /// The JSON is not an object at the top level.
    #[error("the document is {0}, not a JSON object")]
    NotAnObject(&'static str),
    /// Collections nested deeper than the limit (checked before parsing, which would take
    /// long on such a text).
    #[error("nested deeper than {0} levels, the limit for documents and request bodies")]
    TooDeep(usize),
    /// A key the document does not have.
    #[error("unknown key; {}", expected_keys(.expected))]
    UnknownKey {
        /// The keys accepted at that place.
        expected: Vec<String>,
    },
    /// A required key is absent.
    #[error("missing required key")]
    MissingKey,
    /// The value has the wrong type (a string where a number belongs, ...).
    #[error("wrong type: {0}")]
    WrongType(String),
    /// The value has the right type but is not acceptable.
    #[error("{0}")]
    BadValue(String),
    /// A value outside its range; the message names the value and the range.
    #[error("{0}")]
    OutOfRange(String),
    /// Two settings that contradict each other, or a repeated name.
    #[error("{0}")]
    Conflict(String),
    /// An override that cannot be read or applied.
    #[error("{0}")]
    BadOverride(String),
}

impl Problem {
    /// A short stable name of the kind of problem, for metrics and event reasons.
    pub fn metric_label(&self) -> &'static str {
        match self {
            Problem::Read(_) => "read",
            Problem::Empty => "empty",
            Problem::Syntax(_) => "syntax",
            Problem::NotAMapping(_) => "not_a_mapping",
            Problem::Json(_) => "json",
            Problem::NotAnObject(_) => "not_an_object",
            Problem::TooDeep(_) => "too_deep",
            Problem::UnknownKey { .. } => "unknown_key",
            Problem::MissingKey => "missing_key",
            Problem::WrongType(_) => "wrong_type",
            Problem::BadValue(_) => "bad_value",
            Problem::OutOfRange(_) => "out_of_range",
            Problem::Conflict(_) => "conflict",
            Problem::BadOverride(_) => "bad_override",
        }
    }
}

fn expected_keys(expected: &[String]) -> String {
    if expected.is_empty() {
        "this mapping takes no keys".to_string()
    } else {
        format!("expected one of {}", expected.join(", "))
    }
}

/// A document, override or spec that was refused, e.g.
/// `standalone.yaml:5: host.resource_policy.queue.admission_window: 45s is out of range (1ms to 30s)`.
#[derive(Debug, thiserror::Error)]
#[error("{origin}: {}{problem}", path_prefix(.path))]
pub struct DocumentError {
    /// Where the bad value came from.
    pub origin: Origin,
    /// The key path from the document's root (`host.resource_policy.queue.admission_window`,
    /// `deployments[1].name`, `spec.maxConcurrentRequests`); `None` for the whole document.
    pub path: Option<String>,
    /// What is wrong.
    #[source]
    pub problem: Problem,
}

fn path_prefix(path: &Option<String>) -> String {
    match path {
        Some(p) => format!("{p}: "),
        None => String::new(),
    }
}

impl DocumentError {
    /// An error about a whole file (no key path).
    pub fn file(name: &str, line: Option<usize>, problem: Problem) -> Self {
        Self {
            origin: Origin::File {
                name: name.to_string(),
                line,
            },
            path: None,
            problem,
        }
    }

    /// A short stable name of the kind of problem, for metrics and event reasons.
    pub fn metric_label(&self) -> &'static str {
        self.problem.metric_label()
    }

    /// The 1-based line, when the error is about a line of a file.
    pub fn line(&self) -> Option<usize> {
        match self.origin {
            Origin::File { line, .. } => line,
            _ => None,
        }
    }
}

/// One step of a key path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Seg {
    /// A mapping key.
    Key(String),
    /// A sequence index.
    Index(usize),
}

/// A key path from a document's root.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct KeyPath(pub Vec<Seg>);

impl KeyPath {
    /// The path of these mapping keys, in order.
    pub fn keys(keys: &[&str]) -> Self {
        Self(keys.iter().map(|k| Seg::Key((*k).to_string())).collect())
    }

    pub(crate) fn child(&self, key: &str) -> Self {
        let mut v = self.0.clone();
        v.push(Seg::Key(key.to_string()));
        Self(v)
    }

    pub(crate) fn index(&self, i: usize) -> Self {
        let mut v = self.0.clone();
        v.push(Seg::Index(i));
        Self(v)
    }

    pub(crate) fn from_serde(path: &serde_path_to_error::Path) -> Self {
        use serde_path_to_error::Segment;
        Self(
            path.iter()
                .filter_map(|s| match s {
                    Segment::Seq { index } => Some(Seg::Index(*index)),
                    Segment::Map { key } => Some(Seg::Key(key.clone())),
                    Segment::Enum { variant } => Some(Seg::Key(variant.clone())),
                    Segment::Unknown => None,
                })
                .collect(),
        )
    }

    /// The path as written in errors (`a.b[2]`); `None` for the root.
    pub fn display(&self) -> Option<String> {
        if self.0.is_empty() {
            return None;
        }
        let mut out = String::new();
        for seg in &self.0 {
            match seg {
                Seg::Key(k) => {
                    if !out.is_empty() {
                        out.push('.');
                    }
                    out.push_str(k);
                }
                Seg::Index(i) => out.push_str(&format!("[{i}]")),
            }
        }
        Some(out)
    }

    /// Whether `other` starts with this path.
    pub(crate) fn is_prefix_of(&self, other: &KeyPath) -> bool {
        other.0.len() >= self.0.len() && other.0[..self.0.len()] == self.0[..]
    }
}

/// A serde error message turned into a [`Problem`]; `missing` is the name of a missing field,
/// which belongs at the end of the key path.
pub(crate) struct Classified {
    pub(crate) problem: Problem,
    pub(crate) missing: Option<String>,
}

fn backticked(text: &str) -> Vec<String> {
    text.split('`')
        .enumerate()
        .filter(|(i, _)| i % 2 == 1)
        .map(|(_, s)| s.to_string())
        .collect()
}

/// Reads serde's standard messages (`unknown field`, `missing field`, `unknown variant`,
/// `invalid type`, `invalid value`) and this crate's own (`... is out of range (...)`).
pub(crate) fn classify(msg: &str) -> Classified {
    let plain = |problem| Classified {
        problem,
        missing: None,
    };
    if let Some(at) = msg.find("unknown field `") {
        let rest = &msg[at + "unknown field `".len()..];
        let after_key = rest.find('`').map(|i| &rest[i + 1..]).unwrap_or("");
        return plain(Problem::UnknownKey {
            expected: backticked(after_key),
        });
    }
    if let Some(at) = msg.find("missing field `") {
        let rest = &msg[at + "missing field `".len()..];
        let name = rest.split('`').next().unwrap_or("").to_string();
        return Classified {
            problem: Problem::MissingKey,
            missing: Some(name),
        };
    }
    if let Some(at) = msg.find("unknown variant `") {
        let rest = &msg[at + "unknown variant `".len()..];
        let mut parts = rest.splitn(2, '`');
        let value = parts.next().unwrap_or("");
        let expected = backticked(parts.next().unwrap_or(""));
        return plain(Problem::BadValue(format!(
            "`{value}` is not valid; expected one of {}",
            expected.join(", ")
        )));
    }
    if let Some(at) = msg.find("invalid type: ") {
        return plain(Problem::WrongType(
            msg[at + "invalid type: ".len()..].to_string(),
        ));
    }
    if let Some(at) = msg.find("invalid value: ") {
        return plain(Problem::BadValue(
            msg[at + "invalid value: ".len()..].to_string(),
        ));
    }
    if msg.contains(" is out of range (") {
        return plain(Problem::OutOfRange(msg.to_string()));
    }
    plain(Problem::BadValue(msg.to_string()))
}

/// The message of a serde_yaml_ng error without the path prefix and location suffix that
/// serde_yaml_ng adds, and the 1-based line.
pub(crate) fn yaml_message(err: &serde_yaml_ng::Error) -> (String, Option<usize>) {
    let mut text = err.to_string();
    let line = err.location().map(|l| l.line());
    if let Some(loc) = err.location() {
        let suffix = format!(" at line {} column {}", loc.line(), loc.column());
        if let Some(stripped) = text.strip_suffix(&suffix) {
            text = stripped.to_string();
        }
    }
    // serde_yaml_ng writes `<path>: <message>`; a path holds no spaces or backticks, while
    // every message does before its first `: `.
    if let Some(at) = text.find(": ") {
        let head = &text[..at];
        if !head.is_empty() && !head.contains([' ', '`', '"']) {
            text = text[at + 2..].to_string();
        }
    }
    (text, line)
}
