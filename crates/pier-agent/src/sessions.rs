//! The session lifecycle methods: `new`, `load`, `resume`, `list`, `close`, `delete`.
//!
//! Everything but `new` works across agent restarts: it reads the durable
//! session log and summaries under `$PIER_HOME` (the engine's `SessionStore`),
//! never this process's memory alone.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

use agent_client_protocol_schema::v1::{
    CloseSessionRequest, CloseSessionResponse, DeleteSessionRequest, DeleteSessionResponse, Error, ListSessionsRequest,
    ListSessionsResponse, LoadSessionRequest, LoadSessionResponse, McpServer, NewSessionRequest, NewSessionResponse,
    ResumeSessionRequest, ResumeSessionResponse, SessionInfo, SessionUpdate,
};
use pier_acp::RequestCx;
use pier_acp::error::invalid_params;
use pier_engine::log::LogRecord;
use pier_engine::{EngineError, SessionOptions, ToolCallRecord};
use serde_json::Value;

use crate::{AcpAgent, Profile, SessionEntry, engine_error, lock, mcp, profile, to_value};

/// Sessions per `session/list` page (R077).
const PAGE: usize = 50;

/// What `new`, `load` and `resume` share: a checked directory set and started MCP servers.
struct Setup {
    options: SessionOptions,
    mcp: Option<mcp::Servers>,
}

impl AcpAgent {
    /// A session's options. In the automation profile, MCP servers come only from a task host
    /// (`meta` names the task, `pier_acp::TASK_META_KEY`): the automation contract refuses
    /// servers from its client, not the tools a host gives the task it runs.
    async fn setup(
        &self,
        cwd: PathBuf,
        additional: Vec<PathBuf>,
        servers: &[McpServer],
        meta: Option<&agent_client_protocol_schema::v1::Meta>,
    ) -> Result<Setup, Error> {
        self.require_initialized()?;
        if !cwd.is_absolute() {
            return Err(invalid_params(format!("cwd must be an absolute path, got `{}`", cwd.display())));
        }
        if self.profile == Profile::Automation {
            let from_host = meta.is_some_and(|m| m.contains_key(pier_acp::TASK_META_KEY));
            if !servers.is_empty() && !from_host {
                return Err(invalid_params(
                    "the automation profile takes MCP servers only from a task host (a `_meta` naming the task); send `mcpServers: []`",
                ));
            }
            if !additional.is_empty() {
                return Err(invalid_params(
                    "the automation profile takes no additionalDirectories; the session is confined to cwd",
                ));
            }
        }
        for dir in std::iter::once(&cwd).chain(additional.iter()) {
            if !dir.is_absolute() {
                return Err(invalid_params(format!(
                    "additionalDirectories entries must be absolute paths, got `{}`",
                    dir.display()
                )));
            }
            match tokio::fs::metadata(dir).await {
                Ok(m) if m.is_dir() => {}
                _ => return Err(invalid_params(format!("`{}` is not an existing directory", dir.display()))),
            }
        }
        let mut options = SessionOptions::new(cwd);
        options.roots = additional;
        options.mode = self.options.mode;
        let mcp = if servers.is_empty() {
            None
        } else {
            let guard = self.options.mcp_guard.as_deref();
            let started = mcp::Servers::start(servers, &options.cwd, self.options.mcp_timeout, guard).await?;
            options.tools = started.tools();
            Some(started)
        };
        Ok(Setup { options, mcp })
    }

    pub(crate) async fn new_session(self: Arc<Self>, cx: RequestCx, req: NewSessionRequest) -> Result<Value, Error> {
        let cancel = cx.cancel.clone();
        let Setup { mut options, mcp } =
            self.setup(req.cwd, req.additional_directories, &req.mcp_servers, req.meta.as_ref()).await?;
        if self.options.task_context {
            options.note = task_note(req.meta.as_ref());
        }
        let cells = self.offer_client_tools(&mut options, &cx.conn, req.meta.as_ref());
        let session = match self.engine.create(options).await {
            Ok(s) => s,
            Err(e) => {
                stop(mcp).await;
                return Err(engine_error(&e));
            }
        };
        for cell in cells {
            let _ = cell.set(session.id.clone());
        }
        let entry = Arc::new(SessionEntry::new(session, mcp));
        if cancel.is_cancelled() {
            // Lost the race with close: dispose of the handle nobody will ever see.
            self.dispose(&entry).await;
            return Err(Error::request_cancelled());
        }
        let id = entry.session.id.clone();
        tracing::info!(session = %id, cwd = %entry.session.cwd.display(), profile = self.profile.name(), "session created");
        let mut response = NewSessionResponse::new(id.clone());
        if self.profile == Profile::Editor {
            response = response.modes(self.modes(&entry)).config_options(self.config_options(&entry));
        }
        lock(&self.sessions).insert(id, entry);
        to_value(&response)
    }

