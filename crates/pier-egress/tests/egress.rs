//! The egress proxy over real loopback sockets: tunnels, forwarding, refusals, teardown.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use pier_egress::{Allow, Egress, Serving};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::time::timeout;

const LIMIT: Duration = Duration::from_secs(10);

fn allow(entries: &[&str]) -> Arc<Allow> {
    Arc::new(Allow::parse(&entries.iter().map(|e| e.to_string()).collect::<Vec<_>>()).unwrap())
}

/// The proxy serving a fresh loopback listener, and that listener's address.
fn proxy(entries: &[&str]) -> (Serving, SocketAddr) {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let serving = Egress::new().serve(listener, allow(entries), "test-attempt".into()).unwrap();
    let addr = serving.local_addr();
    (serving, addr)
}

/// A TCP server echoing every connection's bytes back.
async fn echo_server() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                let (mut r, mut w) = stream.split();
                let _ = tokio::io::copy(&mut r, &mut w).await;
            });
        }
    });
    addr
}

/// An HTTP/1 server answering every request with `respond`.
async fn http_server<F, Fut>(respond: F) -> SocketAddr
where
    F: Fn(Request<Incoming>) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = Response<http_body_util::combinators::UnsyncBoxBody<Bytes, Infallible>>> + Send + 'static,
{
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let respond = respond.clone();
            tokio::spawn(async move {
                let service = hyper::service::service_fn(move |req| {
                    let respond = respond.clone();
                    async move { Ok::<_, Infallible>(respond(req).await) }
                });
                let _ =
                    hyper::server::conn::http1::Builder::new().serve_connection(TokioIo::new(stream), service).await;
            });
        }
    });
    addr
}

/// Reads a response head byte by byte, so nothing after it (tunnel bytes) is consumed.
async fn read_head(stream: &mut TcpStream) -> String {
    let mut head = Vec::new();
    while !head.ends_with(b"\r\n\r\n") {
        let mut byte = [0u8; 1];
        let n = stream.read(&mut byte).await.unwrap();
        assert_ne!(n, 0, "EOF inside a response head: {:?}", String::from_utf8_lossy(&head));
        head.push(byte[0]);
    }
    String::from_utf8(head).unwrap()
}

/// A whole response to a raw request: (head, body), with a Content-Length body.
async fn raw_exchange(proxy: SocketAddr, request: &str) -> (String, String) {
    timeout(LIMIT, async {
        let mut stream = TcpStream::connect(proxy).await.unwrap();
        stream.write_all(request.as_bytes()).await.unwrap();
        let head = read_head(&mut stream).await;
        let len: usize = head
            .lines()
            .find_map(|l| l.to_ascii_lowercase().strip_prefix("content-length:").map(|v| v.trim().parse().unwrap()))
            .unwrap_or(0);
        let mut body = vec![0u8; len];
        stream.read_exact(&mut body).await.unwrap();
        (head, String::from_utf8(body).unwrap())
    })
    .await
    .expect("the proxy answers in time")
}

fn client(proxy: SocketAddr) -> reqwest::Client {
    reqwest::Client::builder().proxy(reqwest::Proxy::http(format!("http://{proxy}")).unwrap()).build().unwrap()
}

fn boxed(body: impl Into<Bytes>) -> http_body_util::combinators::UnsyncBoxBody<Bytes, Infallible> {
    Full::new(body.into()).boxed_unsync()
}

#[tokio::test]
async fn an_allowed_connect_tunnels_bytes_both_ways() {
    let echo = echo_server().await;
    let (serving, proxy) = proxy(&[&format!("127.0.0.1:{}", echo.port())]);
    timeout(LIMIT, async {
        let mut stream = TcpStream::connect(proxy).await.unwrap();
        stream.write_all(format!("CONNECT {echo} HTTP/1.1\r\nHost: {echo}\r\n\r\n").as_bytes()).await.unwrap();
        let head = read_head(&mut stream).await;
        assert!(head.starts_with("HTTP/1.1 200 Connection Established\r\n"), "{head}");
        for message in [&b"hello through the tunnel"[..], b"and a second write"] {
            stream.write_all(message).await.unwrap();
            let mut back = vec![0u8; message.len()];
            stream.read_exact(&mut back).await.unwrap();
            assert_eq!(back, message);
        }
    })
    .await
    .unwrap();
    assert_eq!((serving.forwarded(), serving.refused()), (1, 0));
}

