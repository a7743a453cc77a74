//! The CLI as an operator meets it: runs listed, a reused run id refused, a typo'd run named,
//! approve and deny picking only their own kind of option, an interrupted run's exit code.

mod support;

use pier_fake_model::{FakeModel, Gate, Reply, Step};
use support::host::{Host, lines, stderr};
use support::must;

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
    assert_eq!(order, vec!["second", "first"], "newest first: {listed}");
    assert!(listed.lines().all(|l| l.contains("2 tasks") && l.contains("2 completed")), "{listed}");
    let json = lines(&h.run(&["runs", "--format", "json"]).await);
    assert_eq!(json[0]["counts"]["completed"], 2);
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
    let o = h.run(&["deny", "t", "allow"]).await;
    assert_ne!(o.status.code(), Some(0));
    assert!(stderr(&o).contains("deny takes reject options"), "{}", stderr(&o));
    let o = h.run(&["deny", "t", "reject"]).await;
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let _ = must(tokio::time::timeout(support::LIMIT, child.wait()).await, "pier run ends");
}
