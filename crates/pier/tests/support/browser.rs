//! A small W3C WebDriver client: headless Chromium driven through `chromedriver`.
//!
//! Checked by hand against Debian bookworm's chromium-driver 156. Chromium-specific on
//! purpose: whole-page screenshots go through chromedriver's CDP passthrough.

#![allow(dead_code)]

use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, Instant};

use reqwest::Method;
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

use super::must;

/// The W3C web element identifier: the key element references travel under, both ways.
pub const ELEMENT: &str = "element-6066-11e4-a52e-4f735466cecf";

/// chromedriver's own page-load and script timeouts. Below [`CALL_LIMIT`], so a slow page
/// ends in chromedriver's error, which says what timed out, rather than in ours.
const DRIVER_TIMEOUT_MS: u64 = 20_000;
/// Bound on one HTTP call.
const CALL_LIMIT: Duration = Duration::from_secs(30);
/// Bound on chromedriver reporting its port, and on Chromium starting (slow on a busy box).
const START_LIMIT: Duration = Duration::from_secs(60);
/// Bound on each call Drop makes: it runs while a test is failing, which should stay quick.
const DROP_LIMIT: Duration = Duration::from_secs(10);
const POLL: Duration = Duration::from_millis(50);
const READY_LINE: &str = "ChromeDriver was started successfully on port ";

pub struct Browser {
    name: String,
    http: reqwest::Client,
    /// `http://127.0.0.1:<port>/session/<id>`; every command's path is relative to it.
    session: String,
    /// Chromium's main process. Killing chromedriver leaves Chromium running, so Drop kills
    /// this when the session could not be deleted.
    browser_pid: Option<i32>,
    // Declared after the rest so that chromedriver is killed before the profile is removed.
    _driver: Child,
    _profile: tempfile::TempDir,
}

impl Browser {
    /// Starts chromedriver on a free loopback port and a headless Chromium session.
    /// `name` names the screenshot saved if the test fails.
    pub async fn start(name: &str) -> Browser {
        let spawned = Command::new("chromedriver")
            .arg("--port=0")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn();
        let mut driver = match spawned {
            Ok(c) => c,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                panic!("chromedriver not found: install chromium and chromium-driver; .ci/run does")
            }
            Err(e) => panic!("spawn chromedriver: {e}"),
        };
        let Some(stdout) = driver.stdout.take() else { panic!("chromedriver: stdout was not piped") };
        let mut lines = BufReader::new(stdout).lines();
        // With --port=0 the kernel picks the port, and only this line of stdout tells it.
        let mut seen = Vec::new();
        let ready = tokio::time::timeout(START_LIMIT, async {
            while let Ok(Some(line)) = lines.next_line().await {
                if let Some(port) = line.strip_prefix(READY_LINE) {
                    return port.trim_end_matches('.').parse::<u16>().ok();
                }
                seen.push(line);
            }
            None
        })
        .await;
        let port = match ready {
            Ok(Some(port)) => port,
            Ok(None) => panic!("chromedriver ended without reporting its port; its output: {seen:?}"),
            Err(_) => panic!("chromedriver reported no port within {START_LIMIT:?}; its output: {seen:?}"),
        };
        // chromedriver goes on logging (`[SEVERE]: ...`) to stdout: drain it so it never blocks
        // on a full pipe, to stderr, which the test harness shows for a failing test.
        tokio::spawn(async move {
            while let Ok(Some(line)) = lines.next_line().await {
                eprintln!("chromedriver: {line}");
            }
        });