#[tokio::test]
async fn a_connect_to_a_port_not_listed_is_refused_and_never_reaches_the_target() {
    let target = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    target.set_nonblocking(true).unwrap();
    let port = target.local_addr().unwrap().port();
    let (serving, proxy) = proxy(&["127.0.0.1:1", "example.com"]);

    let (head, body) = raw_exchange(proxy, &format!("CONNECT 127.0.0.1:{port} HTTP/1.1\r\nHost: x\r\n\r\n")).await;
    assert!(head.starts_with("HTTP/1.1 403 "), "{head}");
    assert!(body.contains(&format!("127.0.0.1:{port} is not on this task's network allowlist")), "{body}");
    assert!(body.contains("allowed: 127.0.0.1:1, example.com"), "{body}");
    assert!(body.contains("network = [...]"), "{body}");
    assert_eq!((serving.refused(), serving.forwarded()), (1, 0));
    // The proxy answers only after deciding, so a connection it had made would be queued by now.
    assert_eq!(target.accept().map_err(|e| e.kind()).err(), Some(std::io::ErrorKind::WouldBlock));
}

#[tokio::test]
async fn a_plain_http_response_streams_through_unbuffered() {
    let (tx, rx) = mpsc::channel::<Bytes>(4);
    let rx = Arc::new(Mutex::new(Some(rx)));
    let upstream = http_server(move |_req| {
        let rx = rx.lock().unwrap().take();
        async move {
            let Some(rx) = rx else { return Response::new(boxed("second request")) };
            let frames = futures::stream::unfold(rx, |mut rx| async move {
                rx.recv().await.map(|chunk| (Ok::<_, Infallible>(Frame::data(chunk)), rx))
            });
            Response::new(StreamBody::new(frames).boxed_unsync())
        }
    })
    .await;
    let (serving, proxy) = proxy(&["127.0.0.1"]);

    timeout(LIMIT, async {
        tx.send(Bytes::from_static(b"data: first\n\n")).await.unwrap();
        let mut resp = client(proxy).get(format!("http://{upstream}/v1/stream")).send().await.unwrap();
        assert_eq!(resp.status(), 200);
        // The server holds the rest until this chunk has arrived: only streaming gets past here.
        let first = resp.chunk().await.unwrap().unwrap();
        assert_eq!(&first[..], b"data: first\n\n");
        tx.send(Bytes::from_static(b"data: second\n\n")).await.unwrap();
        tx.send(Bytes::from_static(b"data: last\n\n")).await.unwrap();
        drop(tx);
        let mut rest = Vec::new();
        while let Some(chunk) = resp.chunk().await.unwrap() {
            rest.extend_from_slice(&chunk);
        }
        assert_eq!(rest, b"data: second\n\ndata: last\n\n");
    })
    .await
    .unwrap();
    assert_eq!((serving.forwarded(), serving.refused()), (1, 0));
}

#[tokio::test]
async fn a_post_body_is_forwarded_intact() {
    let upstream = http_server(|req: Request<Incoming>| async move {
        let body = req.into_body().collect().await.unwrap().to_bytes();
        Response::new(boxed(body))
    })
    .await;
    let (serving, proxy) = proxy(&[&format!("localhost:{}", upstream.port()), "127.0.0.1"]);
    let sent: Vec<u8> = (0..1024 * 1024).map(|i: u32| (i % 251) as u8).collect();

    let got = timeout(LIMIT, async {
        let resp = client(proxy).post(format!("http://{upstream}/upload")).body(sent.clone()).send().await.unwrap();
        assert_eq!(resp.status(), 200);
        resp.bytes().await.unwrap()
    })
    .await
    .unwrap();
    assert_eq!(got.len(), sent.len());
    assert!(got[..] == sent[..], "the body came back changed");
    assert_eq!(serving.forwarded(), 1);
}

