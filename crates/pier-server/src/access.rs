//! Who calls, and what they may do. Without a users file the server's one token is an admin
//! without a name; with one (`pier serve --users FILE`) each person has a token of their own,
//! a name the audit trail records and a role checked on every route, the API's and the
//! dashboard's alike, in one place ([`needs`]).
//!
//! The file holds each token's SHA-256, never the token, so it can be kept in a repository:
//!
//! ```toml
//! [[user]]
//! name = "alice"
//! role = "operator"          # viewer | operator | admin
//! token_sha256 = "9f86d081…" # printf %s "$TOKEN" | sha256sum
//! ```

use std::collections::HashMap;

use axum::http::Method;
use serde::Deserialize;
use sha2::{Digest, Sha256};

/// What a caller may do; each role may do what those below it may.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Reads: pages, runs, tasks, events, metrics.
    Viewer,
    /// And acts on runs and tasks: submit, cancel, retry, answer, say; pull workers' calls.
    Operator,
    /// And changes the server's standing configuration: schedules, budgets.
    Admin,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Viewer => "viewer",
            Role::Operator => "operator",
            Role::Admin => "admin",
        }
    }
}

/// The caller of one request, as its credential says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Caller {
    /// The user's name from the users file; `None` for the server's shared token.
    pub name: Option<String>,
    pub role: Role,
}

impl Caller {
    /// The holder of the server's shared token.
    pub fn owner() -> Caller {
        Caller { name: None, role: Role::Admin }
    }

    /// ` by NAME` for a named caller, to end a sentence of the record; empty for the owner.
    pub fn by_whom(&self) -> String {
        self.name.as_ref().map(|n| format!(" by {n}")).unwrap_or_default()
    }

    /// Who, for the audit trail, calling through `via` (`http`, `dashboard`).
    pub fn by(&self, via: &str) -> String {
        match &self.name {
            Some(name) => format!("{via}:{name}"),
            None => via.to_owned(),
        }
    }
}

/// The least role a request needs: reads are a viewer's; the server's standing configuration
/// (schedules, budgets) an admin's; every other change an operator's. Logging out is anyone's.
pub fn needs(method: &Method, path: &str) -> Role {
    if method == Method::GET || method == Method::HEAD || path == "/ui/logout" {
        Role::Viewer
    } else if path.starts_with("/schedules") || path.starts_with("/ui/schedules") || path.ends_with("/budget") {
        Role::Admin
    } else {
        Role::Operator
    }
}

/// A users file that cannot be used, with what to fix.
#[derive(Debug, thiserror::Error)]
#[error("users file {path}: {problem}")]
pub struct UsersError {
    pub path: String,
    pub problem: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    #[serde(default)]
    user: Vec<Entry>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Entry {
    name: String,
    role: Role,
    token_sha256: String,
}

/// The users of a users file, by their token's hash.
#[derive(Debug, Default)]
pub struct Users {
    by_hash: HashMap<[u8; 32], Caller>,
}

impl Users {
    /// Reads and checks a users file: every name and hash well-formed and used once.
    pub fn load(path: &std::path::Path) -> Result<Users, UsersError> {
        let fail = |problem: String| UsersError { path: path.display().to_string(), problem };
        let text = std::fs::read_to_string(path).map_err(|e| fail(e.to_string()))?;
        Users::parse(&text).map_err(fail)
    }

    pub fn parse(text: &str) -> Result<Users, String> {
        let file: File = toml::from_str(text).map_err(|e| e.to_string())?;
        if file.user.is_empty() {
            return Err("no [[user]]: name at least one, or leave --users out".into());
        }
        let mut users = Users::default();
        let mut names = std::collections::HashSet::new();
        for e in file.user {
            let name = e.name.trim().to_owned();
            if name.is_empty() || name.chars().count() > 64 || name.chars().any(char::is_control) {
                return Err(format!("user `{}`: a name has 1 to 64 characters, without control characters", e.name));
            }
            if !names.insert(name.clone()) {
                return Err(format!("user `{name}` is named twice"));
            }
            let hash = hex32(e.token_sha256.trim()).ok_or_else(|| {
                format!("user `{name}`: token_sha256 is 64 hex digits, as `printf %s \"$TOKEN\" | sha256sum` prints")
            })?;
            if users.by_hash.insert(hash, Caller { name: Some(name.clone()), role: e.role }).is_some() {
                return Err(format!("user `{name}` has the token of another user: give each person their own"));
            }
        }
        Ok(users)
    }

    /// The user whose token this is.
    pub fn caller(&self, token: &str) -> Option<Caller> {
        let hash: [u8; 32] = Sha256::digest(token.as_bytes()).into();
        self.by_hash.get(&hash).cloned()
    }
}

fn hex32(text: &str) -> Option<[u8; 32]> {
    if text.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, pair) in text.as_bytes().chunks(2).enumerate() {
        let digit = |b: u8| (b as char).to_digit(16);
        out[i] = u8::try_from(digit(pair[0])? * 16 + digit(pair[1])?).ok()?;
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    const ALICE: &str = "9c220f200955d76c0a38d308225e0ef10c5f971acaf2f8d1d8f732affa5bd1dc"; // "alice-token"

    #[test]
    fn a_users_file_names_each_token_and_its_role() {
        let text = format!("[[user]]\nname = \"alice\"\nrole = \"operator\"\ntoken_sha256 = \"{ALICE}\"\n");
        let users = Users::parse(&text).unwrap_or_default();
        assert_eq!(users.caller("alice-token"), Some(Caller { name: Some("alice".into()), role: Role::Operator }));
        assert_eq!(users.caller("alice-token "), None);
        let twice = format!("{text}\n{}", text.replace("alice\"", "bob\""));
        assert!(Users::parse(&twice).is_err_and(|e| e.contains("another user")), "one token, two people");
        assert!(Users::parse(&text.replace("operator", "root")).is_err());
        assert!(Users::parse(&text.replace(ALICE, "abc")).is_err_and(|e| e.contains("64 hex")));
        assert!(Users::parse("").is_err_and(|e| e.contains("[[user]]")));
    }

    #[test]
    fn every_change_needs_more_than_a_viewer_and_configuration_an_admin() {
        assert_eq!(needs(&Method::GET, "/runs/r"), Role::Viewer);
        assert_eq!(needs(&Method::POST, "/ui/logout"), Role::Viewer);
        assert_eq!(needs(&Method::POST, "/runs"), Role::Operator);
        assert_eq!(needs(&Method::POST, "/ui/runs/r/tasks/t/retry"), Role::Operator);
        assert_eq!(needs(&Method::POST, "/v1/lease"), Role::Operator);
        assert_eq!(needs(&Method::DELETE, "/schedules/nightly"), Role::Admin);
        assert_eq!(needs(&Method::POST, "/ui/schedules/nightly/pause"), Role::Admin);
        assert_eq!(needs(&Method::POST, "/runs/r/budget"), Role::Admin);
    }
}