    pub(crate) async fn load_session(self: Arc<Self>, cx: RequestCx, req: LoadSessionRequest) -> Result<Value, Error> {
        let id = req.session_id.0.to_string();
        let asked = Reopening { cwd: req.cwd, additional: req.additional_directories, meta: req.meta.as_ref() };
        let entry = self.reopen(&id, asked, &req.mcp_servers, &cx.conn, true).await?;
        let response = LoadSessionResponse::new().modes(self.modes(&entry)).config_options(self.config_options(&entry));
        to_value(&response)
    }

    pub(crate) async fn resume_session(
        self: Arc<Self>,
        cx: RequestCx,
        req: ResumeSessionRequest,
    ) -> Result<Value, Error> {
        let id = req.session_id.0.to_string();
        let asked = Reopening { cwd: req.cwd, additional: req.additional_directories, meta: req.meta.as_ref() };
        let entry = self.reopen(&id, asked, &req.mcp_servers, &cx.conn, false).await?;
        let response =
            ResumeSessionResponse::new().modes(self.modes(&entry)).config_options(self.config_options(&entry));
        to_value(&response)
    }

    /// Opens a stored session with the directories and servers sent now (R058); with
    /// `replay`, sends its whole conversation first (R047), so the answer follows the
    /// last update (R048). A session already open here is closed and opened again.
    async fn reopen(
        &self,
        id: &str,
        asked: Reopening<'_>,
        servers: &[McpServer],
        conn: &pier_acp::Connection,
        replay: bool,
    ) -> Result<Arc<SessionEntry>, Error> {
        let Reopening { cwd, additional, meta } = asked;
        self.require_initialized()?;
        if !self.engine.store().exists(id) {
            return Err(engine_error(&EngineError::UnknownSession(id.to_owned())));
        }
        let live = lock(&self.sessions).get(id).cloned();
        if let Some(live) = live {
            if live.running.try_lock().is_err() {
                return Err(engine_error(&EngineError::Busy));
            }
            lock(&self.sessions).remove(id);
            self.dispose(&live).await;
        }
        let Setup { mut options, mcp } = self.setup(cwd, additional, servers, meta).await?;
        for cell in self.offer_client_tools(&mut options, conn, meta) {
            let _ = cell.set(id.to_owned());
        }
        let reopened = match self.engine.open(id, options).await {
            Ok(r) => r,
            Err(e) => {
                stop(mcp).await;
                return Err(engine_error(&e));
            }
        };
        let entry = Arc::new(SessionEntry::new(reopened.session, mcp));
        if let Some(name) = last_setting(&reopened.records, "model")
            && let Some(model) = self.options.models.iter().find(|m| m.name == name)
        {
            entry.session.set_model(&model.name, model.provider.clone());
            *lock(&entry.model) = Some(model.name.clone());
        }
        if replay {
            for update in replay_updates(&reopened.records) {
                Self::send_update(conn, id, update).await;
            }
        }
        tracing::info!(session = %id, replayed = replay, "session reopened");
        lock(&self.sessions).insert(id.to_owned(), entry.clone());
        Ok(entry)
    }

