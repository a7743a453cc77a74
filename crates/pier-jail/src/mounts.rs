//! The jail's file system: a fresh root holding only what the task may see, the way
//! bubblewrap builds one. A read-only view of the system trees (`/usr`, `/lib*`, `/etc`
//! less its secrets), fresh `/proc` (the jail's own processes), a minimal `/dev`, the
//! attempt's private `/tmp`, and the task's paths bound at their own places, read-only or
//! read-write; pier's state masked wherever a bound tree holds it. Then `pivot_root` and
//! the old root detached: what is not bound does not exist for the agent, whatever its
//! permissions (sockets of other services included), so nothing depends on checking a
//! string. Landlock ([`crate::rules`]) then restricts the same view again.

use std::path::{Component, Path, PathBuf};

use nix::mount::{MntFlags, MsFlags, mount, umount2};

use crate::spec::Spec;

/// The system trees every agent reads (its interpreter and libraries live there).
const SYSTEM: &[&str] = &["/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc"];

/// Secrets masked inside `/etc`.
const SECRETS: &[&str] = &[
    "/etc/shadow",
    "/etc/shadow-",
    "/etc/gshadow",
    "/etc/gshadow-",
    "/etc/sudoers",
    "/etc/sudoers.d",
    "/etc/ssh",
    "/etc/ssl/private",
    "/etc/pier",
];

/// The devices bound into the jail's `/dev`.
pub(crate) const DEVICES: &[&str] = &["/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom", "/dev/tty"];

type Res = Result<(), String>;

/// No source (a remount, a propagation change).
const NONE: Option<&Path> = None;

/// In PID 1 of the jail: builds the root and moves into it; the working directory is `spec.cwd`.
pub(crate) fn build(spec: &Spec) -> Res {
    mnt(NONE, Path::new("/"), None, MsFlags::MS_REC | MsFlags::MS_PRIVATE, None)?;
    let root = spec.root.as_path();
    mnt(Some("tmpfs"), root, Some("tmpfs"), MsFlags::MS_NOSUID | MsFlags::MS_NODEV, Some("mode=0755,size=16m"))?;
    for sys in SYSTEM {
        place(root, Path::new(sys), false)?;
    }
    dev(root)?;
    let proc = within(root, Path::new("/proc"));
    mkdir(&proc)?;
    let quiet = MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC;
    mnt(Some("proc"), &proc, Some("proc"), quiet, None)?;
    let tmp = within(root, Path::new("/tmp"));
    mkdir(&tmp)?;
    mnt(Some(spec.tmp.as_path()), &tmp, None, MsFlags::MS_BIND, None)?;
    // Parents before children, so a writable path inside a read-only root lands on top of it.
    let mut binds: Vec<(&Path, bool)> =
        spec.read.iter().filter(|p| !spec.write.contains(p)).map(|p| (p.as_path(), false)).collect();
    binds.extend(spec.write.iter().map(|p| (p.as_path(), true)));
    binds.sort_by_key(|(p, _)| p.components().count());
    for (path, write) in binds {
        place(root, path, write)?;
    }
    for hidden in spec.hide.iter().map(PathBuf::as_path).chain(SECRETS.iter().map(Path::new)) {
        mask(&within(root, hidden))?;
    }
    std::env::set_current_dir(root).map_err(|e| format!("cannot enter the jail's root: {e}"))?;
    nix::unistd::pivot_root(".", ".").map_err(|e| format!("cannot pivot into the jail's root: {e}"))?;
    umount2(".", MntFlags::MNT_DETACH).map_err(|e| format!("cannot detach the old root: {e}"))?;
    std::env::set_current_dir("/").map_err(|e| format!("cannot enter /: {e}"))?;
    // The root itself (its mount points) is read-only once built.
    mnt(
        NONE,
        Path::new("/"),
        None,
        MsFlags::MS_REMOUNT | MsFlags::MS_RDONLY | MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
        None,
    )?;
    std::env::set_current_dir(&spec.cwd)
        .map_err(|e| format!("cannot enter the working directory {} in the jail: {e}", spec.cwd.display()))
}

