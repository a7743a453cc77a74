//! The host's own MCP endpoint as its attempts see it (`pier serve` at `/mcp`): where it is, and
//! the per-attempt tokens that say which attempt calls. A token exists while its attempt runs
//! on this node: [`Grant`] is held by the attempt and its drop revokes the token, so an agent
//! that outlives its attempt (or a token copied out of one) reaches nothing.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use pier_client::handler::AskingCount;
use pier_store::Attempt;

/// The name the endpoint has among a task's MCP servers: its tools reach the model as
/// `pier__TOOL`. A task's own server of this name is refused at submit.
pub const SERVER_NAME: &str = pier_store::plan::HOST_SERVER;

/// The endpoint as an entry of `session/new`'s `mcpServers`: `url` with the attempt's `token`,
/// its calls given a day (`ask_person` waits for a person; the attempt's own limits still hold).
pub fn server_entry(url: String, token: &str) -> agent_client_protocol_schema::v1::McpServer {
    use agent_client_protocol_schema::v1::{HttpHeader, McpServer, McpServerHttp, Meta};
    let auth = HttpHeader::new("Authorization", format!("Bearer {token}"));
    let mut meta = Meta::new();
    meta.insert(pier_acp::MCP_CALL_TIMEOUT_META_KEY.to_owned(), serde_json::json!(86_400));
    McpServer::Http(McpServerHttp::new(SERVER_NAME, url).headers(vec![auth]).meta(meta))
}

/// The endpoint's tools (`pier-server`'s `mcp.rs` serves them under these names).
pub const TOOLS: [&str; 3] = ["task_result", "ask_person", "submit_task"];

/// Whether a permission request is for one of the endpoint's tools, as agents name an MCP
/// server's tool in the call's title: `pier: TOOL` (pier's agent), `mcp__pier__TOOL` (Claude
/// Code), `pier__TOOL`. The host gave the agent these tools for this attempt, so it does not ask a
/// person to let the agent call them (`ask_person` asks the person itself). A task's own MCP
/// server cannot be named `pier` (refused at submit), so no other server's tool matches.
pub fn is_own_tool(call: &agent_client_protocol_schema::v1::ToolCallUpdate) -> bool {
    let own = |n: &str| {
        let n = n.strip_prefix("mcp__").unwrap_or(n);
        TOOLS.iter().any(|t| {
            n.strip_prefix(SERVER_NAME)
                .is_some_and(|rest| rest.strip_prefix("__").or_else(|| rest.strip_prefix(": ")) == Some(t))
        })
    };
    call.fields.title.as_deref().is_some_and(own)
}

/// The host's own answer to a permission request for one of the endpoint's tools (see
/// [`is_own_tool`]): its allow-once option, said as the host's; `None` for any other request.
pub fn own_tool_answer(
    request: &agent_client_protocol_schema::v1::RequestPermissionRequest,
) -> Option<pier_client::handler::AskAnswer> {
    use agent_client_protocol_schema::v1::PermissionOptionKind;
    if !is_own_tool(&request.tool_call) {
        return None;
    }
    let allow = request.options.iter().find(|o| o.kind == PermissionOptionKind::AllowOnce)?;
    let why = "allowed by the host: a tool of its own MCP endpoint".to_owned();
    Some(pier_client::handler::AskAnswer::Decided { option: allow.option_id.0.to_string(), why })
}

/// Where the endpoint is and who may call it; shared by every clone of the host's config.
/// Its `Debug` names no token.
#[derive(Clone)]
pub struct HostMcp {
    /// The URL the attempts' agents call (`http://127.0.0.1:PORT/mcp`).
    pub url: String,
    /// `host:port` of the URL: what a strict jail's proxy lets the agent reach.
    pub authority: String,
    grants: Arc<Mutex<HashMap<String, Live>>>,
}

/// A granted token's attempt, and the count of questions open for its agent (set once the
/// agent runs), which `ask_person` holds up so the attempt's idle timer stops meanwhile.
#[derive(Clone)]
struct Live {
    attempt: Attempt,
    asking: Arc<Mutex<Option<AskingCount>>>,
}

