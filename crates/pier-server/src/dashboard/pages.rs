//! The pages, in maud: markup checked at compile time and escaped by default, so nothing
//! the plan, the agent or the model wrote can become markup (this file has no `PreEscaped`).

use agent_client_protocol_schema::v1::{
    ContentBlock, PermissionOption, RequestPermissionOutcome, ToolCall, ToolCallContent, ToolCallUpdate,
};
use maud::{DOCTYPE, Markup, html};
use pier_client::elicit::{Input, fields, form_schema};
use pier_host::{LogEvent, NodeRow, Question, QuestionRequest, RunView, Spend, TaskRow, TaskView, option_kind};
use serde_json::Value;

use super::actions::task_links;
use super::auth::Session;
use super::graph::{glyph, svg};
use super::timeline::gantt;
use super::transcript::{Item, Span, build, diff_lines};
use crate::access::Role;

/// A schema enum's wire name (`in_progress`, `execute`): what it serializes to.
fn wire_name<T: serde::Serialize>(v: &T) -> String {
    match serde_json::to_value(v) {
        Ok(Value::String(s)) => s,
        _ => "other".to_owned(),
    }
}

pub use crate::segment as seg;

pub(super) fn time(ms: i64) -> String {
    pier_host::schedule::human(ms.max(0))
}

/// A duration to a tenth of a second: `3.2 s`.
pub(super) fn seconds(ms: i64) -> String {
    format!("{:.1} s", ms.max(0) as f64 / 1000.0)
}

fn duration(ms: i64) -> String {
    let s = ms.max(0) / 1000;
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m {}s", s / 60, s % 60),
        _ => format!("{}h {}m", s / 3600, (s % 3600) / 60),
    }
}

fn state(s: &str) -> Markup {
    html! { span class={ "state state-" (s) } { (glyph(s)) " " (s) } }
}

/// A spend in a few words: tokens and cost, or that it is unknown (never a 0 it did not measure).
fn spend_short(spend: Option<&Spend>) -> String {
    let Some(spend) = spend.filter(|s| s.known()) else { return "unknown".into() };
    let t = &spend.total;
    let cost = match (t.cost, t.unpriced) {
        (Some(c), 0) => format!("{c:.4}"),
        (Some(c), _) => format!("{c:.4} + ?"),
        (None, _) => "?".into(),
    };
    format!("{} tok · {cost}", t.tokens.total())
}

/// A spend whole: the one-line sum and a row per model.
fn spend_section(spend: &Spend) -> Markup {
    html! {
        section class="spend" aria-label="spend" {
            h2 { "Spend" }
            p { (spend.describe()) }
            @if spend.known() {
                div class="scroll" {
                table class="spend" {
                    thead { tr { th { "model" } th { "requests" } th { "cost" } th { "input" } th { "output" } th { "cached input" } th { "reasoning" } } }
                    tbody {
                        @for (model, m) in &spend.by_model {
                            tr data-model=(model) {
                                td { code { (model) } }
                                td { (m.requests) }
                                td class="cost" { @match m.cost { Some(c) => { (format!("{c:.4}")) @if m.unpriced > 0 { " + unknown" } }, None => "unknown (no price)" } }
                                td { (m.tokens.input) }
                                td { (m.tokens.output) }
                                td { (m.tokens.cached_input) }
                                td { (m.tokens.reasoning) }
                            }
                        }
                    }
                }
                }
            }
        }
    }
}

/// The frame of every page. `live`: the `/events` query that keeps it current.
pub(super) fn layout(
    title: &str,
    session: Option<&Session>,
    live: Option<(String, i64)>,
    notice: Option<&str>,
    body: Markup,
) -> Markup {
    let (live, after) = match live {
        Some((q, seq)) => (Some(q), Some(seq)),
        None => (None, None),
    };
    let assets = super::assets();
    html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                meta name="viewport" content="width=device-width, initial-scale=1";
                title { (title) " · pier" }
                link rel="stylesheet" href={ "/ui/assets/" (assets.css.0) };
                script type="module" src={ "/ui/assets/" (assets.js.0) } {}
            }
            body {
                header {
                    a class="brand" href="/ui/" { "pier" }
                    @if let Some(s) = session {
                        nav aria-label="main" {
                            a href="/ui/" { "Runs" }
                            a href="/ui/approvals" { "Approvals" }
                            a href="/ui/schedules" { "Schedules" }
                            a href="/ui/nodes" { "Nodes" }
                        }
                        form method="post" action="/ui/logout" class="logout" {
                            input type="hidden" name="csrf" value=(s.csrf);
                            span class="who" { (s.name()) }
                            " "
                            button type="submit" { "Log out" }
                        }
                    }
                }
                main id="main" data-live=[live] data-after=[after] data-worker={ "/ui/assets/" (assets.worker.0) } {
                    @if let Some(n) = notice {
                        p class={ "notice" @if n.starts_with("refused") { " refused" } } role="status" { (n) }
                    }
                    (body)
                }
            }
        }
    }
}

