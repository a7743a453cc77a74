//! A PostgreSQL store over TLS: a cluster of this test's own (`scripts/pg start-tls`) that
//! accepts TCP only with TLS, its certificate signed by a CA the test makes with `openssl`.
//! The store connects when the URL names that CA, verifying the chain and the name; refuses,
//! saying what to do, when it does not; and the server really refuses plain text.

use std::path::{Path, PathBuf};
use std::process::Command;

use pier_store::TaskStore;
use pier_store::plan::parse;

struct Cluster {
    dir: PathBuf,
    url: String,
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let _ = Command::new(script()).arg("stop").arg(&self.dir).status();
    }
}

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/pg")
}

fn run(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(out.status.success(), "{cmd:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

/// A CA, and a certificate for `localhost` it signed: (the CA's file, the server's, its key).
fn certificates(dir: &Path) -> (PathBuf, PathBuf, PathBuf) {
    let p = |name: &str| dir.join(name);
    let ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes"];
    run(Command::new("openssl")
        .args(["req", "-x509"])
        .args(ec)
        .args(["-days", "2", "-subj", "/CN=pier test CA"])
        .arg("-keyout")
        .arg(p("ca.key"))
        .arg("-out")
        .arg(p("ca.crt")));
    run(Command::new("openssl")
        .arg("req")
        .args(ec)
        .args(["-subj", "/CN=localhost"])
        .arg("-keyout")
        .arg(p("server.key"))
        .arg("-out")
        .arg(p("server.csr")));
    std::fs::write(p("ext"), "subjectAltName=DNS:localhost,IP:127.0.0.1\nbasicConstraints=CA:FALSE\n")
        .unwrap_or_else(|e| panic!("{e}"));
    run(Command::new("openssl")
        .args(["x509", "-req", "-days", "2", "-CAcreateserial"])
        .arg("-in")
        .arg(p("server.csr"))
        .arg("-CA")
        .arg(p("ca.crt"))
        .arg("-CAkey")
        .arg(p("ca.key"))
        .arg("-extfile")
        .arg(p("ext"))
        .arg("-out")
        .arg(p("server.crt")));
    (p("ca.crt"), p("server.crt"), p("server.key"))
}

fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap_or_else(|e| panic!("{e}"));
    l.local_addr().map(|a| a.port()).unwrap_or_else(|e| panic!("{e}"))
}

fn cluster(work: &Path, cert: &Path, key: &Path) -> Cluster {
    let dir = work.join("pg");
    let port = free_port().to_string();
    let url = run(Command::new(script()).arg("start-tls").arg(&dir).arg(&port).arg(cert).arg(key));
    Cluster { dir, url }
}

fn open(url: &str) -> Result<std::sync::Arc<dyn TaskStore>, pier_store::StoreError> {
    pier_store::open(url)
}

#[test]
fn a_store_reaches_a_tls_only_server_by_the_ca_it_is_told_and_never_in_plain_text() {
    let work = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    // The cluster's owner (`postgres`, when run as root) must reach the files.
    let _ = Command::new("chmod").arg("755").arg(work.path()).status();
    let (ca, cert, key) = certificates(work.path());
    let pg = cluster(work.path(), &cert, &key);
    let ca_q = ca.display().to_string().replace('/', "%2F");

    for mode in ["require", "verify-full"] {
        let url = format!("{}?sslmode={mode}&sslrootcert={ca_q}", pg.url);
        let store = open(&url).unwrap_or_else(|e| panic!("sslmode={mode}: {e}"));
        let plan = parse("[[tasks]]\nid = \"a\"\nprompt = \"x\"\n", &|_| Ok(())).unwrap_or_else(|e| panic!("{e}"));
        let run = format!("r-{mode}");
        store.create_run(&run, &plan, "test").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(store.tasks(&run).map(|t| t.len()).ok(), Some(1), "sslmode={mode}");
    }

    // `PGSSLROOTCERT` names the CA as well as the URL does.
    let by_env = Command::new(std::env::current_exe().unwrap_or_else(|e| panic!("{e}")))
        .args(["--exact", "child_opens_the_store_it_is_given", "--nocapture"])
        .env("PIER_TLS_CHILD_URL", format!("{}?sslmode=require", pg.url))
        .env("PGSSLROOTCERT", &ca)
        .output()
        .unwrap_or_else(|e| panic!("{e}"));
    let text = String::from_utf8_lossy(&by_env.stdout);
    assert!(by_env.status.success() && text.contains("1 passed"), "{text}");

    // A server whose CA is not trusted is refused, and the message says how to trust it.
    let untrusted = open(&format!("{}?sslmode=require", pg.url)).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(untrusted.contains("sslrootcert"), "{untrusted}");
    // The server takes no plain text, so the connections above were encrypted.
    let plain = open(&format!("{}?sslmode=disable", pg.url)).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(plain.contains("no encryption") || plain.contains("pg_hba"), "{plain}");
}

/// Run by the test above in a process of its own (the environment is the process's).
#[test]
fn child_opens_the_store_it_is_given() {
    let Ok(url) = std::env::var("PIER_TLS_CHILD_URL") else { return };
    if let Err(e) = open(&url) {
        panic!("{e}");
    }
}