        let profile = must(tempfile::tempdir(), "Chromium profile dir");
        let capabilities = json!({"capabilities": {"alwaysMatch": {
            "browserName": "chrome",
            "timeouts": {"pageLoad": DRIVER_TIMEOUT_MS, "script": DRIVER_TIMEOUT_MS, "implicit": 0},
            "goog:chromeOptions": {"args": [
                "--headless=new",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--window-size=1280,900",
                format!("--user-data-dir={}", profile.path().display()),
            ]},
        }}});
        let http = client();
        let url = format!("http://127.0.0.1:{port}/session");
        let created = call(&http, Method::POST, &url, Some(&capabilities), START_LIMIT)
            .await
            .unwrap_or_else(|e| panic!("{name}: start Chromium through chromedriver: {e}"));
        let Some(id) = created["sessionId"].as_str() else { panic!("{name}: new session without an id: {created}") };
        Browser {
            name: name.to_owned(),
            http,
            session: format!("{url}/{id}"),
            browser_pid: created["capabilities"]["goog:processID"].as_i64().and_then(|p| i32::try_from(p).ok()),
            _driver: driver,
            _profile: profile,
        }
    }

    /// Navigates and waits for the page's load event (at most 20 s, chromedriver's bound).
    pub async fn goto(&self, url: &str) {
        self.post("/url", json!({"url": url})).await;
    }

    pub async fn url(&self) -> String {
        match self.get("/url").await {
            Value::String(url) => url,
            other => panic!("{}: GET /url returned {other}", self.name),
        }
    }

    /// Runs `js` as a function body (so it must `return` its result) with `args` as
    /// `arguments`; a returned promise is awaited. Pass elements with [`element_arg`].
    pub async fn script(&self, js: &str, args: Vec<Value>) -> Value {
        self.post("/execute/sync", json!({"script": js, "args": args})).await
    }

    /// The first element matching `css`, if any.
    pub async fn find(&self, css: &str) -> Option<String> {
        // `/elements` answers [] where `/element` answers a "no such element" error.
        self.find_all(css).await.into_iter().next()
    }

    pub async fn find_all(&self, css: &str) -> Vec<String> {
        let found = self.post("/elements", json!({"using": "css selector", "value": css})).await;
        let Value::Array(found) = found else { panic!("{}: POST /elements returned {found}", self.name) };
        found
            .iter()
            .map(|e| match e[ELEMENT].as_str() {
                Some(id) => id.to_owned(),
                None => panic!("{}: not an element reference: {e}", self.name),
            })
            .collect()
    }

    pub async fn click(&self, element: &str) {
        self.post(&format!("/element/{element}/click"), json!({})).await;
    }

    /// Types `text` after what the field holds.
    pub async fn type_into(&self, element: &str, text: &str) {
        self.post(&format!("/element/{element}/value"), json!({"text": text})).await;
    }

    /// The rendered text (`innerText`-like: hidden elements give "").
    pub async fn text(&self, element: &str) -> String {
        match self.get(&format!("/element/{element}/text")).await {
            Value::String(text) => text,
            other => panic!("{}: text of {element}: {other}", self.name),
        }
    }

    /// The markup attribute, as written: not the live `value` of a field after typing, and
    /// "true" for a boolean attribute that is present. Read live state with [`Self::script`].
    pub async fn attr(&self, element: &str, name: &str) -> Option<String> {
        self.get(&format!("/element/{element}/attribute/{name}")).await.as_str().map(str::to_owned)
    }

    /// Polls `js_condition` (an expression, no trailing `;`) every 50 ms until it is `true`.
    /// A condition that throws, say on an element not rendered yet, counts as false.
    pub async fn wait_for(&self, what: &str, js_condition: &str, limit: Duration) {
        let body = json!({"script": format!("return ({js_condition});"), "args": []});
        let url = format!("{}/execute/sync", self.session);
        let start = Instant::now();
        loop {
            let last = match call(&self.http, Method::POST, &url, Some(&body), CALL_LIMIT).await {
                Ok(Value::Bool(true)) => return,
                Ok(other) => format!("last value {other}"),
                Err(e) => format!("last error {e}"),
            };
            if start.elapsed() >= limit {
                let at = self.url().await;
                panic!(
                    "{}: timed out after {limit:?} waiting for {what} (`{js_condition}`, {last}); page at {at}",
                    self.name
                );
            }
            tokio::time::sleep(POLL).await;
        }
    }

    /// Opens a new tab at `url` and makes it the current one; its window handle.
    pub async fn new_tab(&self, url: &str) -> String {
        let v = self.post("/window/new", json!({"type": "tab"})).await;
        let handle = v["handle"].as_str().unwrap_or_default().to_owned();
        self.switch_to(&handle).await;
        self.goto(url).await;
        handle
    }

    /// The current window handle.
    pub async fn handle(&self) -> String {
        self.get("/window").await.as_str().unwrap_or_default().to_owned()
    }

    pub async fn switch_to(&self, handle: &str) {
        self.post("/window", json!({"handle": handle})).await;
    }

    /// A PNG of the whole page, beyond the viewport.
    pub async fn screenshot(&self) -> Vec<u8> {
        capture(&self.http, &self.session, CALL_LIMIT).await.unwrap_or_else(|e| panic!("{}: {e}", self.name))
    }

    /// Logs in to the dashboard at `base`: a guarded page sends the browser to the login form,
    /// which takes `name` (the form asks one for the server's shared token; with `None` it must
    /// not: a users file's token names its person) and `token`; then the runs page.
    pub async fn login(&self, base: &str, name: Option<&str>, token: &str) {
        const LIMIT: Duration = Duration::from_secs(20);
        self.goto(&format!("{base}/ui/")).await;
        self.wait_for("the login page", "location.pathname === '/ui/login'", LIMIT).await;
        match (name, self.find("#name").await) {
            (Some(name), Some(field)) => self.type_into(&field, name).await,
            (None, None) => {}
            (Some(_), None) => panic!("{}: the login form asks no name", self.name),
            (None, Some(_)) => panic!("{}: the login form asks a name of a personal token", self.name),
        }
        let field = self.find("#token").await.unwrap_or_else(|| panic!("{}: no token field", self.name));
        self.type_into(&field, token).await;
        let submit = self.find("form.login button").await.unwrap_or_else(|| panic!("{}: no login button", self.name));
        self.click(&submit).await;
        self.wait_for("the runs page", "location.pathname === '/ui/'", LIMIT).await;
    }

    /// A DevTools command through chromedriver's passthrough; its result.
    pub async fn cdp(&self, cmd: &str, params: Value) -> Value {
        self.post("/goog/cdp/execute", json!({"cmd": cmd, "params": params})).await
    }

    /// The page as a person whose system asks for dark mode sees it (`prefers-color-scheme`).
    pub async fn prefer_dark(&self) {
        let dark = json!({"features": [{"name": "prefers-color-scheme", "value": "dark"}]});
        self.cdp("Emulation.setEmulatedMedia", dark).await;
    }

    /// Keeps a screenshot as a test artefact: `target/browser-screenshots/NAME-LABEL.png`.
    pub async fn keep_screenshot(&self, label: &str) -> PathBuf {
        let path = screenshot_path(&format!("{}-{label}", self.name));
        let png = self.screenshot().await;
        let written = path.parent().map_or(Ok(()), std::fs::create_dir_all).and_then(|()| std::fs::write(&path, png));
        if let Err(e) = written {
            panic!("{}: keep {}: {e}", self.name, path.display());
        }
        path
    }

    /// The outer window size: the viewport is as wide, but ~143 px shorter (browser UI).
    pub async fn set_window_size(&self, width: u32, height: u32) {
        self.post("/window/rect", json!({"width": width, "height": height})).await;
    }

    async fn get(&self, path: &str) -> Value {
        self.command(Method::GET, path, None).await
    }

    async fn post(&self, path: &str, body: Value) -> Value {
        self.command(Method::POST, path, Some(body)).await
    }

    async fn command(&self, method: Method, path: &str, body: Option<Value>) -> Value {
        let url = format!("{}{path}", self.session);
        match call(&self.http, method.clone(), &url, body.as_ref(), CALL_LIMIT).await {
            Ok(value) => value,
            Err(e) => {
                let body = body.map(|b| b.to_string()).unwrap_or_default();
                panic!("{}: WebDriver {method} {path} {body}: {e}", self.name)
            }
        }
    }
}

