//! The model gateway under a host (issue #30): agents' model traffic goes through pier's
//! gateway with a placeholder key, the real key is swapped in on the way out, every request is
//! recorded with the upstream's own token counts and priced from pier.toml, and no agent
//! process can find a real key.

mod support;

use std::path::Path;

use pier_fake_model::{FakeModel, Reply, Step};
use serde_json::Value;
use support::host::{Host, lines, stderr};
use support::must;

fn fixture(name: &str) -> String {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name).display().to_string()
}

fn json_of(o: &std::process::Output) -> Value {
    serde_json::from_slice(&o.stdout)
        .unwrap_or_else(|e| panic!("not JSON ({e}): {}\n{}", String::from_utf8_lossy(&o.stdout), stderr(o)))
}

const REAL: &str = "sk-real-pier-key-0123456789";

#[tokio::test]
async fn pier_s_own_agent_is_billed_from_the_upstream_s_usage_and_never_holds_the_key() {
    let f = must(FakeModel::start().await, "fake");
    f.set_fallback(|_| {
        Reply::Stream(vec![
            Step::Text("Counted.".into()),
            Step::Finish("stop".into()),
            Step::Usage { prompt: 1_000_000, completion: 500_000 },
            Step::Done,
        ])
    });
    let mut h = Host::new(Some(f.base_url()));
    h.vars.push(("PIER_API_KEY".into(), REAL.into()));
    h.write("pier.toml", "[prices.\"fake-model\"]\ninput = 1.0\ncached_input = 0.5\noutput = 2.0\n");
    let plan = h.write(
        "plan.toml",
        "[defaults]\nagent = \"pier\"\nmax_attempts = 1\n\n[[tasks]]\nid = \"a\"\nprompt = \"one\"\n\n\
         [[tasks]]\nid = \"b\"\nprompt = \"two\"\n",
    );
    let o = h.run(&["run", plan.to_str().unwrap_or_default(), "--format", "json", "--run-id", "billed"]).await;
    assert!(o.status.success(), "{}", stderr(&o));
    let conversation: Vec<_> = f.requests().into_iter().filter(|r| !r.auxiliary).collect();
    assert_eq!(conversation.len(), 2, "{conversation:?}");
    for r in &conversation {
        assert_eq!(r.api_key.as_deref(), Some(REAL), "the gateway swapped the real key in: {r:?}");
    }
    for task in ["a", "b"] {
        let shown = json_of(&h.run(&["show", "billed", task, "--format", "json"]).await);
        let spend = &shown["spend"];
        assert_eq!(spend["requests"], 1, "{task}: {spend}");
        assert_eq!(spend["tokens"]["input"], 1_000_000, "{task}: {spend}");
        assert_eq!(spend["tokens"]["output"], 500_000, "{task}: {spend}");
        // 1,000,000 in at 1.0 and 500,000 out at 2.0 per million.
        assert_eq!(spend["cost"].as_f64(), Some(2.0), "{task}: {spend}");
        assert_eq!(spend["by_model"]["fake-model"]["requests"], 1, "{spend}");
        assert_eq!(spend["by_agent"]["pier"]["requests"], 1, "{spend}");
        assert_eq!(spend["by_attempt"]["1"]["requests"], 1, "{spend}");
        assert_eq!(spend["by_node"].as_object().map(|n| n.len()), Some(1), "{spend}");
        let text = String::from_utf8_lossy(&h.run(&["show", "billed", task]).await.stdout).into_owned();
        assert!(text.contains("spend: 1,500,000 tokens (in 1,000,000"), "{text}");
        assert!(text.contains("cost 2.0000"), "{text}");
    }
    let run = json_of(&h.run(&["show", "billed", "--format", "json"]).await);
    assert_eq!(run["spend"]["tokens"]["input"], 2_000_000, "{run}");
    assert_eq!(run["spend"]["cost"].as_f64(), Some(4.0), "{run}");
    assert_eq!(run["tasks"][0]["spend"]["requests"], 1, "{run}");
    let runs = h.run(&["runs", "--format", "json"]).await;
    let listed = lines(&runs);
    assert_eq!(listed.len(), 1, "{}", String::from_utf8_lossy(&runs.stdout));
    assert_eq!(listed[0]["spend"]["cost"].as_f64(), Some(4.0), "{:?}", listed[0]);
    let runs = String::from_utf8_lossy(&h.run(&["runs"]).await.stdout).into_owned();
    assert!(runs.contains("3000000 tokens, cost 4.0000"), "{runs}");
}