    pub(crate) async fn list_sessions(self: Arc<Self>, req: ListSessionsRequest) -> Result<Value, Error> {
        self.require_initialized()?;
        if let Some(cwd) = &req.cwd
            && !cwd.is_absolute()
        {
            return Err(invalid_params(format!("the cwd filter must be an absolute path, got `{}`", cwd.display())));
        }
        let all = self.engine.store().list(req.cwd.as_deref()).await.map_err(|e| engine_error(&e))?;
        let start = match &req.cursor {
            None => 0,
            Some(cursor) => {
                let (updated, id) = decode_cursor(cursor).ok_or_else(|| {
                    invalid_params("the cursor is not one this agent gave out; list again without a cursor")
                })?;
                // Keyset: the first session after the cursor's in the listing order.
                all.iter()
                    .position(|m| m.updated_at < updated || (m.updated_at == updated && m.session_id > id))
                    .unwrap_or(all.len())
            }
        };
        let page: Vec<_> = all.iter().skip(start).take(PAGE).collect();
        let sessions = page
            .iter()
            .map(|m| {
                SessionInfo::new(m.session_id.clone(), m.cwd.clone())
                    .title(m.title.clone())
                    .updated_at(m.updated_at.clone())
            })
            .collect();
        let mut response = ListSessionsResponse::new(sessions);
        if start + page.len() < all.len()
            && let Some(last) = page.last()
        {
            response = response.next_cursor(encode_cursor(&last.updated_at, &last.session_id));
        }
        to_value(&response)
    }

    /// R056: cancels the running turn as `session/cancel` would, stops the MCP servers, frees the session.
    pub(crate) async fn close_session(self: Arc<Self>, req: CloseSessionRequest) -> Result<Value, Error> {
        self.require_initialized()?;
        let id = req.session_id.0.to_string();
        let entry = lock(&self.sessions).remove(&id);
        let Some(entry) = entry else {
            return Err(engine_error(&EngineError::UnknownSession(id)));
        };
        self.dispose(&entry).await;
        tracing::info!(session = %id, "session closed");
        to_value(&CloseSessionResponse::new())
    }

    /// Removes the session's log. Deleting one that does not exist succeeds (R081).
    pub(crate) async fn delete_session(self: Arc<Self>, req: DeleteSessionRequest) -> Result<Value, Error> {
        self.require_initialized()?;
        let id = req.session_id.0.to_string();
        let live = lock(&self.sessions).remove(&id);
        if let Some(entry) = live {
            self.dispose(&entry).await;
        }
        let found = self.engine.store().delete(&id).await.map_err(|e| engine_error(&e))?;
        tracing::info!(session = %id, found, "session deleted");
        to_value(&DeleteSessionResponse::new())
    }
}

async fn stop(mcp: Option<mcp::Servers>) {
    if let Some(servers) = mcp {
        servers.shutdown().await;
    }
}

/// What a `session/load` or `session/resume` asks of the session it reopens.
struct Reopening<'a> {
    cwd: PathBuf,
    additional: Vec<PathBuf>,
    meta: Option<&'a agent_client_protocol_schema::v1::Meta>,
}

impl AcpAgent {
    /// Offers the session `ask_user` when its client answers form questions, and either the
    /// profile is the editor's or the client asked for it (`ASK_META_KEY` in the request's
    /// `_meta`): the automation profile asks nobody of its own accord (seed 003). And, in the
    /// editor profile with a client that advertised `terminal`, `run_command`
    /// through the client's terminal ([`crate::terminal`]), confined as the local one is. Each
    /// cell takes the session's id once it has one.
    fn offer_client_tools(
        &self,
        options: &mut SessionOptions,
        conn: &pier_acp::Connection,
        meta: Option<&agent_client_protocol_schema::v1::Meta>,
    ) -> Vec<Arc<std::sync::OnceLock<String>>> {
        use std::sync::atomic::Ordering;
        let mut cells = Vec::new();
        let asked = meta.and_then(|m| m.get(pier_acp::ASK_META_KEY)).and_then(Value::as_bool) == Some(true);
        if self.client_elicitation.load(Ordering::SeqCst) && (self.profile == Profile::Editor || asked) {
            let (tool, cell) = crate::ask::AskUser::new(conn.clone());
            options.tools.push(Arc::new(tool));
            cells.push(cell);
        }
        if let Some(exe) = &self.options.terminal_guard
            && self.profile == Profile::Editor
            && self.client_terminal.load(Ordering::SeqCst)
            && self.engine.has_tool(pier_tools::command::NAME)
        {
            let (tool, cell) = crate::terminal::TerminalCommand::new(conn.clone(), exe.clone());
            options.tools.push(Arc::new(tool));
            cells.push(cell);
        }
        cells
    }
}

/// Longest task paragraph given to the model, in characters.
const TASK_NOTE_CHARS: usize = 2_000;

