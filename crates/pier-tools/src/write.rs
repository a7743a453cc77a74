//! `write_file` and `edit_file`: file changes, recorded as old and new text, and
//! written atomically through [`Workspace::write_atomic`] (a temporary file with a
//! random name created beneath the target's directory handle, renamed over the
//! target) so a crash never leaves a half-written file and nothing lands outside
//! the roots.

use std::path::Path;

use futures::future::BoxFuture;
use serde::Deserialize;
use serde_json::{Value, json};

use crate::{
    Location, Preview, Tool, ToolContent, ToolContext, ToolError, ToolKind, ToolOutput, Workspace, arg_path, blocking,
};

pub struct WriteFile;
pub struct EditFile;

#[derive(Deserialize)]
struct WriteArgs {
    path: String,
    content: String,
}

#[derive(Deserialize)]
struct EditArgs {
    path: String,
    old_text: String,
    new_text: String,
    #[serde(default)]
    replace_all: bool,
}

/// Files larger than this get no diff in the preview: the permission request stays small.
const PREVIEW_BYTES: u64 = 1 << 20;

/// Title, location and, where the change can be computed without running, its diff.
/// `change` turns the old text (`None` for a new file) into the new text and the first changed line.
fn preview(
    verb: &str,
    args: &Value,
    ws: &Workspace,
    change: impl FnOnce(Option<&str>) -> Option<(String, usize)>,
) -> Preview {
    let path = arg_path(args).unwrap_or("?");
    let mut preview = Preview { title: format!("{verb} {path}"), locations: Vec::new(), content: Vec::new() };
    let Ok(resolved) = ws.resolve(path) else { return preview };
    let old = match ws.open_file(&resolved) {
        Ok(f) if f.len <= PREVIEW_BYTES => ws.read_text(&resolved).ok().flatten(),
        Ok(_) => return preview_at(preview, resolved, None),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(_) => return preview_at(preview, resolved, None),
    };
    match change(old.as_deref()) {
        Some((new_text, line)) => {
            preview.content.push(ToolContent::Diff { path: resolved.clone(), old_text: old, new_text });
            preview_at(preview, resolved, Some(line as u32))
        }
        None => preview_at(preview, resolved, None),
    }
}

fn preview_at(mut preview: Preview, path: std::path::PathBuf, line: Option<u32>) -> Preview {
    preview.locations.push(Location { path, line });
    preview
}

/// The text after an edit and the 1-based line of its first change, or why it cannot apply.
fn apply_edit(old: &str, args: &EditArgs) -> Result<(String, usize, usize), &'static str> {
    let count = old.matches(args.old_text.as_str()).count();
    if count == 0 {
        return Err("not found");
    }
    if count > 1 && !args.replace_all {
        return Err("ambiguous");
    }
    let first = old.find(args.old_text.as_str()).unwrap_or(0);
    let line = old[..first].matches('\n').count() + 1;
    let new = if args.replace_all {
        old.replace(args.old_text.as_str(), &args.new_text)
    } else {
        old.replacen(args.old_text.as_str(), &args.new_text, 1)
    };
    Ok((new, count, line))
}

/// What the model reads of [`WriteFile`].
const WRITE_FILE_DESCRIPTION: &str = "Create a file, or replace a file's whole content. Parent directories are created. Prefer edit_file for \
         changing part of an existing file.";

/// The arguments [`WriteFile`] takes (JSON schema).
fn write_file_parameters() -> Value {
    json!({
        "type": "object",
        "properties": {
            "path": {"type": "string", "description": "File path, relative to the session directory"},
            "content": {"type": "string", "description": "The complete new content of the file"}
        },
        "required": ["path", "content"]
    })
}

/// What the model reads of [`EditFile`].
const EDIT_FILE_DESCRIPTION: &str = "Replace exact text in a file. `old_text` must match exactly once (whitespace included) unless \
         `replace_all` is true; include enough surrounding lines to make it unique.";

/// The arguments [`EditFile`] takes (JSON schema).
fn edit_file_parameters() -> Value {
    json!({
        "type": "object",
        "properties": {
            "path": {"type": "string", "description": "File path, relative to the session directory"},
            "old_text": {"type": "string", "description": "Exact text to replace"},
            "new_text": {"type": "string", "description": "Replacement text"},
            "replace_all": {"type": "boolean", "description": "Replace every occurrence (default false)"}
        },
        "required": ["path", "old_text", "new_text"]
    })
}

