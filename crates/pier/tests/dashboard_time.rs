//! Issue #34: time on the run page — a Gantt strip of the run's attempts that matches the
//! times the API gives, graph nodes that say their attempts and how long they ran, edges with
//! arrowheads, and a graph that zooms. In headless Chromium against a real `pier serve`.

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use pier_fake_model::{FakeModel, Reply, Step};
use reqwest::Method;
use serde_json::{Value, json};
use support::browser::{Browser, node_state};
use support::serve::{TOKEN, server};
use support::{LIMIT, echo, must};

#[tokio::test]
async fn the_timeline_matches_the_attempts_times_and_the_graph_says_them() {
    let f = must(FakeModel::start().await, "fake");
    let lints = Arc::new(AtomicUsize::new(0));
    let l = lints.clone();
    f.set_fallback(move |body| {
        let last = body["messages"].as_array().and_then(|m| m.iter().rev().find(|m| m["role"] == "user")).cloned();
        if last.is_some_and(|m| m["content"].to_string().contains("Lint")) && l.fetch_add(1, Ordering::SeqCst) == 0 {
            Reply::Stream(vec![Step::Finish("content_filter".into()), Step::Done])
        } else {
            echo(body)
        }
    });
    let s = server(Some(f.base_url())).await;
    let plan = "[[tasks]]\nid = \"fetch\"\nprompt = \"Fetch it\"\n\n\
                [[tasks]]\nid = \"lint\"\nprompt = \"Lint it\"\ndepends_on = [\"fetch\"]\n\n\
                [[tasks]]\nid = \"report\"\nprompt = \"Report\"\ndepends_on = [\"lint\"]\n";
    assert_eq!(s.call(Method::POST, "/runs", Some(json!({"plan": plan, "run_id": "timed"}))).await.0, 201);
    s.events_until(None, |e| e["task"] == "report" && e["to"] == "cancelled").await;
    let (code, v) = s.call(Method::POST, "/runs/timed/tasks/lint/retry", Some(json!({"with_dependents": true}))).await;
    assert_eq!(code, 200, "{v}");
    s.events_until(None, |e| e["task"] == "report" && e["to"] == "completed").await;
    let (_, run) = s.call(Method::GET, "/runs/timed", None).await;
    let api: Vec<(String, i64, i64, i64)> = run["tasks"]
        .as_array()
        .map(|tasks| {
            tasks
                .iter()
                .flat_map(|t| {
                    let id = t["id"].as_str().unwrap_or_default().to_owned();
                    t["times"].as_array().cloned().unwrap_or_default().into_iter().map(move |a| {
                        let n = |k: &str| a[k].as_i64().unwrap_or(-1);
                        (id.clone(), n("attempt"), n("started_at_ms"), n("ended_at_ms"))
                    })
                })
                .collect()
        })
        .unwrap_or_default();
    assert_eq!(api.iter().filter(|a| a.0 == "lint").count(), 2, "lint ran twice: {run}");
    assert_eq!(api.len(), 4, "{run}");

    let b = Browser::start("timeline").await;
    b.login(&s.base, Some("pat"), TOKEN).await;
    b.goto(&format!("{}/ui/runs/timed", s.base)).await;
    b.wait_for("report completed", &format!("{} === 'completed'", node_state("report")), LIMIT).await;

    // Each bar is one attempt, at the times the API gives, placed on the strip's axis.
    let bars = b
        .script(
            "const svg = document.querySelector('svg.gantt'); \
             return {start: Number(svg.dataset.startMs), span: Number(svg.dataset.spanMs), \
             bars: [...svg.querySelectorAll('rect.bar')].map(r => [r.dataset.for, Number(r.dataset.attempt), \
             Number(r.dataset.startMs), Number(r.dataset.endMs), Number(r.getAttribute('x')), Number(r.getAttribute('width')), \
             r.getAttribute('class')])}",
            vec![],
        )
        .await;
    let (start, span) = (bars["start"].as_i64().unwrap_or(-1), bars["span"].as_i64().unwrap_or(-1));
    let first = api.iter().map(|a| a.2).min().unwrap_or_default();
    let last = api.iter().map(|a| a.3).max().unwrap_or_default();
    assert_eq!((start, span), (first, last - first), "the axis spans the first start to the last end");
    let drawn: Vec<(String, i64, i64, i64)> = bars["bars"]
        .as_array()
        .map(|v| {
            v.iter()
                .map(|b| {
                    let n = |i: usize| b[i].as_f64().unwrap_or(-1.0) as i64;
                    (b[0].as_str().unwrap_or_default().to_owned(), n(1), n(2), n(3))
                })
                .collect()
        })
        .unwrap_or_default();
    let mut want = api.clone();
    want.sort();
    let mut got = drawn.clone();
    got.sort();
    assert_eq!(got, want, "a bar per attempt, with its times");
    for bar in bars["bars"].as_array().cloned().unwrap_or_default() {
        let (from, to) = (bar[2].as_f64().unwrap_or(0.0), bar[3].as_f64().unwrap_or(0.0));
        let x = 160.0 + (from - start as f64) * 800.0 / span as f64;
        let w = ((to - from) * 800.0 / span as f64).max(1.0);
        let (gx, gw) = (bar[4].as_f64().unwrap_or(-1.0), bar[5].as_f64().unwrap_or(-1.0));
        assert!((gx - x).abs() < 0.01 && (gw - w).abs() < 0.01, "{bar}: x {x:.2}, width {w:.2}");
    }
    let classes: Vec<Value> =
        bars["bars"].as_array().map(|v| v.iter().map(|b| b[6].clone()).collect()).unwrap_or_default();
    assert!(classes.contains(&json!("bar state-failed")) && classes.contains(&json!("bar state-completed")));

    // The task table says how long each task's attempts ran, together.
    let ran = b.script("return document.querySelector('tr[data-task=\"lint\"] td.ran').textContent", vec![]).await;
    assert!(ran.as_str().is_some_and(|r| r.ends_with(" s") && r != "—"), "{ran}");

    // The graph's nodes say their attempts and time; every edge ends in an arrowhead.
    let meta =
        b.script("return document.querySelector('svg.graph [data-task=\"lint\"] text.meta').textContent", vec![]).await;
    assert!(meta.as_str().is_some_and(|m| m.starts_with("2 attempts · ") && m.ends_with(" s")), "{meta}");
    let edges = b
        .script(
            "return [...document.querySelectorAll('svg.graph line')].map(l => l.getAttribute('marker-end'))",
            vec![],
        )
        .await;
    assert_eq!(edges, json!(["url(#arrow)", "url(#arrow)"]));

    // The event rail shows an answer's deltas as one line per message, not a line per delta.
    b.wait_for(
        "the merged rail",
        "[...document.querySelectorAll('#events li')].some(li => /^\\d+–\\d+ · fetch · agent_message_chunk ×\\d+$/.test(li.textContent))",
        LIMIT,
    )
    .await;
    let singles = b
        .script(
            "return [...document.querySelectorAll('#events li')].filter(li => li.textContent.includes('agent_message_chunk') \
             && !li.textContent.includes('×')).length",
            vec![],
        )
        .await;
    assert_eq!(singles, json!(0), "every message of several deltas is one line");

    // The graph zooms in, and fits its box.
    let width = "return Number(document.querySelector('svg.graph').getAttribute('width'))";
    let natural = b.script(width, vec![]).await.as_f64().unwrap_or_default();
    b.click(&b.find("[data-zoom=\"in\"]").await.unwrap_or_else(|| panic!("no zoom"))).await;
    let zoomed = b.script(width, vec![]).await.as_f64().unwrap_or_default();
    assert_eq!(zoomed, (natural * 1.25).round(), "zoomed in by a quarter");
    b.set_window_size(390, 900).await;
    b.click(&b.find("[data-zoom=\"fit\"]").await.unwrap_or_else(|| panic!("no fit"))).await;
    let fits = b
        .script(
            "const s = document.querySelector('svg.graph'); \
             return s.getBoundingClientRect().width <= s.closest('.graph-box').clientWidth + 1",
            vec![],
        )
        .await;
    assert_eq!(fits, json!(true), "fit: the graph within its box at a phone's width");
    b.keep_screenshot("run-390-fit").await;
}

