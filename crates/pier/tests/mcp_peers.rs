//! Issue #33: a plan's MCP server reaches whichever agent runs the task. pier's own agent and
//! codex-acp (its model traffic in the Responses API, to the fake model) each call the
//! server's `echo` tool and answer with its result; the TypeScript SDK's example agent takes
//! `mcpServers` in `session/new` but has no model to call a tool with, so it is not asked.

mod support;

use pier_fake_model::body::{tool_names as offered, tool_results as results};
use pier_fake_model::{FakeModel, Reply};
use pier_host::TaskStore;
use support::host::{Host, stderr};
use support::must;

#[tokio::test]
async fn a_plans_mcp_server_is_used_by_pier_and_by_codex_acp() {
    let f = must(FakeModel::start().await, "fake");
    f.set_fallback(|body| {
        let Some(echo) = offered(body).into_iter().find(|n| n.ends_with("echo")) else {
            return Reply::text(&format!("no echo tool was offered: {:?}", offered(body)));
        };
        match results(body).pop() {
            None => Reply::tool_call("m1", &echo, r#"{"text": "from the plan's server"}"#),
            Some(result) => Reply::text(&format!("got: {result}")),
        }
    });
    let h = Host::new(Some(f.base_url()));
    let scratch = h.path("peer-codex");
    must(std::fs::create_dir_all(&scratch), "scratch");
    let peer = must(pier_fake_model::peers::setup("codex", &support::interop_bin(), &scratch, &f.base_url()), "peer");
    let env: Vec<String> = peer.env.iter().map(|(k, v)| format!("{k} = {v:?}")).collect();
    h.write("pier.toml", &format!("[agents.codex]\ncommand = {:?}\nenv = {{ {} }}\n", peer.command, env.join(", ")));
    let fixture = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../pier-mcp/tests/fixtures/mcp_server.py");
    let script = h.write("mcp_server.py", &must(std::fs::read_to_string(fixture), "read the MCP fixture"));
    let server = format!("{{ name = \"notes\", command = \"python3\", args = [\"{}\"] }}", script.display());
    let plan = h.write(
        "plan.toml",
        &format!(
            "[defaults]\nsandbox = \"off\"\nmax_attempts = 1\ntimeout = 60\nmcp_servers = [{server}]\n\
             permissions = {{ other = \"allow\", read = \"allow\", fetch = \"allow\", execute = \"allow\" }}\n\n\
             [[tasks]]\nid = \"pier\"\nagent = \"pier\"\nprompt = \"use it\"\n\n\
             [[tasks]]\nid = \"codex\"\nagent = \"codex\"\nprompt = \"use it\"\n"
        ),
    );
    let o = h.run(&["run", plan.to_str().unwrap_or_default(), "--run-id", "m"]).await;
    for id in ["pier", "codex"] {
        let t = must(h.store().task("m", id), "task").unwrap_or_else(|| panic!("no task {id}"));
        let result = t.result.clone().unwrap_or_default();
        assert!(result.contains("got: ") && result.contains("from the plan's server"), "{id}: {t:?}\n{}", stderr(&o));
    }
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
}