impl HostMcp {
    /// The endpoint at `url`, which must be `http://HOST:PORT/…`.
    pub fn new(url: &str) -> Result<HostMcp, String> {
        let rest = url.strip_prefix("http://").ok_or_else(|| format!("`{url}` is not an http:// URL"))?;
        let authority = rest.split('/').next().unwrap_or_default();
        if authority.is_empty() || !authority.contains(':') {
            return Err(format!("`{url}` names no host and port"));
        }
        Ok(HostMcp { url: url.to_owned(), authority: authority.to_owned(), grants: Default::default() })
    }

    /// A new token for `attempt`, valid until the grant is dropped.
    pub fn grant(&self, attempt: &Attempt) -> Grant {
        // 244 random bits from two v4 UUIDs (the OS's generator).
        let token = format!("{}{}", uuid::Uuid::new_v4().simple(), uuid::Uuid::new_v4().simple());
        let asking = Arc::new(Mutex::new(None));
        self.lock().insert(token.clone(), Live { attempt: attempt.clone(), asking: asking.clone() });
        Grant { token, grants: self.grants.clone(), asking }
    }

    /// The attempt `token` was granted to, while that attempt runs.
    pub fn caller(&self, token: &str) -> Option<Attempt> {
        self.lock().get(token).map(|l| l.attempt.clone())
    }

    /// The count of questions open for `attempt`'s agent, once it runs.
    pub fn asking_for(&self, attempt: &Attempt) -> Option<AskingCount> {
        let live = self.lock().values().find(|l| l.attempt == *attempt)?.asking.clone();
        live.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }

    /// How many tokens are live (one per running attempt that was given the endpoint).
    pub fn live(&self) -> usize {
        self.lock().len()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Live>> {
        self.grants.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl std::fmt::Debug for HostMcp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostMcp").field("url", &self.url).field("live", &self.live()).finish()
    }
}

/// One attempt's token; revoked when dropped.
pub struct Grant {
    token: String,
    grants: Arc<Mutex<HashMap<String, Live>>>,
    asking: Arc<Mutex<Option<AskingCount>>>,
}

impl Grant {
    pub fn token(&self) -> &str {
        &self.token
    }

    /// The agent the attempt runs on: questions asked through the endpoint count as its.
    pub fn runs_on(&self, asking: AskingCount) {
        *self.asking.lock().unwrap_or_else(PoisonError::into_inner) = Some(asking);
    }
}

impl Drop for Grant {
    fn drop(&mut self) {
        self.grants.lock().unwrap_or_else(PoisonError::into_inner).remove(&self.token);
    }
}

impl std::fmt::Debug for Grant {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Grant(***)")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use agent_client_protocol_schema::v1::{ToolCallUpdate, ToolCallUpdateFields};

    fn attempt() -> Attempt {
        Attempt { run: "r".into(), task: "t".into(), n: 1, owner: "o".into() }
    }

    #[test]
    fn a_token_names_its_attempt_until_the_grant_is_dropped() {
        let mcp = HostMcp::new("http://127.0.0.1:4000/mcp").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(mcp.authority, "127.0.0.1:4000");
        let (one, two) = (mcp.grant(&attempt()), mcp.grant(&attempt()));
        assert_ne!(one.token(), two.token());
        assert_eq!(one.token().len(), 64);
        assert_eq!(mcp.caller(one.token()), Some(attempt()));
        let token = one.token().to_owned();
        drop(one);
        assert_eq!(mcp.caller(&token), None, "revoked with its attempt");
        assert_eq!((mcp.live(), mcp.caller("")), (1, None));
        assert!(format!("{two:?}").contains("***"), "never printed");
        assert!(!format!("{mcp:?}").contains(two.token()), "never printed");
        for bad in ["https://x:1/mcp", "http:///mcp", "http://host/mcp"] {
            assert!(HostMcp::new(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn only_the_endpoints_own_tools_are_its_own() {
        let call = |title: &str| ToolCallUpdate::new("c", ToolCallUpdateFields::new().title(title.to_owned()));
        for own in ["pier: ask_person", "mcp__pier__submit_task", "pier__task_result"] {
            assert!(is_own_tool(&call(own)), "{own}");
        }
        for other in
            ["pier: run_command", "notes__echo", "mcp__piers__ask_person", "pier__ask_person_now", "ask_person"]
        {
            assert!(!is_own_tool(&call(other)), "{other}");
        }
    }
}
