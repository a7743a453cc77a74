//! `read_file`: a text file, paged by lines; binary files are refused.

use std::io::{BufRead, BufReader, Read};

use futures::future::BoxFuture;
use serde::Deserialize;
use serde_json::{Value, json};

use crate::{Location, Preview, Tool, ToolContext, ToolError, ToolKind, ToolOutput, Workspace, arg_path, blocking};

pub struct ReadFile;

#[derive(Deserialize)]
struct Args {
    path: String,
    #[serde(default)]
    line: Option<u64>,
    #[serde(default)]
    limit: Option<u64>,
}

impl Tool for ReadFile {
    fn name(&self) -> &str {
        "read_file"
    }
    fn kind(&self) -> ToolKind {
        ToolKind::Read
    }
    fn description(&self) -> &str {
        "Read a text file in the session directory. Large files are returned a page at a time: pass `line` \
         (1-based first line) and `limit` (number of lines) to read further."
    }
    fn parameters(&self) -> Value {
        json!({
            "type": "object",
            "properties": {
                "path": {"type": "string", "description": "File path, relative to the session directory"},
                "line": {"type": "integer", "minimum": 1, "description": "First line to read (1-based)"},
                "limit": {"type": "integer", "minimum": 1, "description": "Maximum number of lines to read"}
            },
            "required": ["path"]
        })
    }
    fn preview(&self, args: &Value, ws: &Workspace) -> Preview {
        let path = arg_path(args).unwrap_or("?");
        let line = args.get("line").and_then(Value::as_u64).map(|l| l as u32);
        Preview {
            title: format!("Read {path}"),
            locations: ws.resolve(path).map(|p| vec![Location { path: p, line }]).unwrap_or_default(),
            content: Vec::new(),
        }
    }
    fn run(&self, args: Value, cx: ToolContext) -> BoxFuture<'static, Result<ToolOutput, ToolError>> {
        Box::pin(async move {
            let args: Args = crate::parse_args("read_file", args)?;
            let path = cx.workspace.resolve(&args.path)?;
            let shown = cx.workspace.display(&path);
            let start = args.line.unwrap_or(1).max(1) as usize;
            let limit = args.limit.map_or(cx.limits.read_default_lines, |l| l.max(1) as usize);
            // Leave room for the paging note, so the cap never cuts it off.
            let budget = cx.limits.output_bytes.saturating_sub(256).max(1);
            let file = path.clone();
            let (text, end, total) = blocking(move || read_page(&path, &shown, start, limit, budget)).await?;
            let mut out = ToolOutput::ok(
                text,
                json!({"path": file, "first_line": start, "last_line": end, "total_lines": total}),
            );
            out.locations = vec![Location { path: file, line: Some(start as u32) }];
            Ok(out)
        })
    }
}

/// Lines `start..start+limit` of the file, stopping early at `budget` bytes.
/// Returns the text (with a paging note when there is more), the last line shown and the line count.
fn read_page(
    path: &std::path::Path,
    shown: &str,
    start: usize,
    limit: usize,
    budget: usize,
) -> Result<(String, usize, usize), ToolError> {
    let meta = std::fs::metadata(path).map_err(|e| ToolError::new(format!("cannot read {shown}: {e}")))?;
    if meta.is_dir() {
        return Err(ToolError::new(format!("{shown} is a directory; use list_dir")));
    }
    let mut file = std::fs::File::open(path).map_err(|e| ToolError::new(format!("cannot read {shown}: {e}")))?;
    let mut sniff = vec![0u8; 8192];
    let n = read_up_to(&mut file, &mut sniff).map_err(|e| ToolError::new(format!("cannot read {shown}: {e}")))?;
    sniff.truncate(n);
    if is_binary(&sniff) {
        return Err(ToolError::new(format!("{shown} is a binary file; read_file only returns text")));
    }
    let reader = BufReader::new(std::io::Cursor::new(sniff).chain(file));
    let mut text = String::new();
    let (mut last, mut total, mut cut_by_budget) = (0usize, 0usize, false);
    for (i, line) in reader.split(b'\n').enumerate() {
        let line = line.map_err(|e| ToolError::new(format!("cannot read {shown}: {e}")))?;
        let number = i + 1;
        total = number;
        if number < start || number >= start + limit || cut_by_budget {
            continue;
        }
        let line = String::from_utf8(line)
            .map_err(|_| ToolError::new(format!("{shown} is not valid UTF-8 at line {number}; it looks binary")))?;
        if text.len() + line.len() + 1 > budget && last >= start {
            cut_by_budget = true;
            continue;
        }
        text.push_str(line.strip_suffix('\r').unwrap_or(&line));
        text.push('\n');
        last = number;
    }
    if total == 0 {
        return Ok((format!("[{shown} is empty]"), 0, 0));
    }
    if start > total {
        return Err(ToolError::new(format!("{shown} has {total} lines; line {start} is past the end")));
    }
    if last < total {
        text.push_str(&format!(
            "[showing lines {start}-{last} of {total}; call read_file with line={} to read more]",
            last + 1
        ));
    }
    Ok((text, last, total))
}

fn read_up_to(r: &mut impl Read, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut filled = 0;
    while filled < buf.len() {
        match r.read(&mut buf[filled..])? {
            0 => break,
            n => filled += n,
        }
    }
    Ok(filled)
}

fn is_binary(sniff: &[u8]) -> bool {
    if sniff.contains(&0) {
        return true;
    }
    // A multi-byte character cut at the sniff's end is fine; anything else is not text.
    match std::str::from_utf8(sniff) {
        Ok(_) => false,
        Err(e) => e.error_len().is_some(),
    }
}
