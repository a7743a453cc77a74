//! The session's directory and the confinement of every path a tool touches.
//!
//! A path is joined to the root, normalised lexically (`.` and `..`), checked to
//! be under the root, then resolved through symlinks: the deepest part that
//! exists is canonicalised and the rest re-attached, and the result is checked
//! again. So `..`, absolute paths elsewhere, and symlinks that point out are all
//! refused, including a dangling symlink a write would follow.
//!
//! A workspace has one root, the session's `cwd`, against which relative paths
//! resolve, and may have more (ACP's `additionalDirectories`): an absolute path
//! inside any root is accepted.

use std::path::{Component, Path, PathBuf};

use crate::ToolError;

/// The roots every tool path must stay inside. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Workspace {
    root: PathBuf,
    extra: std::sync::Arc<[PathBuf]>,
}

impl Workspace {
    /// A workspace rooted at `cwd`, which must exist.
    pub fn new(cwd: &Path) -> std::io::Result<Workspace> {
        Ok(Workspace { root: cwd.canonicalize()?, extra: std::sync::Arc::from(Vec::new()) })
    }

    /// A workspace rooted at `cwd` that also admits paths inside each of `extra`; all must exist.
    pub fn with_roots(cwd: &Path, extra: &[PathBuf]) -> std::io::Result<Workspace> {
        let extra: Vec<PathBuf> = extra
            .iter()
            .map(|d| d.canonicalize().map_err(|e| std::io::Error::new(e.kind(), format!("{}: {e}", d.display()))))
            .collect::<std::io::Result<_>>()?;
        Ok(Workspace { root: cwd.canonicalize()?, extra: std::sync::Arc::from(extra) })
    }

    /// The session directory: relative paths start here.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Every root: the session directory first, then the additional ones.
    pub fn roots(&self) -> impl Iterator<Item = &Path> {
        std::iter::once(self.root.as_path()).chain(self.extra.iter().map(PathBuf::as_path))
    }

    fn inside(&self, path: &Path) -> bool {
        self.roots().any(|r| path.starts_with(r))
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
        if !self.inside(&normal) {
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
        if !self.inside(&resolved) {
            return Err(ToolError::new(format!(
                "`{path}` resolves through a symlink to {}, outside the session's roots ({}); refused",
                resolved.display(),
                self.describe_roots()
            )));
        }
        Ok(resolved)
    }

    fn describe_roots(&self) -> String {
        self.roots().map(|r| r.display().to_string()).collect::<Vec<_>>().join(", ")
    }

    fn outside(&self, path: &str) -> ToolError {
        if self.extra.is_empty() {
            return ToolError::new(format!(
                "`{path}` is outside the session directory {}; tools may only touch paths inside it",
                self.root.display()
            ));
        }
        ToolError::new(format!(
            "`{path}` is outside the session's roots ({}); tools may only touch paths inside them",
            self.describe_roots()
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
    fn additional_roots_admit_absolute_paths_inside_them_only() {
        let (_d, ws) = ws();
        let other = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let third = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let multi = Workspace::with_roots(ws.root(), &[other.path().to_owned()]).unwrap_or_else(|e| panic!("{e}"));
        let inside = other.path().canonicalize().unwrap_or_else(|e| panic!("{e}")).join("f");
        assert_eq!(multi.resolve(&inside.display().to_string()).ok(), Some(inside.clone()));
        assert_eq!(multi.resolve("rel").ok(), Some(ws.root().join("rel")));
        assert!(ws.resolve(&inside.display().to_string()).is_err());
        let elsewhere = third.path().join("f").display().to_string();
        let msg = multi.resolve(&elsewhere).err().map(|e| e.0).unwrap_or_default();
        assert!(msg.contains("outside the session's roots"), "{msg}");
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