/// The login form. Without a users file the server's one token is shared, so the person
/// names themself (their answers are recorded with it); a personal token names its person.
pub fn login(error: Option<&str>, personal_tokens: bool) -> Markup {
    layout(
        "Log in",
        None,
        None,
        error,
        html! {
            h1 { "Log in" }
            form method="post" action="/ui/login" class="login" {
                @if personal_tokens {
                    label for="token" { "Your token" }
                } @else {
                    label for="name" { "Your name (answers and actions are recorded with it)" }
                    input id="name" name="name" type="text" autocomplete="username" maxlength="64" required autofocus;
                    label for="token" { "The server's token (" code { "$PIER_HOME/serve.token" } " or " code { "--token" } ")" }
                }
                input id="token" name="token" type="password" autocomplete="current-password" required autofocus[personal_tokens];
                button type="submit" { "Log in" }
            }
        },
    )
}

pub async fn login_page(
    axum::extract::State(app): axum::extract::State<crate::Shared>,
) -> axum::response::Html<String> {
    axum::response::Html(login(None, app.users.is_some()).into_string())
}

pub fn error_page(message: &str) -> Markup {
    layout("Error", None, None, None, html! { h1 { "Not here" } p { (message) } p { a href="/ui/" { "All runs" } } })
}

pub fn runs(s: &Session, list: &pier_host::tasks::RunList, q: &super::RunsQuery, seq: i64) -> Markup {
    let shown = &list.runs;
    let filter = q.state.as_deref().filter(|st| !st.is_empty());
    let search = q.q.as_deref().unwrap_or("");
    let page = q.page.unwrap_or(1).max(1);
    // A link to another state or page of this list, keeping the rest of the query.
    let href = |state: Option<&str>, page: usize| {
        let mut parts = Vec::new();
        if let Some(st) = state {
            parts.push(format!("state={}", seg(st)));
        }
        if !search.is_empty() {
            parts.push(format!("q={}", seg(search)));
        }
        if page > 1 {
            parts.push(format!("page={page}"));
        }
        if parts.is_empty() { "/ui/".to_owned() } else { format!("/ui/?{}", parts.join("&")) }
    };
    let body = html! {
        h1 { "Runs" }
        form method="get" action="/ui/" class="search" role="search" {
            label for="q" { "Find a run" }
            input id="q" name="q" type="search" value=(search) placeholder="run id contains…";
            @if let Some(st) = filter { input type="hidden" name="state" value=(st); }
            button type="submit" { "Find" }
        }
        nav class="filters" aria-label="filter by state" {
            @for (label, f) in [("all", None), ("running", Some("running")), ("waiting", Some("waiting")), ("completed", Some("completed")), ("failed", Some("failed"))] {
                a href=(href(f, 1)) aria-current=[(filter == f).then_some("page")] { (label) }
            }
        }
        @if shown.is_empty() {
            p { "No runs" @if filter.is_some() || !search.is_empty() { " match" } ". Submit one with " code { "pier submit PLAN" } "." }
        } @else {
            table class="runs cards" {
                thead { tr { th { "run" } th { "state" } th { "tasks" } th { "attempts" } th { "waiting" } th { "spend" } th { "started" } th { "finished" } th { "took" } } }
                tbody {
                    @for r in shown {
                        @let st = r.state();
                        tr data-run=(r.run) {
                            td { a href={ "/ui/runs/" (seg(&r.run)) } { (r.run) } }
                            td { (state(st)) }
                            td class="counts" {
                                (r.tasks) ": "
                                @for (i, (k, v)) in r.counts.iter().enumerate() {
                                    @if i > 0 { " · " }
                                    (v) " " (k)
                                }
                            }
                            td { (r.attempts) }
                            td { @if r.waiting() > 0 { a href="/ui/approvals" { (r.waiting()) } } @else { "0" } }
                            td class="spend" { (spend_short(Some(&r.spend))) }
                            td { (time(r.created_at_ms)) }
                            td { @if st != "running" { (time(r.updated_at_ms)) } @else { "—" } }
                            td { (duration(r.updated_at_ms - r.created_at_ms)) }
                        }
                    }
                }
            }
        }
        @if page > 1 || list.more > 0 {
            nav class="pages" aria-label="pages" {
                @if page > 1 { a href=(href(filter, page - 1)) rel="prev" { "← newer" } }
                " page " (page) " "
                @if list.more > 0 { a href=(href(filter, page + 1)) rel="next" { "older →" } " (" (list.more) " more)" }
            }
        }
    };
    layout("Runs", Some(s), Some(("follow=true".into(), seq)), None, body)
}

