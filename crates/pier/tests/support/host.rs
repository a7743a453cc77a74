//! A `pier run` host in a scratch directory: its environment, files and store.

use std::path::PathBuf;
use std::process::Output;

use serde_json::Value;
use tokio::process::Command;

use super::{LIMIT, must};

pub struct Host {
    pub dir: tempfile::TempDir,
    pub vars: Vec<(String, String)>,
}

impl Host {
    pub fn new(base_url: Option<String>) -> Host {
        let dir = must(tempfile::tempdir(), "dir");
        let mut vars = vec![
            ("HOME".to_owned(), dir.path().display().to_string()),
            ("PIER_HOME".to_owned(), dir.path().join("data").display().to_string()),
            ("PATH".to_owned(), std::env::var("PATH").unwrap_or_default()),
            ("RUST_LOG".to_owned(), "error".to_owned()),
        ];
        if let Some(url) = base_url {
            vars.push(("PIER_BASE_URL".into(), url));
            vars.push(("PIER_MODEL".into(), "fake-model".into()));
        }
        Host { dir, vars }
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    pub fn write(&self, name: &str, text: &str) -> PathBuf {
        let p = self.path(name);
        must(std::fs::write(&p, text), "write");
        p
    }

    pub fn command(&self, args: &[&str]) -> Command {
        super::pier_command(self.dir.path(), &self.vars, args)
    }

    pub async fn run(&self, args: &[&str]) -> Output {
        let child = must(self.command(args).spawn(), "spawn");
        must(must(tokio::time::timeout(LIMIT * 6, child.wait_with_output()).await, "finished in time"), "wait")
    }

    pub fn store(&self) -> pier_host::SqliteStore {
        must(pier_host::SqliteStore::open(&self.path("data/pier.db")), "open store")
    }

    /// Stores run `run` of one task `t`, claimed (attempt 1) by another host `owner`
    /// whose lease ends at `expires_ms`, as if that host had crashed or gone silent.
    pub fn claimed_elsewhere(&self, run: &str, owner: String, expires_ms: i64) -> pier_host::Attempt {
        let plan = must(pier_host::plan::parse("[[tasks]]\nid = \"t\"\nprompt = \"hi\"\n", &|_| Ok(())), "plan");
        let store = self.store();
        must(pier_host::TaskStore::create_run(&store, run, &plan, "test"), "create");
        let claimed = must(pier_host::TaskStore::claim(&store, run, "t", &owner, expires_ms), "claim by another host");
        claimed.unwrap_or_else(|| panic!("the task was not claimable")).0
    }
}

/// A lease owner naming a process of this machine that does not exist.
pub fn dead_owner() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    format!("{}:{}:dead", host.trim(), u32::MAX - 3)
}

pub fn lines(o: &Output) -> Vec<Value> {
    String::from_utf8_lossy(&o.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect()
}

pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}
