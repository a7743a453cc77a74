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

/// Whether `s` has the shape a string format asks for (the checks a form would make).
fn fits_format(format: &agent_client_protocol_schema::v1::StringFormat, s: &str) -> bool {
    use agent_client_protocol_schema::v1::StringFormat as F;
    let date = |d: &str| {
        let parts: Vec<&str> = d.split('-').collect();
        parts.len() == 3
            && parts[0].len() == 4
            && parts[1].len() == 2
            && parts[2].len() == 2
            && parts.iter().all(|p| p.chars().all(|c| c.is_ascii_digit()))
            && (1..=12).contains(&parts[1].parse::<u32>().unwrap_or(0))
            && (1..=31).contains(&parts[2].parse::<u32>().unwrap_or(0))
    };
    match format {
        F::Email => s.split_once('@').is_some_and(|(user, domain)| {
            !user.is_empty()
                && domain.contains('.')
                && !domain.starts_with('.')
                && !domain.ends_with('.')
                && !s.contains(' ')
        }),
        F::Uri => s.split_once(':').is_some_and(|(scheme, rest)| {
            !rest.is_empty()
                && scheme.chars().next().is_some_and(|c| c.is_ascii_alphabetic())
                && scheme.chars().all(|c| c.is_ascii_alphanumeric() || "+-.".contains(c))
        }),
        F::Date => date(s),
        F::DateTime => {
            s.split_once(['T', 't']).is_some_and(|(d, t)| date(d) && t.len() >= 8 && t.as_bytes()[2] == b':')
        }
        _ => true,
    }
}

fn format_name(format: &agent_client_protocol_schema::v1::StringFormat) -> &'static str {
    use agent_client_protocol_schema::v1::StringFormat as F;
    match format {
        F::Email => "an email address",
        F::Uri => "a URI",
        F::Date => "a date (YYYY-MM-DD)",
        F::DateTime => "a date and time (YYYY-MM-DDTHH:MM:SS…)",
        _ => "in its format",
    }
}

/// The values a text field may take (its `enum` or `oneOf`); empty when any text goes.
fn choices(p: &agent_client_protocol_schema::v1::StringPropertySchema) -> Vec<&str> {
    p.enum_values
        .iter()
        .flatten()
        .map(String::as_str)
        .chain(p.one_of.iter().flatten().map(|o| o.value.as_str()))
        .collect()
}

/// How a form field is answered.
#[derive(Debug, Clone, PartialEq)]
pub enum Input<'a> {
    Boolean,
    Number,
    Integer,
    /// One of these (a string field with choices), or several (a multi-select).
    Choice(Vec<&'a str>),
    Text,
}

/// A form field as a page shows it.
#[derive(Debug, Clone, PartialEq)]
pub struct Field<'a> {
    pub name: &'a str,
    pub title: &'a str,
    pub description: Option<&'a str>,
    pub required: bool,
    pub input: Input<'a>,
}

/// The fields a form-mode question asks for, in the schema's order.
pub fn fields(schema: &ElicitationSchema) -> Vec<Field<'_>> {
    let required: Vec<&str> = schema.required.iter().flatten().map(String::as_str).collect();
    schema
        .properties
        .iter()
        .map(|(name, property)| {
            let (title, description, input) = match property {
                ElicitationPropertySchema::String(p) => {
                    let choices = choices(p);
                    let input = if choices.is_empty() { Input::Text } else { Input::Choice(choices) };
                    (p.title.as_deref(), p.description.as_deref(), input)
                }
                ElicitationPropertySchema::Number(p) => (p.title.as_deref(), p.description.as_deref(), Input::Number),
                ElicitationPropertySchema::Integer(p) => (p.title.as_deref(), p.description.as_deref(), Input::Integer),
                ElicitationPropertySchema::Boolean(p) => (p.title.as_deref(), p.description.as_deref(), Input::Boolean),
                ElicitationPropertySchema::Array(p) => {
                    let choices: Vec<&str> = match &p.items {
                        MultiSelectItems::String(items) => items.values.iter().map(String::as_str).collect(),
                        MultiSelectItems::Titled(items) => items.options.iter().map(|o| o.value.as_str()).collect(),
                        _ => Vec::new(),
                    };
                    let input = if choices.is_empty() { Input::Text } else { Input::Choice(choices) };
                    (p.title.as_deref(), p.description.as_deref(), input)
                }
                _ => (None, None, Input::Text),
            };
            Field {
                name,
                title: title.unwrap_or(name),
                description,
                required: required.contains(&name.as_str()),
                input,
            }
        })
        .collect()
}

