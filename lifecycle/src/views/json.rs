//! The pieces of the reads' JSON written by hand (the load read's, the deployments list's), as
//! `serde_json` writes them (compact), into any buffer (`Vec<u8>`, `BytesMut`).

use std::fmt;

use bytes::BufMut;

/// `n` in decimal.
pub(crate) fn number<B: BufMut + ?Sized>(out: &mut B, n: u64) {
    out.put_slice(itoa::Buffer::new().format(n).as_bytes());
}

/// `b` as JSON.
pub(crate) fn boolean<B: BufMut + ?Sized>(out: &mut B, b: bool) {
    out.put_slice(if b { b"true" } else { b"false" });
}

/// `s` as a JSON string: as it is where nothing needs escaping (no quote, backslash or
/// control character: what `serde_json` escapes), else escaped as `serde_json` escapes it.
pub(crate) fn string<B: BufMut + ?Sized>(out: &mut B, s: &str) {
    out.put_u8(b'"');
    unquoted(out, s);
    out.put_u8(b'"');
}

/// `v`'s text as a JSON string, escaped as it is written (no copy of the text first).
pub(crate) fn display<B: BufMut + ?Sized>(out: &mut B, v: &impl fmt::Display) {
    out.put_u8(b'"');
    // Writing into a buffer cannot fail (a `Display` that fails is a bug of its own).
    let _ = fmt::write(&mut Unquoted(out), format_args!("{v}"));
    out.put_u8(b'"');
}

/// `s` escaped, without its quotes.
fn unquoted<B: BufMut + ?Sized>(out: &mut B, s: &str) {
    if s.bytes().all(|b| b >= 0x20 && b != b'"' && b != b'\\') {
        out.put_slice(s.as_bytes());
    } else {
        // A string always encodes; its escaping is serde_json's own, its quotes left out.
        if let Ok(quoted) = serde_json::to_vec(s)
            && let [b'"', inner @ .., b'"'] = quoted.as_slice()
        {
            out.put_slice(inner);
        }
    }
}

/// Text written escaped into a buffer ([`display`]).
struct Unquoted<'a, B: ?Sized>(&'a mut B);

impl<B: BufMut + ?Sized> fmt::Write for Unquoted<'_, B> {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        unquoted(self.0, s);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strings_are_escaped_as_serde_json_escapes_them() {
        for s in ["", "plain", "q\"uote\\ \u{1}é\u{7f}\n", "\t", "ünï"] {
            let mut out = Vec::new();
            string(&mut out, s);
            assert_eq!(out, serde_json::to_vec(s).expect("encodes"), "{s:?}");
            let mut out = bytes::BytesMut::new();
            display(&mut out, &format_args!("{s}-{}", 7));
            assert_eq!(
                &out[..],
                serde_json::to_vec(&format!("{s}-7")).expect("encodes"),
                "{s:?}"
            );
        }
        let mut out = Vec::new();
        number(&mut out, u64::MAX);
        boolean(&mut out, false);
        assert_eq!(out, format!("{}false", u64::MAX).as_bytes());
    }
}