/// Tasks in a run page's table at once; a graph is drawn for runs of at most [`GRAPH_MAX`]
/// tasks (a graph of thousands of nodes is read by nobody, and costs seconds to load).
pub(crate) const TASKS_PER_PAGE: usize = 500;
pub(crate) const GRAPH_MAX: usize = 1000;
/// Questions answered in place on a run page; the rest on the Approvals page.
const WAITING_MAX: usize = 50;

pub fn run(s: &Session, run: &str, view: &RunView, seq: i64, notice: Option<&str>, q: &super::RunPageQuery) -> Markup {
    let tasks = &view.tasks;
    let rows: Vec<TaskRow> = tasks.iter().map(|(t, _)| t.clone()).collect();
    let counts = view.counts();
    let unfinished = rows.iter().any(|t| !t.state.is_terminal());
    let filter = q.state.as_deref().filter(|st| !st.is_empty());
    let page = q.page.unwrap_or(1).max(1);
    let listed: Vec<&(TaskRow, Option<Question>)> = tasks
        .iter()
        .filter(|(t, _)| {
            filter.is_none_or(|f| {
                t.state.as_str() == f || (f == "waiting" && t.state == pier_host::TaskState::AwaitingInput)
            })
        })
        .collect();
    let pages = listed.len().div_ceil(TASKS_PER_PAGE).max(1);
    let page = page.min(pages);
    let shown = &listed[(page - 1) * TASKS_PER_PAGE..listed.len().min(page * TASKS_PER_PAGE)];
    let href = |state: Option<&str>, page: usize| {
        let mut parts = Vec::new();
        if let Some(st) = state {
            parts.push(format!("state={}", seg(st)));
        }
        if page > 1 {
            parts.push(format!("page={page}"));
        }
        let base = format!("/ui/runs/{}", seg(run));
        if parts.is_empty() { base } else { format!("{base}?{}", parts.join("&")) }
    };
    let body = html! {
        h1 { "Run " (run) }
        div data-region="run" {
        p class="counts" {
            @for (i, (k, v)) in counts.iter().enumerate() { @if i > 0 { " · " } (v) " " (k) }
        }
        @if unfinished && s.may(Role::Operator) {
            a class="action danger" href={ "/ui/runs/" (seg(run)) "/cancel" } { "Cancel run…" }
        }
        @let here = format!("/ui/runs/{}", seg(run));
        @let waiting: Vec<_> = tasks.iter().filter(|(t, _)| t.state == pier_host::TaskState::AwaitingInput).collect();
        @if !waiting.is_empty() && s.may(Role::Operator) {
            section class="waiting" aria-label="waiting for you" {
                h2 { "Waiting for you" }
                @if waiting.len() > WAITING_MAX { p { "The first " (WAITING_MAX) " of " (waiting.len()) "; all of them on " a href="/ui/approvals" { "Approvals" } "." } }
                @for (t, q) in waiting.into_iter().take(WAITING_MAX) {
                    div class="approval" data-task=(t.id) {
                        h3 { a href={ (here) "/tasks/" (seg(&t.id)) } { (t.id) } }
                        (decide(s, run, &t.id, q.as_ref(), &here))
                    }
                }
            }
        }
        @let now = pier_host::store::now_ms();
        @if rows.len() <= GRAPH_MAX {
            div class="zoom" role="group" aria-label="zoom the graph" {
                button type="button" data-zoom="out" aria-label="zoom out" { "−" }
                button type="button" data-zoom="fit" { "fit" }
                button type="button" data-zoom="in" aria-label="zoom in" { "+" }
            }
            section aria-label="graph" class="scroll graph-box" { (svg(run, &rows, &view.times, now)) }
        } @else {
            p class="no-graph" { "A graph of " (rows.len()) " tasks is not drawn (over " (GRAPH_MAX) "): find tasks by state below, page by page." }
        }
        (gantt(&rows, &view.times, now))
        h2 { "Tasks" }
        nav class="filters" aria-label="tasks by state" {
            @for (label, f) in [("all", None), ("running", Some("running")), ("waiting", Some("waiting")), ("pending", Some("pending")), ("failed", Some("failed")), ("cancelled", Some("cancelled")), ("completed", Some("completed"))] {
                a href=(href(f, 1)) aria-current=[(filter == f).then_some("page")] { (label) }
            }
        }
        table class="tasks cards" data-complete=[(listed.len() == tasks.len() && pages == 1).then_some("true")] {
            thead { tr { th { "task" } th { "state" } th { "attempts" } th { "ran" } th { "agent" } th { "result, error or question" } th { "spend" } th { "actions" } } }
            tbody {
                @for (t, q) in shown {
                    tr data-task=(t.id) data-state=(t.state.as_str()) {
                        td { a href={ "/ui/runs/" (seg(run)) "/tasks/" (seg(&t.id)) } { (t.id) } }
                        td { (state(t.state.as_str())) }
                        td { (t.attempt) }
                        td class="ran" { (ran_for(view.times.get(&t.id), now)) }
                        td { code { (t.spec.agent) } }
                        td class="clip" {
                            @if let Some(q) = q { "asks: " (asks(&q.request)) }
                            @else if t.state == pier_host::TaskState::AwaitingInput { "waits for a re-run decision" }
                            @else { (first_line(t.result.as_deref().or(t.error.as_deref()).unwrap_or(""))) }
                        }
                        td class="spend" { (spend_short(view.task_spend.get(&t.id))) }
                        td { (task_links(s, run, &t.id, t.state, false)) }
                    }
                }
            }
        }
        @if pages > 1 {
            nav class="pages" aria-label="pages of tasks" {
                @if page > 1 { a href=(href(filter, page - 1)) rel="prev" { "← previous" } }
                " tasks " ((page - 1) * TASKS_PER_PAGE + 1) "–" ((page - 1) * TASKS_PER_PAGE + shown.len()) " of " (listed.len()) " "
                @if page < pages { a href=(href(filter, page + 1)) rel="next" { "next →" } }
            }
        }
        (spend_section(&view.spend))
        }
        (rail(seq))
    };
    layout(&format!("Run {run}"), Some(s), Some((format!("run={}", seg(run)), seq)), notice, body)
}

