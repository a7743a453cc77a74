//! Unified diffs of a tool call's `diff` content, as `--format text` prints them:
//! `--- a/PATH` / `+++ b/PATH` headers (`/dev/null` for a new file), hunks with three
//! lines of context, red `-`, green `+` and cyan `@@` lines when colour is on.

use std::time::Duration;

use similar::{ChangeTag, TextDiff};

/// How many lines of hunks one diff may print; the rest is counted in a last line.
pub const MAX_LINES: usize = 400;

/// Lines of unchanged context around each change.
const CONTEXT: usize = 3;

/// A bound on the diff algorithm for pathological inputs; past it the diff is coarser, not wrong.
const DIFF_TIMEOUT: Duration = Duration::from_millis(500);

/// One `diff` item of a tool call's content: whole file texts, `old` absent for a new file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileDiff {
    /// The path as shown: relative to the current directory when under it.
    pub path: String,
    pub old: Option<String>,
    pub new: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Style {
    Header,
    Hunk,
    Removed,
    Added,
    Context,
    Note,
}

impl Style {
    fn paint(self, line: &str) -> String {
        let code = match self {
            Style::Header => "1",
            Style::Hunk => "36",
            Style::Removed => "31",
            Style::Added => "32",
            Style::Note => "2",
            Style::Context => return line.to_owned(),
        };
        format!("\x1b[{code}m{line}\x1b[0m")
    }
}

/// The unified diff of `diff`, each line ending in `\n`; empty when nothing changed.
pub fn unified(diff: &FileDiff, colour: bool, max_lines: usize) -> String {
    let old = diff.old.as_deref().unwrap_or("");
    if diff.old.is_some() && old == diff.new {
        return String::new();
    }
    let text = TextDiff::configure().timeout(DIFF_TIMEOUT).diff_lines(old, diff.new.as_str());
    let mut body: Vec<(Style, String)> = Vec::new();
    for hunk in text.unified_diff().context_radius(CONTEXT).iter_hunks() {
        body.push((Style::Hunk, hunk.header().to_string()));
        for change in hunk.iter_changes() {
            let (style, sign) = match change.tag() {
                ChangeTag::Delete => (Style::Removed, '-'),
                ChangeTag::Insert => (Style::Added, '+'),
                ChangeTag::Equal => (Style::Context, ' '),
            };
            let value = change.value();
            body.push((style, format!("{sign}{}", value.strip_suffix('\n').unwrap_or(value))));
            if change.missing_newline() {
                body.push((Style::Note, "\\ No newline at end of file".to_owned()));
            }
        }
    }
    let from = if diff.old.is_some() { format!("a/{}", diff.path) } else { "/dev/null".to_owned() };
    let mut lines = vec![(Style::Header, format!("--- {from}")), (Style::Header, format!("+++ b/{}", diff.path))];
    let hidden = body.len().saturating_sub(max_lines);
    body.truncate(max_lines);
    lines.extend(body);
    if hidden > 0 {
        lines.push((Style::Note, format!("… {hidden} more lines")));
    }
    let mut out = String::new();
    for (style, line) in lines {
        out.push_str(&if colour { style.paint(&line) } else { line });
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn diff(old: Option<&str>, new: &str) -> FileDiff {
        FileDiff { path: "src/a.rs".into(), old: old.map(str::to_owned), new: new.into() }
    }

    #[test]
    fn an_edit_is_a_hunk_with_three_lines_of_context() {
        let old = "1\n2\n3\n4\n5\n6\n7\n8\n9\n";
        let new = "1\n2\n3\n4\nfive\n6\n7\n8\n9\n";
        assert_eq!(
            unified(&diff(Some(old), new), false, MAX_LINES),
            "--- a/src/a.rs\n+++ b/src/a.rs\n@@ -2,7 +2,7 @@\n 2\n 3\n 4\n-5\n+five\n 6\n 7\n 8\n"
        );
    }

    #[test]
    fn a_new_file_comes_from_dev_null() {
        assert_eq!(
            unified(&diff(None, "a\nb"), false, MAX_LINES),
            "--- /dev/null\n+++ b/src/a.rs\n@@ -0,0 +1,2 @@\n+a\n+b\n\\ No newline at end of file\n"
        );
    }

    #[test]
    fn colour_marks_each_kind_of_line() {
        let out = unified(&diff(Some("x\n"), "y\n"), true, MAX_LINES);
        assert!(out.contains("\x1b[31m-x\x1b[0m\n"), "{out:?}");
        assert!(out.contains("\x1b[32m+y\x1b[0m\n"), "{out:?}");
        assert!(out.contains("\x1b[36m@@ -1 +1 @@\x1b[0m\n"), "{out:?}");
    }

    #[test]
    fn long_diffs_are_capped_with_a_count() {
        let new: String = (0..10).map(|i| format!("{i}\n")).collect();
        let out = unified(&diff(None, &new), false, 4);
        assert_eq!(out, "--- /dev/null\n+++ b/src/a.rs\n@@ -0,0 +1,10 @@\n+0\n+1\n+2\n… 7 more lines\n");
    }

    #[test]
    fn an_unchanged_file_prints_nothing() {
        assert_eq!(unified(&diff(Some("same\n"), "same\n"), false, MAX_LINES), "");
    }
}