/// A script expression for the state of `task`'s node in the run page's graph (undefined without one).
pub fn node_state(task: &str) -> String {
    format!("(document.querySelector('svg.graph [data-task=\"{task}\"]') || {{dataset: {{}}}}).dataset.state")
}

/// An element as a [`Browser::script`] argument; it arrives in the page as the DOM node.
pub fn element_arg(element: &str) -> Value {
    Value::Object([(ELEMENT.to_owned(), Value::from(element))].into_iter().collect())
}

impl Drop for Browser {
    fn drop(&mut self) {
        let shot = std::thread::panicking().then(|| screenshot_path(&self.name));
        let session = self.session.clone();
        let (done, finished) = std::sync::mpsc::channel();
        // Drop cannot await, and the test's runtime may be this very thread: the HTTP runs on
        // a thread of its own, with its own runtime and client (a reqwest client's
        // connections belong to the runtime they were made on).
        std::thread::spawn(move || {
            let Ok(rt) = tokio::runtime::Builder::new_current_thread().enable_all().build() else { return };
            let deleted = rt.block_on(async {
                let http = client();
                if let Some(path) = shot {
                    match capture(&http, &session, DROP_LIMIT).await {
                        Ok(png) => save(&path, &png),
                        Err(e) => eprintln!("no screenshot of the failed page: {e}"),
                    }
                }
                call(&http, Method::DELETE, &session, None, DROP_LIMIT).await.is_ok()
            });
            let _ = done.send(deleted);
        });
        // Beyond the bound, the thread is left behind: its calls end by their own timeouts.
        let deleted = finished.recv_timeout(2 * DROP_LIMIT + Duration::from_secs(5)).unwrap_or(false);
        if !deleted && let Some(pid) = self.browser_pid {
            let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGKILL);
        }
    }
}