/// A field's kind and choices, for the prompt.
fn describe(property: &ElicitationPropertySchema) -> String {
    match property {
        ElicitationPropertySchema::String(p) => {
            let choices = choices(p);
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
            let allowed = choices(p);
            if !allowed.is_empty() && !allowed.contains(&s) {
                return Err(format!("`{name}` must be one of: {}", allowed.join(", ")));
            }
            if let Some(pattern) = &p.pattern {
                // The agent's pattern, compiled with a bound; one that does not compile cannot
                // be checked and is left to the agent.
                let compiled = regex::RegexBuilder::new(pattern).size_limit(1 << 20).build();
                if compiled.is_ok_and(|re| !re.is_match(s)) {
                    return Err(format!("`{name}` must match the pattern {pattern}"));
                }
            }
            if let Some(format) = &p.format
                && !fits_format(format, s)
            {
                return Err(format!("`{name}` must be {}", format_name(format)));
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

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn schema() -> ElicitationSchema {
        serde_json::from_value(json!({
            "type": "object",
            "required": ["name", "email"],
            "properties": {
                "name": {"type": "string", "minLength": 1, "pattern": "^[A-Z][a-z]+$"},
                "email": {"type": "string", "format": "email"},
                "when": {"type": "string", "format": "date"},
                "size": {"type": "string", "enum": ["s", "m", "l"]},
                "count": {"type": "integer", "minimum": 1, "maximum": 10},
                "ok": {"type": "boolean"},
                "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b"]}}
            }
        }))
        .unwrap_or_else(|e| panic!("{e}"))
    }

    fn pairs(p: &[(&str, &str)]) -> Result<Content, String> {
        let p: Vec<(String, String)> = p.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect();
        check_pairs(&schema(), &p)
    }

    #[test]
    fn a_fitting_answer_is_typed() {
        let got = pairs(&[
            ("name", "Ada"),
            ("email", "ada@example.org"),
            ("when", "2026-12-03"),
            ("size", "m"),
            ("count", "3"),
            ("ok", "yes"),
            ("tags", "a, b"),
        ]);
        let got = got.unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(got["count"], ElicitationContentValue::Integer(3));
        assert_eq!(got["ok"], ElicitationContentValue::Boolean(true));
        assert_eq!(got["tags"], ElicitationContentValue::StringArray(vec!["a".into(), "b".into()]));
    }

    #[test]
    fn each_rule_of_the_schema_refuses_what_breaks_it() {
        let base = [("name", "Ada"), ("email", "ada@example.org")];
        let with = |k: &'static str, v: &'static str| {
            let mut p: Vec<(&str, &str)> = base.iter().copied().filter(|(n, _)| *n != k).collect();
            p.push((k, v));
            pairs(&p).err().unwrap_or_else(|| panic!("{k}={v} was accepted"))
        };
        assert!(with("name", "ada").contains("pattern"));
        assert!(with("email", "not-an-address").contains("email"));
        assert!(with("when", "03/12/2026").contains("date"));
        assert!(with("size", "xl").contains("one of"));
        assert!(with("count", "11").contains("range"));
        assert!(with("count", "three").contains("whole number"));
        assert!(with("ok", "maybe").contains("true or false"));
        assert!(with("tags", "c").contains("not one of"));
        assert!(with("colour", "red").contains("not asked for"));
        assert!(pairs(&[("name", "Ada")]).err().is_some_and(|e| e.contains("missing: email")));
    }
}
