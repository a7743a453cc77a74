//! What this machine lets pier enforce, found once per process and said at start, in
//! `pier show` and `GET /agents`: a task is refused at submit when its level needs what is
//! missing, never run open.

use std::path::Path;
use std::sync::OnceLock;

use crate::level::{Level, Limits};
use crate::limits::CgroupKind;

/// The machine's confinement, probed once.
#[derive(Debug, Clone)]
pub struct Kernel {
    /// The kernel's Landlock ABI, `None` where it is unavailable.
    pub landlock_abi: Option<u32>,
    /// `Ok` when `pier jail --probe` built user, mount, PID and network namespaces; the reason if not.
    pub namespaces: Result<(), String>,
    pub cgroups: CgroupKind,
}

impl Kernel {
    /// Probes with `pier_exe jail --probe` the first time; later calls return the same.
    pub fn get(pier_exe: &Path) -> &'static Kernel {
        static KERNEL: OnceLock<Kernel> = OnceLock::new();
        KERNEL.get_or_init(|| Kernel {
            landlock_abi: landlock_abi(),
            namespaces: probe_namespaces(pier_exe),
            cgroups: crate::limits::probe(),
        })
    }

    /// One line: "landlock 7, userns, mountns, pidns, netns, cgroup v1: memory, pids, cpu".
    pub fn describe(&self) -> String {
        let mut parts = vec![match self.landlock_abi {
            Some(abi) => format!("landlock {abi}"),
            None => "no landlock".to_owned(),
        }];
        match &self.namespaces {
            Ok(()) => parts.push("userns, mountns, pidns, netns".into()),
            Err(e) => parts.push(format!("no namespaces ({e})")),
        }
        parts.push(self.cgroups.describe());
        parts.join(", ")
    }

    /// Why a task at `level` with `limits` cannot run here, if it cannot: checked at submit
    /// and again before each attempt.
    pub fn refuses(&self, level: Level, limits: &Limits) -> Option<String> {
        if level == Level::Off {
            return None;
        }
        if let Err(e) = &self.namespaces {
            return Some(format!("sandbox = \"{level}\" needs namespaces this machine does not give: {e}"));
        }
        if let Some(missing) = self.cgroups.missing(limits) {
            return Some(format!(
                "the task's {missing} limit cannot be enforced here ({}); remove it or run where cgroups are delegated",
                self.cgroups.describe()
            ));
        }
        None
    }
}

fn probe_namespaces(pier_exe: &Path) -> Result<(), String> {
    let out = std::process::Command::new(pier_exe)
        .args(["jail", "--probe"])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .output()
        .map_err(|e| format!("cannot run {} jail --probe: {e}", pier_exe.display()))?;
    let text = String::from_utf8_lossy(&out.stderr);
    if out.status.success() && text.contains(crate::helper::PROBE_OK) {
        Ok(())
    } else if out.status.success() {
        Err(format!("{} is not a pier that can run `jail --probe`", pier_exe.display()))
    } else {
        let text = String::from_utf8_lossy(&out.stderr);
        Err(text.trim().trim_start_matches("pier jail: ").to_owned())
    }
}

/// The kernel's Landlock ABI version, `None` where Landlock is unavailable.
#[allow(unsafe_code)]
fn landlock_abi() -> Option<u32> {
    const LANDLOCK_CREATE_RULESET_VERSION: libc::c_uint = 1;
    // SAFETY: with a null attribute pointer, size 0 and the VERSION flag, the kernel reads no
    // memory and only returns the ABI version (or an error).
    let v = unsafe {
        libc::syscall(
            libc::SYS_landlock_create_ruleset,
            std::ptr::null::<libc::c_void>(),
            0usize,
            LANDLOCK_CREATE_RULESET_VERSION,
        )
    };
    u32::try_from(v).ok().filter(|v| *v > 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_level_the_machine_cannot_give_is_refused_with_the_reason_never_lowered() {
        let open = Kernel { landlock_abi: None, namespaces: Err("EPERM".into()), cgroups: CgroupKind::None };
        let why = open.refuses(Level::Strict, &Limits::default()).unwrap_or_default();
        assert!(why.contains("sandbox = \"strict\" needs namespaces") && why.contains("EPERM"), "{why}");
        assert!(open.refuses(Level::Workspace, &Limits::default()).is_some());
        assert_eq!(open.refuses(Level::Off, &Limits::default()), None);
        let no_pids = Kernel {
            landlock_abi: Some(7),
            namespaces: Ok(()),
            cgroups: CgroupKind::V1 { bases: vec![("memory".into(), "/sys/fs/cgroup/memory".into())] },
        };
        assert_eq!(no_pids.refuses(Level::Strict, &Limits { memory: Some(1 << 30), ..Limits::default() }), None);
        let why = no_pids.refuses(Level::Strict, &Limits { pids: Some(64), ..Limits::default() }).unwrap_or_default();
        assert!(why.contains("pids limit cannot be enforced"), "{why}");
        assert!(no_pids.describe().starts_with("landlock 7, userns, mountns, pidns, netns, cgroup v1: memory"));
    }
}
