//! A linear pre-scan that bounds how deeply a YAML (or JSON) text nests, before the parser
//! reads it.
//!
//! NB: libyaml's scanner (under serde_yaml_ng) spends time in proportion to the text times its
//! flow nesting (`[[[[...`, `{a: {a: ...`): a 100 KB body nested 50,000 deep took seconds of
//! CPU, and serde_yaml_ng's own limit (128) applies only once the whole text is read. So the
//! text is scanned first, in one pass, following libyaml's tokenizing rules for everything that
//! can hold a bracket without opening a collection (quoted, plain and block scalars, comments,
//! tags, anchors, directives): every flow collection libyaml would open is counted, and block
//! collections are counted by their indentation as libyaml rolls it. Where libyaml would stop
//! with an error, the scan stops too (accepting; the parser then refuses the text quickly).

/// The deepest nesting of collections a document or request body may have (CapyCTL's documents
/// need fewer than 10 levels).
pub const MAX_DEPTH: usize = 64;

/// How a scan ended early.
enum End {
    /// Nested deeper than [`MAX_DEPTH`]; the 1-based line where it went past.
    TooDeep(usize),
    /// libyaml refuses the text here: nothing after this point is parsed.
    Stop,
}

type Scanned = Result<(), End>;

/// Checks that `text` nests at most [`MAX_DEPTH`] collections deep; `Err(line)` names the
/// 1-based line where it goes deeper.
pub(crate) fn check(text: &str) -> Result<(), usize> {
    let mut scan = Scan {
        s: text.chars().collect(),
        i: 0,
        line: 1,
        col: 0,
        flow: 0,
        indents: Vec::new(),
        key_allowed: true,
        key: None,
    };
    match scan.run() {
        Err(End::TooDeep(line)) => Err(line),
        Ok(()) | Err(End::Stop) => Ok(()),
    }
}

fn is_break(c: char) -> bool {
    matches!(c, '\n' | '\r' | '\u{85}' | '\u{2028}' | '\u{2029}')
}

fn is_blank(c: char) -> bool {
    c == ' ' || c == '\t'
}

/// A blank, a line break or the end (`\0`, which libyaml also reads as the end).
fn is_blankz(c: char) -> bool {
    is_blank(c) || is_break(c) || c == '\0'
}

struct Scan {
    s: Vec<char>,
    i: usize,
    /// 1-based line and 0-based column (in characters, as libyaml counts) of `i`.
    line: usize,
    col: usize,
    /// Open flow collections.
    flow: usize,
    /// The columns of the open block collections (libyaml's indent stack).
    indents: Vec<usize>,
    /// Whether a simple key may start here (libyaml's `simple_key_allowed`).
    key_allowed: bool,
    /// A possible simple key outside flow collections: its line, column and index.
    key: Option<(usize, usize, usize)>,
}

impl Scan {
    fn at(&self, k: usize) -> char {
        self.s.get(self.i + k).copied().unwrap_or('\0')
    }

    fn cur(&self) -> char {
        self.at(0)
    }

    fn eof(&self) -> bool {
        self.cur() == '\0'
    }

    /// Moves past one character, a line break (`\r\n` being one) included.
    fn step(&mut self) {
        let c = self.cur();
        if is_break(c) {
            self.i += if c == '\r' && self.at(1) == '\n' {
                2
            } else {
                1
            };
            self.line += 1;
            self.col = 0;
        } else if c != '\0' {
            self.i += 1;
            self.col += 1;
        }
    }

    fn indent(&self) -> isize {
        self.indents.last().map_or(-1, |&c| c as isize)
    }

    fn depth_check(&self) -> Scanned {
        if self.flow + self.indents.len() > MAX_DEPTH {
            Err(End::TooDeep(self.line))
        } else {
            Ok(())
        }
    }

    /// A block collection starting at `col` (libyaml's `roll_indent`).
    fn roll(&mut self, col: usize) -> Scanned {
        if self.flow == 0 && self.indent() < col as isize {
            self.indents.push(col);
            self.depth_check()?;
        }
        Ok(())
    }