/// In `pier jail --probe`: the mounts `build` needs, on a scratch tmpfs.
pub(crate) fn probe() -> Res {
    mnt(NONE, Path::new("/"), None, MsFlags::MS_REC | MsFlags::MS_PRIVATE, None)?;
    let scratch = Path::new("/tmp");
    mnt(Some("tmpfs"), scratch, Some("tmpfs"), MsFlags::empty(), Some("size=1m"))?;
    let proc = scratch.join("proc");
    mkdir(&proc)?;
    mnt(Some("proc"), &proc, Some("proc"), MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC, None)
}

/// `path` (absolute) inside `root`.
fn within(root: &Path, path: &Path) -> PathBuf {
    let mut out = root.to_path_buf();
    for c in path.components() {
        if let Component::Normal(part) = c {
            out.push(part);
        }
    }
    out
}

fn mnt(
    source: Option<&(impl AsRef<Path> + ?Sized)>,
    target: &Path,
    fstype: Option<&str>,
    flags: MsFlags,
    data: Option<&str>,
) -> Res {
    let source = source.map(|s| s.as_ref().to_path_buf());
    mount(source.as_deref(), target, fstype, flags, data)
        .map_err(|e| format!("cannot mount {} in the jail: {e}", target.display()))
}

fn mkdir(path: &Path) -> Res {
    std::fs::create_dir_all(path).map_err(|e| format!("cannot create {} in the jail: {e}", path.display()))
}

/// Binds `path` at its own place under `root`, read-only unless `write`. A top-level
/// symbolic link (`/lib -> usr/lib`) is recreated as a link; a missing path is skipped.
fn place(root: &Path, path: &Path, write: bool) -> Res {
    let Ok(meta) = std::fs::symlink_metadata(path) else { return Ok(()) };
    let target = within(root, path);
    if meta.file_type().is_symlink() {
        if target.symlink_metadata().is_ok() {
            return Ok(());
        }
        let link = std::fs::read_link(path).map_err(|e| format!("cannot read the link {}: {e}", path.display()))?;
        if let Some(parent) = target.parent() {
            mkdir(parent)?;
        }
        return std::os::unix::fs::symlink(&link, &target)
            .map_err(|e| format!("cannot link {}: {e}", target.display()));
    }
    if target.symlink_metadata().is_err() {
        if let Some(parent) = target.parent() {
            mkdir(parent)?;
        }
        if meta.is_dir() {
            mkdir(&target)?;
        } else {
            std::fs::File::create(&target).map_err(|e| format!("cannot create {}: {e}", target.display()))?;
        }
    }
    mnt(Some(path), &target, None, MsFlags::MS_BIND | MsFlags::MS_REC, None)?;
    if !write {
        read_only(&target)?;
    }
    Ok(())
}

