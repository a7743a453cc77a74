//! `pier store`: the store itself, as a file to keep.

use std::path::PathBuf;

use crate::run_cmd::open_tasks;

#[derive(Debug, clap::Subcommand)]
pub enum StoreCmd {
    /// Copy the whole store, while it is in use, to a new SQLite file (restore: stop pier,
    /// then put the copy in the store's place and remove its -wal and -shm files)
    Backup {
        /// The new file
        path: PathBuf,
        /// The store [env: PIER_STORE; default: $PIER_HOME/pier.db]
        #[arg(long)]
        store: Option<String>,
    },
}

pub async fn run(cmd: StoreCmd) -> anyhow::Result<()> {
    match cmd {
        StoreCmd::Backup { path, store } => {
            let tasks = open_tasks(&store)?;
            tasks.backup(path.clone()).await.map_err(|e| anyhow::anyhow!("the backup was not made: {e}"))?;
            eprintln!("pier: the store is copied to {}", path.display());
            Ok(())
        }
    }
}
