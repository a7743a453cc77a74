//! Questions from the agent (`elicitation/create`, form mode): the answers a client can
//! give, and the one check of an answer against the schema the agent asked with, shared by
//! the host's `pier answer` (text `key=value` pairs) and its HTTP route (JSON values).

use std::collections::BTreeMap;

use agent_client_protocol_schema::v1::{
    CreateElicitationRequest, CreateElicitationResponse, ElicitationAcceptAction, ElicitationAction,
    ElicitationContentValue, ElicitationMode, ElicitationPropertySchema, ElicitationSchema, MultiSelectItems,
};
use serde_json::Value;

/// How a question was answered.
#[derive(Debug, Clone, PartialEq)]
pub enum ElicitAnswer {
    /// The person answered with these values (checked against the schema).
    Accept(BTreeMap<String, ElicitationContentValue>),
    /// The person, or the rule for nobody being there, declined.
    Decline,
    /// The question was withdrawn: the turn is being cancelled or the task ended (R088's
    /// symmetry).
    Cancel,
}

impl ElicitAnswer {
    pub fn response(self) -> CreateElicitationResponse {
        let action = match self {
            ElicitAnswer::Accept(content) => ElicitationAction::Accept(ElicitationAcceptAction::new().content(content)),
            ElicitAnswer::Decline => ElicitationAction::Decline,
            ElicitAnswer::Cancel => ElicitationAction::Cancel,
        };
        CreateElicitationResponse::new(action)
    }
}

/// The schema a form-mode question asks with; `None` for other modes (a URL to visit).
pub fn form_schema(request: &CreateElicitationRequest) -> Option<&ElicitationSchema> {
    match &request.mode {
        ElicitationMode::Form(form) => Some(&form.requested_schema),
        _ => None,
    }
}

/// Checks JSON `content` against `schema`: every required field present, no unknown one,
/// each value of its property's type and within its bounds.
pub fn check(schema: &ElicitationSchema, content: &serde_json::Map<String, Value>) -> Result<Content, String> {
    let mut out = BTreeMap::new();
    for (name, value) in content {
        let property = schema
            .properties
            .get(name)
            .ok_or_else(|| format!("`{name}` is not asked for; the fields are: {}", field_names(schema)))?;
        out.insert(name.clone(), value_of(name, property, value)?);
    }
    required_present(schema, &out)?;
    Ok(out)
}

/// Checks `key=value` pairs against `schema`, each value read as its property's type
/// (an array field takes comma-separated values).
pub fn check_pairs(schema: &ElicitationSchema, pairs: &[(String, String)]) -> Result<Content, String> {
    let mut json = serde_json::Map::new();
    for (name, text) in pairs {
        let property = schema
            .properties
            .get(name)
            .ok_or_else(|| format!("`{name}` is not asked for; the fields are: {}", field_names(schema)))?;
        let value = match property {
            ElicitationPropertySchema::Number(_) => {
                Value::from(text.trim().parse::<f64>().map_err(|_| format!("`{name}` must be a number, not `{text}`"))?)
            }
            ElicitationPropertySchema::Integer(_) => Value::from(
                text.trim().parse::<i64>().map_err(|_| format!("`{name}` must be a whole number, not `{text}`"))?,
            ),
            ElicitationPropertySchema::Boolean(_) => match text.trim() {
                "true" | "yes" => Value::Bool(true),
                "false" | "no" => Value::Bool(false),
                _ => return Err(format!("`{name}` must be true or false, not `{text}`")),
            },
            ElicitationPropertySchema::Array(_) => {
                Value::Array(text.split(',').map(|v| Value::String(v.trim().to_owned())).collect())
            }
            _ => Value::String(text.clone()),
        };
        json.insert(name.clone(), value);
    }
    check(schema, &json)
}

/// Checks one field's text answer (as `check_pairs` reads it) on its own, for asking field
/// by field.
pub fn check_field(schema: &ElicitationSchema, name: &str, text: &str) -> Result<ElicitationContentValue, String> {
    let mut one = schema.clone();
    one.properties.retain(|k, _| k == name);
    one.required = None;
    let mut checked = check_pairs(&one, &[(name.to_owned(), text.to_owned())])?;
    checked.remove(name).ok_or_else(|| format!("`{name}` is not asked for"))
}

/// Asks the person at this terminal, field by field, each answer checked as it is given
/// (a bad one is asked again); `.decline` declines. `None` when stdin is not a terminal or
/// it ended.
pub fn ask_on_terminal(request: &CreateElicitationRequest) -> Option<ElicitAnswer> {
    use std::io::{BufRead, IsTerminal};
    let schema = form_schema(request)?;
    if !std::io::stdin().is_terminal() {
        return None;
    }
    eprintln!("\npier: the agent asks: {}", request.message);
    eprintln!("pier: (answer each field; an empty answer skips an optional one; `.decline` declines)");
    let required: Vec<&str> = schema.required.iter().flatten().map(String::as_str).collect();
    let mut content = Content::new();
    for (name, property) in &schema.properties {
        let needed = required.contains(&name.as_str());
        loop {
            eprint!("  {name}{}{}: ", describe(property), if needed { " (required)" } else { "" });
            let mut line = String::new();
            if std::io::stdin().lock().read_line(&mut line).ok()? == 0 {
                return None;
            }
            let text = line.trim_end_matches(['\n', '\r']);
            if text.trim() == ".decline" {
                return Some(ElicitAnswer::Decline);
            }
            if text.is_empty() && !needed {
                break;
            }
            match check_field(schema, name, text) {
                Ok(value) => {
                    content.insert(name.clone(), value);
                    break;
                }
                Err(why) => eprintln!("  pier: {why}"),
            }
        }
    }
    Some(ElicitAnswer::Accept(content))
}