/// The run's event log, live: filled by the page's script from `/events`, resumable from any sequence.
fn rail(seq: i64) -> Markup {
    html! {
        section class="rail" aria-label="events" {
            h2 { "Events" }
            form class="replay" id="replay" {
                label for="from" { "Replay from sequence" }
                input id="from" name="from" type="number" min="0" value=((seq - 50).max(0));
                button type="submit" { "Replay" }
            }
            ol id="events" data-after=((seq - 50).max(0)) {}
        }
    }
}

fn first_line(text: &str) -> String {
    let line = text.lines().next().unwrap_or("");
    if line.chars().count() > 120 {
        format!("{}…", line.chars().take(119).collect::<String>())
    } else {
        line.to_owned()
    }
}

/// What a question asks, in a line.
fn asks(request: &QuestionRequest) -> String {
    match request {
        QuestionRequest::Elicitation(q) => q.message.clone(),
        QuestionRequest::Permission(p) => format!(
            "permission for {} ({})",
            p.tool_call.fields.title.as_deref().unwrap_or("a tool call"),
            p.tool_call.fields.kind.as_ref().map_or_else(|| "?".to_owned(), wire_name)
        ),
    }
}

/// The buttons that answer what a task waits on: the agent's own options verbatim, or the
/// re-run decision. `n` ties the answer to the question shown.
fn decide(s: &Session, run: &str, task: &str, q: Option<&Question>, from: &str) -> Markup {
    let action = format!("/ui/runs/{}/tasks/{}/answer", seg(run), seg(task));
    html! {
        div class="decide" {
            @match q {
                Some(q @ Question { request: QuestionRequest::Elicitation(ask), .. }) => {
                    @let input = format!("/ui/runs/{}/tasks/{}/input", seg(run), seg(task));
                    p { "The agent asks: " strong { (asks(&q.request)) } }
                    form method="post" action=(input) class="question-form" {
                        input type="hidden" name="csrf" value=(s.csrf);
                        input type="hidden" name="n" value=(q.n);
                        input type="hidden" name="from" value=(from);
                        @for field in form_schema(ask).map(fields).unwrap_or_default() {
                            @let id = format!("f-{}-{}", seg(task), seg(field.name));
                            @let name = format!("f.{}", field.name);
                            label for=(id) { (field.title) @if field.required { " (required)" } }
                            @if let Some(d) = field.description { small { (d) } }
                            @match &field.input {
                                Input::Boolean => {
                                    select id=(id) name=(name) { option value="" { "—" } option value="true" { "yes" } option value="false" { "no" } }
                                }
                                Input::Choice(choices) => {
                                    select id=(id) name=(name) { option value="" { "—" } @for c in choices { option value=(c) { (c) } } }
                                }
                                Input::Number => { input id=(id) name=(name) type="number" step="any"; }
                                Input::Integer => { input id=(id) name=(name) type="number" step="1"; }
                                Input::Text => { input id=(id) name=(name) type="text"; }
                            }
                        }
                        button type="submit" class="option allow" { "Answer" }
                    }
                    form method="post" action=(input) class="inline" {
                        input type="hidden" name="csrf" value=(s.csrf);
                        input type="hidden" name="n" value=(q.n);
                        input type="hidden" name="from" value=(from);
                        input type="hidden" name="decline" value="1";
                        button type="submit" class="option reject" { "Decline" }
                    }
                }
                Some(q @ Question { request: QuestionRequest::Permission(ask), .. }) => {
                    (requested_tool(&ask.tool_call))
                    @for o in &ask.options {
                        @let kind = option_kind(o.kind);
                        form method="post" action=(action) class="inline" {
                            input type="hidden" name="csrf" value=(s.csrf);
                            input type="hidden" name="n" value=(q.n);
                            input type="hidden" name="from" value=(from);
                            input type="hidden" name="decision" value=(if kind.starts_with("allow") { "allow" } else { "reject" });
                            input type="hidden" name="option" value=(o.option_id.0);
                            button type="submit" class={ "option " (kind) } data-option=(o.option_id.0) data-kind=(kind) {
                                (o.name) " (" (kind) ")"
                            }
                        }
                    }
                }
                None => {
                    p { "A lost attempt reported side effects: run it again?" }
                    @for (decision, label) in [("allow", "Run it again"), ("reject", "Cancel it")] {
                        form method="post" action=(action) class="inline" {
                            input type="hidden" name="csrf" value=(s.csrf);
                            input type="hidden" name="n" value="0";
                            input type="hidden" name="from" value=(from);
                            input type="hidden" name="decision" value=(decision);
                            button type="submit" class={ "option " (decision) } { (label) }
                        }
                    }
                }
            }
        }
    }
}

