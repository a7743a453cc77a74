//! The CLI as an operator meets it: runs listed, a reused run id refused, a typo'd run named,
//! approve and deny picking only their own kind of option, an interrupted run's exit code.

mod support;

use pier_fake_model::{FakeModel, Gate, Reply, Step};
use support::host::{Host, lines, stderr};
use support::{LIMIT, must};

#[tokio::test]
async fn runs_are_listed_and_a_run_id_names_one_plan() {
    let f = must(FakeModel::start().await, "fake");
    f.set_fallback(|_| Reply::text("ok"));
    let h = Host::new(Some(f.base_url()));
    let plan = h.write("plan.toml", "[[tasks]]\nid = \"a\"\nprompt = \"x\"\n\n[[tasks]]\nid = \"b\"\nprompt = \"y\"\n");
    let p = plan.to_str().unwrap_or_default();
    assert_eq!(h.run(&["run", p, "--run-id", "first"]).await.status.code(), Some(0));
    assert_eq!(h.run(&["run", p, "--run-id", "second"]).await.status.code(), Some(0));
    let listed = String::from_utf8_lossy(&h.run(&["runs"]).await.stdout).into_owned();
    let order: Vec<&str> = listed.lines().filter_map(|l| l.split_whitespace().next()).collect();
    assert_eq!(order, vec!["RUN", "second", "first"], "a header, then newest first: {listed}");
    assert!(listed.lines().next().is_some_and(|l| l.contains("STATE") && l.contains("CREATED") && l.contains("TOOK")));
    for l in listed.lines().skip(1) {
        assert!(l.contains("completed") && l.contains("2 tasks") && l.contains("2 completed"), "{listed}");
        assert!(l.contains(&pier_host::schedule::rfc3339(pier_host::store::now_ms())[..10]), "its date: {listed}");
    }
    let json = lines(&h.run(&["runs", "--format", "json"]).await);
    assert_eq!((json[0]["run"].as_str(), &json[0]["counts"]["completed"]), (Some("second"), &serde_json::json!(2)));
    assert!(json[0]["created_at_ms"].as_i64() <= json[0]["updated_at_ms"].as_i64(), "{:?}", json[0]);
    // Issue #34: filtered by state, limited, each saying what it left out.
    let one = h.run(&["runs", "--limit", "1"]).await;
    let shown = String::from_utf8_lossy(&one.stdout).into_owned();
    assert_eq!(shown.lines().count(), 2, "{shown}");
    assert!(stderr(&one).contains("1 older run(s) not shown"), "{}", stderr(&one));
    let failed = h.run(&["runs", "--state", "failed"]).await;
    assert!(failed.stdout.is_empty() && stderr(&failed).contains("no failed runs"), "{}", stderr(&failed));
    let bad = h.run(&["runs", "--state", "done"]).await;
    assert_eq!(bad.status.code(), Some(1));
    assert!(stderr(&bad).contains("running, waiting, completed, failed"), "{}", stderr(&bad));
    // Another plan under an existing id is refused, naming the run and what to do.
    let other = h.write("other.toml", "[[tasks]]\nid = \"c\"\nprompt = \"z\"\n");
    let o = h.run(&["run", other.to_str().unwrap_or_default(), "--run-id", "first"]).await;
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("run `first` already exists with another plan; resume it with `pier run --resume first`"),
        "{}",
        stderr(&o)
    );
    // The same plan under it joins the run (a second host driving it), with nothing left to do.
    assert_eq!(h.run(&["run", p, "--run-id", "first"]).await.status.code(), Some(0));
    // Events of a run that is not there: an error, not silence.
    let o = h.run(&["events", "--run", "frist"]).await;
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("there is no run `frist`"), "{}", stderr(&o));
}

#[tokio::test]
async fn an_interrupted_run_exits_130() {
    let f = must(FakeModel::start().await, "fake");
    let never = Gate::new();
    f.set_fallback(move |_| Reply::Stream(vec![Step::Gate(never.clone()), Step::Done]));
    let h = Host::new(Some(f.base_url()));
    let plan = h.write("plan.toml", "[[tasks]]\nid = \"a\"\nprompt = \"x\"\n");
    let child = must(h.command(&["run", plan.to_str().unwrap_or_default()]).spawn(), "pier run");
    must(tokio::time::timeout(support::LIMIT, f.wait_for_requests(1)).await, "the task runs");
    let pid = child.id().unwrap_or(0) as i32;
    must(nix_kill(pid), "SIGINT");
    let o = must(must(tokio::time::timeout(support::LIMIT, child.wait_with_output()).await, "ends"), "wait");
    assert_eq!(o.status.code(), Some(130), "{}", stderr(&o));
}