/// Issue #34: a running task's page says who holds its attempt, when it last did something and
/// the last lines its agent wrote to stderr (the host records them); its tool calls say when
/// they started and, once ended, how long they took.
#[tokio::test]
async fn a_running_task_s_page_shows_its_liveness_and_stderr_tail() {
    let dir = must(tempfile::tempdir(), "dir");
    let gate = dir.path().join("gate");
    must(nix::unistd::mkfifo(&gate, nix::sys::stat::Mode::from_bits_truncate(0o600)), "fifo");
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/stderr_agent.py");
    let toml = format!(
        "[agents.noisy]\ncommand = \"python3\"\nargs = [\"{}\"]\nenv = {{ GATE = \"{}\" }}\n",
        script.display(),
        gate.display()
    );
    let (s, _) = support::serve::server_in(dir, None, &[], Some(&toml)).await;
    let plan = "[[tasks]]\nid = \"build\"\nagent = \"noisy\"\nsandbox = \"off\"\nprompt = \"build it\"\n";
    assert_eq!(s.call(Method::POST, "/runs", Some(json!({"plan": plan, "run_id": "noisy"}))).await.0, 201);
    s.events_until(None, |e| e["type"] == "agent_stderr" && e.to_string().contains("compiling step 3/3")).await;

    let b = Browser::start("liveness").await;
    b.login(&s.base, Some("pat"), TOKEN).await;
    b.goto(&format!("{}/ui/runs/noisy/tasks/build", s.base)).await;
    let live = b.text(&b.find("section.live").await.unwrap_or_else(|| panic!("no liveness section"))).await;
    assert!(live.contains("attempt 1, held by") && live.contains("lease renewed") && live.contains("ago"), "{live}");
    let tail = b.text(&b.find("pre.stderr-tail").await.unwrap_or_else(|| panic!("no stderr tail"))).await;
    assert_eq!(tail.trim(), "compiling step 1/3\ncompiling step 2/3\ncompiling step 3/3");
    let when = b.text(&b.find(".tool[data-tool=\"m1\"] .when").await.unwrap_or_else(|| panic!("no time"))).await;
    assert!(!when.contains("took"), "still on: {when}");

    must(std::fs::write(&gate, "go"), "open the gate");
    s.events_until(None, |e| e["task"] == "build" && e["to"] == "completed").await;
    b.goto(&format!("{}/ui/runs/noisy/tasks/build", s.base)).await;
    assert!(b.find("section.live").await.is_none(), "an ended task is not live");
    // The API has the same turn and tool call times, and `pier show --server` prints them.
    let (_, plain) = s.call(Method::GET, "/runs/noisy/tasks/build", None).await;
    assert!(plain.get("turns").is_none(), "turns only when asked: {plain}");
    let (_, t) = s.call(Method::GET, "/runs/noisy/tasks/build?turns=true", None).await;
    let call = &t["turns"][0]["tool_calls"][0];
    assert_eq!((call["title"].as_str(), call["status"].as_str()), (Some("make"), Some("completed")), "{t}");
    assert!(call["ended_at_ms"].as_i64() >= call["started_at_ms"].as_i64() && call["started_at_ms"].as_i64() > Some(0));
    assert_eq!(t["turns"][0]["said"], "building done", "{t}");
    let o = support::serve::cli(&s, &["show", "noisy", "build"]).await;
    let shown = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(shown.contains("  turn 1, the task's prompt\n    ✓ make ("), "{shown}");
    // `pier logs` from the server: an ended task's whole log, even with --follow, at once.
    let o = support::serve::cli(&s, &["logs", "noisy", "build", "--follow"]).await;
    let logs = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(o.status.success() && logs.contains("stderr| linked") && logs.contains("✓ completed: make"), "{logs}");
    let o = support::serve::cli(&s, &["logs", "noisy", "nope", "--follow"]).await;
    assert!(!o.status.success(), "an unknown task is refused, not followed");
    assert!(String::from_utf8_lossy(&o.stderr).contains("nope"), "{}", String::from_utf8_lossy(&o.stderr));
    let when = b.text(&b.find(".tool[data-tool=\"m1\"] .when").await.unwrap_or_else(|| panic!("no time"))).await;
    assert!(when.contains(", took ") && when.ends_with(" s"), "{when}");
    // Every line, in the attempt's transcript where it came.
    let lines = b
        .script(
            "return [...document.querySelectorAll('details.stderr pre')].map(p => p.textContent.trim()).join('\\n')",
            vec![],
        )
        .await;
    assert_eq!(lines, json!("compiling step 1/3\ncompiling step 2/3\ncompiling step 3/3\nlinked"));
}

