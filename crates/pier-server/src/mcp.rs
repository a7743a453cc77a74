//! `/mcp`: the host's own MCP endpoint, served to the agents of this node's attempts (streamable
//! HTTP, stateless, answers as JSON). A request carries its attempt's token (`Authorization:
//! Bearer`, given in `session/new`'s `mcpServers`), not a person's: the token names the
//! attempt, and every tool is one call of the host's API as that attempt
//! ([`pier_host::Tasks::result_for`], [`pier_host::Tasks::ask_for`],
//! [`pier_host::Tasks::add_follow_up`]).

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use pier_host::store::Attempt;
use pier_host::tasks::{FollowUp, PersonSaid};
use pier_host::{ErrorCode, Tasks};
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, ContentBlock, ListToolsResult, PaginatedRequestParams,
    ServerCapabilities, ServerConfig, Tool,
};
use rmcp::service::RequestContext;
use rmcp::transport::streamable_http_server::session::never::NeverSessionManager;
use rmcp::transport::streamable_http_server::{StreamableHttpServerConfig, StreamableHttpService};
use rmcp::{ErrorData, RoleServer, ServerHandler};
use serde::Deserialize;
use serde_json::{Value, json};

use crate::{ApiError, Shared};

/// The attempt a request's token was granted to, put in the request by [`auth`].
#[derive(Debug, Clone)]
struct Caller(Attempt);

/// The service under `/mcp`, its token check in front. Any `Host` is answered (a pull worker
/// reaches the server by whatever name it was given): rmcp's check of it guards a server a web
/// page could reach by DNS rebinding, and this one answers nothing without an attempt's token.
pub(crate) fn service(app: Shared) -> axum::Router {
    let tasks = app.tasks.clone();
    let config = StreamableHttpServerConfig::default()
        .with_legacy_session_mode(false)
        .with_json_response(true)
        .with_sse_keep_alive(None)
        .disable_allowed_hosts()
        .with_cancellation_token(app.shutdown.child_token());
    let service: StreamableHttpService<HostTools, NeverSessionManager> =
        StreamableHttpService::new(move || Ok(HostTools { tasks: tasks.clone() }), Arc::default(), config);
    axum::Router::new().nest_service("/mcp", service).layer(axum::middleware::from_fn_with_state(app, auth))
}

/// Lets through a request whose token names a running attempt of this node, with it.
async fn auth(State(app): State<Shared>, mut req: Request, next: Next) -> Response {
    let given =
        req.headers().get("authorization").and_then(|v| v.to_str().ok()).and_then(|v| v.strip_prefix("Bearer "));
    match given.and_then(|t| app.tasks.mcp_caller(t)) {
        Some(attempt) => {
            req.extensions_mut().insert(Caller(attempt));
            next.run(req).await
        }
        None => ApiError::new(
            ErrorCode::Unauthorized,
            "the host's MCP endpoint takes the token of a running attempt (given in session/new), and this is none",
        )
        .into_response(),
    }
}

