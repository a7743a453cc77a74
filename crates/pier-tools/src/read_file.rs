//! `read_file`: a text file, paged by lines; binary files are refused.
//!
//! The file is opened beneath its root ([`Workspace::open_file`]: FIFOs and
//! devices refused) and streamed: memory is bounded by the page and the line cap
//! whatever the file's size or the length of its lines. A line longer than
//! [`MAX_LINE_CHARS`] is cut and its tail marked.

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

/// What the model reads of [`ReadFile`].
const READ_FILE_DESCRIPTION: &str = "Read a text file in the session directory. Large files are returned a page at a time: pass `line` \
         (1-based first line) and `limit` (number of lines) to read further.";

/// The arguments [`ReadFile`] takes (JSON schema).
fn read_file_parameters() -> Value {
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

impl Tool for ReadFile {
    crate::tool_spec!("read_file", ToolKind::Read, READ_FILE_DESCRIPTION, read_file_parameters);
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
            let ws = cx.workspace.clone();
            let (text, end, total) = blocking(move || read_page(&ws, &path, &shown, start, limit, budget)).await?;
            let mut out = ToolOutput::ok(
                text.clone(),
                json!({"path": file, "first_line": start, "last_line": end, "total_lines": total}),
            );
            // An editor shows what was read inside the call, as the model reads it.
            out.content = vec![crate::ToolContent::Text { text }];
            out.locations = vec![Location { path: file, line: Some(start as u32) }];
            Ok(out)
        })
    }
}

/// Longest line returned, in chars; the rest of the line is replaced by a marker.
pub const MAX_LINE_CHARS: usize = 2000;

/// Bytes of a line kept while reading: enough for [`MAX_LINE_CHARS`] of any width.
const MAX_LINE_BYTES: usize = MAX_LINE_CHARS * 4;

/// One line as read: its first bytes (at most [`MAX_LINE_BYTES`]) and its full length.
struct Line {
    kept: Vec<u8>,
    len: u64,
}

/// Reads the next line (without its `\n`) keeping at most `MAX_LINE_BYTES` of it;
/// `None` at the end of the file. The rest of a long line is skipped, never held.
fn next_line(reader: &mut impl BufRead, line: &mut Line, keep: bool) -> std::io::Result<bool> {
    line.kept.clear();
    line.len = 0;
    let mut any = false;
    loop {
        let buf = match reader.fill_buf() {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        if buf.is_empty() {
            return Ok(any);
        }
        any = true;
        let (chunk, done) = match memchr::memchr(b'\n', buf) {
            Some(i) => (&buf[..i], Some(i + 1)),
            None => (buf, None),
        };
        if keep && line.kept.len() < MAX_LINE_BYTES {
            let room = MAX_LINE_BYTES - line.kept.len();
            line.kept.extend_from_slice(&chunk[..room.min(chunk.len())]);
        }
        line.len += chunk.len() as u64;
        let used = done.unwrap_or(buf.len());
        reader.consume(used);
        if done.is_some() {
            return Ok(true);
        }
    }
}

/// The line's text, cut at [`MAX_LINE_CHARS`] with a marker saying how much was left out.
fn render_line(line: &Line, shown: &str, number: usize) -> Result<String, ToolError> {
    let whole = line.kept.len() as u64 == line.len;
    let mut bytes = line.kept.as_slice();
    if whole && bytes.last() == Some(&b'\r') {
        bytes = &bytes[..bytes.len() - 1];
    }
    let text = match std::str::from_utf8(bytes) {
        Ok(t) => t,
        // A character cut by the byte cap is fine; anything else is not text.
        Err(e) if !whole && e.error_len().is_none() => std::str::from_utf8(&bytes[..e.valid_up_to()]).unwrap_or(""),
        Err(_) => {
            return Err(ToolError::new(format!("{shown} is not valid UTF-8 at line {number}; it looks binary")));
        }
    };
    let head = match text.char_indices().nth(MAX_LINE_CHARS) {
        Some((i, _)) => &text[..i],
        None if whole => return Ok(text.to_owned()),
        None => text,
    };
    Ok(format!("{head}[… line cut: {} more bytes]", line.len - head.len() as u64))
}

/// Lines `start..start+limit` of the file, stopping early at `budget` bytes.
/// Returns the text (with a paging note when there is more), the last line shown and the line count.
fn read_page(
    ws: &Workspace,
    path: &std::path::Path,
    shown: &str,
    start: usize,
    limit: usize,
    budget: usize,
) -> Result<(String, usize, usize), ToolError> {
    let opened = ws.open_file(path).map_err(|e| match e.kind() {
        std::io::ErrorKind::IsADirectory => ToolError::new(format!("{shown} is a directory; use list_dir")),
        _ => ToolError::new(format!("cannot read {shown}: {e}")),
    })?;
    let mut file = opened.file;
    let mut sniff = vec![0u8; 8192];
    let n = read_up_to(&mut file, &mut sniff).map_err(|e| ToolError::new(format!("cannot read {shown}: {e}")))?;
    sniff.truncate(n);
    if is_binary(&sniff) {
        return Err(ToolError::new(format!("{shown} is a binary file; read_file only returns text")));
    }
    let mut reader = BufReader::with_capacity(64 * 1024, std::io::Cursor::new(sniff).chain(file));
    let mut text = String::new();
    let (mut last, mut total, mut cut_by_budget) = (0usize, 0usize, false);
    let mut line = Line { kept: Vec::new(), len: 0 };
    loop {
        let number = total + 1;
        let wanted = number >= start && number < start.saturating_add(limit) && !cut_by_budget;
        if !next_line(&mut reader, &mut line, wanted)
            .map_err(|e| ToolError::new(format!("cannot read {shown}: {e}")))?
        {
            break;
        }
        total = number;
        if !wanted {
            continue;
        }
        let rendered = render_line(&line, shown, number)?;
        if text.len() + rendered.len() + 1 > budget && last >= start {
            cut_by_budget = true;
            continue;
        }
        text.push_str(&rendered);
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