/// A hostile agent searches its environment, arguments and files for the keys pier's
/// environment and its definition hold: with the gateway, whether jailed or not, it finds none;
/// with `gateway = false` it finds them (so the test can fail).
#[tokio::test]
async fn no_agent_process_finds_a_real_key_and_a_task_without_gateway_traffic_shows_spend_unknown() {
    let keys = ["sk-real-openai-111", "sk-ant-real-222", "g-real-333", REAL, "sk-named-444"];
    for (gateway, sandbox, found) in [(true, "strict", false), (true, "off", false), (false, "off", true)] {
        let mut h = Host::new(None);
        for (var, key) in [
            ("OPENAI_API_KEY", keys[0]),
            ("ANTHROPIC_API_KEY", keys[1]),
            ("GEMINI_API_KEY", keys[2]),
            ("PIER_API_KEY", keys[3]),
        ] {
            h.vars.push((var.into(), key.into()));
        }
        h.vars.push(("DEEPSEEK_KEY".into(), keys[4].into()));
        h.write(
            "pier.toml",
            &format!(
                "gateway = {gateway}\n[providers.deepseek]\napi_key_env = \"DEEPSEEK_KEY\"\n\n\
                 [agents.hostile]\ncommand = \"python3\"\nargs = [{:?}]\nenv = {{ ANTHROPIC_API_KEY = {:?} }}\n",
                fixture("hostile_agent.py"),
                keys[1]
            ),
        );
        must(std::fs::create_dir_all(h.path("work")), "work");
        // Jailed behind the gateway, the providers themselves are out of reach: only the gateway is.
        let mut prompt = serde_json::json!({ "keys": keys });
        if sandbox == "strict" {
            prompt["blocked"] = "api.openai.com:443".into();
        }
        let prompt = prompt.to_string();
        let plan = h.write(
            "plan.toml",
            &format!(
                "[[tasks]]\nid = \"search\"\nagent = \"hostile\"\nsandbox = \"{sandbox}\"\ncwd = \"work\"\nmax_attempts = 1\nprompt = '''{prompt}'''\n"
            ),
        );
        let o = h.run(&["run", plan.to_str().unwrap_or_default(), "--format", "json", "--run-id", "keys"]).await;
        let shown = json_of(&h.run(&["show", "keys", "search", "--format", "json"]).await);
        let result = shown["task"]["result"].as_str().unwrap_or_default().to_owned();
        let expect = if found { "find_keys=ok" } else { "find_keys=blocked" };
        assert!(result.contains(expect), "gateway {gateway}, sandbox {sandbox}: {result}\n{}", stderr(&o));
        if gateway {
            assert!(result.contains("/anthropic"), "the agent was pointed at the gateway: {result}");
        }
        if sandbox == "strict" {
            assert!(result.contains("reach_blocked_host=blocked") && result.contains("403"), "{result}");
        }
        assert!(shown["spend"].is_null(), "no model traffic: the spend is unknown, not 0: {}", shown["spend"]);
        let text = String::from_utf8_lossy(&h.run(&["show", "keys", "search"]).await.stdout).into_owned();
        assert!(text.contains("spend: unknown"), "{text}");
    }
}

