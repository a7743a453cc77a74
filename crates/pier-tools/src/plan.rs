//! `update_plan`: the model's plan, replaced whole on every update (R099).

use futures::future::BoxFuture;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use crate::{Preview, Tool, ToolContext, ToolError, ToolKind, ToolOutput, Workspace};

pub struct UpdatePlan;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PlanPriority {
    High,
    Medium,
    Low,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PlanStatus {
    Pending,
    InProgress,
    Completed,
}

/// One step of the plan.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlanEntry {
    pub content: String,
    pub priority: PlanPriority,
    pub status: PlanStatus,
}

#[derive(Deserialize)]
struct Args {
    entries: Vec<PlanEntry>,
}

/// What the model reads of [`UpdatePlan`].
const UPDATE_PLAN_DESCRIPTION: &str = "Record your plan for the task as a full list of steps. Each call replaces the whole plan, so always send \
         every step with its current status.";

/// The arguments [`UpdatePlan`] takes (JSON schema).
fn update_plan_parameters() -> Value {
    json!({
        "type": "object",
        "properties": {
            "entries": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "content": {"type": "string"},
                        "priority": {"type": "string", "enum": ["high", "medium", "low"]},
                        "status": {"type": "string", "enum": ["pending", "in_progress", "completed"]}
                    },
                    "required": ["content", "priority", "status"]
                }
            }
        },
        "required": ["entries"]
    })
}

impl Tool for UpdatePlan {
    crate::tool_spec!("update_plan", ToolKind::Think, UPDATE_PLAN_DESCRIPTION, update_plan_parameters);
    fn shows_as_plan(&self) -> bool {
        true
    }
    fn preview(&self, args: &Value, _ws: &Workspace) -> Preview {
        let n = args.get("entries").and_then(Value::as_array).map_or(0, Vec::len);
        Preview { title: format!("Update plan ({n} steps)"), locations: Vec::new(), content: Vec::new() }
    }
    fn run(&self, args: Value, _cx: ToolContext) -> BoxFuture<'static, Result<ToolOutput, ToolError>> {
        Box::pin(async move {
            let args: Args = crate::parse_args("update_plan", args)?;
            let count = |s: PlanStatus| args.entries.iter().filter(|e| e.status == s).count();
            let text = format!(
                "Plan updated: {} steps ({} completed, {} in progress, {} pending)",
                args.entries.len(),
                count(PlanStatus::Completed),
                count(PlanStatus::InProgress),
                count(PlanStatus::Pending)
            );
            let mut out = ToolOutput::ok(text, json!({"entries": args.entries}));
            out.plan = Some(args.entries);
            Ok(out)
        })
    }
}