/// The tools, for one request.
#[derive(Clone)]
struct HostTools {
    tasks: Tasks,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ResultArgs {
    task: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct AskArgs {
    question: String,
    #[serde(default)]
    options: Vec<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SubmitArgs {
    #[serde(rename = "type")]
    task_type: String,
    #[serde(default)]
    input: Option<Value>,
    #[serde(default)]
    id: Option<String>,
    #[serde(default)]
    depends_on: Vec<String>,
    #[serde(default)]
    priority: Option<u8>,
}

fn tools() -> Vec<Tool> {
    let schema = |v: Value| match v {
        Value::Object(o) => Arc::new(o),
        _ => Arc::default(),
    };
    vec![
        Tool::new(
            "task_result",
            "The state of a task of this run and, once it completed, its result.",
            schema(json!({
                "type": "object",
                "properties": {"task": {"type": "string", "description": "the task's id"}},
                "required": ["task"],
                "additionalProperties": false
            })),
        ),
        Tool::new(
            "ask_person",
            "Ask a person a question and wait for the answer. The task waits for a person meanwhile.",
            schema(json!({
                "type": "object",
                "properties": {
                    "question": {"type": "string"},
                    "options": {"type": "array", "items": {"type": "string"}, "description": "the answers to choose from; free text without"}
                },
                "required": ["question"],
                "additionalProperties": false
            })),
        ),
        Tool::new(
            "submit_task",
            "Add a task of a declared type to this run; it runs once the tasks it depends on complete.",
            schema(json!({
                "type": "object",
                "properties": {
                    "type": {"type": "string", "description": "a task type the host declares"},
                    "input": {"type": "object", "description": "the type's input"},
                    "id": {"type": "string", "description": "the new task's id (a repeat of the same call adds it once)"},
                    "depends_on": {"type": "array", "items": {"type": "string"}},
                    "priority": {"type": "integer", "minimum": 0, "maximum": 9}
                },
                "required": ["type"],
                "additionalProperties": false
            })),
        ),
    ]
}

impl ServerHandler for HostTools {
    fn get_info(&self) -> ServerConfig {
        let mut info = ServerConfig::new(ServerCapabilities::builder().enable_tools().build());
        info.instructions = Some(
            "The pier host running this task: results of the run's tasks, a person's answers, follow-up tasks.".into(),
        );
        info
    }

    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, ErrorData> {
        Ok(ListToolsResult::with_all_items(tools()))
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, ErrorData> {
        let parts = context.extensions.get::<axum::http::request::Parts>();
        let Some(Caller(caller)) = parts.and_then(|p| p.extensions.get::<Caller>()).cloned() else {
            return Err(ErrorData::invalid_request("no attempt's token came with the call", None));
        };
        let args = Value::Object(request.arguments.unwrap_or_default());
        let call = async {
            match request.name.as_ref() {
                "task_result" => Ok(self.result(&caller, args).await),
                "ask_person" => Ok(self.ask(&caller, args).await),
                "submit_task" => Ok(self.submit(&caller, args).await),
                other => Err(ErrorData::invalid_params(
                    format!("no tool `{other}`: the tools are task_result, ask_person, submit_task"),
                    None,
                )),
            }
        };
        // A caller that hung up (or cancelled the request) drops the call: a question it asked
        // is withdrawn, and the task runs again.
        let answer = tokio::select! {
            answer = call => answer?,
            () = context.ct.cancelled() => return Err(ErrorData::internal_error("the call was cancelled", None)),
        };
        Ok(match answer {
            Ok(structured) => {
                let text = serde_json::to_string(&structured).unwrap_or_default();
                let mut r = CallToolResult::success(vec![ContentBlock::text(text)]);
                r.structured_content = Some(structured);
                r
            }
            Err(why) => CallToolResult::error(vec![ContentBlock::text(why)]),
        }
        .into())
    }
}

/// The arguments, or why they do not fit the tool.
fn args<T: for<'de> Deserialize<'de>>(tool: &str, v: Value) -> Result<T, String> {
    serde_json::from_value(v).map_err(|e| format!("invalid arguments for {tool}: {e}"))
}

impl HostTools {
    async fn result(&self, caller: &Attempt, v: Value) -> Result<Value, String> {
        let a: ResultArgs = args("task_result", v)?;
        let r = self.tasks.result_for(caller, &a.task).await.map_err(|e| e.to_string())?;
        serde_json::to_value(r).map_err(|e| e.to_string())
    }

    async fn ask(&self, caller: &Attempt, v: Value) -> Result<Value, String> {
        let a: AskArgs = args("ask_person", v)?;
        match self.tasks.ask_for(caller, &a.question, a.options).await.map_err(|e| e.to_string())? {
            PersonSaid::Answer(text) => Ok(json!({"answer": text})),
            PersonSaid::Declined => Ok(json!({"declined": true})),
        }
    }

    async fn submit(&self, caller: &Attempt, v: Value) -> Result<Value, String> {
        let a: SubmitArgs = args("submit_task", v)?;
        let f = FollowUp {
            task_type: a.task_type,
            input: a.input.unwrap_or_else(|| json!({})),
            id: a.id,
            depends_on: a.depends_on,
            priority: a.priority,
        };
        let done = self.tasks.add_follow_up(caller, f).await.map_err(|e| e.to_string())?;
        Ok(json!({"run": done.run, "task": done.task, "added": done.added}))
    }
}
