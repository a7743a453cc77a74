//! Landlock inside the jail's root, the second wall: even if a mount were wrong, the agent
//! writes only the writable paths and its temp directories (what it reads is what the mount
//! view holds); since ABI 6 it can neither signal nor reach an
//! abstract Unix socket outside its domain. `no_new_privs` comes with it. On a kernel
//! without Landlock the mount view alone holds (said by [`crate::Kernel::describe`]).

use std::path::PathBuf;

use landlock::{ABI, Access, AccessFs, Ruleset, RulesetAttr, RulesetCreatedAttr, Scope, path_beneath_rules};

use crate::mounts::DEVICES;
use crate::spec::Spec;

/// The newest ABI pier knows the rights of; older kernels get what they support.
const ABI_USED: ABI = ABI::V7;

pub(crate) fn restrict(spec: &Spec) -> Result<(), String> {
    let all = AccessFs::from_all(ABI_USED);
    let read = AccessFs::from_read(ABI_USED);
    // Reads are bounded by the mount view, which holds only what the task may read (Landlock
    // cannot grant `/` itself without all beneath it, and programs list `/`).
    let readable = [PathBuf::from("/")];
    let mut writable: Vec<PathBuf> = spec.write.clone();
    writable.extend(["/tmp", "/dev/shm", "/dev/pts"].map(PathBuf::from));
    writable.extend(DEVICES.iter().map(PathBuf::from));
    writable.retain(|p| p.exists());
    let error = |e: landlock::RulesetError| format!("cannot apply the jail's Landlock rules: {e}");
    Ruleset::default()
        .handle_access(all)
        .map_err(error)?
        .scope(Scope::from_all(ABI_USED))
        .map_err(error)?
        .create()
        .map_err(error)?
        .add_rules(path_beneath_rules(readable, read))
        .map_err(error)?
        .add_rules(path_beneath_rules(writable, all))
        .map_err(error)?
        .restrict_self()
        .map_err(error)?;
    Ok(())
}