/// codex-acp, claude-agent-acp and gemini-cli answer tasks confined, their model traffic
/// through the gateway in their own APIs (Responses, Messages, Gemini): each got the real key
/// upstream and only a placeholder itself, and the tokens recorded for the run equal, request
/// for request, what the upstream reported.
#[tokio::test]
async fn the_real_peers_are_billed_exactly_what_the_upstream_reported() {
    let f = must(FakeModel::start().await, "fake");
    f.set_fallback(|_| {
        Reply::Stream(vec![
            Step::Text("Hello through the gateway.".into()),
            Step::Finish("stop".into()),
            Step::Usage { prompt: 1234, completion: 56 },
            Step::Done,
        ])
    });
    let h = Host::new(None);
    let mut agents = String::new();
    let keys = [
        ("codex", "OPENAI_API_KEY", "sk-codex-real"),
        ("claude", "ANTHROPIC_API_KEY", "sk-ant-claude-real"),
        ("gemini", "GEMINI_API_KEY", "g-gemini-real"),
    ];
    for (name, key_var, key) in keys {
        let scratch = h.path(&format!("peer-{name}"));
        must(std::fs::create_dir_all(&scratch), "scratch");
        let mut peer =
            must(pier_fake_model::peers::setup(name, &support::interop_bin(), &scratch, &f.base_url()), "peer setup");
        if name == "codex" {
            // The built-in OpenAI provider, which reads OPENAI_BASE_URL: the gateway's variable.
            let home = peer.env.iter().find(|(k, _)| k == "CODEX_HOME").map(|(_, v)| v.clone()).unwrap_or_default();
            must(
                std::fs::write(
                    Path::new(&home).join("config.toml"),
                    "model = \"fake-model\"\napproval_policy = \"untrusted\"\nsandbox_mode = \"danger-full-access\"\n",
                ),
                "codex config",
            );
            // Its upstream, as pier would have given it; codex itself is told the gateway's URL.
            peer.env.push(("OPENAI_BASE_URL".into(), f.base_url()));
            peer.command.push_str(" -c openai_base_url=\"${OPENAI_BASE_URL}\"");
        }
        peer.env.retain(|(k, _)| !k.ends_with("_API_KEY"));
        peer.env.push((key_var.into(), key.into()));
        let mut words = peer.command.split_whitespace();
        let program = words.next().unwrap_or_default();
        let args: Vec<String> = words.map(|w| format!("{w:?}")).collect();
        let env: Vec<String> = peer.env.iter().map(|(k, v)| format!("{k} = {v:?}")).collect();
        agents.push_str(&format!(
            "[agents.{name}]\ncommand = {program:?}\nargs = [{}]\nenv = {{ {} }}\n\n",
            args.join(", "),
            env.join(", ")
        ));
    }
    h.write("pier.toml", &agents);
    let plan = h.write(
        "plan.toml",
        "[defaults]\nmax_attempts = 1\ntimeout = 60\n\n\
         [[tasks]]\nid = \"codex\"\nagent = \"codex\"\nprompt = \"Say hello.\"\n\n\
         [[tasks]]\nid = \"claude\"\nagent = \"claude\"\nprompt = \"Say hello.\"\n\n\
         [[tasks]]\nid = \"gemini\"\nagent = \"gemini\"\nprompt = \"Say hello.\"\n",
    );
    let o = h.run(&["run", plan.to_str().unwrap_or_default(), "--format", "json", "--run-id", "peers"]).await;
    let run = json_of(&h.run(&["show", "peers", "--format", "json"]).await);
    for t in run["tasks"].as_array().into_iter().flatten() {
        assert_eq!(t["state"], "completed", "{t}\n{}", stderr(&o));
        assert!(t["result"].as_str().unwrap_or_default().contains("Hello through the gateway."), "{t}");
        assert!(t["spend"]["requests"].as_u64().unwrap_or(0) >= 1, "{t}");
    }
    let requests = f.requests();
    for r in &requests {
        let real = keys.iter().map(|(_, _, k)| *k).find(|k| r.api_key.as_deref() == Some(*k));
        assert!(
            real.is_some(),
            "every upstream request carried a real key, never a placeholder: {:?} {}",
            r.api_key,
            r.path
        );
    }
    let (mut input, mut output) = (0, 0);
    for r in &requests {
        // A request the fake answered without usage (a probe it has no route for) counts nothing.
        let (i, o) = r.reported.unwrap_or((0, 0));
        input += i;
        output += o;
    }
    assert_eq!(run["spend"]["requests"].as_u64(), Some(requests.len() as u64), "{}", run["spend"]);
    assert_eq!(run["spend"]["tokens"]["input"].as_u64(), Some(input), "{}", run["spend"]);
    assert_eq!(run["spend"]["tokens"]["output"].as_u64(), Some(output), "{}", run["spend"]);
}

