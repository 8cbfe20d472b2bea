//! Finds the line of a key path in block-style YAML, for errors found after deserialization
//! (cross-field checks, Kubernetes specs). Best effort: flow-style values give the line of the
//! key that holds them, and anything not found gives no line.

use super::error::{KeyPath, Seg};

struct Line {
    no: usize,
    indent: usize,
    body: String,
}

fn is_dash(body: &str) -> bool {
    body == "-" || body.starts_with("- ")
}

/// The key a line starts with (`key:` / `"key":` / `'key':`), if any.
fn key_of(body: &str) -> Option<String> {
    let (key, rest) = match body.chars().next()? {
        q @ ('"' | '\'') => {
            let end = body[1..].find(q)? + 1;
            (body[1..end].to_string(), &body[end + 1..])
        }
        _ => {
            let colon = body
                .char_indices()
                .find(|&(i, c)| c == ':' && body[i + 1..].chars().next().is_none_or(|n| n == ' '))?
                .0;
            (body[..colon].trim_end().to_string(), &body[colon..])
        }
    };
    let rest = rest.trim_start();
    (rest.starts_with(':')).then_some(key)
}

/// The 1-based line of the key at `path` in `text`.
pub(crate) fn find_line(text: &str, path: &KeyPath) -> Option<usize> {
    let mut lines: Vec<Line> = text
        .lines()
        .enumerate()
        .filter_map(|(i, raw)| {
            let body = raw.trim_start();
            let skip = body.is_empty() || body.starts_with('#') || body == "---" || body == "...";
            (!skip).then(|| Line {
                no: i + 1,
                indent: raw.len() - body.len(),
                body: body.to_string(),
            })
        })
        .collect();
    let mut start = 0;
    let mut end = lines.len();
    let mut found = None;
    for seg in &path.0 {
        if start >= end {
            // The previous key's value sits on its own line (flow style or a scalar).
            return found;
        }
        let block = lines[start].indent;
        match seg {
            Seg::Key(k) => {
                let i = (start..end).find(|&i| {
                    lines[i].indent == block && key_of(&lines[i].body).as_deref() == Some(k)
                })?;
                found = Some(lines[i].no);
                start = i + 1;
                end = (i + 1..end)
                    .find(|&j| {
                        lines[j].indent < block
                            || (lines[j].indent == block && !is_dash(&lines[j].body))
                    })
                    .unwrap_or(end);
            }
            Seg::Index(n) => {
                let i = (start..end)
                    .filter(|&i| lines[i].indent == block && is_dash(&lines[i].body))
                    .nth(*n)?;
                found = Some(lines[i].no);
                let item_end = (i + 1..end)
                    .find(|&j| lines[j].indent <= block)
                    .unwrap_or(end);
                let after_dash = lines[i].body[1..].to_string();
                let content = after_dash.trim_start();
                if content.is_empty() {
                    start = i + 1;
                } else {
                    lines[i].indent += 1 + after_dash.len() - content.len();
                    lines[i].body = content.to_string();
                    start = i;
                }
                end = item_end;
            }
        }
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    fn path(parts: &[&str]) -> KeyPath {
        KeyPath(
            parts
                .iter()
                .map(|p| match p.parse::<usize>() {
                    Ok(i) => Seg::Index(i),
                    Err(_) => Seg::Key((*p).to_string()),
                })
                .collect(),
        )
    }

    const TEXT: &str = "\
# a comment
server:
  switching:
    drain_timeout: 30s
host:
  id: box   # trailing comment
  resource_policy:
    queue:

      admission_window: \"5s\"
      request_deadline: 1s
  engines: {vllm: {command: [vllm]}}
deployments:
- name: a
  engine: vllm
-   name: b
    model: m
'quoted key': 1
";

    #[test]
    fn finds_block_keys_items_and_flow_values() {
        assert_eq!(find_line(TEXT, &path(&["server"])), Some(2));
        assert_eq!(
            find_line(TEXT, &path(&["server", "switching", "drain_timeout"])),
            Some(4)
        );
        assert_eq!(find_line(TEXT, &path(&["host", "id"])), Some(6));
        assert_eq!(
            find_line(
                TEXT,
                &path(&["host", "resource_policy", "queue", "request_deadline"])
            ),
            Some(11)
        );
        assert_eq!(
            find_line(
                TEXT,
                &path(&["host", "resource_policy", "queue", "admission_window"])
            ),
            Some(10)
        );
        assert_eq!(
            find_line(TEXT, &path(&["host", "engines", "vllm", "command"])),
            Some(12)
        );
        assert_eq!(
            find_line(TEXT, &path(&["deployments", "0", "name"])),
            Some(14)
        );
        assert_eq!(
            find_line(TEXT, &path(&["deployments", "0", "engine"])),
            Some(15)
        );
        assert_eq!(
            find_line(TEXT, &path(&["deployments", "1", "name"])),
            Some(16)
        );
        assert_eq!(
            find_line(TEXT, &path(&["deployments", "1", "model"])),
            Some(17)
        );
        assert_eq!(find_line(TEXT, &path(&["quoted key"])), Some(18));
        assert_eq!(find_line(TEXT, &path(&["host", "nope"])), None);
        assert_eq!(find_line(TEXT, &path(&["deployments", "5"])), None);
        assert_eq!(find_line("", &path(&["a"])), None);
    }
}
