//! pier's built-in tools. They run inside pier, never through the client, and
//! every path they touch is confined to the session's directory.
//!
//! - [`workspace`]: path resolution and confinement (`..`, absolute paths, symlinks).
//! - [`toolbox`]: the registry the engine calls: argument parsing, panics caught,
//!   output capped.
//! - one module per tool: [`read_file`], [`list_dir`], [`search`] (`grep`),
//!   [`write`] (`write_file`, `edit_file`), [`command`] (`run_command`), [`plan`].
//! - [`contain`]: how a command is started and ended (session, cgroup, subreaper,
//!   Landlock) so that nothing it starts outlives it.
//! - [`output`]: bounded capture (head and tail) and output capping.

pub mod command;
pub mod contain;
pub mod guard;
pub mod link;
pub mod list_dir;
pub mod output;
pub mod plan;
pub mod read_file;
pub mod search;
pub mod toolbox;
mod walk;
pub mod workspace;
pub mod write;

use std::path::PathBuf;
use std::time::Duration;

use futures::future::BoxFuture;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use tokio_util::sync::CancellationToken;

pub use contain::Confinement;
pub use link::{Action, CallLink, CallRequest, Permit};
pub use plan::{PlanEntry, PlanPriority, PlanStatus};
pub use toolbox::Toolbox;
pub use workspace::{OpenedFile, Workspace};

/// What a tool does, for permission policy and for clients' icons. Mirrors ACP's
/// tool kinds without depending on ACP.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ToolKind {
    Read,
    Edit,
    Delete,
    Move,
    Search,
    Execute,
    Think,
    Fetch,
    Other,
}

impl ToolKind {
    pub const ALL: [ToolKind; 9] = [
        ToolKind::Read,
        ToolKind::Edit,
        ToolKind::Delete,
        ToolKind::Move,
        ToolKind::Search,
        ToolKind::Execute,
        ToolKind::Think,
        ToolKind::Fetch,
        ToolKind::Other,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            ToolKind::Read => "read",
            ToolKind::Edit => "edit",
            ToolKind::Delete => "delete",
            ToolKind::Move => "move",
            ToolKind::Search => "search",
            ToolKind::Execute => "execute",
            ToolKind::Think => "think",
            ToolKind::Fetch => "fetch",
            ToolKind::Other => "other",
        }
    }
}

impl std::str::FromStr for ToolKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        ToolKind::ALL.into_iter().find(|k| k.as_str() == s).ok_or_else(|| {
            let known: Vec<&str> = ToolKind::ALL.iter().map(|k| k.as_str()).collect();
            format!("unknown tool kind `{s}`; expected one of {}", known.join(", "))
        })
    }
}

/// What to do with a tool kind: a plan's permission rule, the client's policy, pier's own
/// agent's `--allow`/`--ask`/`--deny`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Rule {
    Allow,
    AllowAlways,
    Ask,
    Deny,
    DenyAlways,
}

impl std::str::FromStr for Rule {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "allow" => Ok(Rule::Allow),
            "allow_always" => Ok(Rule::AllowAlways),
            "ask" => Ok(Rule::Ask),
            "deny" => Ok(Rule::Deny),
            "deny_always" => Ok(Rule::DenyAlways),
            other => Err(format!("unknown rule `{other}`; expected allow, allow_always, ask, deny or deny_always")),
        }
    }
}

/// Limits every tool call runs under.
#[derive(Debug, Clone)]
pub struct Limits {
    /// Longest tool output sent back to the model.
    pub output_bytes: usize,
    /// Default `run_command` timeout.
    pub command_timeout: Duration,
    /// Longest `run_command` timeout a model may ask for.
    pub max_command_timeout: Duration,
    /// Bytes of each command stream kept from its start and from its end.
    pub command_capture_bytes: usize,
    /// Most matches `grep` reports.
    pub grep_max_matches: usize,
    /// Lines `read_file` returns when no limit is given.
    pub read_default_lines: usize,
    /// Entries `list_dir` reports.
    pub list_max_entries: usize,
    /// How `run_command` confines a command (Landlock, cgroups).
    pub confinement: contain::Confinement,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            output_bytes: 64 * 1024,
            command_timeout: Duration::from_secs(120),
            max_command_timeout: Duration::from_secs(3600),
            command_capture_bytes: 16 * 1024,
            grep_max_matches: 200,
            read_default_lines: 2000,
            list_max_entries: 1000,
            confinement: contain::Confinement::default(),
        }
    }
}

/// What a tool call runs with.
#[derive(Clone)]
pub struct ToolContext {
    pub workspace: Workspace,
    /// Fires when the turn is cancelled; long tools stop and clean up.
    pub cancel: CancellationToken,
    pub limits: Limits,
    /// Progress and permission requests to the turn running the call.
    pub link: CallLink,
}

/// A place a tool call touches, so a client can follow along.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Location {
    pub path: PathBuf,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub line: Option<u32>,
}

/// Structured content a tool produced.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ToolContent {
    Text {
        text: String,
    },
    /// A file change: the whole old text (none for a new file) and new text.
    Diff {
        path: PathBuf,
        old_text: Option<String>,
        new_text: String,
    },
    /// Another agent's session doing the call's work (a subagent), and how its turn
    /// ended once it has (a stop reason's wire name, or `error`).
    Session {
        session_id: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        stop_reason: Option<String>,
    },
    /// A content block as MCP and ACP both shape it (text, image, audio, resource, resource
    /// link), passed on unchanged: an MCP tool's result.
    Block {
        block: Value,
    },
    /// A terminal of the client's that runs (or ran) the call's command: the client shows
    /// its output as it grows (`run_command` through `terminal/create`).
    Terminal {
        terminal_id: String,
    },
}