/// The tool call a permission request is about, as far as the request tells it.
fn requested_tool(call: &ToolCallUpdate) -> Markup {
    match ToolCall::try_from(call.clone()) {
        Ok(call) => tool(&call),
        Err(_) => html! { p { "a tool call" } },
    }
}

/// One tool call: kind, status, title, and its content (text, diffs as unified diffs).
fn tool(call: &ToolCall) -> Markup {
    tool_at(call, None)
}

/// [`tool`], with when it started and how long it took, when known.
fn tool_at(call: &ToolCall, span: Option<Span>) -> Markup {
    let status = wire_name(&call.status);
    html! {
        div class={ "tool status-" (status) } data-tool=(call.tool_call_id.0) {
            p class="tool-head" {
                span class="kind" { (wire_name(&call.kind)) }
                " " strong { (call.title) }
                " " span class="status" { "[" (status) "]" }
                @if let Some(span) = span {
                    " " span class="when" data-started-ms=(span.started_ms) data-ended-ms=[span.ended_ms] {
                        (time(span.started_ms))
                        @if let Some(end) = span.ended_ms { ", took " (seconds(end - span.started_ms)) }
                    }
                }
            }
            @for c in &call.content {
                @match c {
                    ToolCallContent::Diff(d) => {
                        div class="diff" {
                            p class="path" { (d.path.display()) @if d.old_text.is_none() { " (new file)" } }
                            pre {
                                @for (class, line) in diff_lines(d.old_text.as_deref().unwrap_or(""), &d.new_text) {
                                    span class=(class) { (line) "\n" }
                                }
                            }
                        }
                    }
                    ToolCallContent::Content(c) => {
                        @if let ContentBlock::Text(t) = &c.content { pre class="output" { (t.text) } }
                    }
                    _ => {}
                }
            }
        }
    }
}

