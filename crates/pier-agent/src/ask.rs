//! The `ask_user` tool: a question for the person at the client, through
//! `elicitation/create` (form mode). Offered only in sessions whose client advertised form
//! elicitation; the answer (or the refusal) is the tool's result.

use std::sync::{Arc, OnceLock};

use agent_client_protocol_schema::v1::{
    BooleanPropertySchema, CreateElicitationRequest, CreateElicitationResponse, ElicitationAction,
    ElicitationContentValue, ElicitationFormMode, ElicitationSchema, ElicitationSessionScope, IntegerPropertySchema,
    NumberPropertySchema, StringPropertySchema,
};
use futures::future::BoxFuture;
use pier_acp::Connection;
use pier_tools::{Preview, Tool, ToolContext, ToolError, ToolKind, ToolOutput, Workspace};
use serde::Deserialize;
use serde_json::{Value, json};

pub const NAME: &str = "ask_user";

/// The tool of one session: its client's connection and, once known, the session's id.
pub struct AskUser {
    conn: Connection,
    session_id: Arc<OnceLock<String>>,
}

impl AskUser {
    /// The tool, and the cell to put the session id in once the session exists.
    pub fn new(conn: Connection) -> (AskUser, Arc<OnceLock<String>>) {
        let session_id = Arc::new(OnceLock::new());
        (AskUser { conn, session_id: session_id.clone() }, session_id)
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Args {
    message: String,
    #[serde(default)]
    fields: Vec<Field>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Field {
    name: String,
    #[serde(default)]
    description: Option<String>,
    #[serde(default, rename = "type")]
    kind: Option<String>,
    #[serde(default)]
    options: Vec<String>,
    #[serde(default = "yes")]
    required: bool,
}

fn yes() -> bool {
    true
}

/// What the model reads of [`AskUser`].
const ASK_USER_DESCRIPTION: &str = "Ask the user a question when you cannot go on without their input (a choice, a missing value, a \
         confirmation). Give the question in `message` and, if you need structured answers, the `fields` to fill \
         (name, description, type string|number|integer|boolean, options to choose from, required). The user \
         may decline.";

/// The arguments [`AskUser`] takes (JSON schema).
fn ask_user_parameters() -> Value {
    json!({
        "type": "object",
        "properties": {
            "message": {"type": "string", "description": "The question"},
            "fields": {
                "type": "array",
                "description": "What to fill in; default one text field `answer`",
                "items": {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string"},
                        "description": {"type": "string"},
                        "type": {"type": "string", "enum": ["string", "number", "integer", "boolean"]},
                        "options": {"type": "array", "items": {"type": "string"}},
                        "required": {"type": "boolean"}
                    },
                    "required": ["name"]
                }
            }
        },
        "required": ["message"],
        "additionalProperties": false
    })
}

impl Tool for AskUser {
    // `think`: asking is not acting; the person's answer decides what happens next.
    pier_tools::tool_spec!(NAME, ToolKind::Think, ASK_USER_DESCRIPTION, ask_user_parameters);

    fn preview(&self, args: &Value, _workspace: &Workspace) -> Preview {
        let message = args.get("message").and_then(Value::as_str).unwrap_or("a question");
        let first: String = message.chars().take(80).collect();
        Preview { title: format!("Ask the user: {first}"), locations: Vec::new(), content: Vec::new() }
    }

    fn run(&self, args: Value, cx: ToolContext) -> BoxFuture<'static, Result<ToolOutput, ToolError>> {
        let conn = self.conn.clone();
        let session_id = self.session_id.get().cloned();
        Box::pin(async move {
            let args: Args = serde_json::from_value(args)
                .map_err(|e| ToolError::new(format!("invalid arguments for ask_user: {e}")))?;
            let session_id = session_id.ok_or_else(|| ToolError::new("the session is not ready to ask"))?;
            let schema = schema(&args.fields)?;
            let request = CreateElicitationRequest::new(
                ElicitationFormMode::new(ElicitationSessionScope::new(session_id), schema),
                args.message,
            );
            // Dropping the request on cancel withdraws it from the client ($/cancel_request).
            let asked = conn.request::<_, CreateElicitationResponse>("elicitation/create", &request);
            let response = tokio::select! {
                response = asked => response,
                _ = cx.cancel.cancelled() => return Err(ToolError::new("cancelled while the user was asked")),
            };
            let response = response.map_err(|e| ToolError::new(format!("the client could not ask the user: {e}")))?;
            let (text, raw) = match response.action {
                ElicitationAction::Accept(accepted) => {
                    let content = accepted.content.unwrap_or_default();
                    let lines: Vec<String> = content.iter().map(|(k, v)| format!("- {k}: {}", shown(v))).collect();
                    (
                        format!("The user answered:\n{}", lines.join("\n")),
                        json!({"action": "accept", "content": content}),
                    )
                }
                ElicitationAction::Decline => ("The user declined to answer.".to_owned(), json!({"action": "decline"})),
                _ => ("The user dismissed the question.".to_owned(), json!({"action": "cancel"})),
            };
            Ok(ToolOutput::ok(text, raw))
        })
    }
}

fn shown(v: &ElicitationContentValue) -> String {
    match v {
        ElicitationContentValue::String(s) => s.clone(),
        ElicitationContentValue::Integer(n) => n.to_string(),
        ElicitationContentValue::Number(n) => n.to_string(),
        ElicitationContentValue::Boolean(b) => b.to_string(),
        ElicitationContentValue::StringArray(a) => a.join(", "),
        other => serde_json::to_string(other).unwrap_or_default(),
    }
}

/// The form for `fields`; one required text field `answer` without any.
fn schema(fields: &[Field]) -> Result<ElicitationSchema, ToolError> {
    if fields.is_empty() {
        return Ok(ElicitationSchema::new().property("answer", StringPropertySchema::new(), true));
    }
    let mut schema = ElicitationSchema::new();
    for f in fields {
        if f.name.trim().is_empty() {
            return Err(ToolError::new("a field has an empty name"));
        }
        schema = match f.kind.as_deref().unwrap_or("string") {
            "string" => {
                let options = (!f.options.is_empty()).then(|| f.options.clone());
                let p = StringPropertySchema::new().description(f.description.clone()).enum_values(options);
                schema.property(f.name.clone(), p, f.required)
            }
            "number" => schema.property(
                f.name.clone(),
                NumberPropertySchema::new().description(f.description.clone()),
                f.required,
            ),
            "integer" => schema.property(
                f.name.clone(),
                IntegerPropertySchema::new().description(f.description.clone()),
                f.required,
            ),
            "boolean" => schema.property(
                f.name.clone(),
                BooleanPropertySchema::new().description(f.description.clone()),
                f.required,
            ),
            other => {
                return Err(ToolError::new(format!(
                    "field `{}` has type `{other}`; use string, number, integer or boolean",
                    f.name
                )));
            }
        };
    }
    Ok(schema)
}