#[tokio::test]
async fn hop_by_hop_headers_stay_behind_and_host_names_the_target() {
    let upstream = http_server(|req: Request<Incoming>| async move {
        let mut seen: Vec<String> =
            req.headers().iter().map(|(k, v)| format!("{k}: {}", v.to_str().unwrap_or("?"))).collect();
        seen.sort();
        seen.push(format!("uri: {}", req.uri()));
        Response::new(boxed(seen.join("\n")))
    })
    .await;
    let (_serving, proxy) = proxy(&["127.0.0.1"]);
    let request = format!(
        "GET http://{upstream}/path?q=1 HTTP/1.1\r\nHost: elsewhere.example\r\nConnection: keep-alive, x-private\r\n\
         X-Private: secret\r\nProxy-Connection: keep-alive\r\nProxy-Authorization: Basic Zm9vOmJhcg==\r\n\
         Keep-Alive: timeout=5\r\nTE: trailers\r\nX-Kept: yes\r\n\r\n"
    );
    let (head, body) = raw_exchange(proxy, &request).await;
    assert!(head.starts_with("HTTP/1.1 200 "), "{head}");
    let lines: Vec<&str> = body.lines().collect();
    assert_eq!(lines, [&format!("host: {upstream}")[..], "x-kept: yes", "uri: /path?q=1"], "{body}");
}

#[tokio::test]
async fn plain_http_outside_the_allowlist_is_refused() {
    let upstream = http_server(|_req| async { Response::new(boxed("should not be reached")) }).await;
    let (serving, proxy) = proxy(&["127.0.0.1:1"]);
    let resp = timeout(LIMIT, client(proxy).get(format!("http://{upstream}/")).send()).await.unwrap().unwrap();
    assert_eq!(resp.status(), 403);
    let body = resp.text().await.unwrap();
    assert!(body.contains(&format!("{upstream} is not on this task's network allowlist")), "{body}");
    assert_eq!((serving.refused(), serving.forwarded()), (1, 0));
}

#[tokio::test]
async fn origin_form_and_https_requests_are_bad_requests() {
    let (serving, proxy) = proxy(&["127.0.0.1"]);
    let (head, body) = raw_exchange(proxy, "GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n").await;
    assert!(head.starts_with("HTTP/1.1 400 "), "{head}");
    assert!(body.contains("this is pier's egress proxy; send absolute-form requests or CONNECT"), "{body}");

    let (head, body) = raw_exchange(proxy, "GET https://127.0.0.1:8443/ HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n").await;
    assert!(head.starts_with("HTTP/1.1 400 "), "{head}");
    assert!(body.contains("CONNECT 127.0.0.1:8443"), "{body}");
    assert_eq!((serving.refused(), serving.forwarded()), (0, 0));
}

#[tokio::test]
async fn an_unreachable_upstream_is_a_bad_gateway() {
    // Bound and dropped: nothing listens there any more.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    let (serving, proxy) = proxy(&["127.0.0.1"]);
    let (head, body) = raw_exchange(proxy, &format!("CONNECT {closed} HTTP/1.1\r\nHost: {closed}\r\n\r\n")).await;
    assert!(head.starts_with("HTTP/1.1 502 "), "{head}");
    assert!(body.contains(&format!("could not connect to {closed}")), "{body}");

    let (head, body) = raw_exchange(proxy, &format!("GET http://{closed}/ HTTP/1.1\r\nHost: {closed}\r\n\r\n")).await;
    assert!(head.starts_with("HTTP/1.1 502 "), "{head}");
    assert!(body.contains(&format!("forwarding to {closed} failed")), "{body}");
    assert_eq!((serving.refused(), serving.forwarded()), (0, 0));
}