impl Tool for WriteFile {
    crate::tool_spec!("write_file", ToolKind::Edit, WRITE_FILE_DESCRIPTION, write_file_parameters);
    fn preview(&self, args: &Value, ws: &Workspace) -> Preview {
        let content = args.get("content").and_then(Value::as_str).map(str::to_owned);
        preview("Write", args, ws, |_| content.map(|c| (c, 1)))
    }
    fn run(&self, args: Value, cx: ToolContext) -> BoxFuture<'static, Result<ToolOutput, ToolError>> {
        Box::pin(async move {
            let args: WriteArgs = crate::parse_args("write_file", args)?;
            let path = cx.workspace.resolve(&args.path)?;
            let shown = cx.workspace.display(&path);
            let target = path.clone();
            let content = args.content.clone();
            let ws = cx.workspace.clone();
            let old = blocking(move || {
                let old = read_existing(&ws, &target, &shown)?;
                write_atomic(&ws, &target, content.as_bytes(), &shown)?;
                Ok(old)
            })
            .await?;
            let shown = cx.workspace.display(&path);
            let verb = if old.is_some() { "Replaced" } else { "Created" };
            let mut out = ToolOutput::ok(
                format!("{verb} {shown} ({} bytes)", args.content.len()),
                json!({"path": path, "created": old.is_none(), "bytes": args.content.len()}),
            );
            out.content = vec![ToolContent::Diff { path: path.clone(), old_text: old, new_text: args.content }];
            out.locations = vec![Location { path: path.clone(), line: Some(1) }];
            Ok(out)
        })
    }
}

impl Tool for EditFile {
    crate::tool_spec!("edit_file", ToolKind::Edit, EDIT_FILE_DESCRIPTION, edit_file_parameters);
    fn preview(&self, args: &Value, ws: &Workspace) -> Preview {
        let edit: Option<EditArgs> = serde_json::from_value(args.clone()).ok();
        preview("Edit", args, ws, |old| {
            let (edit, old) = (edit?, old?);
            if edit.old_text.is_empty() {
                return None;
            }
            apply_edit(old, &edit).ok().map(|(new, _, line)| (new, line))
        })
    }
    fn run(&self, args: Value, cx: ToolContext) -> BoxFuture<'static, Result<ToolOutput, ToolError>> {
        Box::pin(async move {
            let args: EditArgs = crate::parse_args("edit_file", args)?;
            if args.old_text.is_empty() {
                return Err(ToolError::new("old_text is empty; give the exact text to replace"));
            }
            let path = cx.workspace.resolve(&args.path)?;
            let shown = cx.workspace.display(&path);
            let target = path.clone();
            let ws = cx.workspace.clone();
            let (old, new, count, line) = blocking(move || {
                let Some(old) = read_existing(&ws, &target, &shown)? else {
                    return Err(ToolError::new(format!("{shown} does not exist; use write_file to create it")));
                };
                let (new, count, line) = match apply_edit(&old, &args) {
                    Ok(applied) => applied,
                    Err("not found") => {
                        return Err(ToolError::new(format!(
                            "old_text was not found in {shown}; read the file and copy the exact text, whitespace \
                             included"
                        )));
                    }
                    Err(_) => {
                        let count = old.matches(args.old_text.as_str()).count();
                        return Err(ToolError::new(format!(
                            "old_text matches {count} times in {shown}; include more surrounding text to make it \
                             unique, or set replace_all"
                        )));
                    }
                };
                write_atomic(&ws, &target, new.as_bytes(), &shown)?;
                Ok((old, new, count, line))
            })
            .await?;
            let shown = cx.workspace.display(&path);
            let mut out = ToolOutput::ok(
                format!("Edited {shown}: replaced {count} occurrence{}", if count == 1 { "" } else { "s" }),
                json!({"path": path, "replacements": count, "first_line": line}),
            );
            out.content = vec![ToolContent::Diff { path: path.clone(), old_text: Some(old), new_text: new }];
            out.locations = vec![Location { path, line: Some(line as u32) }];
            Ok(out)
        })
    }
}

/// The current text of `path`, `None` if it does not exist; refuses directories,
/// FIFOs, devices and binary files.
fn read_existing(ws: &Workspace, path: &Path, shown: &str) -> Result<Option<String>, ToolError> {
    ws.read_text(path).map_err(|e| match e.kind() {
        std::io::ErrorKind::InvalidData => {
            ToolError::new(format!("{shown} is not a UTF-8 text file; refusing to change it"))
        }
        std::io::ErrorKind::IsADirectory => ToolError::new(format!("{shown} is a directory ({e})")),
        _ => ToolError::new(format!("cannot read {shown}: {e}")),
    })
}

fn write_atomic(ws: &Workspace, path: &Path, bytes: &[u8], shown: &str) -> Result<(), ToolError> {
    ws.write_atomic(path, bytes).map(|_| ()).map_err(|e| ToolError::new(format!("cannot write {shown}: {e}")))
}
