//! `pier config`: the effective configuration and where each value came from — a flag, an
//! environment variable, which file, or pier's default. Secrets are never printed: a key
//! or token shows only that it is set, and where.

use std::collections::BTreeMap;
use std::path::Path;

use serde_json::{Value, json};

use crate::config::{self, Env, ModelFlags, ProcessEnv};
use crate::run_cmd::EventFormat;

#[derive(Debug, clap::Args)]
pub struct ConfigArgs {
    #[command(flatten)]
    model: ModelFlags,
    /// The store, as `pier run --store` would take it
    #[arg(long)]
    store: Option<String>,
    /// text for a person, json for scripts
    #[arg(long, value_enum, default_value_t = EventFormat::Text)]
    format: EventFormat,
}

/// Each setting: its value, and where it came from.
type Settings = BTreeMap<String, (String, String)>;

/// Environment variables pier reads, the setting each stands for, and whether it is secret.
const ENV: &[(&str, &str, bool)] = &[
    ("PIER_PROVIDER", "provider", false),
    ("PIER_MODEL", "model", false),
    ("PIER_BASE_URL", "base_url", false),
    ("PIER_API_KEY", "api_key", true),
    ("OPENAI_API_KEY", "api_key", true),
    ("PIER_LOCAL_MODEL", "local_model", false),
    ("PIER_STORE", "store", false),
    ("PIER_HOME", "home", false),
    ("PIER_SERVER", "server", false),
    ("PIER_TOKEN", "token", true),
];

#[allow(clippy::print_stdout)]
pub fn show(args: ConfigArgs) -> anyhow::Result<()> {
    let env = ProcessEnv;
    let cwd = std::env::current_dir()?;
    // A file pier would refuse is an error here too, with the same message.
    let files = config::load_files(&env, &cwd)?;
    let mut settings = Settings::new();
    for path in config::config_files(&env, &cwd) {
        from_file(&path, &mut settings)?;
    }
    // Earlier entries lose: OPENAI_API_KEY is read after PIER_API_KEY.
    for (var, key, secret) in ENV.iter().rev() {
        if let Some(v) = env.var(var).filter(|v| !v.is_empty()) {
            let shown = if *secret { "(set)".to_owned() } else { v };
            settings.insert((*key).to_owned(), (shown, format!("env {var}")));
        }
    }
    for (key, flag, value) in [
        ("provider", "--provider", &args.model.provider),
        ("model", "--model", &args.model.model),
        ("base_url", "--base-url", &args.model.base_url),
        ("store", "--store", &args.store),
    ] {
        if let Some(v) = value {
            settings.insert(key.to_owned(), (v.clone(), format!("flag {flag}")));
        }
    }
    let defaults = [
        ("home", config::pier_home(&env)?.display().to_string()),
        ("store", config::store_spec(&env, args.store.as_deref(), &files)?),
        ("profile", "automation".to_owned()),
        ("mode", "ask".to_owned()),
    ];
    for (key, value) in defaults {
        settings.entry(key.to_owned()).or_insert((value, "default".to_owned()));
    }
    if let Some((store, _)) = settings.get_mut("store") {
        *store = pier_host::store::redacted(store);
    }
    let (model, why) = effective_model(&args.model, &env, &files)?;
    settings.insert("model (effective)".to_owned(), (model, why));
    match args.format {
        EventFormat::Json => {
            let out: BTreeMap<&String, Value> =
                settings.iter().map(|(k, (v, s))| (k, json!({"value": v, "source": s}))).collect();
            println!("{}", json!(out));
        }
        EventFormat::Text => {
            let width = settings.keys().map(|k| k.len()).max().unwrap_or(0);
            for (key, (value, source)) in &settings {
                println!("{key:<width$} = {value}  # {source}");
            }
        }
    }
    Ok(())
}

/// Every value of one file, flattened to dotted keys, attributed to the file.
fn from_file(path: &Path, settings: &mut Settings) -> anyhow::Result<()> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(anyhow::anyhow!("could not read {}: {e}", path.display())),
    };
    let table: toml::Table = toml::from_str(&text)
        .map_err(|e| anyhow::anyhow!("{} is not a valid pier configuration: {e}", path.display()))?;
    let mut flat = Vec::new();
    flatten("", &toml::Value::Table(table), &mut flat);
    for (key, value) in flat {
        settings.insert(key, (value, path.display().to_string()));
    }
    Ok(())
}

fn flatten(prefix: &str, value: &toml::Value, out: &mut Vec<(String, String)>) {
    match value {
        toml::Value::Table(t) => {
            for (k, v) in t {
                let key = if prefix.is_empty() { k.clone() } else { format!("{prefix}.{k}") };
                flatten(&key, v, out);
            }
        }
        toml::Value::String(s) => out.push((prefix.to_owned(), s.clone())),
        other => out.push((prefix.to_owned(), serde_json::to_string(other).unwrap_or_default())),
    }
}

/// The model `pier agent` would use here, and why.
fn effective_model(flags: &ModelFlags, env: &dyn Env, files: &config::FileConfig) -> anyhow::Result<(String, String)> {
    if !config::wants_local(flags, env)
        && let Some(c) = config::resolve_model(flags, env, files)?
    {
        return Ok((format!("{} at {}", c.model, c.base_url), "resolved from the settings above".to_owned()));
    }
    #[cfg(feature = "local")]
    {
        let path = match config::named_local_model(env, files) {
            Some((p, _)) => p,
            None => pier_model::local::model_path(&config::pier_home(env)?, pier_model::local::DEFAULT_MODEL),
        };
        if path.is_file() {
            return Ok((
                format!("embedded {}", path.display()),
                "no provider is configured; the embedded model is installed".into(),
            ));
        }
        Ok((
            "none".to_owned(),
            format!("no provider is configured and {} is missing: {}", path.display(), pier_model::CONFIGURE_HINT),
        ))
    }
    #[cfg(not(feature = "local"))]
    Ok(("none".to_owned(), format!("no provider is configured: {}", pier_model::CONFIGURE_HINT)))
}
