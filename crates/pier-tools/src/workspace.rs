//! The session's directories and the confinement of every file a tool touches.
//!
//! Two layers. [`Workspace::resolve`] gives the absolute path a tool argument
//! names, for messages, locations and previews: it is joined to the session
//! directory, normalised lexically (`.` and `..`), checked to be under a root,
//! resolved through symlinks and checked again, so `..`, absolute paths elsewhere
//! and symlinks that point out are refused with a clear message.
//!
//! A path check on strings cannot make a later `open` safe: a directory can be
//! swapped for a symlink between the check and the use. So every file a tool
//! opens, creates, renames or lists goes through the second layer: the root's
//! directory handle (`cap_std::fs::Dir`), beneath which the kernel resolves the
//! rest of the path (`openat2` with `RESOLVE_BENEATH`, or cap-std's component-wise
//! walk with `O_NOFOLLOW` on older kernels). A symlink is followed only while it
//! stays inside the root. [`Workspace::open_file`], [`Workspace::read_text`],
//! [`Workspace::write_atomic`] and [`Workspace::open_dir`] are those primitives;
//! pier-client's `fs/*` methods use them too.
//!
//! A workspace has one root, the session's `cwd`, against which relative paths
//! resolve, and may have more (ACP's `additionalDirectories`): an absolute path
//! is opened beneath the root it is lexically under.

use std::io::{ErrorKind, Read, Write};
use std::path::{Component, Path, PathBuf};
use std::sync::Arc;

use cap_std::fs::{Dir, OpenOptions, OpenOptionsExt};

use crate::ToolError;

/// One root: its canonical path, whose directory handle everything beneath it is opened
/// through. The handle is opened for each operation and closed after it, so an idle
/// session holds no descriptor (a process may keep any number of sessions); what is
/// beneath the root is still resolved in the kernel, beneath that handle.
#[derive(Debug)]
struct Root {
    path: PathBuf,
}

impl Root {
    fn open(path: &Path) -> std::io::Result<Root> {
        let path =
            path.canonicalize().map_err(|e| std::io::Error::new(e.kind(), format!("{}: {e}", path.display())))?;
        let root = Root { path };
        root.dir()?;
        Ok(root)
    }

    fn dir(&self) -> std::io::Result<Dir> {
        Dir::open_ambient_dir(&self.path, cap_std::ambient_authority())
            .map_err(|e| std::io::Error::new(e.kind(), format!("{}: {e}", self.path.display())))
    }
}

/// The roots every tool path must stay inside. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Workspace {
    /// The session directory first, then the additional ones.
    roots: Arc<[Root]>,
    /// When set, the only directories writes may land in (a host's `writable`); tools'
    /// writes outside them are refused and commands may write only there (and in temp).
    writable: Option<Arc<[PathBuf]>>,
}

/// A file opened beneath a root: a regular file, never a FIFO, socket or device.
#[derive(Debug)]
pub struct OpenedFile {
    pub file: std::fs::File,
    /// The absolute path it was opened by (symlinks inside the root resolved).
    pub path: PathBuf,
    pub len: u64,
}

/// Largest file [`Workspace::read_text`] reads whole.
pub const READ_TEXT_MAX: u64 = 64 << 20;

impl Workspace {
    /// A workspace rooted at `cwd`, which must exist.
    pub fn new(cwd: &Path) -> std::io::Result<Workspace> {
        Workspace::with_roots(cwd, &[])
    }

    /// A workspace rooted at `cwd` that also admits paths inside each of `extra`; all must exist.
    pub fn with_roots(cwd: &Path, extra: &[PathBuf]) -> std::io::Result<Workspace> {
        let roots: Vec<Root> =
            std::iter::once(cwd).chain(extra.iter().map(PathBuf::as_path)).map(Root::open).collect::<Result<_, _>>()?;
        Ok(Workspace { roots: Arc::from(roots), writable: None })
    }

    /// Restricts writes to `dirs` (absolute; symlinks resolved now). Reads are unchanged.
    pub fn with_writable(mut self, dirs: &[PathBuf]) -> std::io::Result<Workspace> {
        let dirs: Vec<PathBuf> = dirs.iter().map(std::fs::canonicalize).collect::<Result<_, _>>()?;
        self.writable = Some(Arc::from(dirs));
        Ok(self)
    }