    fn save_key(&mut self) {
        if self.flow == 0 && self.key_allowed {
            self.key = Some((self.line, self.col, self.i));
        }
    }

    fn document_indicator(&self) -> bool {
        self.col == 0
            && ((self.at(0) == '-' && self.at(1) == '-' && self.at(2) == '-')
                || (self.at(0) == '.' && self.at(1) == '.' && self.at(2) == '.'))
            && is_blankz(self.at(3))
    }

    /// Spaces, tabs where libyaml allows them, comments and line breaks.
    fn skip_to_token(&mut self) {
        loop {
            if self.col == 0 && self.cur() == '\u{feff}' {
                self.step();
            }
            while self.cur() == ' ' || ((self.flow > 0 || !self.key_allowed) && self.cur() == '\t')
            {
                self.step();
            }
            if self.cur() == '#' {
                while !is_break(self.cur()) && !self.eof() {
                    self.step();
                }
            }
            if !is_break(self.cur()) {
                return;
            }
            self.step();
            if self.flow == 0 {
                self.key_allowed = true;
            }
        }
    }

    fn run(&mut self) -> Scanned {
        loop {
            self.skip_to_token();
            if self.eof() {
                return Ok(());
            }
            if self.flow == 0 {
                while self.indent() > self.col as isize {
                    self.indents.pop();
                }
            }
            let (c, next) = (self.cur(), self.at(1));
            match c {
                '%' if self.col == 0 => {
                    while !is_break(self.cur()) && !self.eof() {
                        self.step();
                    }
                }
                '-' | '.' if self.document_indicator() => {
                    self.indents.clear();
                    self.key = None;
                    self.key_allowed = false;
                    (0..3).for_each(|_| self.step());
                }
                '[' | '{' => {
                    self.save_key();
                    self.flow += 1;
                    self.depth_check()?;
                    self.key_allowed = true;
                    self.step();
                }
                ']' | '}' => {
                    self.flow = self.flow.saturating_sub(1);
                    self.key_allowed = false;
                    self.step();
                }
                ',' => {
                    self.key_allowed = true;
                    self.step();
                }
                '-' if is_blankz(next) => {
                    if self.flow == 0 {
                        if !self.key_allowed {
                            return Err(End::Stop);
                        }
                        self.roll(self.col)?;
                        self.key = None;
                    }
                    self.key_allowed = true;
                    self.step();
                }
                '?' if self.flow > 0 || is_blankz(next) => {
                    if self.flow == 0 {
                        if !self.key_allowed {
                            return Err(End::Stop);
                        }
                        self.roll(self.col)?;
                        self.key = None;
                    }
                    self.key_allowed = self.flow == 0;
                    self.step();
                }
                ':' if self.flow > 0 || is_blankz(next) => {
                    if self.flow == 0 {
                        match self.key.take() {
                            // libyaml drops a simple key that is on an earlier line or more
                            // than 1024 characters back.
                            Some((line, col, i)) if line == self.line && i + 1024 >= self.i => {
                                self.roll(col)?;
                                self.key_allowed = false;
                            }
                            _ => {
                                if !self.key_allowed {
                                    return Err(End::Stop);
                                }
                                self.roll(self.col)?;
                                self.key_allowed = true;
                            }
                        }
                    } else {
                        self.key_allowed = false;
                    }
                    self.step();
                }
                '*' | '&' => {
                    self.save_key();
                    self.key_allowed = false;
                    self.step();
                    while self.cur().is_ascii_alphanumeric() || matches!(self.cur(), '_' | '-') {
                        self.step();
                    }
                }
                '!' => {
                    self.save_key();
                    self.key_allowed = false;
                    self.step();
                    while !(is_blankz(self.cur()) || (self.flow > 0 && self.cur() == ',')) {
                        self.step();
                    }
                }
                '|' | '>' if self.flow == 0 => {
                    self.key = None;
                    self.key_allowed = true;
                    self.block_scalar()?;
                }
                '\'' | '"' => {
                    self.save_key();
                    self.key_allowed = false;
                    self.quoted(c);
                }
                _ => {
                    let indicator = is_blankz(c) || "-?:,[]{}#&*!|>'\"%@`".contains(c);
                    let plain = !indicator
                        || (c == '-' && !is_blank(next))
                        || (self.flow == 0 && (c == '?' || c == ':') && !is_blankz(next));
                    if !plain {
                        return Err(End::Stop);
                    }
                    self.save_key();
                    self.key_allowed = false;
                    if self.plain_scalar()? {
                        self.key_allowed = true;
                    }
                }
            }
        }
    }

