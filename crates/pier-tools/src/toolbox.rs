//! The registry of tools the engine calls.

use std::sync::Arc;

use futures::FutureExt;
use serde_json::Value;

use crate::command::RunCommand;
use crate::list_dir::ListDir;
use crate::plan::UpdatePlan;
use crate::read_file::ReadFile;
use crate::search::Grep;
use crate::write::{EditFile, WriteFile};
use crate::{Limits, Tool, ToolContext, ToolError, ToolOutput, output};

/// A set of tools by name.
pub struct Toolbox {
    tools: Vec<Arc<dyn Tool>>,
    limits: Limits,
}

impl Toolbox {
    /// The built-in tools.
    pub fn builtin(limits: Limits) -> Toolbox {
        let tools: Vec<Arc<dyn Tool>> = vec![
            Arc::new(ReadFile),
            Arc::new(ListDir),
            Arc::new(Grep),
            Arc::new(WriteFile),
            Arc::new(EditFile),
            Arc::new(RunCommand),
            Arc::new(UpdatePlan),
        ];
        Toolbox { tools, limits }
    }

    /// No tools at all, for models that cannot call them.
    pub fn empty() -> Toolbox {
        Toolbox { tools: Vec::new(), limits: Limits::default() }
    }

    /// This toolbox with `tool` added after the others.
    pub fn with(mut self, tool: Arc<dyn Tool>) -> Toolbox {
        self.tools.push(tool);
        self
    }

    pub fn limits(&self) -> &Limits {
        &self.limits
    }

    pub fn tools(&self) -> &[Arc<dyn Tool>] {
        &self.tools
    }

    pub fn get(&self, name: &str) -> Option<Arc<dyn Tool>> {
        self.tools.iter().find(|t| t.name() == name).cloned()
    }

    /// Runs `tool`: a panic becomes a failure and the text for the model is capped.
    pub async fn run(&self, tool: &Arc<dyn Tool>, args: Value, cx: ToolContext) -> Result<ToolOutput, ToolError> {
        let name = tool.name();
        let result = std::panic::AssertUnwindSafe(tool.run(args, cx)).catch_unwind().await;
        let mut out = match result {
            Ok(r) => r?,
            Err(panic) => {
                let msg = panic
                    .downcast_ref::<&str>()
                    .map(|s| (*s).to_owned())
                    .or_else(|| panic.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "unknown panic".to_owned());
                tracing::error!(tool = name, panic = %msg, "a tool panicked");
                return Err(ToolError::new(format!("the {name} tool crashed: {msg}")));
            }
        };
        out.text = output::cap(std::mem::take(&mut out.text), self.limits.output_bytes);
        Ok(out)
    }
}