/// A field's kind and choices, for the prompt.
fn describe(property: &ElicitationPropertySchema) -> String {
    match property {
        ElicitationPropertySchema::String(p) => {
            let choices: Vec<&str> = p
                .enum_values
                .iter()
                .flatten()
                .map(String::as_str)
                .chain(p.one_of.iter().flatten().map(|o| o.value.as_str()))
                .collect();
            if choices.is_empty() { String::new() } else { format!(" [{}]", choices.join("/")) }
        }
        ElicitationPropertySchema::Number(_) => " (a number)".into(),
        ElicitationPropertySchema::Integer(_) => " (a whole number)".into(),
        ElicitationPropertySchema::Boolean(_) => " (yes/no)".into(),
        ElicitationPropertySchema::Array(_) => " (comma-separated)".into(),
        _ => String::new(),
    }
}

/// Checked answer values, by field.
pub type Content = BTreeMap<String, ElicitationContentValue>;

fn field_names(schema: &ElicitationSchema) -> String {
    schema.properties.keys().map(String::as_str).collect::<Vec<_>>().join(", ")
}

fn required_present(schema: &ElicitationSchema, content: &Content) -> Result<(), String> {
    let missing: Vec<&str> =
        schema.required.iter().flatten().filter(|r| !content.contains_key(*r)).map(String::as_str).collect();
    if missing.is_empty() { Ok(()) } else { Err(format!("required fields are missing: {}", missing.join(", "))) }
}

fn value_of(
    name: &str,
    property: &ElicitationPropertySchema,
    value: &Value,
) -> Result<ElicitationContentValue, String> {
    match property {
        ElicitationPropertySchema::String(p) => {
            let s = value.as_str().ok_or_else(|| format!("`{name}` must be text"))?;
            let chars = s.chars().count() as u64;
            if p.min_length.is_some_and(|m| chars < u64::from(m)) || p.max_length.is_some_and(|m| chars > u64::from(m))
            {
                return Err(format!(
                    "`{name}` must be {}–{} characters long",
                    p.min_length.unwrap_or(0),
                    p.max_length.map_or("∞".into(), |m| m.to_string())
                ));
            }
            let allowed: Vec<&str> = p
                .enum_values
                .iter()
                .flatten()
                .map(String::as_str)
                .chain(p.one_of.iter().flatten().map(|o| o.value.as_str()))
                .collect();
            if !allowed.is_empty() && !allowed.contains(&s) {
                return Err(format!("`{name}` must be one of: {}", allowed.join(", ")));
            }
            Ok(ElicitationContentValue::String(s.to_owned()))
        }
        ElicitationPropertySchema::Number(p) => {
            let n = value.as_f64().ok_or_else(|| format!("`{name}` must be a number"))?;
            if p.minimum.is_some_and(|m| n < m) || p.maximum.is_some_and(|m| n > m) {
                return Err(format!("`{name}` is out of its range"));
            }
            Ok(ElicitationContentValue::Number(n))
        }
        ElicitationPropertySchema::Integer(p) => {
            let n = value.as_i64().ok_or_else(|| format!("`{name}` must be a whole number"))?;
            if p.minimum.is_some_and(|m| n < m) || p.maximum.is_some_and(|m| n > m) {
                return Err(format!("`{name}` is out of its range"));
            }
            Ok(ElicitationContentValue::Integer(n))
        }
        ElicitationPropertySchema::Boolean(_) => Ok(ElicitationContentValue::Boolean(
            value.as_bool().ok_or_else(|| format!("`{name}` must be true or false"))?,
        )),
        ElicitationPropertySchema::Array(p) => {
            let items: Option<Vec<String>> =
                value.as_array().and_then(|a| a.iter().map(|v| v.as_str().map(str::to_owned)).collect());
            let items = items.ok_or_else(|| format!("`{name}` must be a list of texts"))?;
            let allowed: Vec<&str> = match &p.items {
                MultiSelectItems::String(s) => s.values.iter().map(String::as_str).collect(),
                MultiSelectItems::Titled(t) => t.options.iter().map(|o| o.value.as_str()).collect(),
                _ => Vec::new(),
            };
            if let Some(bad) = items.iter().find(|i| !allowed.is_empty() && !allowed.contains(&i.as_str())) {
                return Err(format!("`{name}`: `{bad}` is not one of: {}", allowed.join(", ")));
            }
            let count = items.len() as u64;
            if p.min_items.is_some_and(|m| count < m) || p.max_items.is_some_and(|m| count > m) {
                return Err(format!("`{name}` has the wrong number of items"));
            }
            Ok(ElicitationContentValue::StringArray(items))
        }
        _ => Err(format!("`{name}` has a field type pier cannot fill")),
    }
}