pub fn task(
    s: &Session,
    run: &str,
    v: &TaskView,
    events: &[pier_host::Event],
    seq: i64,
    notice: Option<&str>,
) -> Markup {
    let t = &v.row;
    let here = format!("/ui/runs/{}/tasks/{}", seg(run), seg(&t.id));
    let transcript = build(events);
    let body = html! {
        p { a href={ "/ui/runs/" (seg(run)) } { "← run " (run) } }
        h1 { "Task " (t.id) }
        dl class="facts" {
            dt { "state" } dd {
                (state(t.state.as_str())) @if let Some(why) = &t.cancel_requested { " — stopping: cancelled (" (why) ")" }
                " " (task_links(s, run, &t.id, t.state, true))
            }
            dt { "agent" } dd { code { (t.spec.agent) } @if let Some(info) = v.agent.as_ref().and_then(|a| a.info()) { " (" (info.name) " " (info.version) ")" } }
            dt { "attempts" } dd { (t.attempt) " (" (t.failures) " failed)" }
            @if let Some(owner) = &t.lease_owner { dt { "lease" } dd { (owner) } }
            @if !t.spec.depends_on.is_empty() { dt { "depends on" } dd { (t.spec.depends_on.join(", ")) } }
        }
        @if matches!(t.state, pier_host::TaskState::Running | pier_host::TaskState::AwaitingInput) {
            (liveness(t, events))
        }
        @if t.state == pier_host::TaskState::AwaitingInput && s.may(Role::Operator) {
            section class="waiting" aria-label="waiting for you" {
                h2 { "Waiting for you" }
                (decide(s, run, &t.id, v.question.as_ref(), &here))
                @if v.question.is_none() && !v.evidence().is_empty() {
                    h3 { "The evidence" }
                    ul { @for e in v.evidence() { li { code { (e.to_string()) } } } }
                }
            }
        }
        h2 { "Prompt" }
        pre class="prompt" { (v.prompt) }
        @if let Some(r) = &t.result { h2 { "Result" } pre class="result" { (r) } }
        @if let Some(e) = &t.error { h2 { "Error" } pre class="error" { (e) } }
        (spend_section(&v.spend))
        @for (n, items) in &transcript {
            @if *n > 0 {
                section class="attempt" aria-label={ "attempt " (n) } {
                    h2 { "Attempt " (n) }
                    @if let Some(t) = v.times.iter().find(|t| t.attempt == *n) { (attempt_time(t)) }
                    @if let Some(a) = v.attempts.iter().find(|a| a.attempt == *n) {
                        @if !a.evidence.is_empty() { p class="evidence" { (a.evidence.len()) " side effect(s) reported" } }
                    }
                    @for item in items { (item_markup(item)) }
                }
            }
        }
    };
    layout(&format!("Task {}", t.id), Some(s), Some((format!("run={}", seg(run)), seq)), notice, body)
}

/// How long a task's attempts ran, together (to `now_ms` for one still on); "—" before any.
fn ran_for(times: Option<&Vec<pier_host::AttemptTime>>, now_ms: i64) -> String {
    match times.filter(|v| !v.is_empty()) {
        Some(v) => seconds(pier_host::AttemptTime::ran_ms(v, now_ms)),
        None => "—".to_owned(),
    }
}

/// Lines of a running agent's stderr shown on its task page.
const STDERR_TAIL: usize = 20;