/// A task whose budget is below its need: the request that spends it completes, the next is
/// refused in the provider's own shape, the attempt ends with its partial output kept and the
/// task waits for a person; `pier budget` raises the budget and the task resumes and completes.
/// A run budget holds the same way.
#[tokio::test]
async fn a_spent_budget_parks_the_task_for_a_person_and_a_raise_resumes_it() {
    let f = must(FakeModel::start().await, "fake");
    let h = Host::new(Some(f.base_url()));
    // The first answer uses 1,500 tokens and asks for a tool, so the agent asks again.
    let first = || {
        Reply::Stream(vec![
            Step::Text("Looking around first.".into()),
            Step::ToolCallStart { index: 0, id: "c1".into(), name: "list_dir".into() },
            Step::ToolCallArgs { index: 0, fragment: "{\"path\": \".\"}".into() },
            Step::Finish("tool_calls".into()),
            Step::Usage { prompt: 1000, completion: 500 },
            Step::Done,
        ])
    };
    f.push(first());
    let plan = h.write(
        "plan.toml",
        "[[tasks]]\nid = \"t\"\nagent = \"pier\"\nprompt = \"look\"\nmax_attempts = 1\nbudget = { tokens = 1000 }\n",
    );
    let o = h.run(&["run", plan.to_str().unwrap_or_default(), "--format", "json", "--run-id", "budget"]).await;
    let shown = json_of(&h.run(&["show", "budget", "t", "--format", "json"]).await);
    let t = &shown["task"];
    assert_eq!(t["state"], "awaiting_input", "{shown}\n{}", stderr(&o));
    let error = t["error"].as_str().unwrap_or_default();
    assert!(error.contains("over budget") && error.contains("1500 of 1000 tokens"), "{error}");
    assert!(error.contains("pier budget budget t"), "the message says how to go on: {error}");
    assert_eq!(f.requests().iter().filter(|r| !r.auxiliary).count(), 1, "the refused request never went upstream");
    let said = shown["attempts"][0]["output"]["text"].as_str().unwrap_or_default();
    assert!(said.contains("Looking around first."), "the partial output is kept: {}", shown["attempts"]);
    assert_eq!(shown["spend"]["tokens"]["input"], 1000);
    // The host that left it waiting handed its run back on the way out: a resume starts at once.
    assert!(must(pier_host::TaskStore::nodes(&h.store()), "nodes").is_empty(), "no node still holds the run");
    let waiting = String::from_utf8_lossy(&h.run(&["show", "budget", "t"]).await.stdout).into_owned();
    assert!(waiting.contains("over budget"), "{waiting}");

    // Raised: the task runs again at once, and this time finishes.
    f.push(Reply::text("Done within the new budget."));
    let raised = h.run(&["budget", "budget", "t", "--tokens", "100000"]).await;
    let said = String::from_utf8_lossy(&raised.stdout).into_owned();
    assert!(said.contains("budget 100000 tokens") && said.contains("it runs again"), "{said}\n{}", stderr(&raised));
    let o = h.run(&["run", "--resume", "budget", "--format", "json"]).await;
    let shown = json_of(&h.run(&["show", "budget", "t", "--format", "json"]).await);
    assert_eq!(shown["task"]["state"], "completed", "{shown}\n{}", stderr(&o));
    assert_eq!(shown["task"]["result"], "Done within the new budget.");
    let events = String::from_utf8_lossy(&h.run(&["events", "--run", "budget"]).await.stdout).into_owned();
    assert!(events.contains("raising its budget"), "{events}");

    // A run's budget: the second task finds it spent and waits too, until the run's is raised.
    f.push(Reply::Stream(vec![
        Step::Text("Big.".into()),
        Step::Finish("stop".into()),
        Step::Usage { prompt: 4000, completion: 1000 },
        Step::Done,
    ]));
    let plan = h.write(
        "run.toml",
        "budget = { tokens = 2000 }\n\n[[tasks]]\nid = \"a\"\nagent = \"pier\"\nprompt = \"one\"\nmax_attempts = 1\n\n\
         [[tasks]]\nid = \"b\"\nagent = \"pier\"\nprompt = \"two\"\nmax_attempts = 1\ndepends_on = [\"a\"]\n",
    );
    let o = h.run(&["run", plan.to_str().unwrap_or_default(), "--format", "json", "--run-id", "capped"]).await;
    let run = json_of(&h.run(&["show", "capped", "--format", "json"]).await);
    assert_eq!(run["tasks"][0]["state"], "completed", "{run}\n{}", stderr(&o));
    assert_eq!(run["tasks"][1]["state"], "awaiting_input", "{run}");
    assert!(run["tasks"][1]["error"].as_str().unwrap_or_default().contains("budget of run `capped`"), "{run}");
    f.push(Reply::text("Second."));
    let raised = h.run(&["budget", "capped", "--tokens", "100000", "--format", "json"]).await;
    assert!(raised.status.success(), "{}", stderr(&raised));
    let o = h.run(&["run", "--resume", "capped", "--format", "json"]).await;
    let run = json_of(&h.run(&["show", "capped", "--format", "json"]).await);
    assert_eq!(run["tasks"][1]["state"], "completed", "{run}\n{}", stderr(&o));
}

