//! The per-attempt network allowlist.

use std::fmt;
use std::net::{IpAddr, Ipv6Addr};

use crate::EgressError;

/// The hosts one attempt may reach: entries `host`, `host:port` or `[ipv6-address]:port`.
///
/// Names are compared case-insensitively and without a trailing dot; IP addresses are compared as
/// addresses, so `[::1]` and `[0:0::1]` are the same entry. An entry without a port allows every
/// port. Names are never resolved: `localhost` and `127.0.0.1` are different entries, so a plan
/// allows exactly the spellings it lists.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Allow {
    entries: Vec<Entry>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Entry {
    host: Host,
    port: Option<u16>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Host {
    Name(String),
    Ip(IpAddr),
}

impl Allow {
    /// Parses a plan's `network = [...]` entries; the error names the first bad entry.
    pub fn parse(entries: &[String]) -> Result<Allow, EgressError> {
        let entries = entries
            .iter()
            .map(|raw| parse_entry(raw).map_err(|reason| EgressError::BadEntry { entry: raw.clone(), reason }))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Allow { entries })
    }

    /// Whether `host` (as in a request target: a name, an IPv4 address or a bracketed IPv6 address)
    /// may be reached on `port`.
    pub fn permits(&self, host: &str, port: u16) -> bool {
        let Some(host) = normalise(host) else { return false };
        self.entries.iter().any(|e| e.host == host && e.port.is_none_or(|p| p == port))
    }

    /// The entries in their canonical spelling, for messages.
    pub fn entries(&self) -> impl Iterator<Item = String> + '_ {
        self.entries.iter().map(Entry::to_string)
    }

    /// Whether nothing at all is allowed.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

impl fmt::Display for Entry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (&self.host, self.port) {
            (Host::Ip(IpAddr::V6(ip)), Some(port)) => write!(f, "[{ip}]:{port}"),
            (Host::Ip(IpAddr::V6(ip)), None) => write!(f, "[{ip}]"),
            (Host::Ip(ip), Some(port)) => write!(f, "{ip}:{port}"),
            (Host::Ip(ip), None) => write!(f, "{ip}"),
            (Host::Name(name), Some(port)) => write!(f, "{name}:{port}"),
            (Host::Name(name), None) => f.write_str(name),
        }
    }
}

/// The comparable form of a host from a request target; `None` when it cannot be a host at all,
/// which no entry permits.
fn normalise(host: &str) -> Option<Host> {
    let host = match host.strip_prefix('[') {
        Some(rest) => return rest.strip_suffix(']')?.parse::<Ipv6Addr>().ok().map(|ip| Host::Ip(IpAddr::V6(ip))),
        None => host,
    };
    if let Ok(ip) = host.parse::<IpAddr>() {
        return Some(Host::Ip(ip));
    }
    let name = host.strip_suffix('.').unwrap_or(host);
    if name.is_empty() {
        return None;
    }
    Some(Host::Name(name.to_ascii_lowercase()))
}

fn parse_entry(raw: &str) -> Result<Entry, String> {
    let s = raw.trim();
    if s.is_empty() {
        return Err("it is empty".into());
    }
    if s.contains("://") {
        return Err("it looks like a URL; give only the host, without scheme or path".into());
    }
    if s.contains('/') {
        return Err("it has a path; give only the host".into());
    }
    if let Some(rest) = s.strip_prefix('[') {
        let Some((addr, after)) = rest.split_once(']') else {
            return Err("the `[` of an IPv6 address is not closed".into());
        };
        let ip: Ipv6Addr = addr.parse().map_err(|_| format!("`{addr}` is not an IPv6 address"))?;
        let port = match after {
            "" => None,
            _ => match after.strip_prefix(':') {
                Some(p) => Some(parse_port(p)?),
                None => return Err(format!("expected `:port` after `]`, found `{after}`")),
            },
        };
        return Ok(Entry { host: Host::Ip(IpAddr::V6(ip)), port });
    }
    if s.matches(':').count() > 1 {
        return Err(if s.parse::<Ipv6Addr>().is_ok() {
            format!("an IPv6 address needs brackets, as in `[{s}]:443`")
        } else {
            "it has more than one `:`".into()
        });
    }
    let (host, port) = match s.split_once(':') {
        Some((host, port)) => (host, Some(parse_port(port)?)),
        None => (s, None),
    };
    if let Ok(ip) = host.parse::<IpAddr>() {
        return Ok(Entry { host: Host::Ip(ip), port });
    }
    check_name(host)?;
    let name = host.strip_suffix('.').unwrap_or(host).to_ascii_lowercase();
    Ok(Entry { host: Host::Name(name), port })
}

fn parse_port(p: &str) -> Result<u16, String> {
    match p.parse::<u16>() {
        Ok(port) if port != 0 => Ok(port),
        _ => Err(format!("`{p}` is not a port (1-65535)")),
    }
}

fn check_name(host: &str) -> Result<(), String> {
    if host.is_empty() {
        return Err("the host is missing".into());
    }
    if host.contains('*') {
        return Err("wildcards are not supported; list each host".into());
    }
    if host.len() > 253 {
        return Err("the host name is longer than 253 characters".into());
    }
    let labels = host.strip_suffix('.').unwrap_or(host);
    for label in labels.split('.') {
        if label.is_empty() {
            return Err("the host name has an empty label (`..` or a leading dot)".into());
        }
        if let Some(c) = label.chars().find(|c| !(c.is_ascii_alphanumeric() || *c == '-' || *c == '_')) {
            return Err(format!("`{c}` cannot appear in a host name"));
        }
    }
    Ok(())
}
