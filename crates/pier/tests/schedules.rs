//! Issue #32's schedules end to end: declared in pier.toml and over the API, each occurrence
//! run once under an id derived from its time, paused, resumed and deleted from the CLI,
//! refused whole when wrong, and the misfire policy applied by a node that was down.

mod support;

use pier_fake_model::FakeModel;
use pier_host::schedule::{ScheduleSpec, run_id};
use pier_host::store::{SqliteStore, TaskStore};
use serde_json::{Value, json};
use support::serve::{Server, cli, server_configured, server_in};
use support::{echo, must};

const TYPES: &str = r#"
[types.greet]
prompt = "Say hello to {{input.who}}."
input = { type = "object", required = ["who"], properties = { who = { type = "string" } } }
"#;

fn text(o: &std::process::Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

/// The occurrence time (ms) of a run id `ID-YYYYMMDDTHHMMSSZ`.
fn occurrence(id: &str, run: &str) -> Option<i64> {
    let stamp = run.strip_prefix(id)?.strip_prefix('-')?.strip_suffix('Z')?;
    let t = jiff::fmt::strtime::parse("%Y%m%dT%H%M%S", stamp).ok()?.to_datetime().ok()?;
    Some(t.to_zoned(jiff::tz::TimeZone::UTC).ok()?.timestamp().as_millisecond())
}

/// The runs of schedule `id` on the server, by occurrence time.
async fn runs_of(s: &Server, id: &str) -> Vec<(i64, String)> {
    let (_, runs) = s.call(reqwest::Method::GET, "/runs", None).await;
    let mut out: Vec<(i64, String)> = runs["runs"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|r| r["run"].as_str())
        .filter_map(|r| Some((occurrence(id, r)?, r.to_owned())))
        .collect();
    out.sort();
    out
}

/// Waits (on the event log) until `n` runs of schedule `id` have been created.
async fn until_runs(s: &Server, id: &str, n: usize) {
    let prefix = format!("{id}-");
    let mut seen = std::collections::HashSet::new();
    s.events_until(Some(0), |e| {
        if e["type"] == "run_created" && e["run"].as_str().is_some_and(|r| r.starts_with(&prefix)) {
            seen.insert(e["run"].as_str().unwrap_or_default().to_owned());
        }
        seen.len() >= n
    })
    .await;
}

async fn schedule(s: &Server, id: &str) -> (u16, Value) {
    s.call(reqwest::Method::GET, &format!("/schedules/{id}"), None).await
}

#[tokio::test]
async fn a_pier_toml_schedule_runs_each_occurrence_once_and_is_paused_resumed_and_deleted() {
    let f = must(FakeModel::start().await, "fake");
    f.set_fallback(echo);
    let toml = format!(
        "{TYPES}\n[[schedules]]\nid = \"tick\"\nevery = \"1s\"\ntype = \"greet\"\ninput = {{ who = \"clock\" }}\n\
         overlap = \"allow\"\n"
    );
    let (s, _) = server_configured(Some(f.base_url()), &[], Some(&toml)).await;
    until_runs(&s, "tick", 3).await;
    let runs = runs_of(&s, "tick").await;
    let times: Vec<i64> = runs.iter().map(|(t, _)| *t).collect();
    assert!(times.windows(2).all(|w| w[1] - w[0] == 1000), "one run a second, none twice, none missed: {runs:?}");
    let (_, v) = schedule(&s, "tick").await;
    let last = runs.last().map(|(_, r)| r.clone()).unwrap_or_default();
    assert!(v["schedule"]["next_at_ms"].as_i64() > v["schedule"]["last_at_ms"].as_i64(), "{v}");
    assert_eq!(v["schedule"]["source"], "pier.toml", "{v}");
    // Issue #34: `GET /runs` lists newest first, limited, saying how many more there are.
    let (_, listed) = s.call(reqwest::Method::GET, "/runs?limit=2&state=completed", None).await;
    let ids: Vec<&str> = listed["runs"].as_array().into_iter().flatten().filter_map(|r| r["run"].as_str()).collect();
    assert!(ids.len() <= 2 && ids.windows(2).all(|w| w[0] > w[1]), "newest first: {listed}");
    let (code, v) = s.call(reqwest::Method::GET, "/runs?state=done", None).await;
    assert_eq!((code, &v["error"]["code"]), (400, &json!("bad_request")), "{v}");
    let (_, run) = s.call(reqwest::Method::GET, &format!("/runs/{}", runs[0].1), None).await;
    assert_eq!(run["tasks"][0]["spec"]["prompt"], "Say hello to clock.", "{run}");

    let listed = text(&cli(&s, &["schedules"]).await);
    for part in ["ID", "NEXT", "tick", "every 1s", "type greet", "on"] {
        assert!(listed.contains(part), "`{part}` in:\n{listed}");
    }
    assert!(listed.contains(&last) || listed.contains("tick-"), "{listed}");

    // Paused: no occurrence runs (each is fenced on the pause in the store) until resumed,
    // and what came due meanwhile is not run afterwards.
    let o = cli(&s, &["schedules", "pause", "tick"]).await;
    assert!(o.status.success() && text(&o).contains("paused by http"), "{}", text(&o));
    let paused_at = pier_host::store::now_ms();
    let before = runs_of(&s, "tick").await.len();
    // Time must pass for an occurrence to be missed: three of them.
    tokio::time::sleep(std::time::Duration::from_millis(3_200)).await;
    assert_eq!(runs_of(&s, "tick").await.len(), before, "a paused schedule ran");
    let resumed_at = pier_host::store::now_ms();
    let o = cli(&s, &["schedules", "resume", "tick"]).await;
    assert!(o.status.success(), "{}", text(&o));
    until_runs(&s, "tick", before + 1).await;
    let during: Vec<_> =
        runs_of(&s, "tick").await.into_iter().filter(|(t, _)| *t > paused_at + 1000 && *t <= resumed_at).collect();
    assert!(during.is_empty(), "occurrences of the pause ran after it: {during:?}");

    let o = cli(&s, &["schedules", "delete", "tick"]).await;
    assert!(o.status.success(), "{}", text(&o));
    let (code, v) = schedule(&s, "tick").await;
    assert_eq!((code, &v["error"]["code"]), (404, &json!("unknown_schedule")), "{v}");
    assert!(runs_of(&s, "tick").await.len() > before, "its runs stay");
}

#[tokio::test]
async fn schedules_over_the_api_are_checked_whole_and_a_taken_id_is_refused() {
    let (s, _) = server_configured(None, &[], Some(TYPES)).await;
    let bad = json!({"id": "bad id", "cron": "61 * * * *", "timezone": "Mars/Base", "type": "greet",
                     "input": {"who": 3}});
    let (code, v) = s.call(reqwest::Method::POST, "/schedules", Some(bad)).await;
    assert_eq!(code, 400, "{v}");
    let said = v.to_string();
    for part in ["schedule id", "not a cron expression"] {
        assert!(said.contains(part), "`{part}` in {said}");
    }
    let (code, v) = s
        .call(
            reqwest::Method::POST,
            "/schedules",
            Some(json!({"id": "x", "every": "1h", "type": "greet", "input": {}})),
        )
        .await;
    assert_eq!(code, 400, "the input is checked against the type's schema: {v}");
    assert!(v.to_string().contains("who"), "{v}");
    let (code, v) =
        s.call(reqwest::Method::POST, "/schedules", Some(json!({"id": "x", "every": "1h", "plan": "[[tasks]]"}))).await;
    assert_eq!(code, 400, "the plan is checked: {v}");
    let (code, v) = s.call(reqwest::Method::POST, "/schedules", Some(json!({"id": "x", "evry": "1h"}))).await;
    assert_eq!(code, 400, "an unknown field: {v}");
    assert!(v.to_string().contains("evry"), "{v}");
    let (_, v) = s.call(reqwest::Method::GET, "/schedules", None).await;
    assert_eq!(v["schedules"], json!([]), "nothing was stored: {v}");

    let good = json!({"id": "yearly", "cron": "0 9 1 1 *", "timezone": "Europe/Paris", "type": "greet",
                      "input": {"who": "new year"}});
    let (code, v) = s.call(reqwest::Method::POST, "/schedules", Some(good.clone())).await;
    assert_eq!(code, 201, "{v}");
    let next = v["schedule"]["next_at"].as_str().unwrap_or_default().to_owned();
    assert!(next.ends_with("-01-01T08:00:00Z"), "09:00 in Paris in winter is 08:00 UTC: {next}");
    let (code, _) = s.call(reqwest::Method::POST, "/schedules", Some(good)).await;
    assert_eq!(code, 200, "the same schedule again changes nothing");
    let other = json!({"id": "yearly", "every": "1d", "type": "greet", "input": {"who": "x"}});
    let (code, v) = s.call(reqwest::Method::POST, "/schedules", Some(other)).await;
    assert_eq!((code, &v["error"]["code"]), (409, &json!("schedule_exists")), "{v}");
    let (code, v) = s.call(reqwest::Method::POST, "/schedules/nope/pause", Some(json!({}))).await;
    assert_eq!((code, &v["error"]["code"]), (404, &json!("unknown_schedule")), "{v}");
}

/// `pier serve` in `dir`, which must stop at start: its output.
async fn refused_start(dir: &std::path::Path) -> std::process::Output {
    let o = tokio::process::Command::new(env!("CARGO_BIN_EXE_pier"))
        .args(["serve", "--listen", "127.0.0.1:0", "--token", support::serve::TOKEN])
        .current_dir(dir)
        .env("HOME", dir)
        .env("PIER_HOME", dir.join("data"))
        .stdin(std::process::Stdio::null())
        .output();
    must(must(tokio::time::timeout(support::LIMIT, o).await, "serve in time"), "serve")
}

#[tokio::test]
async fn a_bad_schedule_in_pier_toml_stops_the_start_naming_it() {
    let dir = must(tempfile::tempdir(), "dir");
    let toml = format!("{TYPES}\n[[schedules]]\nid = \"n\"\ncron = \"* * *\"\nplan = \"missing.toml\"\n");
    must(std::fs::write(dir.path().join("pier.toml"), toml), "toml");
    let o = refused_start(dir.path()).await;
    assert_ne!(o.status.code(), Some(0));
    let said = String::from_utf8_lossy(&o.stderr);
    assert!(said.contains("schedule `n`") && said.contains("missing.toml"), "{said}");
    must(std::fs::write(dir.path().join("missing.toml"), "[[tasks]]\nid = \"a\"\nprompt = \"p\"\n"), "plan");
    let o = refused_start(dir.path()).await;
    let said = String::from_utf8_lossy(&o.stderr);
    assert!(said.contains("not a cron expression"), "{said}");
}

/// A store whose schedule `id` (every hour, grace 1 s, `misfire`) waits on an occurrence three
/// hours old, as if every node had been down since: the node that starts applies the policy.
async fn down_for_three_hours(misfire: &str) -> (Server, i64) {
    let dir = must(tempfile::tempdir(), "dir");
    must(std::fs::create_dir_all(dir.path().join("data")), "data");
    let spec = json!({"id": "hourly", "every": "1h", "grace": "1s", "misfire": misfire,
                      "plan": "[[tasks]]\nid = \"a\"\nprompt = \"hello\"\n"});
    let spec = must(ScheduleSpec::from_value(spec).map_err(|e| e.join("; ")), "spec");
    const H: i64 = 3_600_000;
    let now = pier_host::store::now_ms();
    let stale = now.div_euclid(H) * H - 3 * H;
    {
        let store = must(SqliteStore::open(&dir.path().join("data/pier.db")), "store");
        must(store.put_schedule(&spec, "test", Some(stale), false), "put");
    }
    let f = must(FakeModel::start().await, "fake");
    f.set_fallback(echo);
    let (s, _) = server_in(dir, Some(f.base_url()), &[], None).await;
    std::mem::forget(f);
    (s, stale)
}

#[tokio::test]
async fn a_node_back_from_down_runs_the_latest_missed_occurrence_once_under_run_once() {
    let (s, stale) = down_for_three_hours("run_once").await;
    until_runs(&s, "hourly", 1).await;
    let runs = runs_of(&s, "hourly").await;
    assert_eq!(runs.len(), 1, "one run for every missed occurrence: {runs:?}");
    let (at, run) = &runs[0];
    assert!(*at >= stale + 2 * 3_600_000, "the latest missed occurrence ran: {run}");
    assert_eq!(run, &run_id("hourly", *at));
    let (_, v) = schedule(&s, "hourly").await;
    let note = v["schedule"]["last_note"].as_str().unwrap_or_default();
    assert!(note.contains(&format!("ran {run}")) && note.contains("misfire = run_once"), "{note}");
    assert_eq!(v["schedule"]["next_at_ms"].as_i64(), Some(at + 3_600_000), "{v}");
}

#[tokio::test]
async fn a_node_back_from_down_drops_every_missed_occurrence_under_skip() {
    let (s, stale) = down_for_three_hours("skip").await;
    // The skip is a commit of the schedule alone: wait for it on the schedule itself.
    let deadline = tokio::time::Instant::now() + support::LIMIT;
    let v = loop {
        let (_, v) = schedule(&s, "hourly").await;
        if v["schedule"]["next_at_ms"].as_i64() != Some(stale) {
            break v;
        }
        assert!(tokio::time::Instant::now() < deadline, "the node never handled the missed occurrences: {v}");
        tokio::task::yield_now().await;
    };
    let note = v["schedule"]["last_note"].as_str().unwrap_or_default();
    assert!(note.contains("missed") && note.contains("misfire = skip"), "{note}");
    assert!(v["schedule"]["next_at_ms"].as_i64() > Some(pier_host::store::now_ms() - 1_000), "{v}");
    assert!(runs_of(&s, "hourly").await.is_empty(), "a missed occurrence ran");
}

/// A pier.toml schedule's plan uses the types of the `types.toml` beside it, as `pier run` and
/// `pier submit` do.
#[tokio::test]
async fn a_scheduled_plan_uses_the_types_beside_it() {
    let dir = must(tempfile::tempdir(), "dir");
    must(std::fs::create_dir_all(dir.path().join("plans")), "plans");
    let types = "[types.note]\nprompt = \"Write {{input.what}}.\"\ninput = { type = \"object\" }\n";
    must(std::fs::write(dir.path().join("plans/types.toml"), types), "types");
    let plan = "[[tasks]]\nid = \"a\"\ntype = \"note\"\ninput = { what = \"docs\" }\n";
    must(std::fs::write(dir.path().join("plans/nightly.toml"), plan), "plan");
    let toml = "[[schedules]]\nid = \"nightly\"\ncron = \"0 3 * * *\"\nplan = \"plans/nightly.toml\"\n";
    let (s, _) = server_in(dir, None, &[], Some(toml)).await;
    let (code, v) = schedule(&s, "nightly").await;
    assert_eq!(code, 200, "{v}");
    assert_eq!(v["schedule"]["spec"]["plan_file"], "plans/nightly.toml", "{v}");
    assert!(v["schedule"]["spec"]["types"].as_str().is_some_and(|t| t.contains("[types.note]")), "{v}");
}
