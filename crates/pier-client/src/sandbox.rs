//! The directories the agent's `fs/*` and `terminal/*` calls may touch: the
//! session's cwd and any `--allow-dir`, with symlinks resolved. Files are opened
//! beneath a root's directory handle (`pier_tools::Workspace`'s confined
//! primitives), and terminals are contained (`pier_tools::contain`).

use std::path::{Path, PathBuf};

use agent_client_protocol_schema::v1::Error;
use pier_acp::error::invalid_params;
use pier_tools::{Confinement, Workspace};

#[derive(Debug, Clone)]
pub struct Sandbox {
    roots: Vec<Workspace>,
    /// When set, writes must also land inside one of these (host-side trust).
    writable: Option<Vec<Workspace>>,
    /// How terminals are confined.
    confinement: Confinement,
    /// The agent's jail: a terminal's command runs in one like it, never beside it on the host.
    jail: Option<crate::process::JailSetup>,
}

impl Sandbox {
    pub fn new(cwd: &Path, allow_dirs: &[PathBuf]) -> std::io::Result<Sandbox> {
        let mut roots = vec![Workspace::new(cwd)?];
        for dir in allow_dirs {
            roots.push(Workspace::new(dir)?);
        }
        Ok(Sandbox { roots, writable: None, confinement: Confinement::default(), jail: None })
    }

    /// Sets how terminals are confined (`--sandbox off` turns Landlock off).
    pub fn with_confinement(mut self, confinement: Confinement) -> Sandbox {
        self.confinement = confinement;
        self
    }

    pub fn confinement(&self) -> &Confinement {
        &self.confinement
    }

    /// Runs terminals' commands in a jail like the agent's.
    pub fn with_jail(mut self, jail: Option<crate::process::JailSetup>) -> Sandbox {
        self.jail = jail;
        self
    }

    pub fn jail(&self) -> Option<&crate::process::JailSetup> {
        self.jail.as_ref()
    }

    /// The directories a terminal's command may write beneath under Landlock.
    pub fn write_roots(&self) -> Vec<PathBuf> {
        self.writable.as_ref().unwrap_or(&self.roots).iter().map(|w| w.root().to_owned()).collect()
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
        self.locate(path).map(|(_, p)| p)
    }

    /// The root `path` is inside and the resolved path: open it only through that
    /// root's confined primitives (`Workspace::open_file`, `write_atomic`).
    pub fn locate(&self, path: &Path) -> Result<(&Workspace, PathBuf), Error> {
        if !path.is_absolute() {
            return Err(invalid_params(format!("`{}` is not an absolute path (R010)", path.display())));
        }
        let Some(text) = path.to_str() else {
            return Err(invalid_params("the path is not valid UTF-8"));
        };
        let mut last = None;
        for root in &self.roots {
            match root.resolve(text) {
                Ok(p) => return Ok((root, p)),
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
