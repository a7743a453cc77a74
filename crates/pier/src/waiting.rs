//! What a task waiting on a person waits for, said the same way everywhere it is shown
//! (the live view, `pier events`, `pier show`, the run's summary): what is asked, the
//! choices, and the exact command that answers it.

use serde_json::Value;

/// `request`: the open question (a permission request, or an agent's question under
/// `elicitation`); `None` when the task waits for a re-run decision.
pub fn waiting_for(run: &str, task: &str, request: Option<&Value>) -> String {
    let Some(request) = request else {
        return format!(
            "a person decides whether it runs again — `pier approve --run {run} {task}` runs it, `pier deny --run {run} {task}` cancels it"
        );
    };
    if let Some(q) = request.get(pier_host::person::ELICITATION) {
        let fields: Vec<&str> = q["requestedSchema"]["properties"]
            .as_object()
            .map(|p| p.keys().map(String::as_str).collect())
            .unwrap_or_default();
        return format!(
            "asks: {} — answer with `pier answer --run {run} {task} {}` or `--decline`",
            q["message"].as_str().unwrap_or("?"),
            fields.iter().map(|f| format!("{f}=…")).collect::<Vec<_>>().join(" ")
        );
    }
    let call = &request["toolCall"];
    let mut what = call["title"].as_str().unwrap_or("a tool call").to_owned();
    if let Some(kind) = call["kind"].as_str() {
        what.push_str(&format!(" ({kind})"));
    }
    let options: Vec<&str> = request["options"]
        .as_array()
        .map(|o| o.iter().filter_map(|o| o["optionId"].as_str()).collect())
        .unwrap_or_default();
    format!(
        "asks permission: {what}; options {} — `pier approve --run {run} {task} [OPTION]` or `pier deny --run {run} {task} [OPTION]`",
        options.join(", ")
    )
}
