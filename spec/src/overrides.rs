//! Overrides of document settings for one run: `--set a.b=c` and `CAPYCTL_SET__A__B=c`.
//!
//! Keys are paths from the document's root: `host.resource_policy.queue.max_pending_per_deployment`
//! for a standalone document, `resource_policy.queue.max_pending_per_deployment` for a host
//! document. In a variable name `__` separates path segments and each segment is lowercased
//! (a single `_` stays: `CAPYCTL_SET__LIFECYCLE__ACTIVATION=explicit`). Values are read as YAML
//! (`0`, `2s`, `explicit`, `[vllm, serve]`); an empty value is YAML null, which means "unset".
//!
//! Precedence: `--set` wins over the variable, both over the document; among several `--set` of
//! the same key the last wins. Overridden documents are validated exactly like the document, and
//! an error caused by an override names it as the source.

use serde_yaml_ng::{Mapping, Value};

use crate::documents::{DocumentError, Origin, Problem};

/// The prefix of override variables.
pub const ENV_PREFIX: &str = "CAPYCTL_SET__";

/// One override.
#[derive(Debug, Clone, PartialEq)]
pub struct Override {
    /// Key path segments from the document's root.
    pub key: Vec<String>,
    /// The value, read as YAML.
    pub value: Value,
    /// How it was given: `--set a.b=c` or `CAPYCTL_SET__A__B=c`.
    pub source: String,
}

/// Overrides in the order they apply: variables first (sorted by name), then `--set` in the
/// order given, so a later entry wins.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Overrides {
    entries: Vec<Override>,
}

fn bad(source: &str, message: String) -> DocumentError {
    DocumentError {
        origin: Origin::Override(source.to_string()),
        path: None,
        problem: Problem::BadOverride(message),
    }
}

fn read_value(text: &str) -> Value {
    if text.trim().is_empty() {
        return Value::Null;
    }
    // A value YAML cannot read (`a: b: c`), or nested too deep to read quickly, is taken as the
    // string it is.
    if !crate::documents::within_depth(text) {
        return Value::String(text.to_string());
    }
    serde_yaml_ng::from_str(text).unwrap_or_else(|_| Value::String(text.to_string()))
}

fn kind_of(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Sequence(_) => "a list",
        Value::Mapping(_) => "a mapping",
        Value::Tagged(_) => "a tagged value",
    }
}

impl Overrides {
    /// No overrides.
    pub fn none() -> Self {
        Self::default()
    }