    /// A single- or double-quoted scalar, over lines. (libyaml refuses one that runs into a
    /// document indicator or the end; scanning on then only counts more.)
    fn quoted(&mut self, quote: char) {
        self.step();
        loop {
            let c = self.cur();
            if self.eof() {
                return;
            }
            if quote == '\'' && c == '\'' {
                self.step();
                if self.cur() != '\'' {
                    return;
                }
            } else if quote == '"' && c == '\\' {
                self.step();
            } else if quote == '"' && c == '"' {
                self.step();
                return;
            }
            self.step();
        }
    }

    /// A plain scalar (libyaml's `scan_plain_scalar`): it ends at `: `, ` #`, a flow indicator
    /// inside a flow collection, or a line indented at most as far as the block it is in.
    /// Returns whether it ended after a line break.
    fn plain_scalar(&mut self) -> Result<bool, End> {
        let indent = self.indent() + 1;
        let mut leading_blanks = false;
        loop {
            if self.document_indicator() || self.cur() == '#' {
                break;
            }
            while !is_blankz(self.cur()) {
                let (c, next) = (self.cur(), self.at(1));
                if self.flow > 0 && c == ':' && ",?[]{}".contains(next) {
                    return Err(End::Stop);
                }
                if (c == ':' && is_blankz(next)) || (self.flow > 0 && ",[]{}".contains(c)) {
                    break;
                }
                leading_blanks = false;
                self.step();
            }
            if !(is_blank(self.cur()) || is_break(self.cur())) {
                break;
            }
            while is_blank(self.cur()) || is_break(self.cur()) {
                if is_blank(self.cur()) {
                    if leading_blanks && (self.col as isize) < indent && self.cur() == '\t' {
                        return Err(End::Stop);
                    }
                } else {
                    leading_blanks = true;
                }
                self.step();
            }
            if self.flow == 0 && (self.col as isize) < indent {
                break;
            }
        }
        Ok(leading_blanks)
    }

    /// A literal (`|`) or folded (`>`) scalar: its header, then the lines indented past the
    /// block it is in (libyaml's `scan_block_scalar`).
    fn block_scalar(&mut self) -> Scanned {
        let parent = self.indent();
        self.step();
        let mut increment = 0;
        for _ in 0..2 {
            match self.cur() {
                '+' | '-' => self.step(),
                d @ '1'..='9' => {
                    increment = d as usize - '0' as usize;
                    self.step();
                }
                _ => {}
            }
        }
        while is_blank(self.cur()) {
            self.step();
        }
        if self.cur() == '#' {
            while !is_break(self.cur()) && !self.eof() {
                self.step();
            }
        }
        if self.eof() {
            return Ok(());
        }
        if !is_break(self.cur()) {
            return Err(End::Stop);
        }
        self.step();
        let mut indent = match (increment, parent) {
            (0, _) => 0,
            (n, p) if p >= 0 => p as usize + n,
            (n, _) => n,
        };
        let mut max_indent = 0;
        self.block_breaks(indent, &mut max_indent)?;
        if indent == 0 {
            indent = max_indent.max((parent + 1).max(1) as usize);
        }
        while self.col == indent && !self.eof() {
            while !is_break(self.cur()) && !self.eof() {
                self.step();
            }
            if self.eof() {
                break;
            }
            self.step();
            self.block_breaks(indent, &mut max_indent)?;
        }
        Ok(())
    }