#[allow(unsafe_code)]
fn nix_kill(pid: i32) -> Result<(), String> {
    // SAFETY: kill(2) on a process this test started; no memory is touched.
    if unsafe { libc::kill(pid, libc::SIGINT) } == 0 { Ok(()) } else { Err("kill failed".into()) }
}

#[tokio::test]
async fn deny_help_speaks_of_reject_options_and_deny_never_picks_an_allow_one() {
    let h = Host::new(None);
    let help = String::from_utf8_lossy(&h.run(&["deny", "--help"]).await.stdout).into_owned();
    assert!(help.contains("reject_once") && help.contains("reject_always"), "{help}");
    // A task waiting on a permission (the SDK example agent asks before its edit).
    let agent = support::sdk_agent();
    let plan = h.write("plan.toml", &format!("[[tasks]]\nid = \"t\"\nagent = \"{agent}\"\nprompt = \"fix it\"\n"));
    let mut child = must(h.command(&["run", plan.to_str().unwrap_or_default(), "--run-id", "p"]).spawn(), "pier run");
    let until = std::time::Instant::now() + support::LIMIT;
    use pier_host::TaskStore;
    while h.store().open_question("p", "t").ok().flatten().is_none() {
        assert!(std::time::Instant::now() < until, "no question");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    // Everywhere it is shown, the task says what it is asked, the options, and the command.
    let shown = String::from_utf8_lossy(&h.run(&["show", "p"]).await.stdout).into_owned();
    let asked = shown.lines().find(|l| l.starts_with("? t asks permission: ")).unwrap_or_else(|| panic!("{shown}"));
    assert!(
        asked.contains("options allow, reject")
            && asked.contains("`pier approve --run p t [OPTION]` or `pier deny --run p t [OPTION]`"),
        "{asked}"
    );
    let events = String::from_utf8_lossy(&h.run(&["events", "--run", "p"]).await.stdout).into_owned();
    assert!(events.lines().any(|l| l.ends_with(asked.trim_start_matches("? t "))), "{events}");
    let o = h.run(&["deny", "t", "allow"]).await;
    assert_ne!(o.status.code(), Some(0));
    assert!(stderr(&o).contains("deny takes reject options"), "{}", stderr(&o));
    let o = h.run(&["deny", "t", "reject"]).await;
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let _ = must(tokio::time::timeout(support::LIMIT, child.wait()).await, "pier run ends");
}

#[tokio::test]
async fn demo_prints_every_json_rpc_line_both_ways_and_leaves_no_directory_behind() {
    let tmp = must(tempfile::tempdir(), "tmp");
    let dir = must(tempfile::tempdir(), "dir");
    std::fs::write(dir.path().join("README.md"), "# a readme\n").unwrap_or_default();
    let vars = vec![("TMPDIR".to_owned(), tmp.path().display().to_string())];
    let o = support::pier_command(dir.path(), &vars, &["demo"]).output();
    let o = must(must(tokio::time::timeout(support::LIMIT, o).await, "demo ends"), "demo");
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    let (mut sent, mut received) = (Vec::new(), Vec::new());
    for line in out.lines() {
        if let Some(frame) = line.strip_prefix("-> ") {
            sent.push(must(support::check_frame(frame), "a line the client wrote"));
        } else if let Some(frame) = line.strip_prefix("<- ") {
            received.push(must(support::check_frame(frame), "a line the agent wrote"));
        } else {
            assert!(line.starts_with("# "), "only frames and # remarks: {line}");
        }
    }
    let methods: Vec<&str> = sent.iter().filter_map(|f| f["method"].as_str()).collect();
    assert_eq!(methods, ["initialize", "session/new", "session/prompt", "session/prompt"], "{out}");
    assert!(received.iter().any(|f| f["params"]["update"]["sessionUpdate"] == "agent_message_chunk"), "{out}");
    let stops = received.iter().filter(|f| f["result"]["stopReason"] == "end_turn").count();
    assert_eq!(stops, 2, "{out}");
    let left: Vec<_> =
        must(std::fs::read_dir(tmp.path()), "tmp").filter_map(Result::ok).map(|e| e.file_name()).collect();
    assert!(left.is_empty(), "the demo left {left:?} in its temporary directory");
}

#[tokio::test]
async fn a_plan_task_s_idle_timeout_is_reset_by_the_answer_as_it_streams() {
    let f = must(FakeModel::start().await, "fake");
    // Longer than the task's timeout as a whole, but never silent for that long.
    f.set_fallback(|_| {
        let mut steps = Vec::new();
        for i in 0..6 {
            steps.push(Step::Text(format!("part{i} ")));
            steps.push(Step::Pause(std::time::Duration::from_millis(300)));
        }
        steps.extend([Step::Finish("stop".into()), Step::Done]);
        Reply::Stream(steps)
    });
    let h = Host::new(Some(f.base_url()));
    let plan =
        h.write("plan.toml", "[[tasks]]\nid = \"long\"\nprompt = \"write at length\"\ntimeout = 1\nmax_attempts = 1\n");
    let o = h.run(&["run", plan.to_str().unwrap_or_default(), "--run-id", "slow"]).await;
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let shown = lines(&h.run(&["show", "slow", "long", "--format", "json"]).await);
    assert_eq!(shown[0]["task"]["state"], "completed");
    assert_eq!(shown[0]["task"]["result"], "part0 part1 part2 part3 part4 part5 ", "{shown:?}");
}

#[tokio::test]
async fn a_failed_task_is_retried_with_the_tasks_cancelled_below_it() {
    let f = must(FakeModel::start().await, "fake");
    f.push(Reply::Stream(vec![Step::Finish("content_filter".into()), Step::Done]));
    f.set_fallback(|_| Reply::text("ok"));
    let h = Host::new(Some(f.base_url()));
    let plan = h.write(
        "plan.toml",
        "[[tasks]]\nid = \"a\"\nprompt = \"x\"\n\n[[tasks]]\nid = \"b\"\nprompt = \"y\"\ndepends_on = [\"a\"]\n",
    );
    let o = h.run(&["run", plan.to_str().unwrap_or_default(), "--run-id", "r"]).await;
    assert_eq!(o.status.code(), Some(1), "a refusal fails a; b is cancelled: {}", stderr(&o));
    // A task that did not fail cannot be retried; the message says which can.
    let o = h.run(&["retry", "r", "nope"]).await;
    assert!(stderr(&o).contains("unknown task"), "{}", stderr(&o));
    let o = h.run(&["retry", "r", "b"]).await;
    assert!(
        stderr(&o).contains("depends on `a`, which is failed; retry that with --with-dependents"),
        "{}",
        stderr(&o)
    );
    let o = h.run(&["retry", "r", "a", "--with-dependents"]).await;
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(out.contains("task a of run r: pending again (attempt 2 next)"), "{out}");
    assert!(out.contains("task b of run r: pending again (attempt 1 next)"), "{out}");
    assert!(out.contains("pier run --resume r"), "{out}");
    let o = h.run(&["run", "--resume", "r"]).await;
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    use pier_host::TaskStore;
    let tasks = must(h.store().tasks("r"), "tasks");
    let got: Vec<_> = tasks.iter().map(|t| (t.id.as_str(), t.state.as_str(), t.attempt)).collect();
    assert_eq!(got, [("a", "completed", 2), ("b", "completed", 1)]);
    let events = String::from_utf8_lossy(&h.run(&["events", "--run", "r"]).await.stdout).into_owned();
    assert!(events.lines().any(|l| l.contains("a: failed -> pending (a person retried it (cli:")), "{events}");
    // Filters return what they name (issue #34): a task, types, a time.
    let json = |args: &[&str]| {
        let mut all = vec!["events", "--run", "r", "--format", "json"];
        all.extend_from_slice(args);
        all.iter().map(|a| (*a).to_owned()).collect::<Vec<String>>()
    };
    let run = |args: Vec<String>| {
        let h = &h;
        async move {
            let refs: Vec<&str> = args.iter().map(String::as_str).collect();
            let o = h.run(&refs).await;
            assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .map(|l| must(serde_json::from_str::<serde_json::Value>(l), "json"))
                .collect::<Vec<_>>()
        }
    };
    let every = run(json(&[])).await;
    let of_b = run(json(&["--task", "b"])).await;
    assert!(!of_b.is_empty() && of_b.iter().all(|e| e["task"] == "b"), "{of_b:#?}");
    assert!(of_b.len() < every.len());
    let transitions = run(json(&["--type", "transition,run_created"])).await;
    assert!(transitions.iter().all(|e| e["type"] == "transition" || e["type"] == "run_created"), "{transitions:#?}");
    assert!(transitions.iter().any(|e| e["type"] == "run_created"));
    let both = run(json(&["--task", "a", "--type", "transition"])).await;
    assert!(!both.is_empty() && both.iter().all(|e| e["task"] == "a" && e["type"] == "transition"), "{both:#?}");
    assert_eq!(run(json(&["--since", "1h"])).await.len(), every.len(), "everything is from the last hour");
    assert!(run(json(&["--since", "2999-01-01T00:00:00Z"])).await.is_empty(), "nothing is from the future");
    let bad = h.run(&["events", "--since", "yesterday"]).await;
    assert!(stderr(&bad).contains("--since \"yesterday\" is neither a duration"), "{}", stderr(&bad));
    let o = h.run(&["retry", "r", "a"]).await;
    assert!(stderr(&o).contains("is completed; only a failed or cancelled task can be retried"), "{}", stderr(&o));
}

#[tokio::test]
async fn config_says_where_each_value_came_from_and_never_prints_a_secret() {
    let dir = must(tempfile::tempdir(), "dir");
    let user = dir.path().join(".config/pier");
    must(std::fs::create_dir_all(&user), "config dir");
    must(std::fs::write(user.join("config.toml"), "mode = \"auto\"\n[providers.ds]\nmodel = \"user-model\"\n"), "user");
    must(
        std::fs::write(
            dir.path().join("pier.toml"),
            "provider = \"ds\"\n[providers.ds]\nmodel = \"project-model\"\nbase_url = \"http://127.0.0.1:9/v1\"\n",
        ),
        "project",
    );
    let home = dir.path().display().to_string();
    let vars: Vec<(String, String)> = vec![
        ("HOME".into(), home.clone()),
        ("PIER_API_KEY".into(), "sk-very-secret".into()),
        ("PIER_STORE".into(), "postgres://pier:hunter2@127.0.0.1/db".into()),
    ];
    let run = |args: &'static [&'static str]| {
        let cmd = support::pier_command(dir.path(), &vars, args).output();
        async move { must(must(tokio::time::timeout(support::LIMIT, cmd).await, "in time"), "config") }
    };
    let o = run(&["config", "--provider", "ds"]).await;
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let text = String::from_utf8_lossy(&o.stdout).into_owned();
    let line = |key: &str| {
        text.lines()
            .find(|l| l.split(" = ").next().map(str::trim) == Some(key))
            .unwrap_or_else(|| panic!("no {key} in:\n{text}"))
            .to_owned()
    };
    let project = dir.path().join("pier.toml").display().to_string();
    let user_file = user.join("config.toml").display().to_string();
    assert!(line("provider").ends_with("= ds  # flag --provider"), "{text}");
    assert!(line("providers.ds.model").ends_with(&format!("= project-model  # {project}")), "{text}");
    assert!(line("mode").ends_with(&format!("= auto  # {user_file}")), "{text}");
    assert!(line("profile").ends_with("= automation  # default"), "{text}");
    assert!(line("api_key").ends_with("= (set)  # env PIER_API_KEY"), "{text}");
    assert!(line("store").contains("# env PIER_STORE"), "{text}");
    assert!(line("model (effective)").contains("project-model at http://127.0.0.1:9/v1"), "{text}");
    assert!(!text.contains("sk-very-secret") && !text.contains("hunter2"), "a secret was printed:\n{text}");
    let json: serde_json::Value =
        must(serde_json::from_slice(&run(&["config", "--format", "json"]).await.stdout), "json");
    assert_eq!(json["provider"], serde_json::json!({"value": "ds", "source": project}));
}