/// Makes the bind at `target` read-only, with every mount below it (`mount_setattr`,
/// Linux 5.12); on older kernels the top mount only, keeping the flags a user namespace
/// may not clear (nosuid, nodev, noexec).
#[allow(unsafe_code)]
fn read_only(target: &Path) -> Res {
    #[repr(C)]
    struct MountAttr {
        attr_set: u64,
        attr_clr: u64,
        propagation: u64,
        userns_fd: u64,
    }
    const MOUNT_ATTR_RDONLY: u64 = 0x1;
    let attr = MountAttr { attr_set: MOUNT_ATTR_RDONLY, attr_clr: 0, propagation: 0, userns_fd: 0 };
    let path = std::ffi::CString::new(target.as_os_str().as_encoded_bytes()).map_err(|_| "a path holds a NUL byte")?;
    // SAFETY: `path` is a NUL-terminated string and `attr` a mount_attr of the size passed; the
    // kernel reads both and writes neither.
    let r = unsafe {
        libc::syscall(
            libc::SYS_mount_setattr,
            libc::AT_FDCWD,
            path.as_ptr(),
            libc::AT_RECURSIVE,
            &attr as *const MountAttr,
            std::mem::size_of::<MountAttr>(),
        )
    };
    if r == 0 {
        return Ok(());
    }
    let locked = nix::sys::statvfs::statvfs(target).map(|s| s.flags()).unwrap_or(nix::sys::statvfs::FsFlags::empty());
    let mut flags = MsFlags::MS_BIND | MsFlags::MS_REMOUNT | MsFlags::MS_RDONLY;
    for (fs, ms) in [
        (nix::sys::statvfs::FsFlags::ST_NOSUID, MsFlags::MS_NOSUID),
        (nix::sys::statvfs::FsFlags::ST_NODEV, MsFlags::MS_NODEV),
        (nix::sys::statvfs::FsFlags::ST_NOEXEC, MsFlags::MS_NOEXEC),
        (nix::sys::statvfs::FsFlags::ST_NOATIME, MsFlags::MS_NOATIME),
        (nix::sys::statvfs::FsFlags::ST_NODIRATIME, MsFlags::MS_NODIRATIME),
        (nix::sys::statvfs::FsFlags::ST_RELATIME, MsFlags::MS_RELATIME),
    ] {
        if locked.contains(fs) {
            flags |= ms;
        }
    }
    mnt(NONE, target, None, flags, None)
}

/// Hides `target` if the jail holds it: an empty read-only directory or an empty file.
fn mask(target: &Path) -> Res {
    let Ok(meta) = target.symlink_metadata() else { return Ok(()) };
    if meta.is_dir() {
        let flags = MsFlags::MS_RDONLY | MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC;
        mnt(Some("tmpfs"), target, Some("tmpfs"), flags, Some("size=4k,mode=0555"))
    } else if meta.is_file() {
        mnt(Some("/dev/null"), target, None, MsFlags::MS_BIND, None)?;
        read_only(target)
    } else {
        Ok(())
    }
}

/// A minimal `/dev`: the usual devices bound from the host, a private `shm` and `pts`.
fn dev(root: &Path) -> Res {
    let dev = within(root, Path::new("/dev"));
    mkdir(&dev)?;
    mnt(Some("tmpfs"), &dev, Some("tmpfs"), MsFlags::MS_NOSUID | MsFlags::MS_NOEXEC, Some("mode=0755,size=64k"))?;
    for device in DEVICES {
        let target = within(root, Path::new(device));
        if Path::new(device).exists() {
            std::fs::File::create(&target).map_err(|e| format!("cannot create {}: {e}", target.display()))?;
            mnt(Some(*device), &target, None, MsFlags::MS_BIND, None)?;
        }
    }
    let shm = dev.join("shm");
    mkdir(&shm)?;
    mnt(Some("tmpfs"), &shm, Some("tmpfs"), MsFlags::MS_NOSUID | MsFlags::MS_NODEV, Some("mode=1777"))?;
    let pts = dev.join("pts");
    mkdir(&pts)?;
    // A private devpts instance; without one (old kernels) terminals inside the jail fail, nothing else does.
    let private = mnt(
        Some("devpts"),
        &pts,
        Some("devpts"),
        MsFlags::MS_NOSUID | MsFlags::MS_NOEXEC,
        Some("newinstance,ptmxmode=0666,mode=620"),
    );
    let mut links = vec![
        ("/proc/self/fd", "fd"),
        ("/proc/self/fd/0", "stdin"),
        ("/proc/self/fd/1", "stdout"),
        ("/proc/self/fd/2", "stderr"),
    ];
    if private.is_ok() {
        links.push(("pts/ptmx", "ptmx"));
    }
    for (to, name) in links {
        std::os::unix::fs::symlink(to, dev.join(name)).map_err(|e| format!("cannot link /dev/{name}: {e}"))?;
    }
    Ok(())
}