fn client() -> reqwest::Client {
    // A proxy from the environment must not see calls to a loopback chromedriver.
    must(reqwest::Client::builder().no_proxy().build(), "HTTP client")
}

/// One WebDriver call: the response's `value`, or an error naming the WebDriver error code.
async fn call(
    http: &reqwest::Client,
    method: Method,
    url: &str,
    body: Option<&Value>,
    limit: Duration,
) -> Result<Value, String> {
    let mut request = http.request(method, url).timeout(limit);
    if let Some(body) = body {
        let text = serde_json::to_string(body).map_err(|e| e.to_string())?;
        request = request.header("content-type", "application/json").body(text);
    }
    let response = request.send().await.map_err(|e| chain(&e))?;
    let status = response.status();
    let text = response.text().await.map_err(|e| chain(&e))?;
    let mut reply: Value =
        serde_json::from_str(&text).map_err(|e| format!("HTTP {status} and not JSON ({e}): {text}"))?;
    let value = reply.get_mut("value").map(Value::take).unwrap_or_default();
    if status.is_success() {
        return Ok(value);
    }
    // chromedriver's message starts with the error code ("no such element: ...") and ends in
    // a "(Session info: ...)" line; the `stacktrace` beside it is bare addresses.
    let message = value["message"].as_str().unwrap_or("?");
    let message = message.split("\n  (Session info:").next().unwrap_or(message);
    Err(format!("HTTP {}: {message}", status.as_u16()))
}

/// The error with its causes: reqwest's own message hides the one that matters (a timeout).
fn chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        text = format!("{text}: {c}");
        cause = c.source();
    }
    text
}

async fn capture(http: &reqwest::Client, session: &str, limit: Duration) -> Result<Vec<u8>, String> {
    // W3C's screenshot stops at the viewport; CDP's captureBeyondViewport takes the page.
    let command = json!({"cmd": "Page.captureScreenshot", "params": {"format": "png", "captureBeyondViewport": true}});
    let shot = call(http, Method::POST, &format!("{session}/goog/cdp/execute"), Some(&command), limit).await?;
    match shot["data"].as_str() {
        Some(data) => base64_decode(data),
        None => Err(format!("screenshot: no data in {shot}")),
    }
}

fn screenshot_path(name: &str) -> PathBuf {
    let file: String =
        name.chars().map(|c| if c.is_ascii_alphanumeric() || c == '-' || c == '_' { c } else { '_' }).collect();
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../target/browser-screenshots")).join(format!("{file}.png"))
}

fn save(path: &std::path::Path, png: &[u8]) {
    let written = path.parent().map_or(Ok(()), std::fs::create_dir_all).and_then(|()| std::fs::write(path, png));
    match written {
        Ok(()) => eprintln!("screenshot of the failed page: {}", path.display()),
        Err(e) => eprintln!("no screenshot of the failed page: {}: {e}", path.display()),
    }
}

/// Standard base64 with optional padding, as chromedriver sends it.
fn base64_decode(text: &str) -> Result<Vec<u8>, String> {
    let mut out = Vec::with_capacity(text.len() / 4 * 3);
    let (mut acc, mut bits) = (0u32, 0u32);
    for c in text.bytes() {
        let sextet = match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' => 62,
            b'/' => 63,
            b'=' | b'\r' | b'\n' => continue,
            _ => return Err(format!("screenshot: byte {c:#04x} is not base64")),
        };
        acc = (acc << 6) | u32::from(sextet);
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
            acc &= (1 << bits) - 1;
        }
    }
    Ok(out)
}