    /// The directories writes may land in: the writable ones if set, else every root.
    pub fn write_roots(&self) -> Vec<PathBuf> {
        match &self.writable {
            Some(dirs) => dirs.to_vec(),
            None => self.roots().map(Path::to_path_buf).collect(),
        }
    }

    /// The session directory: relative paths start here.
    pub fn root(&self) -> &Path {
        &self.roots[0].path
    }

    /// Every root: the session directory first, then the additional ones.
    pub fn roots(&self) -> impl Iterator<Item = &Path> {
        self.roots.iter().map(|r| r.path.as_path())
    }

    fn inside(&self, path: &Path) -> bool {
        self.roots().any(|r| path.starts_with(r))
    }

    /// `path` relative to the root for display, or as is when outside.
    pub fn display(&self, path: &Path) -> String {
        match path.strip_prefix(self.root()) {
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
        let joined = if given.is_absolute() { given.to_path_buf() } else { self.root().join(given) };
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
            let roots = if self.roots.len() == 1 {
                format!("the session directory {}", self.root().display())
            } else {
                format!("the session's roots ({})", self.describe_roots())
            };
            return Err(ToolError::new(format!(
                "`{path}` resolves through a symlink to {}, outside {roots}; refused",
                resolved.display()
            )));
        }
        Ok(resolved)
    }

    fn describe_roots(&self) -> String {
        self.roots().map(|r| r.display().to_string()).collect::<Vec<_>>().join(", ")
    }

    fn outside(&self, path: &str) -> ToolError {
        if self.roots.len() == 1 {
            return ToolError::new(format!(
                "`{path}` is outside the session directory {}; tools may only touch paths inside it",
                self.root().display()
            ));
        }
        ToolError::new(format!(
            "`{path}` is outside the session's roots ({}); tools may only touch paths inside them",
            self.describe_roots()
        ))
    }
}

/// The confined primitives: every open goes through a root's directory handle.
impl Workspace {
    /// The root `path` is beneath and the path relative to it. `path` is resolved
    /// first (for its message and to translate symlinks that stay inside); the
    /// kernel then resolves the relative part again beneath the root's handle, so a
    /// swap after the check cannot lead outside.
    fn locate(&self, path: &Path) -> std::io::Result<(&Root, PathBuf, PathBuf)> {
        let text =
            path.to_str().ok_or_else(|| std::io::Error::new(ErrorKind::InvalidInput, "the path is not UTF-8"))?;
        let resolved = self.resolve(text).map_err(|e| std::io::Error::new(ErrorKind::PermissionDenied, e.0))?;
        // The deepest root wins when roots nest.
        let root = self
            .roots
            .iter()
            .filter(|r| resolved.starts_with(&r.path))
            .max_by_key(|r| r.path.as_os_str().len())
            .ok_or_else(|| std::io::Error::new(ErrorKind::PermissionDenied, self.outside(text).0))?;
        let rel = resolved.strip_prefix(&root.path).map(Path::to_path_buf).unwrap_or_default();
        Ok((root, rel, resolved))
    }

    /// Opens the regular file at `path` for reading, beneath its root. A directory,
    /// FIFO, socket or device is refused at once: the open does not block
    /// (`O_NONBLOCK`) and the type is checked on the open descriptor.
    pub fn open_file(&self, path: &Path) -> std::io::Result<OpenedFile> {
        let (root, rel, resolved) = self.locate(path)?;
        let file = open_regular(&root.dir()?, rel_or_dot(&rel))?;
        let len = file.metadata()?.len();
        Ok(OpenedFile { file, path: resolved, len })
    }

    /// The text of the file at `path`, `None` if it does not exist. Refuses what
    /// [`Workspace::open_file`] refuses, files over [`READ_TEXT_MAX`] and text that is not UTF-8.
    pub fn read_text(&self, path: &Path) -> std::io::Result<Option<String>> {
        let opened = match self.open_file(path) {
            Ok(o) => o,
            Err(e) if e.kind() == ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(e),
        };
        if opened.len > READ_TEXT_MAX {
            return Err(std::io::Error::new(
                ErrorKind::FileTooLarge,
                format!("the file has {} bytes, more than the {READ_TEXT_MAX} this reads whole", opened.len),
            ));
        }
        let mut bytes = Vec::with_capacity(opened.len as usize);
        opened.file.take(READ_TEXT_MAX + 1).read_to_end(&mut bytes)?;
        String::from_utf8(bytes)
            .map(Some)
            .map_err(|_| std::io::Error::new(ErrorKind::InvalidData, "not a UTF-8 text file"))
    }