/// What the model is told of the task a host runs this session for: its identity and its
/// metadata, keys and values. None without metadata.
fn task_note(meta: Option<&agent_client_protocol_schema::v1::Meta>) -> Option<String> {
    let task = meta?.get(pier_acp::TASK_META_KEY)?;
    let metadata = task.get("metadata")?.as_object().filter(|m| !m.is_empty())?;
    let pairs: Vec<String> = metadata
        .iter()
        .map(|(k, v)| match v {
            Value::String(s) => format!("{k} = {s}"),
            other => format!("{k} = {other}"),
        })
        .collect();
    let name = |key: &str| task.get(key).and_then(Value::as_str).unwrap_or("?").to_owned();
    let note = format!(
        "This session runs task `{}` of run `{}` for a task host. The task's metadata: {}.",
        name("task"),
        name("run"),
        pairs.join("; ")
    );
    Some(if note.chars().count() > TASK_NOTE_CHARS {
        note.chars().take(TASK_NOTE_CHARS).chain(std::iter::once('…')).collect()
    } else {
        note
    })
}

fn last_setting<'a>(records: &'a [(u64, LogRecord)], key: &str) -> Option<&'a str> {
    records.iter().rev().find_map(|(_, r)| match r {
        LogRecord::Setting { id, value } if id == key => Some(value.as_str()),
        _ => None,
    })
}

/// The conversation as an editor shows it: prompts, thoughts, answers, each tool
/// call once in its final state where it first appeared (but a plan's), and plans.
pub(crate) fn replay_updates(records: &[(u64, LogRecord)]) -> Vec<SessionUpdate> {
    let mut last: HashMap<&str, &ToolCallRecord> = HashMap::new();
    for (_, r) in records {
        if let LogRecord::ToolCall { call } = r {
            last.insert(call.id.as_str(), call);
        }
    }
    let mut shown: std::collections::HashSet<&str> = std::collections::HashSet::new();
    let mut out = Vec::new();
    for (_, r) in records {
        match r {
            LogRecord::Prompt { text } => out.push(profile::user_text(text)),
            LogRecord::Reasoning { text } => out.push(profile::thought(text)),
            LogRecord::Message { text } | LogRecord::Refusal { text } if !text.is_empty() => {
                out.push(profile::agent_text(text))
            }
            LogRecord::ToolCall { call } if !call.plan && shown.insert(call.id.as_str()) => {
                let mut fin = last.get(call.id.as_str()).copied().unwrap_or(call).clone();
                // A past turn's subagents are gone with their processes: no reference to them.
                fin.content.retain(|c| !matches!(c, pier_tools::ToolContent::Session { .. }));
                // Its terminals were released: what they printed stands in their place.
                let printed = fin.raw_output.as_ref().and_then(|r| r["output"].as_str()).map(str::to_owned);
                for c in &mut fin.content {
                    if let pier_tools::ToolContent::Terminal { .. } = c {
                        let text = printed.clone().unwrap_or_else(|| "(its terminal was released)".to_owned());
                        *c = pier_tools::ToolContent::Text { text };
                    }
                }
                out.push(SessionUpdate::ToolCall(profile::full_tool_call(&fin)));
            }
            LogRecord::Plan { entries } => out.push(profile::plan(entries)),
            _ => {}
        }
    }
    out
}

fn encode_cursor(updated_at: &str, id: &str) -> String {
    format!("{updated_at}|{id}").bytes().map(|b| format!("{b:02x}")).collect()
}

fn decode_cursor(cursor: &str) -> Option<(String, String)> {
    if !cursor.len().is_multiple_of(2) || cursor.len() > 512 {
        return None;
    }
    let bytes: Option<Vec<u8>> =
        (0..cursor.len()).step_by(2).map(|i| u8::from_str_radix(cursor.get(i..i + 2)?, 16).ok()).collect();
    let text = String::from_utf8(bytes?).ok()?;
    let (updated, id) = text.split_once('|')?;
    Some((updated.to_owned(), id.to_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cursors_round_trip_and_garbage_is_refused() {
        let c = encode_cursor("2026-12-03T10:00:00.000Z", "abc-1");
        assert_eq!(decode_cursor(&c), Some(("2026-12-03T10:00:00.000Z".into(), "abc-1".into())));
        for bad in ["zz", "abc", "", "00"] {
            assert_eq!(decode_cursor(bad), None, "{bad}");
        }
    }
}