/// The result of a tool that ran.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolOutput {
    /// Whether the tool achieved what it was asked (a command's exit code 0, say).
    pub success: bool,
    /// What the model reads.
    pub text: String,
    pub content: Vec<ToolContent>,
    pub locations: Vec<Location>,
    /// Structured output for the session log.
    pub raw: Value,
    /// A new plan, from `update_plan`.
    pub plan: Option<Vec<PlanEntry>>,
    /// Images for the model to see (an MCP tool's image blocks), where it takes images; `text`
    /// describes them either way.
    pub images: Vec<ToolImage>,
}

/// An image a tool returned: base64 data and its MIME type.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolImage {
    pub mime_type: String,
    pub data: String,
}

impl ToolOutput {
    pub fn ok(text: impl Into<String>, raw: Value) -> ToolOutput {
        ToolOutput {
            success: true,
            text: text.into(),
            content: Vec::new(),
            locations: Vec::new(),
            raw,
            plan: None,
            images: Vec::new(),
        }
    }
}

/// Why a tool did not run or did not finish. The message goes back to the model.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct ToolError(pub String);

impl ToolError {
    pub fn new(msg: impl Into<String>) -> ToolError {
        ToolError(msg.into())
    }
}

/// How a pending call looks before it runs: for the permission request and the log.
#[derive(Debug, Clone, PartialEq)]
pub struct Preview {
    pub title: String,
    pub locations: Vec<Location>,
    /// What the call would produce, where that is known before it runs: an edit's diff.
    pub content: Vec<ToolContent>,
}

/// What an *always* permission answer for a call covers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Scope {
    /// Every call of the tool's kind.
    Kind,
    /// Calls whose every name (a command's programs, say) is covered.
    Names(Vec<String>),
    /// Nothing beyond this call: its shape cannot be scoped safely.
    Unscoped,
}

/// A built-in tool.
/// What a tool is, as the model and the permission policy see it: written once per tool
/// (a `static` for pier's own, built from the server's listing for an MCP tool).
#[derive(Debug, Clone)]
pub struct ToolSpec {
    pub name: std::borrow::Cow<'static, str>,
    pub kind: ToolKind,
    pub description: std::borrow::Cow<'static, str>,
    /// JSON schema of the arguments.
    pub parameters: Value,
}

/// A tool's [`Tool::spec`], made once on first use: `tool_spec!(NAME, KIND, DESCRIPTION,
/// parameters)` in an `impl Tool`, `parameters` a function returning the JSON schema.
#[macro_export]
macro_rules! tool_spec {
    ($name:expr, $kind:expr, $description:expr, $parameters:expr) => {
        fn spec(&self) -> &$crate::ToolSpec {
            static SPEC: std::sync::LazyLock<$crate::ToolSpec> = std::sync::LazyLock::new(|| $crate::ToolSpec {
                name: $name.into(),
                kind: $kind,
                description: $description.into(),
                parameters: $parameters(),
            });
            &SPEC
        }
    };
}

pub trait Tool: Send + Sync + 'static {
    /// What the tool is; the methods below read it.
    fn spec(&self) -> &ToolSpec;
    fn name(&self) -> &str {
        &self.spec().name
    }
    fn kind(&self) -> ToolKind {
        self.spec().kind
    }
    fn description(&self) -> &str {
        &self.spec().description
    }
    /// JSON schema of the arguments.
    fn parameters(&self) -> Value {
        self.spec().parameters.clone()
    }
    /// Title and locations of a call with `args`, without running it.
    fn preview(&self, args: &Value, workspace: &Workspace) -> Preview;
    /// Runs the call.
    fn run(&self, args: Value, cx: ToolContext) -> BoxFuture<'static, Result<ToolOutput, ToolError>>;
    /// What a remembered permission answer for a call with `args` covers.
    fn scope(&self, _args: &Value) -> Scope {
        Scope::Kind
    }
    /// How many calls of this tool from one model message may run at once, beside the
    /// others. 1 (the default): in the model's order, one after another.
    fn concurrency(&self) -> usize {
        1
    }
    /// Its calls are the session's plan (R099): a client is shown the plan they make, not the
    /// calls themselves (the session log keeps both).
    fn shows_as_plan(&self) -> bool {
        false
    }
}

/// Parses a tool's arguments, with a message the model can act on.
pub(crate) fn parse_args<T: serde::de::DeserializeOwned>(tool: &str, args: Value) -> Result<T, ToolError> {
    serde_json::from_value(args).map_err(|e| ToolError::new(format!("invalid arguments for {tool}: {e}")))
}

/// The `path` argument of a call, for previews.
pub(crate) fn arg_path(args: &Value) -> Option<&str> {
    args.get("path").and_then(Value::as_str)
}

/// Runs blocking filesystem work off the async threads.
pub(crate) async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, ToolError> + Send + 'static,
) -> Result<T, ToolError> {
    tokio::task::spawn_blocking(f).await.map_err(|e| ToolError::new(format!("the tool's worker failed: {e}")))?
}