    /// The indentation and empty lines before a block scalar's next line.
    fn block_breaks(&mut self, indent: usize, max_indent: &mut usize) -> Scanned {
        loop {
            while (indent == 0 || self.col < indent) && self.cur() == ' ' {
                self.step();
            }
            *max_indent = (*max_indent).max(self.col);
            if (indent == 0 || self.col < indent) && self.cur() == '\t' {
                return Err(End::Stop);
            }
            if !is_break(self.cur()) {
                return Ok(());
            }
            self.step();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nested(open: &str, close: &str, n: usize) -> String {
        format!("a: {}1{}\n", open.repeat(n), close.repeat(n))
    }

    #[test]
    fn flow_nesting_is_counted() {
        assert_eq!(check(&nested("[", "]", MAX_DEPTH - 1)), Ok(()));
        assert_eq!(check(&nested("[", "]", MAX_DEPTH)), Err(1));
        assert_eq!(check(&nested("{a: ", "}", 5_000)), Err(1));
        assert_eq!(check(&format!("x: 1\n\n{}", "[".repeat(100))), Err(3));
        // JSON is YAML's flow style.
        let json = format!("{{\"a\":{}1{}}}", "[".repeat(200), "]".repeat(200));
        assert_eq!(check(&json), Err(1));
    }

    #[test]
    fn block_nesting_is_counted() {
        let deep: String = (0..100)
            .map(|i| format!("{}k{i}:\n", "  ".repeat(i)))
            .collect();
        assert_eq!(check(&deep), Err(MAX_DEPTH + 1));
        assert_eq!(check(&format!("a:\n  {}x\n", "- ".repeat(200))), Err(2));
        let shallow: String = (0..30)
            .map(|i| format!("{}k{i}:\n", "  ".repeat(i)))
            .collect();
        assert_eq!(check(&shallow), Ok(()));
    }

    #[test]
    fn brackets_in_scalars_and_comments_do_not_count() {
        let many = "[".repeat(500);
        for text in [
            format!("a: '{many}'\n"),
            format!("a: \"{many}\\\" {many}\"\n"),
            format!("a: b{many}\n"),
            format!("a: b\n  c {many}\n"),
            format!("a: b # {many}\n"),
            format!("a: |\n  {many}\n   {many}\n\n  x\nb: 1\n"),
            format!("a: >-\n {many}\n"),
            format!("- !tag{many} x\n"),
            format!("%TAG ! tag:{many}\n--- a\n"),
        ] {
            assert_eq!(check(&text), Ok(()), "{text}");
            // The parser agrees: nothing there nests.
            let parsed = serde_yaml_ng::from_str::<serde_yaml_ng::Value>(&text);
            assert!(
                !parsed.is_err_and(|e| e.to_string().contains("recursion limit")),
                "{text}"
            );
        }
    }

    #[test]
    fn what_libyaml_reads_as_brackets_is_counted_wherever_it_hides() {
        let many = "[".repeat(500);
        for text in [
            // A quote inside a plain scalar opens nothing.
            format!("a: it's\nb: {many}\n"),
            format!("a: x\n  'y\nb: {many}\n"),
            // A comment ends at any line break libyaml knows.
            format!("# c\u{2028}a: {many}\n"),
            format!("a: 1 #c\rb: {many}\n"),
            // The byte order mark is skipped at the start of a line.
            format!("\u{feff}{many}\n"),
            // Anchors, tags and the document start leave what follows to be read.
            format!("a: &x {many}\n"),
            format!("--- !t {many}\n"),
            format!("[!t,{many}\n"),
            // A block scalar ends at the first line indented no further than its key.
            format!("a: |\n  text\nb: {many}\n"),
            format!("a:\n  b: |2\n    text\nc: {many}\n"),
        ] {
            assert!(check(&text).is_err(), "{text:?}");
            // The parser agrees: it is nested that deep.
            let parsed = serde_yaml_ng::from_str::<serde_yaml_ng::Value>(&text);
            assert!(
                parsed.is_err_and(|e| e.to_string().contains("recursion limit")),
                "{text:?}"
            );
        }
    }
}