/// How a running task's attempt is doing: who holds it and until when, when it last did
/// something, and the last lines its agent wrote to stderr.
fn liveness(t: &TaskRow, events: &[pier_host::Event]) -> Markup {
    let now = pier_host::store::now_ms();
    let last = events.iter().rev().find(|e| e.task.as_deref() == Some(t.id.as_str())).map(|e| e.at_ms);
    let mut tail: Vec<String> = Vec::new();
    for e in events.iter().rev().filter(|e| e.kind == "agent_stderr") {
        if tail.len() >= STDERR_TAIL {
            break;
        }
        if let pier_host::Entry::Agent { attempt, event } = e.entry()
            && attempt == t.attempt
            && let pier_host::AgentEvent::AgentStderr { lines, .. } = *event
        {
            tail.extend(lines.into_iter().rev().take(STDERR_TAIL - tail.len()));
        }
    }
    tail.reverse();
    html! {
        section class="live" aria-label="now" {
            h2 { "Now" }
            p {
                "attempt " (t.attempt)
                @if let (Some(owner), Some(until)) = (&t.lease_owner, t.lease_expires_at_ms) {
                    ", held by " code { (owner) } @if until >= now { " (lease renewed, good for " (duration(until - now)) ")" } @else { " (lease lapsed " (duration(now - until)) " ago: its host may be gone)" }
                }
                @if let Some(at) = last { "; last event " span class="ago" data-at-ms=(at) { (duration(now - at)) " ago" } }
            }
            @if !tail.is_empty() {
                h3 { "stderr, last lines" }
                pre class="stderr-tail" { @for l in &tail { (l) "\n" } }
            }
        }
    }
}

/// When an attempt started, how long it took and how it ended (its `<time>`s in UTC, for a
/// script or the browser to read).
fn attempt_time(t: &pier_host::AttemptTime) -> Markup {
    html! {
        p class="when" {
            "started " time datetime=(pier_host::schedule::rfc3339(t.started_at_ms)) { (time(t.started_at_ms)) }
            @match (t.took_ms(), t.ended) {
                (Some(took), Some(how)) => {
                    ", took " span class="took" { (seconds(took)) }
                    ", " (how.as_str())
                }
                _ => { ", still on" }
            }
        }
    }
}

fn item_markup(item: &Item) -> Markup {
    match item {
        Item::Said(text) => html! { div class="said" { pre { (text) } } },
        Item::User(text) => html! { div class="user" { p class="who" { "prompt" } pre { (text) } } },
        Item::Thought(text) => html! { details class="thought" { summary { "thoughts" } pre { (text) } } },
        Item::Tool(call, span) => tool_at(call, Some(*span)),
        Item::Stderr { lines, dropped } => html! {
            details class="stderr" {
                summary { "stderr · " (lines.len()) @if lines.len() == 1 { " line" } @else { " lines" } @if *dropped > 0 { " (" (dropped) " more dropped)" } }
                pre { @for l in lines { (l) "\n" } }
            }
        },
        Item::Plan(plan) => html! {
            ol class="plan" {
                @for e in &plan.entries {
                    @let status = wire_name(&e.status);
                    li class={ "plan-" (status) } { "[" (status) "] " (e.content) }
                }
            }
        },
        Item::Permission { tool_call, options, outcome, rule: why, reason } => {
            permission(tool_call, options, outcome, why, reason)
        }
        Item::Question { request, response } => html! {
            div class="question" {
                p { "The agent asked: " strong { (request.message) } }
                p { "Answer: " code { (response.to_string()) } }
            }
        },
        Item::Transition(at, LogEvent::Transition { from, to, reason, owner, class, error, .. }) => html! {
            p class="transition" {
                (time(*at)) " · "
                (from.as_str()) " → " (to.as_str()) " · " (reason)
                @if let Some(owner) = owner { " · lease " (owner) }
                @if let Some(class) = class { " · error class " (wire_name(class)) }
                @if let Some(error) = error { " · " (first_line(error)) }
            }
        },
        Item::Transition(..) => html! {},
        Item::Model(r) => html! {
            p class="model-request" {
                "model request · " code { (r.model.as_deref().unwrap_or("unknown model")) } " · " (r.provider)
                " · " (r.status) " · " (r.latency_ms) " ms"
                @if r.held_ms > 0 { " (" (r.held_ms) " ms held for a rate limit)" }
                @if let Some(t) = &r.tokens { " · " (t.total()) " tokens (in " (t.input) ", out " (t.output) ")" }
                @else { " · tokens not reported" }
                @if let Some(c) = r.cost { " · cost " (format!("{c:.4}")) }
                @if let Some(e) = &r.error { " · " (first_line(e)) }
            }
        },
    }
}