    /// Reads `--set` arguments (`a.b=c`, without the `--set`) and the environment, taking only
    /// variables named `CAPYCTL_SET__…`. Pass `std::env::vars()` for the real environment.
    pub fn from_args_and_env<S, K, V>(
        sets: impl IntoIterator<Item = S>,
        env: impl IntoIterator<Item = (K, V)>,
    ) -> Result<Self, DocumentError>
    where
        S: AsRef<str>,
        K: AsRef<str>,
        V: AsRef<str>,
    {
        let mut vars: Vec<(String, String)> = env
            .into_iter()
            .filter(|(k, _)| k.as_ref().starts_with(ENV_PREFIX))
            .map(|(k, v)| (k.as_ref().to_string(), v.as_ref().to_string()))
            .collect();
        vars.sort();
        let mut entries = Vec::new();
        for (name, value) in vars {
            let source = format!("{name}={value}");
            let rest = &name[ENV_PREFIX.len()..];
            let key: Vec<String> = rest.split("__").map(str::to_lowercase).collect();
            if key.iter().any(String::is_empty) {
                return Err(bad(
                    &name,
                    format!(
                        "`{name}` does not name a key: use {ENV_PREFIX}SEGMENT__SEGMENT, e.g. {ENV_PREFIX}LIFECYCLE__ACTIVATION"
                    ),
                ));
            }
            entries.push(Override {
                key,
                value: read_value(&value),
                source,
            });
        }
        for arg in sets {
            let arg = arg.as_ref();
            let source = format!("--set {arg}");
            let Some((key, value)) = arg.split_once('=') else {
                return Err(bad(
                    &source,
                    "expected key=value, e.g. --set lifecycle.activation=explicit".to_string(),
                ));
            };
            let key: Vec<String> = key.trim().split('.').map(str::to_string).collect();
            if key.iter().any(String::is_empty) {
                return Err(bad(
                    &source,
                    "the key has an empty segment: use dotted keys such as resource_policy.queue.max_pending_total".to_string(),
                ));
            }
            entries.push(Override {
                key,
                value: read_value(value),
                source,
            });
        }
        Ok(Self { entries })
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The overrides in the order they apply (the last one for a key wins).
    pub fn entries(&self) -> &[Override] {
        &self.entries
    }

    /// Sets every override in `root`, creating mappings on the way.
    pub(crate) fn apply(&self, root: &mut Value) -> Result<(), DocumentError> {
        for o in &self.entries {
            let mut node = &mut *root;
            for (depth, seg) in o.key.iter().enumerate() {
                if node.is_null() {
                    *node = Value::Mapping(Mapping::new());
                }
                let Value::Mapping(map) = node else {
                    return Err(bad(
                        &o.source,
                        format!(
                            "cannot set {}: {} is {}, not a mapping",
                            o.key.join("."),
                            if depth == 0 {
                                "the document".to_string()
                            } else {
                                o.key[..depth].join(".")
                            },
                            kind_of(node)
                        ),
                    ));
                };
                node = map.entry(Value::String(seg.clone())).or_insert(Value::Null);
            }
            *node = o.value.clone();
        }
        Ok(())
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn variables_apply_before_sets_and_are_lowercased() {
        let o = Overrides::from_args_and_env(
            ["host.lifecycle.activation=explicit", "a=1"],
            [
                ("PATH", "/bin"),
                (
                    "CAPYCTL_SET__HOST__RESOURCE_POLICY__QUEUE__MAX_PENDING_TOTAL",
                    "0",
                ),
                ("CAPYCTL_SET__A", "2"),
            ],
        )
        .unwrap();
        let keys: Vec<String> = o.entries().iter().map(|e| e.key.join(".")).collect();
        assert_eq!(
            keys,
            [
                "a",
                "host.resource_policy.queue.max_pending_total",
                "host.lifecycle.activation",
                "a"
            ]
        );
        assert_eq!(o.entries()[0].source, "CAPYCTL_SET__A=2");
        assert_eq!(
            o.entries()[2].source,
            "--set host.lifecycle.activation=explicit"
        );
        let mut root = Value::Mapping(Mapping::new());
        o.apply(&mut root).unwrap();
        assert_eq!(root["a"], Value::from(1));
        assert_eq!(
            root["host"]["lifecycle"]["activation"],
            Value::from("explicit")
        );
    }

    #[test]
    fn malformed_overrides_are_refused() {
        let err = Overrides::from_args_and_env(["nokey"], std::iter::empty::<(&str, &str)>())
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            "--set nokey: expected key=value, e.g. --set lifecycle.activation=explicit"
        );
        let err = Overrides::from_args_and_env(["a..b=1"], std::iter::empty::<(&str, &str)>())
            .unwrap_err();
        assert!(
            err.to_string()
                .starts_with("--set a..b=1: the key has an empty segment")
        );
        let err = Overrides::from_args_and_env(
            std::iter::empty::<&str>(),
            [("CAPYCTL_SET__A____B", "1")],
        )
        .unwrap_err();
        assert!(
            err.to_string()
                .starts_with("CAPYCTL_SET__A____B: `CAPYCTL_SET__A____B` does not name a key")
        );
        let o =
            Overrides::from_args_and_env(["id.x=1"], std::iter::empty::<(&str, &str)>()).unwrap();
        let mut root: Value = serde_yaml_ng::from_str("id: box").unwrap();
        assert_eq!(
            o.apply(&mut root).unwrap_err().to_string(),
            "--set id.x=1: cannot set id.x: id is a string, not a mapping"
        );
    }
}