/// A provider's 429 that outlasts what the gateway may hold (`hold = 0`) stops the attempt and
/// parks the task until the reset without consuming an attempt (`max_attempts = 1`, and it still
/// runs again), within a second of the reset; a task on another provider goes on meanwhile.
#[tokio::test]
async fn a_rate_limited_task_waits_for_the_reset_without_losing_an_attempt() {
    let f = must(FakeModel::start().await, "fake");
    let other = must(FakeModel::start().await, "other");
    let h = Host::new(Some(f.base_url()));
    f.push(Reply::Status { code: 429, message: "slow down".into(), retry_after_secs: Some(2) });
    f.push(Reply::text("Done after the reset."));
    let gate = pier_fake_model::Gate::new();
    other.push(Reply::Stream(vec![
        Step::Gate(gate.clone()),
        Step::ToolCallStart { index: 0, id: "c1".into(), name: "list_dir".into() },
        Step::ToolCallArgs { index: 0, fragment: "{\"path\": \".\"}".into() },
        Step::Finish("tool_calls".into()),
        Step::Usage { prompt: 10, completion: 5 },
        Step::Done,
    ]));
    other.push(Reply::text("Other done."));
    h.write(
        "pier.toml",
        &format!(
            "[rate_limits.pier]\nhold = 0\n\n[providers.other]\nmodel = \"fake-model\"\n\n\
             [agents.other]\ncommand = {:?}\nargs = [\"agent\"]\nenv = {{ PIER_PROVIDER = \"other\", PIER_BASE_URL = {:?} }}\n",
            env!("CARGO_BIN_EXE_pier"),
            other.base_url()
        ),
    );
    let plan = h.write(
        "plan.toml",
        "[[tasks]]\nid = \"a\"\nagent = \"pier\"\nprompt = \"one\"\nmax_attempts = 1\n\n\
         [[tasks]]\nid = \"b\"\nagent = \"other\"\nprompt = \"two\"\nmax_attempts = 1\n",
    );
    let child = must(
        h.command(&["run", plan.to_str().unwrap_or_default(), "--format", "json", "--run-id", "rl"]).spawn(),
        "spawn",
    );
    let opened = async {
        must(tokio::time::timeout(support::LIMIT, f.wait_for_requests(1)).await, "a's first request");
        gate.open();
    };
    let (_, o) = tokio::join!(opened, child.wait_with_output());
    let o = must(o, "wait");
    let run = json_of(&h.run(&["show", "rl", "--format", "json"]).await);
    let state = |t: usize| run["tasks"][t]["state"].clone();
    assert_eq!((state(0), state(1)), ("completed".into(), "completed".into()), "{run}\n{}", stderr(&o));
    let a = json_of(&h.run(&["show", "rl", "a", "--format", "json"]).await);
    assert_eq!(a["task"]["result"], "Done after the reset.", "{a}");
    assert_eq!(a["task"]["failures"], 0, "the rate limit consumed no attempt: {a}");
    assert_eq!(a["attempts"].as_array().map(Vec::len), Some(2), "{a}");
    let events = String::from_utf8_lossy(&h.run(&["events", "--run", "rl"]).await.stdout).into_owned();
    assert!(events.contains("rate limited"), "{events}");
    let seen: Vec<_> = f.requests().into_iter().filter(|r| !r.auxiliary).collect();
    assert_eq!(seen.len(), 2, "{seen:?}");
    let resumed = seen[1].at - seen[0].at;
    assert!(
        resumed >= std::time::Duration::from_secs(2) && resumed < std::time::Duration::from_secs(3),
        "the task ran again {resumed:?} after a 429 that asked for 2 s"
    );
    let theirs: Vec<_> = other.requests().into_iter().filter(|r| !r.auxiliary).collect();
    assert_eq!(theirs.len(), 2, "{theirs:?}");
    assert!(theirs[1].at < seen[0].at + std::time::Duration::from_secs(2), "the other provider was not held");
}
