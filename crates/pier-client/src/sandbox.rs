//! The directories the agent's `fs/*` and `terminal/*` calls may touch: the
//! session's cwd and any `--allow-dir`, with symlinks resolved.

use std::path::{Path, PathBuf};

use agent_client_protocol_schema::v1::Error;
use pier_acp::error::invalid_params;
use pier_tools::Workspace;

#[derive(Debug, Clone)]
pub struct Sandbox {
    roots: Vec<Workspace>,
    /// When set, writes must also land inside one of these (host-side trust).
    writable: Option<Vec<Workspace>>,
}

impl Sandbox {
    pub fn new(cwd: &Path, allow_dirs: &[PathBuf]) -> std::io::Result<Sandbox> {
        let mut roots = vec![Workspace::new(cwd)?];
        for dir in allow_dirs {
            roots.push(Workspace::new(dir)?);
        }
        Ok(Sandbox { roots, writable: None })
    }

    /// Restricts writes to `dirs` (each must exist).
    pub fn with_writable(mut self, dirs: &[PathBuf]) -> std::io::Result<Sandbox> {
        self.writable = Some(dirs.iter().map(|d| Workspace::new(d)).collect::<std::io::Result<_>>()?);
        Ok(self)
    }

    /// Whether `path` (absolute) may be written under the write restriction.
    pub fn may_write(&self, path: &Path) -> bool {
        match (&self.writable, path.to_str()) {
            (None, _) => true,
            (Some(dirs), Some(text)) => dirs.iter().any(|d| d.resolve(text).is_ok()),
            (Some(_), None) => false,
        }
    }

    /// The path of a write: inside the roots, and inside the writable directories if any.
    pub fn resolve_write(&self, path: &Path) -> Result<PathBuf, Error> {
        let resolved = self.resolve(path)?;
        if !self.may_write(&resolved) {
            return Err(invalid_params(format!("`{}` is outside the paths this task may write", path.display())));
        }
        Ok(resolved)
    }

    /// The path, if it is absolute and inside a root once symlinks are resolved.
    pub fn resolve(&self, path: &Path) -> Result<PathBuf, Error> {
        if !path.is_absolute() {
            return Err(invalid_params(format!("`{}` is not an absolute path (R010)", path.display())));
        }
        let Some(text) = path.to_str() else {
            return Err(invalid_params("the path is not valid UTF-8"));
        };
        let mut last = None;
        for root in &self.roots {
            match root.resolve(text) {
                Ok(p) => return Ok(p),
                Err(e) => last = Some(e),
            }
        }
        let roots: Vec<String> = self.roots.iter().map(|r| r.root().display().to_string()).collect();
        Err(invalid_params(format!(
            "`{}` is outside the directories this client serves ({}); {}",
            path.display(),
            roots.join(", "),
            last.map(|e| e.0).unwrap_or_default()
        )))
    }
}
