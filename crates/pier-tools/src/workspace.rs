//! The session's directory and the confinement of every path a tool touches.
//!
//! A path is joined to the root, normalised lexically (`.` and `..`), checked to
//! be under the root, then resolved through symlinks: the deepest part that
//! exists is canonicalised and the rest re-attached, and the result is checked
//! again. So `..`, absolute paths elsewhere, and symlinks that point out are all
//! refused, including a dangling symlink a write would follow.

use std::path::{Component, Path, PathBuf};

use crate::ToolError;

/// The root every tool path must stay inside. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Workspace {
    root: PathBuf,
}

impl Workspace {
    /// A workspace rooted at `cwd`, which must exist.
    pub fn new(cwd: &Path) -> std::io::Result<Workspace> {
        Ok(Workspace { root: cwd.canonicalize()? })
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// `path` relative to the root for display, or as is when outside.
    pub fn display(&self, path: &Path) -> String {
        match path.strip_prefix(&self.root) {
            Ok(rel) if rel.as_os_str().is_empty() => ".".to_owned(),
            Ok(rel) => rel.display().to_string(),
            Err(_) => path.display().to_string(),
        }
    }

    /// The absolute path `path` names, if it is inside the root once symlinks are resolved.
    pub fn resolve(&self, path: &str) -> Result<PathBuf, ToolError> {
        if path.is_empty() {
            return Err(ToolError::new("the path is empty; give a path relative to the session directory"));
        }
        if path.contains('\0') {
            return Err(ToolError::new("the path contains a NUL byte"));
        }
        let given = Path::new(path);
        let joined = if given.is_absolute() { given.to_path_buf() } else { self.root.join(given) };
        let normal = normalize(&joined);
        if !normal.starts_with(&self.root) {
            return Err(self.outside(path));
        }
        // Find the deepest existing ancestor (not following a final symlink).
        let mut existing = normal.as_path();
        let mut rest: Vec<&std::ffi::OsStr> = Vec::new();
        while std::fs::symlink_metadata(existing).is_err() {
            match (existing.file_name(), existing.parent()) {
                (Some(name), Some(parent)) => {
                    rest.push(name);
                    existing = parent;
                }
                _ => return Err(self.outside(path)),
            }
        }
        let mut resolved = existing
            .canonicalize()
            .map_err(|e| ToolError::new(format!("`{path}` cannot be resolved ({e}); it may be a dangling symlink")))?;
        for name in rest.into_iter().rev() {
            resolved.push(name);
        }
        if !resolved.starts_with(&self.root) {
            return Err(ToolError::new(format!(
                "`{path}` resolves through a symlink to {}, outside the session directory {}; refused",
                resolved.display(),
                self.root.display()
            )));
        }
        Ok(resolved)
    }

    fn outside(&self, path: &str) -> ToolError {
        ToolError::new(format!(
            "`{path}` is outside the session directory {}; tools may only touch paths inside it",
            self.root.display()
        ))
    }
}

/// Resolves `.` and `..` without touching the filesystem.
fn normalize(path: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for c in path.components() {
        match c {
            Component::ParentDir => {
                out.pop();
            }
            Component::CurDir => {}
            other => out.push(other.as_os_str()),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ws() -> (tempfile::TempDir, Workspace) {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let ws = Workspace::new(dir.path()).unwrap_or_else(|e| panic!("{e}"));
        (dir, ws)
    }

    #[test]
    fn relative_and_inside_absolute_paths_resolve() {
        let (_d, ws) = ws();
        std::fs::create_dir(ws.root().join("src")).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(ws.resolve("src/new.rs").ok(), Some(ws.root().join("src/new.rs")));
        assert_eq!(ws.resolve("./src/../src/x").ok(), Some(ws.root().join("src/x")));
        let abs = ws.root().join("src").display().to_string();
        assert_eq!(ws.resolve(&abs).ok(), Some(ws.root().join("src")));
        assert_eq!(ws.resolve(".").ok(), Some(ws.root().to_owned()));
        assert_eq!(ws.resolve("a/b/c/d.txt").ok(), Some(ws.root().join("a/b/c/d.txt")));
    }

    #[test]
    fn traversal_and_foreign_absolute_paths_are_refused() {
        let (_d, ws) = ws();
        for bad in ["..", "../x", "src/../../x", "/etc/passwd", "/", ""] {
            assert!(ws.resolve(bad).is_err(), "{bad} was accepted");
        }
        let msg = ws.resolve("../secret").err().map(|e| e.0).unwrap_or_default();
        assert!(msg.contains("outside the session directory"), "{msg}");
    }

    #[test]
    fn symlink_escapes_are_refused() {
        let (_d, ws) = ws();
        let outside = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        std::fs::write(outside.path().join("secret"), "s").unwrap_or_else(|e| panic!("{e}"));
        let link = ws.root().join("out");
        std::os::unix::fs::symlink(outside.path(), &link).unwrap_or_else(|e| panic!("{e}"));
        std::os::unix::fs::symlink(outside.path().join("secret"), ws.root().join("file-link"))
            .unwrap_or_else(|e| panic!("{e}"));
        std::os::unix::fs::symlink(outside.path().join("missing"), ws.root().join("dangling"))
            .unwrap_or_else(|e| panic!("{e}"));
        for bad in ["out", "out/secret", "out/new-file", "file-link", "dangling"] {
            let r = ws.resolve(bad);
            assert!(r.is_err(), "{bad} resolved to {r:?}");
        }
        // A symlink that stays inside is fine.
        std::fs::create_dir(ws.root().join("real")).unwrap_or_else(|e| panic!("{e}"));
        std::os::unix::fs::symlink(ws.root().join("real"), ws.root().join("alias")).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(ws.resolve("alias/f").ok(), Some(ws.root().join("real/f")));
    }
}