    /// Replaces (or creates) the file at `path` with `bytes`, atomically, beneath
    /// its root: parent directories are created, a temporary file with a random
    /// name is created with `O_EXCL` in the target's directory handle (it never
    /// follows a planted symlink), synced, and renamed over the target with
    /// `renameat` in that same handle. An existing target keeps its permissions.
    /// Returns the absolute path written.
    pub fn write_atomic(&self, path: &Path, bytes: &[u8]) -> std::io::Result<PathBuf> {
        let (root, rel, resolved) = self.locate(path)?;
        if let Some(dirs) = &self.writable
            && !dirs.iter().any(|d| resolved.starts_with(d))
        {
            let list: Vec<String> = dirs.iter().map(|d| d.display().to_string()).collect();
            return Err(std::io::Error::new(
                ErrorKind::PermissionDenied,
                format!(
                    "{} is outside the directories this session may write ({})",
                    resolved.display(),
                    list.join(", ")
                ),
            ));
        }
        let (Some(name), parent) = (rel.file_name(), rel.parent().unwrap_or(Path::new(""))) else {
            return Err(std::io::Error::new(ErrorKind::InvalidInput, "the path names no file"));
        };
        let base = root.dir()?;
        let dir = if parent.as_os_str().is_empty() {
            base
        } else {
            base.create_dir_all(parent)?;
            base.open_dir(parent)?
        };
        let mut tmp = None;
        for _ in 0..16 {
            let candidate = format!(".{}.pier-{:016x}.tmp", name.to_string_lossy(), fastrand::u64(..));
            match dir.open_with(&candidate, OpenOptions::new().write(true).create_new(true).mode(0o600)) {
                Ok(file) => {
                    tmp = Some((candidate, file));
                    break;
                }
                Err(e) if e.kind() == ErrorKind::AlreadyExists => continue,
                Err(e) => return Err(e),
            }
        }
        let Some((tmp_name, mut file)) = tmp else {
            return Err(std::io::Error::new(ErrorKind::AlreadyExists, "no free temporary name"));
        };
        let result = (|| {
            file.write_all(bytes)?;
            let mode = match dir.symlink_metadata(name) {
                Ok(meta) if meta.is_file() => meta.permissions(),
                _ => cap_std::fs::Permissions::from_std(std::os::unix::fs::PermissionsExt::from_mode(0o644)),
            };
            file.set_permissions(mode)?;
            file.sync_all()?;
            dir.rename(&tmp_name, &dir, name)
        })();
        if result.is_err() {
            let _ = dir.remove_file(&tmp_name);
        }
        result.map(|()| resolved)
    }

    /// The directory at `path`, opened beneath its root, and its absolute path.
    pub fn open_dir(&self, path: &Path) -> std::io::Result<(Dir, PathBuf)> {
        let (root, rel, resolved) = self.locate(path)?;
        Ok((root.dir()?.open_dir(rel_or_dot(&rel))?, resolved))
    }
}

fn rel_or_dot(rel: &Path) -> &Path {
    if rel.as_os_str().is_empty() { Path::new(".") } else { rel }
}

/// Opens `name` beneath `dir` for reading without blocking and refuses anything but a
/// regular file. `name` may have several components; symlinks are followed only inside.
pub(crate) fn open_regular(dir: &Dir, name: &Path) -> std::io::Result<std::fs::File> {
    let file =
        dir.open_with(name, OpenOptions::new().read(true).custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY))?.into_std();
    let kind = file.metadata()?.file_type();
    if !kind.is_file() {
        use std::os::unix::fs::FileTypeExt;
        let what = if kind.is_dir() {
            return Err(std::io::Error::new(ErrorKind::IsADirectory, "it is a directory"));
        } else if kind.is_fifo() {
            "a FIFO"
        } else if kind.is_socket() {
            "a socket"
        } else if kind.is_char_device() || kind.is_block_device() {
            "a device"
        } else {
            "not a regular file"
        };
        return Err(std::io::Error::new(ErrorKind::InvalidInput, format!("it is {what}; only regular files are read")));
    }
    Ok(file)
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