#[tokio::test]
async fn completions_are_generated_for_each_shell() {
    let dir = must(tempfile::tempdir(), "dir");
    for (shell, marker) in [
        ("bash", "_pier()"),
        ("zsh", "#compdef pier"),
        ("fish", "complete -c pier"),
        ("elvish", "pier"),
        ("powershell", "pier"),
    ] {
        let o = support::pier_command(dir.path(), &[], &["completions", shell]).output();
        let o = must(must(tokio::time::timeout(support::LIMIT, o).await, "in time"), "completions");
        assert_eq!(o.status.code(), Some(0), "{shell}");
        let text = String::from_utf8_lossy(&o.stdout);
        assert!(text.contains(marker) && text.contains("retry"), "{shell}: {text}");
    }
    let o = must(support::pier_command(dir.path(), &[], &["completions", "tcsh"]).output().await, "bad shell");
    assert_eq!(o.status.code(), Some(2));
}

/// Issue #34: `pier logs RUN TASK --follow` shows a task's agent as a terminal would — its
/// text, its tool call and how it ended, what it wrote to stderr (the host records it) — live,
/// and ends when the task ends; without --follow it prints what is there and ends.
#[tokio::test]
async fn pier_logs_follows_a_task_s_agent_with_its_stderr_and_ends_with_the_task() {
    use tokio::io::AsyncBufReadExt;
    let h = Host::new(None);
    let gate = h.path("gate");
    must(nix::unistd::mkfifo(&gate, nix::sys::stat::Mode::from_bits_truncate(0o600)), "fifo");
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/stderr_agent.py");
    h.write(
        "pier.toml",
        &format!(
            "[agents.noisy]\ncommand = \"python3\"\nargs = [\"{}\"]\nenv = {{ GATE = \"{}\" }}\n",
            script.display(),
            gate.display()
        ),
    );
    let plan =
        h.write("p.toml", "[[tasks]]\nid = \"build\"\nagent = \"noisy\"\nsandbox = \"off\"\nprompt = \"build it\"\n");
    let mut run = h.command(&["run", plan.to_str().unwrap_or_default(), "--run-id", "r", "--format", "json"]);
    let mut running = must(run.stdout(std::process::Stdio::piped()).spawn(), "pier run");
    // The run's own events say when the agent's stderr is in the log (it waits at the gate).
    let mut events = tokio::io::BufReader::new(running.stdout.take().unwrap_or_else(|| panic!("stdout"))).lines();
    loop {
        let line = must(tokio::time::timeout(LIMIT, events.next_line()).await, "an event in time");
        let line = must(line, "read").unwrap_or_else(|| panic!("pier run ended early"));
        if line.contains("\"agent_stderr\"") {
            break;
        }
    }
    tokio::spawn(async move { while let Ok(Some(_)) = events.next_line().await {} });
    // Followed while the agent waits at the gate: what it did so far shows, then the rest.
    let mut logs = h.command(&["logs", "r", "build", "--follow"]);
    let mut logs = must(logs.stdout(std::process::Stdio::piped()).spawn(), "pier logs");
    let stdout = logs.stdout.take().unwrap_or_else(|| panic!("stdout"));
    let mut lines = tokio::io::BufReader::new(stdout).lines();
    let mut seen = Vec::new();
    let wait_for = |seen: &Vec<String>, what: &str| seen.iter().any(|l| l.contains(what));
    // The whole lines the agent wrote before the gate, in whichever order its two pipes were
    // read (its text, "building", stays on an open line until something follows it).
    while !["stderr| compiling step 3/3", "▸ [execute] make"].iter().all(|w| wait_for(&seen, w)) {
        let line = must(tokio::time::timeout(LIMIT, lines.next_line()).await, "a line in time");
        seen.push(must(line, "read").unwrap_or_else(|| panic!("pier logs ended early: {seen:#?}")));
    }
    assert!(wait_for(&seen, "attempt 1: pending → running"), "{seen:#?}");
    // The go-ahead: the agent finishes, and `pier logs` ends with the task.
    must(std::fs::write(&gate, "go"), "open the gate");
    let rest = must(
        tokio::time::timeout(LIMIT, async {
            let mut rest = Vec::new();
            while let Ok(Some(line)) = lines.next_line().await {
                rest.push(line);
            }
            rest
        })
        .await,
        "pier logs ended with the task",
    );
    let status = must(must(tokio::time::timeout(LIMIT, logs.wait()).await, "exit"), "wait");
    assert!(status.success());
    seen.extend(rest);
    let text = seen.join("\n");
    for want in [
        "stderr| compiling step 1/3",
        "stderr| linked",
        "✓ completed: make",
        "building",
        " done",
        "running → completed",
    ] {
        assert!(text.contains(want), "{want} in:\n{text}");
    }
    let o = must(must(tokio::time::timeout(LIMIT, running.wait_with_output()).await, "run ended"), "run");
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    // Afterwards, without --follow: the same, and it ends at once.
    let o = h.run(&["logs", "r", "build"]).await;
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(String::from_utf8_lossy(&o.stdout).contains("stderr| linked"), "{}", String::from_utf8_lossy(&o.stdout));
    // `pier show` has the tool call in its turn, with how long it took.
    let o = h.run(&["show", "r", "build"]).await;
    let shown = String::from_utf8_lossy(&o.stdout).into_owned();
    let call = shown.lines().find(|l| l.trim_start().starts_with("✓ make (")).unwrap_or_default();
    assert!(call.ends_with(" s)"), "{shown}");
}
