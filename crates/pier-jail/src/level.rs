//! What a task asks of its confinement: a level and resource limits, as plans and
//! pier.toml write them.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// How much of the confinement an agent runs under.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Level {
    /// Files, network (egress only through pier's proxy), processes and limits: the default of
    /// `pier run` and `pier serve`.
    #[default]
    Strict,
    /// Files only: the agent sees and writes only what the task allows, but keeps the
    /// machine's network.
    Workspace,
    /// No confinement beyond the process group that ends with the attempt (logged as a warning).
    Off,
}

impl Level {
    pub fn as_str(self) -> &'static str {
        match self {
            Level::Strict => "strict",
            Level::Workspace => "workspace",
            Level::Off => "off",
        }
    }
}

impl fmt::Display for Level {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Level {
    type Err = String;
    fn from_str(s: &str) -> Result<Level, String> {
        match s {
            "strict" => Ok(Level::Strict),
            "workspace" => Ok(Level::Workspace),
            "off" => Ok(Level::Off),
            other => Err(format!("sandbox = \"{other}\" is not a level; use \"strict\", \"workspace\" or \"off\"")),
        }
    }
}

/// Resource limits of one attempt (all its processes together). `None` is no limit.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Limits {
    /// Bytes of memory (written `"2G"`, `"512M"` or a number of bytes).
    #[serde(default, with = "bytes", skip_serializing_if = "Option::is_none")]
    pub memory: Option<u64>,
    /// Processes and threads.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pids: Option<u64>,
    /// CPUs' worth of time (1.5 = one and a half cores).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu: Option<f64>,
}

impl Limits {
    /// These limits, each one replaced by `over`'s where `over` sets it.
    pub fn overlaid(self, over: Limits) -> Limits {
        Limits { memory: over.memory.or(self.memory), pids: over.pids.or(self.pids), cpu: over.cpu.or(self.cpu) }
    }

    pub fn is_empty(&self) -> bool {
        self.memory.is_none() && self.pids.is_none() && self.cpu.is_none()
    }

    /// Refuses limits no kernel could apply, naming the field.
    pub fn check(&self) -> Result<(), String> {
        if self.memory == Some(0) {
            return Err("limits.memory must be more than 0 bytes".into());
        }
        if self.pids == Some(0) {
            return Err("limits.pids must be at least 1".into());
        }
        if let Some(cpu) = self.cpu
            && !(cpu.is_finite() && (0.01..=4096.0).contains(&cpu))
        {
            return Err(format!("limits.cpu = {cpu} is not a number of CPUs between 0.01 and 4096"));
        }
        Ok(())
    }
}

impl fmt::Display for Limits {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut parts = Vec::new();
        if let Some(m) = self.memory {
            parts.push(format!("memory {}", show_bytes(m)));
        }
        if let Some(p) = self.pids {
            parts.push(format!("pids {p}"));
        }
        if let Some(c) = self.cpu {
            parts.push(format!("cpu {c}"));
        }
        if parts.is_empty() { f.write_str("no limits") } else { f.write_str(&parts.join(", ")) }
    }
}

/// `"2G"`, `"512M"`, `"64K"`, `"1000"` (bytes): powers of 1024.
pub fn parse_bytes(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let (digits, unit) = match t.char_indices().find(|(_, c)| !c.is_ascii_digit()) {
        Some((i, _)) => t.split_at(i),
        None => (t, ""),
    };
    let n: u64 = digits.parse().map_err(|_| format!("`{text}` is not a size; write it as 2G, 512M, 64K or bytes"))?;
    let shift = match unit.trim().to_ascii_uppercase().trim_end_matches("IB").trim_end_matches('B') {
        "" => 0,
        "K" => 10,
        "M" => 20,
        "G" => 30,
        "T" => 40,
        _ => return Err(format!("`{text}` has an unknown unit; use K, M, G or T")),
    };
    n.checked_mul(1 << shift).ok_or_else(|| format!("`{text}` is too large"))
}

pub fn show_bytes(n: u64) -> String {
    for (shift, unit) in [(40, "T"), (30, "G"), (20, "M"), (10, "K")] {
        if n >= 1 << shift && n.is_multiple_of(1 << shift) {
            return format!("{}{unit}", n >> shift);
        }
    }
    format!("{n}")
}

mod bytes {
    use serde::{Deserialize, Deserializer, Serializer};

    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Size {
        Number(u64),
        Text(String),
    }

    pub fn serialize<S: Serializer>(v: &Option<u64>, s: S) -> Result<S::Ok, S::Error> {
        match v {
            Some(n) => s.serialize_str(&super::show_bytes(*n)),
            None => s.serialize_none(),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
        match Option::<Size>::deserialize(d)? {
            None => Ok(None),
            Some(Size::Number(n)) => Ok(Some(n)),
            Some(Size::Text(t)) => super::parse_bytes(&t).map(Some).map_err(serde::de::Error::custom),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_in_powers_of_1024_and_refuse_what_they_cannot_read() {
        assert_eq!(parse_bytes("2G"), Ok(2 << 30));
        assert_eq!(parse_bytes("512M"), Ok(512 << 20));
        assert_eq!(parse_bytes("64KiB"), Ok(64 << 10));
        assert_eq!(parse_bytes("1000"), Ok(1000));
        assert!(parse_bytes("2X").is_err());
        assert!(parse_bytes("G").is_err());
        assert!(parse_bytes("99999999999T").is_err());
        assert_eq!(show_bytes(2 << 30), "2G");
        assert_eq!(show_bytes(1000), "1000");
    }

    #[test]
    fn limits_read_from_toml_words_and_overlay_field_by_field() {
        let l: Limits = serde_json::from_str(r#"{"memory":"2G","pids":512,"cpu":1.5}"#).unwrap_or_default();
        assert_eq!(l, Limits { memory: Some(2 << 30), pids: Some(512), cpu: Some(1.5) });
        let task = Limits { pids: Some(64), ..Limits::default() };
        assert_eq!(l.overlaid(task), Limits { memory: Some(2 << 30), pids: Some(64), cpu: Some(1.5) });
        assert!(Limits { cpu: Some(f64::NAN), ..Limits::default() }.check().is_err());
        assert!(Limits { pids: Some(0), ..Limits::default() }.check().is_err());
        assert_eq!("workspace".parse::<Level>(), Ok(Level::Workspace));
        assert!("open".parse::<Level>().is_err());
    }
}
