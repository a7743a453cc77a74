//! What a task waiting on a person waits for, said the same way everywhere it is shown
//! (the live view, `pier events`, `pier show`, the run's summary): what is asked, the
//! choices, and the exact command that answers it.

use pier_host::QuestionRequest;

/// `request`: the open question (a permission request, or an agent's question); `None` when
/// the task waits for a re-run decision.
pub fn waiting_for(run: &str, task: &str, request: Option<&QuestionRequest>) -> String {
    match request {
        None => format!(
            "a person decides whether it runs again — `pier approve --run {run} {task}` runs it, `pier deny --run {run} {task}` cancels it"
        ),
        Some(QuestionRequest::Elicitation(q)) => {
            let fields = pier_client::elicit::form_schema(q).map(pier_client::elicit::fields).unwrap_or_default();
            format!(
                "asks: {} — answer with `pier answer --run {run} {task} {}` or `--decline`; fields: {}",
                q.message,
                fields.iter().map(|f| format!("{}=…", f.name)).collect::<Vec<_>>().join(" "),
                fields.iter().map(field).collect::<Vec<_>>().join(", ")
            )
        }
        Some(QuestionRequest::Permission(p)) => {
            let call = &p.tool_call.fields;
            let mut what = call.title.clone().unwrap_or_else(|| "a tool call".to_owned());
            if let Some(kind) = &call.kind {
                what.push_str(&format!(
                    " ({})",
                    serde_json::to_value(kind).ok().and_then(|k| k.as_str().map(str::to_owned)).unwrap_or_default()
                ));
            }
            let options: Vec<&str> = p.options.iter().map(|o| &*o.option_id.0).collect();
            format!(
                "asks permission: {what}; options {} — `pier approve --run {run} {task} [OPTION]` or `pier deny --run {run} {task} [OPTION]`",
                options.join(", ")
            )
        }
    }
}

/// A question's field as a person needs it: its name, its type or choices, whether required.
fn field(f: &pier_client::elicit::Field<'_>) -> String {
    use pier_client::elicit::Input;
    let kind = match &f.input {
        Input::Boolean => "true or false".to_owned(),
        Input::Number => "a number".to_owned(),
        Input::Integer => "a whole number".to_owned(),
        Input::Choice(choices) => format!("one of {}", choices.join(" | ")),
        Input::Text => "text".to_owned(),
    };
    let required = if f.required { ", required" } else { "" };
    format!("{} ({kind}{required})", f.name)
}