/// A permission request of the agent's, the options it offered and the one chosen.
fn permission(
    call: &ToolCallUpdate,
    options: &[PermissionOption],
    outcome: &RequestPermissionOutcome,
    why: &Value,
    reason: &str,
) -> Markup {
    let chosen = match outcome {
        RequestPermissionOutcome::Selected(s) => s.option_id.0.to_string(),
        RequestPermissionOutcome::Cancelled => "cancelled".to_owned(),
        _ => "?".to_owned(),
    };
    html! {
        div class="permission" {
            p { "Permission for " strong { (call.fields.title.as_deref().unwrap_or("a tool call")) } }
            ul class="options" {
                @for o in options {
                    @let id = &*o.option_id.0;
                    li class=[(id == chosen).then_some("chosen")] {
                        (o.name) " (" (option_kind(o.kind)) ")"
                        @if id == chosen { " ← chosen" }
                    }
                }
            }
            p class="why" { "chosen " (chosen) " by " (rule(why)) @if !reason.is_empty() { ": " (reason) } }
        }
    }
}

fn rule(rule: &Value) -> String {
    match rule {
        Value::String(s) => s.clone(),
        Value::Null => "policy".to_owned(),
        other => other.to_string(),
    }
}

pub fn approvals(s: &Session, waiting: &[(TaskRow, Option<Question>)], seq: i64, notice: Option<&str>) -> Markup {
    let body = html! {
        h1 { "Approvals" }
        @if waiting.is_empty() { p { "Nothing waits for you." } }
        @for (t, q) in waiting {
            section class="approval" data-task=(t.id) aria-label={ "task " (t.id) } {
                h2 { a href={ "/ui/runs/" (seg(&t.run_id)) "/tasks/" (seg(&t.id)) } { (t.id) } " of run " a href={ "/ui/runs/" (seg(&t.run_id)) } { (t.run_id) } }
                @if s.may(Role::Operator) { (decide(s, &t.run_id, &t.id, q.as_ref(), "/ui/approvals")) }
                @else if let Some(q) = q { p { "asks: " (asks(&q.request)) } }
            }
        }
    };
    layout("Approvals", Some(s), Some(("follow=true".into(), seq)), notice, body)
}

pub fn nodes(s: &Session, nodes: &[NodeRow], workers: &[pier_host::WorkerRow]) -> Markup {
    let body = html! {
        h1 { "Nodes" }
        @if nodes.is_empty() { p { "No node has registered: one " code { "pier serve" } " on SQLite drives every run itself." } }
        @else {
            table {
                thead { tr { th { "node" } th { "started" } th { "last heartbeat" } th { "runs it drives" } } }
                tbody {
                    @for n in nodes {
                        tr { td { (n.id) } td { (time(n.started_at_ms)) } td { (time(n.heartbeat_at_ms)) } td { (n.runs.join(", ")) } }
                    }
                }
            }
        }
        h2 { "Workers" }
        @if workers.is_empty() { p { "No pull worker has asked for work. Start one with " code { "pier worker --server URL" } "." } }
        @else {
            table class="workers" {
                thead { tr { th { "worker" } th { "capabilities" } th { "running" } th { "last seen" } } }
                tbody {
                    @for w in workers {
                        tr data-worker=(w.name) {
                            td { (w.name) }
                            td { (w.capabilities.join(", ")) }
                            td {
                                @if w.running.is_empty() { "—" }
                                @for (i, (run, task, n)) in w.running.iter().enumerate() {
                                    @if i > 0 { ", " }
                                    a href={ "/ui/runs/" (seg(run)) "/tasks/" (seg(task)) } { (task) } " (" (run) ", attempt " (n) ")"
                                }
                            }
                            td { (time(w.seen_at_ms)) }
                        }
                    }
                }
            }
        }
    };
    layout("Nodes", Some(s), None, None, body)
}
