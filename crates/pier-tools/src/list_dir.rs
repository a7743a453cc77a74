//! `list_dir`: one directory's entries with type and size, `.gitignore` respected,
//! read through the directory's handle beneath its root.

use futures::future::BoxFuture;
use serde::Deserialize;
use serde_json::{Value, json};

use crate::walk::Kind;
use crate::{Location, Preview, Tool, ToolContext, ToolError, ToolKind, ToolOutput, Workspace, arg_path, blocking};

pub struct ListDir;

#[derive(Deserialize)]
struct Args {
    #[serde(default)]
    path: Option<String>,
}

/// What the model reads of [`ListDir`].
const LIST_DIR_DESCRIPTION: &str =
    "List a directory of the session: each entry with its type and size. Files ignored by .gitignore are left out.";

/// The arguments [`ListDir`] takes (JSON schema).
fn list_dir_parameters() -> Value {
    json!({
        "type": "object",
        "properties": {"path": {"type": "string", "description": "Directory, relative to the session directory (default: .)"}},
        "required": ["path"]
    })
}

impl Tool for ListDir {
    crate::tool_spec!("list_dir", ToolKind::Read, LIST_DIR_DESCRIPTION, list_dir_parameters);
    fn preview(&self, args: &Value, ws: &Workspace) -> Preview {
        let path = arg_path(args).unwrap_or(".");
        Preview {
            title: format!("List {path}"),
            locations: ws.resolve(path).map(|p| vec![Location { path: p, line: None }]).unwrap_or_default(),
            content: Vec::new(),
        }
    }
    fn run(&self, args: Value, cx: ToolContext) -> BoxFuture<'static, Result<ToolOutput, ToolError>> {
        Box::pin(async move {
            let args: Args = crate::parse_args("list_dir", args)?;
            let dir = cx.workspace.resolve(args.path.as_deref().unwrap_or("."))?;
            let shown = cx.workspace.display(&dir);
            let max = cx.limits.list_max_entries;
            let dir2 = dir.clone();
            let ws = cx.workspace.clone();
            let entries = blocking(move || list(&ws, &dir2, &shown, max)).await?;
            let mut out = ToolOutput::ok(entries.0, json!({"path": dir, "entries": entries.1}));
            out.locations = vec![Location { path: dir, line: None }];
            Ok(out)
        })
    }
}

fn list(ws: &Workspace, dir: &std::path::Path, shown: &str, max: usize) -> Result<(String, usize), ToolError> {
    let (handle, abs) = ws.open_dir(dir).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotADirectory => ToolError::new(format!("{shown} is not a directory; use read_file")),
        _ => ToolError::new(format!("cannot list {shown}: {e}")),
    })?;
    let mut rows = Vec::new();
    crate::walk::walk(ws, handle, &abs, Some(1), |entry| {
        let name = entry.name.to_string_lossy().into_owned();
        let row = match entry.kind {
            Kind::Symlink => {
                let target =
                    entry.dir.read_link_contents(&entry.name).map(|t| t.display().to_string()).unwrap_or_default();
                format!("{name} -> {target}  (symlink)")
            }
            Kind::Dir => format!("{name}/  (dir)"),
            Kind::File | Kind::Other => {
                let size = entry.dir.symlink_metadata(&entry.name).map(|m| m.len()).unwrap_or(0);
                format!("{name}  ({size} bytes)")
            }
        };
        rows.push(row);
        true
    })
    .map_err(|e| ToolError::new(format!("cannot list {shown}: {e}")))?;
    rows.sort();
    let count = rows.len();
    if count == 0 {
        return Ok((format!("[{shown} is empty]"), 0));
    }
    let mut text = rows.iter().take(max).cloned().collect::<Vec<_>>().join("\n");
    if count > max {
        text.push_str(&format!("\n[{} more entries not shown]", count - max));
    }
    Ok((text, count))
}