#[tokio::test]
async fn dropping_serving_closes_the_listener_and_open_tunnels() {
    let echo = echo_server().await;
    let (serving, proxy) = proxy(&["127.0.0.1"]);
    timeout(LIMIT, async {
        let mut tunnel = TcpStream::connect(proxy).await.unwrap();
        tunnel.write_all(format!("CONNECT {echo} HTTP/1.1\r\nHost: {echo}\r\n\r\n").as_bytes()).await.unwrap();
        assert!(read_head(&mut tunnel).await.starts_with("HTTP/1.1 200 "));
        tunnel.write_all(b"ping").await.unwrap();
        let mut back = [0u8; 4];
        tunnel.read_exact(&mut back).await.unwrap();

        drop(serving);

        let mut rest = Vec::new();
        let ended = tunnel.read_to_end(&mut rest).await;
        assert!(ended.is_err() || rest.is_empty(), "the tunnel still delivered {rest:?}");
        match TcpStream::connect(proxy).await {
            Err(_) => {}
            Ok(mut late) => {
                // Queued in the backlog before the listener closed: reset or EOF, never an answer.
                let _ = late.write_all(b"CONNECT 127.0.0.1:1 HTTP/1.1\r\n\r\n").await;
                let mut answer = Vec::new();
                let read = late.read_to_end(&mut answer).await;
                assert!(read.is_err() || answer.is_empty(), "answered after drop: {answer:?}");
            }
        }
    })
    .await
    .unwrap();
}

#[test]
fn allow_entries_parse_and_match() {
    let allow = Allow::parse(&[
        "API.Example.com".to_string(),
        "registry.npmjs.org:443".to_string(),
        "[::1]:8443".to_string(),
        "10.0.0.1".to_string(),
        " spaced.example ".to_string(),
    ])
    .unwrap();
    assert!(allow.permits("api.example.com", 443));
    assert!(allow.permits("api.EXAMPLE.com.", 80));
    assert!(allow.permits("registry.npmjs.org", 443));
    assert!(!allow.permits("registry.npmjs.org", 80));
    assert!(!allow.permits("npmjs.org", 443));
    assert!(!allow.permits("evil.api.example.com", 443));
    assert!(allow.permits("[::1]", 8443));
    assert!(allow.permits("[0:0::1]", 8443));
    assert!(!allow.permits("[::1]", 443));
    assert!(allow.permits("::1", 8443));
    assert!(allow.permits("10.0.0.1", 22));
    assert!(allow.permits("spaced.example", 1));
    assert!(!allow.permits("", 80));
    assert_eq!(
        allow.entries().collect::<Vec<_>>(),
        ["api.example.com", "registry.npmjs.org:443", "[::1]:8443", "10.0.0.1", "spaced.example"]
    );
    assert!(Allow::parse(&[]).unwrap().entries().next().is_none());
    assert!(!Allow::parse(&[]).unwrap().permits("localhost", 80));
}

#[test]
fn bad_allow_entries_are_rejected_with_the_form_expected() {
    for (entry, why) in [
        ("", "empty"),
        ("https://api.example.com", "looks like a URL"),
        ("api.example.com/v1", "path"),
        ("api.example.com:0", "not a port"),
        ("api.example.com:https", "not a port"),
        ("api.example.com:70000", "not a port"),
        ("::1", "needs brackets"),
        ("[::1", "not closed"),
        ("[nope]:443", "not an IPv6 address"),
        ("[::1]443", "expected `:port`"),
        ("*.example.com", "wildcards"),
        ("a..b", "empty label"),
        ("exa mple.com", "cannot appear"),
        (":443", "host is missing"),
    ] {
        let err = Allow::parse(&["ok.example".to_string(), entry.to_string()]).unwrap_err().to_string();
        assert!(err.contains(&format!("`{entry}`")), "{entry:?}: {err}");
        assert!(err.contains(why), "{entry:?}: {err}");
        assert!(err.contains("`host`, `host:port` or `[ipv6-address]:port`"), "{entry:?}: {err}");
        assert!(!err.ends_with('.'), "{err}");
    }
}
