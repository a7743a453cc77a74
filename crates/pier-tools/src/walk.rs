//! A directory walk beneath a root's directory handle, with `.gitignore` and
//! `.ignore` files respected (as ripgrep does without a git repository) and `.git`
//! left out. Every directory and file is opened through its parent's handle, so a
//! directory swapped for a symlink mid-walk cannot lead outside the root; symlinks
//! are reported, never followed.

use std::ffi::OsString;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use cap_std::fs::Dir;
use ignore::gitignore::{Gitignore, GitignoreBuilder};

use crate::Workspace;
use crate::workspace::open_regular;

/// What an entry is, as its directory reports it (symlinks not followed).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    File,
    Dir,
    Symlink,
    Other,
}

/// One entry of the walk.
pub(crate) struct Entry<'a> {
    /// The directory holding the entry: open the entry through it.
    pub dir: &'a Dir,
    pub name: OsString,
    pub abs: PathBuf,
    pub kind: Kind,
}

/// Largest ignore file read.
const IGNORE_FILE_MAX: u64 = 1 << 20;

type Matchers = Arc<Vec<Arc<Gitignore>>>;

/// Walks the directory at `start` (absolute, already opened as `dir`) to `max_depth`
/// (1: its entries only), calling `visit` for each entry not ignored, in name order
/// within a directory. `visit` returns `false` to stop the walk.
pub(crate) fn walk(
    ws: &Workspace,
    dir: Dir,
    start: &Path,
    max_depth: Option<usize>,
    mut visit: impl FnMut(&Entry<'_>) -> bool,
) -> std::io::Result<()> {
    let inherited = ancestors_ignores(ws, start);
    let mut stack: Vec<(Dir, PathBuf, usize, Matchers)> = vec![(dir, start.to_owned(), 1, inherited)];
    while let Some((dir, abs, depth, parent_matchers)) = stack.pop() {
        let mut matchers = (*parent_matchers).clone();
        matchers.extend(dir_ignores(&dir, &abs));
        let matchers: Matchers = Arc::new(matchers);
        let mut entries: Vec<(OsString, Kind)> = Vec::new();
        for entry in dir.entries()? {
            let Ok(entry) = entry else { continue };
            let kind = match entry.file_type() {
                Ok(t) if t.is_symlink() => Kind::Symlink,
                Ok(t) if t.is_dir() => Kind::Dir,
                Ok(t) if t.is_file() => Kind::File,
                _ => Kind::Other,
            };
            entries.push((entry.file_name(), kind));
        }
        entries.sort_by(|a, b| a.0.cmp(&b.0));
        let mut subdirs = Vec::new();
        for (name, kind) in entries {
            if name == ".git" {
                continue;
            }
            let child = abs.join(&name);
            if ignored(&matchers, &child, kind == Kind::Dir) {
                continue;
            }
            if !visit(&Entry { dir: &dir, name: name.clone(), abs: child.clone(), kind }) {
                return Ok(());
            }
            if kind == Kind::Dir && max_depth.is_none_or(|m| depth < m) {
                // Opened beneath this directory's handle: a swap to a symlink that leads out fails here.
                match dir.open_dir(&name) {
                    Ok(sub) => subdirs.push((sub, child, depth + 1, matchers.clone())),
                    Err(e) => tracing::debug!(dir = %child.display(), error = %e, "walk skipped a directory"),
                }
            }
        }
        // Reversed so the stack visits them in name order.
        stack.extend(subdirs.into_iter().rev());
    }
    Ok(())
}

/// Whether the deepest matcher with an opinion ignores `path`.
fn ignored(matchers: &[Arc<Gitignore>], path: &Path, is_dir: bool) -> bool {
    for m in matchers.iter().rev() {
        let found = m.matched(path, is_dir);
        if found.is_ignore() {
            return true;
        }
        if found.is_whitelist() {
            return false;
        }
    }
    false
}

/// The ignore files of the directory open as `dir` at `abs`: `.gitignore`, then `.ignore` (which wins).
fn dir_ignores(dir: &Dir, abs: &Path) -> Vec<Arc<Gitignore>> {
    let mut out = Vec::new();
    for name in [".gitignore", ".ignore"] {
        let Ok(file) = open_regular(dir, Path::new(name)) else { continue };
        let mut text = String::new();
        if file.take(IGNORE_FILE_MAX).read_to_string(&mut text).is_err() {
            continue;
        }
        let mut builder = GitignoreBuilder::new(abs);
        for line in text.lines() {
            let _ = builder.add_line(None, line);
        }
        if let Ok(gi) = builder.build() {
            out.push(Arc::new(gi));
        }
    }
    out
}

/// The ignore files of the directories above `start` up to its root, shallowest first.
fn ancestors_ignores(ws: &Workspace, start: &Path) -> Matchers {
    let Some(root) = ws.roots().filter(|r| start.starts_with(r)).max_by_key(|r| r.as_os_str().len()) else {
        return Arc::new(Vec::new());
    };
    let mut chain: Vec<&Path> = start.ancestors().skip(1).take_while(|a| a.starts_with(root)).collect();
    chain.reverse();
    let mut out = Vec::new();
    for dir in chain {
        if let Ok((handle, _)) = ws.open_dir(dir) {
            out.extend(dir_ignores(&handle, dir));
        }
    }
    Arc::new(out)
}
