//! `grep`: a regex over the tree with ripgrep's own crates, `.gitignore` respected.
//! The tree is walked and each file opened through directory handles beneath the
//! root (`walk`), so no search reads a file outside it.

use futures::future::BoxFuture;
use grep::regex::RegexMatcher;
use grep::searcher::sinks::UTF8;
use grep::searcher::{BinaryDetection, SearcherBuilder};
use serde::Deserialize;
use serde_json::{Value, json};

use crate::walk::Kind;
use crate::workspace::open_regular;
use crate::{Location, Preview, Tool, ToolContext, ToolError, ToolKind, ToolOutput, Workspace, blocking};

pub struct Grep;

#[derive(Deserialize)]
struct Args {
    pattern: String,
    #[serde(default)]
    path: Option<String>,
    #[serde(default)]
    glob: Option<String>,
}

/// Longest matched line shown, in chars.
const MAX_LINE_CHARS: usize = 400;

/// What the model reads of [`Grep`].
const GREP_DESCRIPTION: &str = "Search files of the session for a regular expression (Rust regex syntax). Returns `path:line: text` \
         for each matching line. Respects .gitignore and skips binary files. Narrow with `path` and `glob` (e.g. `*.rs`).";

/// The arguments [`Grep`] takes (JSON schema).
fn grep_parameters() -> Value {
    json!({
        "type": "object",
        "properties": {
            "pattern": {"type": "string", "description": "Regular expression"},
            "path": {"type": "string", "description": "File or directory to search (default: .)"},
            "glob": {"type": "string", "description": "Only search files whose path matches this glob, e.g. *.rs"}
        },
        "required": ["pattern"]
    })
}

impl Tool for Grep {
    crate::tool_spec!("grep", ToolKind::Search, GREP_DESCRIPTION, grep_parameters);
    fn preview(&self, args: &Value, ws: &Workspace) -> Preview {
        let pattern = args.get("pattern").and_then(Value::as_str).unwrap_or("?");
        let path = args.get("path").and_then(Value::as_str).unwrap_or(".");
        Preview {
            title: format!("grep {pattern:?} in {path}"),
            locations: ws.resolve(path).map(|p| vec![Location { path: p, line: None }]).unwrap_or_default(),
            content: Vec::new(),
        }
    }
    fn run(&self, args: Value, cx: ToolContext) -> BoxFuture<'static, Result<ToolOutput, ToolError>> {
        Box::pin(async move {
            let args: Args = crate::parse_args("grep", args)?;
            let root = cx.workspace.resolve(args.path.as_deref().unwrap_or("."))?;
            let ws = cx.workspace.clone();
            let max = cx.limits.grep_max_matches;
            let cancel = cx.cancel.clone();
            let pattern = args.pattern.clone();
            let (lines, capped, files) =
                blocking(move || search(&ws, &root, &pattern, args.glob.as_deref(), max, &cancel)).await?;
            let count = lines.len();
            let mut text =
                if lines.is_empty() { format!("no matches for {:?}", args.pattern) } else { lines.join("\n") };
            if capped {
                text.push_str(&format!("\n[stopped at {max} matches; narrow the pattern, path or glob]"));
            }
            Ok(ToolOutput::ok(text, json!({"matches": count, "files_searched": files, "capped": capped})))
        })
    }
}

/// The files a glob picks out beneath `root`.
fn overrides(root: &std::path::Path, glob: &str) -> Result<ignore::overrides::Override, ToolError> {
    let mut overrides = ignore::overrides::OverrideBuilder::new(root);
    overrides.add(glob).map_err(|e| ToolError::new(format!("invalid glob {glob:?}: {e}")))?;
    overrides.build().map_err(|e| ToolError::new(format!("invalid glob {glob:?}: {e}")))
}

/// A matched line as the model sees it: `PATH:N: line`, cut at [`MAX_LINE_CHARS`].
fn shown_line(shown: &str, number: u64, line: &str) -> String {
    let line = line.trim_end_matches(['\n', '\r']);
    if line.chars().count() > MAX_LINE_CHARS {
        let cut: String = line.chars().take(MAX_LINE_CHARS).chain("…".chars()).collect();
        format!("{shown}:{number}: {cut}")
    } else {
        format!("{shown}:{number}: {line}")
    }
}

fn search(
    ws: &Workspace,
    root: &std::path::Path,
    pattern: &str,
    glob: Option<&str>,
    max: usize,
    cancel: &tokio_util::sync::CancellationToken,
) -> Result<(Vec<String>, bool, usize), ToolError> {
    let matcher =
        RegexMatcher::new_line_matcher(pattern).map_err(|e| ToolError::new(format!("invalid pattern: {e}")))?;
    let overrides = glob.map(|glob| overrides(root, glob)).transpose()?;
    let mut searcher =
        SearcherBuilder::new().binary_detection(BinaryDetection::quit(b'\x00')).line_number(true).build();
    let (mut lines, mut files, mut capped, mut cancelled) = (Vec::new(), 0usize, false, false);
    let mut search_one = |file: std::fs::File, abs: &std::path::Path| {
        files += 1;
        let shown = ws.display(abs);
        let result = searcher.search_file(
            &matcher,
            &file,
            UTF8(|number, line| {
                lines.push(shown_line(&shown, number, line));
                if lines.len() >= max {
                    capped = true;
                    return Ok(false);
                }
                Ok(true)
            }),
        );
        if let Err(e) = result {
            tracing::debug!(file = %shown, error = %e, "grep skipped a file");
        }
        !capped
    };
    match ws.open_dir(root) {
        Ok((dir, abs)) => {
            crate::walk::walk(ws, dir, &abs, None, |entry| {
                if cancel.is_cancelled() {
                    cancelled = true;
                    return false;
                }
                if entry.kind != Kind::File {
                    return true;
                }
                if let Some(ov) = &overrides
                    && ov.matched(&entry.abs, false).is_ignore()
                {
                    return true;
                }
                match open_regular(entry.dir, std::path::Path::new(&entry.name)) {
                    Ok(file) => search_one(file, &entry.abs),
                    Err(e) => {
                        tracing::debug!(file = %entry.abs.display(), error = %e, "grep skipped a file");
                        true
                    }
                }
            })
            .map_err(|e| ToolError::new(format!("cannot search {}: {e}", ws.display(root))))?;
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotADirectory => {
            let opened =
                ws.open_file(root).map_err(|e| ToolError::new(format!("cannot search {}: {e}", ws.display(root))))?;
            search_one(opened.file, &opened.path);
        }
        Err(e) => return Err(ToolError::new(format!("cannot search {}: {e}", ws.display(root)))),
    }
    if cancelled {
        return Err(ToolError::new("cancelled"));
    }
    Ok((lines, capped, files))
}