/// Issue #34: the graph's edges end in arrowheads and pass through no node, also an edge that
/// skips a layer (it goes down the gutter between columns).
#[tokio::test]
async fn no_edge_of_the_graph_crosses_a_node() {
    let s = server(None).await;
    // d depends on a (two layers up) and on b and c (one up); e on a and d.
    let plan = "[[tasks]]\nid = \"a\"\nagent = \"worker:x\"\nprompt = \"p\"\n\n\
                [[tasks]]\nid = \"b\"\nagent = \"worker:x\"\nprompt = \"p\"\ndepends_on = [\"a\"]\n\n\
                [[tasks]]\nid = \"c\"\nagent = \"worker:x\"\nprompt = \"p\"\ndepends_on = [\"a\"]\n\n\
                [[tasks]]\nid = \"d\"\nagent = \"worker:x\"\nprompt = \"p\"\ndepends_on = [\"a\", \"b\", \"c\"]\n\n\
                [[tasks]]\nid = \"e\"\nagent = \"worker:x\"\nprompt = \"p\"\ndepends_on = [\"a\", \"d\"]\n";
    assert_eq!(s.call(Method::POST, "/runs", Some(json!({"plan": plan, "run_id": "edges"}))).await.0, 201);
    let b = Browser::start("edges").await;
    b.login(&s.base, Some("pat"), TOKEN).await;
    b.goto(&format!("{}/ui/runs/edges", s.base)).await;
    // Every edge sampled along its segments: no point inside a node it does not join.
    let crossings = b
        .script(
            "const nodes = [...document.querySelectorAll('svg.graph g.node')].map(g => { \
               const m = g.transform.baseVal[0].matrix, r = g.querySelector('rect'); \
               return {id: g.dataset.task, x: m.e, y: m.f, w: r.width.baseVal.value, h: r.height.baseVal.value}; }); \
             const bad = []; \
             for (const e of document.querySelectorAll('svg.graph .edges > *')) { \
               const pts = e.tagName === 'line' \
                 ? [[e.x1.baseVal.value, e.y1.baseVal.value], [e.x2.baseVal.value, e.y2.baseVal.value]] \
                 : [...e.points].map(p => [p.x, p.y]); \
               if (e.getAttribute('marker-end') !== 'url(#arrow)') bad.push('no arrow ' + e.dataset.from + '->' + e.dataset.to); \
               for (let i = 1; i < pts.length; i++) for (let k = 0; k <= 50; k++) { \
                 const x = pts[i-1][0] + (pts[i][0] - pts[i-1][0]) * k / 50, y = pts[i-1][1] + (pts[i][1] - pts[i-1][1]) * k / 50; \
                 for (const n of nodes) if (n.id !== e.dataset.from && n.id !== e.dataset.to \
                   && x > n.x + 1 && x < n.x + n.w - 1 && y > n.y + 1 && y < n.y + n.h - 1) bad.push(e.dataset.from + '->' + e.dataset.to + ' through ' + n.id); } } \
             return {edges: document.querySelectorAll('svg.graph .edges > *').length, skips: document.querySelectorAll('svg.graph polyline').length, bad: [...new Set(bad)]}",
            vec![],
        )
        .await;
    assert_eq!(crossings, json!({"edges": 7, "skips": 2, "bad": []}), "a→d and a→e skip layers");
}
