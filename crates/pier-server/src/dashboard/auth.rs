//! Dashboard sessions: the API token, given once at `/ui/login`, buys a session — a random
//! id in an `HttpOnly`, `SameSite=Strict` cookie, with a CSRF token for its forms — held in
//! memory for [`TTL`]. A restart revokes them all; logging out revokes one, and ends the
//! event streams it opened.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use axum::extract::{Form, FromRequestParts, Request, State};
use axum::http::request::Parts;
use axum::http::{HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Redirect, Response};
use serde::Deserialize;
use tokio_util::sync::CancellationToken;

use crate::Shared;
use crate::access::{self, Role};

const COOKIE: &str = "pier_session";
/// How long a session lasts after login.
pub const TTL: Duration = Duration::from_secs(12 * 3600);
/// Most sessions held at once (memory stays bounded whatever logs in).
const MAX: usize = 4096;

/// One session as the server holds it.
#[derive(Clone)]
struct Held {
    csrf: String,
    until: Instant,
    /// Who logged in: the users file's name for their token, or the name given at login.
    name: String,
    role: Role,
    /// Cancelled when the session is closed: its event streams end.
    ends: CancellationToken,
}

#[derive(Default)]
pub struct Sessions {
    map: Mutex<HashMap<String, Held>>,
}

impl Sessions {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Held>> {
        self.map.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A new session's id. A table full of live sessions gives up its oldest: a login always
    /// gets in, and no one can lock the owner out by logging in again and again.
    fn open(&self, name: String, role: Role) -> String {
        let mut map = self.lock();
        let now = Instant::now();
        map.retain(|_, h| {
            let live = h.until > now;
            if !live {
                h.ends.cancel();
            }
            live
        });
        while map.len() >= MAX {
            let Some(oldest) = map.iter().min_by_key(|(_, h)| h.until).map(|(id, _)| id.clone()) else { break };
            if let Some(h) = map.remove(&oldest) {
                h.ends.cancel();
            }
        }
        let id = random();
        map.insert(id.clone(), Held { csrf: random(), until: now + TTL, name, role, ends: CancellationToken::new() });
        id
    }

    fn get(&self, id: &str) -> Option<Held> {
        self.lock().get(id).filter(|h| h.until > Instant::now()).cloned()
    }

    fn close(&self, id: &str) {
        if let Some(h) = self.lock().remove(id) {
            h.ends.cancel();
        }
    }
}

/// 244 random bits, hex.
fn random() -> String {
    format!("{}{}", uuid::Uuid::new_v4().simple(), uuid::Uuid::new_v4().simple())
}

/// The session of a request that passed [`require`].
#[derive(Clone)]
pub struct Session {
    id: String,
    pub csrf: String,
    name: String,
    role: Role,
    until: Instant,
    ends: CancellationToken,
}

impl Session {
    /// A state-changing form must carry this session's CSRF token.
    pub fn check(&self, csrf: &str) -> Result<(), Response> {
        if crate::same(csrf.as_bytes(), self.csrf.as_bytes()) {
            Ok(())
        } else {
            Err(super::refusal(StatusCode::FORBIDDEN, "The form is stale or not from this dashboard: reload the page."))
        }
    }

    /// Who acts, for the audit trail: `dashboard:NAME`.
    pub fn by(&self) -> String {
        format!("dashboard:{}", self.name)
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// Whether the session's role may do what needs `role` (the pages show only such forms).
    pub fn may(&self, role: Role) -> bool {
        self.role >= role
    }

    /// A token cancelled when the session ends: logged out, or expired.
    pub fn ending(&self) -> CancellationToken {
        let token = self.ends.child_token();
        let (t, until) = (token.clone(), tokio::time::Instant::from_std(self.until));
        tokio::spawn(async move {
            tokio::select! {
                _ = t.cancelled() => {}
                _ = tokio::time::sleep_until(until) => t.cancel(),
            }
        });
        token
    }
}

impl<S: Send + Sync> FromRequestParts<S> for Session {
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Self::Rejection> {
        parts.extensions.get::<Session>().cloned().ok_or_else(|| Redirect::to("/ui/login").into_response())
    }
}

fn cookie(headers: &axum::http::HeaderMap) -> Option<String> {
    headers.get_all(header::COOKIE).iter().filter_map(|v| v.to_str().ok()).flat_map(|v| v.split(';')).find_map(|kv| {
        let (k, v) = kv.trim().split_once('=')?;
        (k == COOKIE).then(|| v.to_owned())
    })
}

/// Every guarded page: a live session, else to the login page. What it serves is the
/// session's own: never stored by a cache (the Back button after logout shows nothing).
pub async fn require(State(app): State<Shared>, mut req: Request, next: Next) -> Response {
    let session = cookie(req.headers()).and_then(|id| {
        app.ui.get(&id).map(|h| Session { id, csrf: h.csrf, name: h.name, role: h.role, until: h.until, ends: h.ends })
    });
    let Some(s) = session else {
        return Redirect::to("/ui/login").into_response();
    };
    let needed = access::needs(req.method(), req.uri().path());
    if !s.may(needed) {
        let message = format!("{} is a {}: this needs the {} role.", s.name, s.role.as_str(), needed.as_str());
        return super::refusal(StatusCode::FORBIDDEN, &message);
    }
    req.extensions_mut().insert(s);
    let mut resp = next.run(req).await;
    resp.headers_mut().insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    resp
}

#[derive(Deserialize)]
pub struct LoginForm {
    token: String,
    /// Who logs in, for the audit trail (a users file's token names its person instead).
    #[serde(default)]
    name: String,
}

pub async fn login(
    State(app): State<Shared>,
    crate::throttle::Client(client): crate::throttle::Client,
    Form(f): Form<LoginForm>,
) -> Response {
    if let Err(wait) = app.throttle.check(client) {
        let secs = wait.as_secs() + u64::from(wait.subsec_nanos() > 0);
        let page = super::pages::login(
            Some(&format!("Too many wrong tokens from here; try again in {secs} s.")),
            app.users.is_some(),
        );
        let mut resp = (StatusCode::TOO_MANY_REQUESTS, axum::response::Html(page.into_string())).into_response();
        if let Ok(v) = HeaderValue::from_str(&secs.to_string()) {
            resp.headers_mut().insert(header::RETRY_AFTER, v);
        }
        return resp;
    }
    let refuse = |status: StatusCode, why: &str| {
        let page = super::pages::login(Some(why), app.users.is_some());
        (status, axum::response::Html(page.into_string())).into_response()
    };
    let Some(caller) = app.caller(f.token.trim()) else {
        app.throttle.failed(client);
        return refuse(StatusCode::UNAUTHORIZED, "That is not the token of this server.");
    };
    let name = match caller.name {
        Some(name) => name,
        None => {
            let name = f.name.trim();
            if name.is_empty() || name.chars().count() > 64 || name.chars().any(char::is_control) {
                return refuse(
                    StatusCode::BAD_REQUEST,
                    "Give your name (1 to 64 characters): answers are recorded with it.",
                );
            }
            name.to_owned()
        }
    };
    let id = app.ui.open(name, caller.role);
    let mut resp = Redirect::to("/ui/").into_response();
    let value = format!("{COOKIE}={id}; HttpOnly; SameSite=Strict; Path=/; Max-Age={}", TTL.as_secs());
    if let Ok(v) = HeaderValue::from_str(&value) {
        resp.headers_mut().insert(header::SET_COOKIE, v);
    }
    resp
}

#[derive(Deserialize)]
pub struct LogoutForm {
    csrf: String,
}

pub async fn logout(State(app): State<Shared>, s: Session, Form(f): Form<LogoutForm>) -> Response {
    if let Err(refused) = s.check(&f.csrf) {
        return refused;
    }
    app.ui.close(&s.id);
    let mut resp = Redirect::to("/ui/login").into_response();
    resp.headers_mut().insert(
        header::SET_COOKIE,
        HeaderValue::from_static("pier_session=; HttpOnly; SameSite=Strict; Path=/; Max-Age=0"),
    );
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_table_gives_up_its_oldest_session_for_a_new_login() {
        let sessions = Sessions::default();
        let first = sessions.open("first".into(), Role::Admin);
        let ends = sessions.get(&first).map(|h| h.ends);
        for _ in 1..MAX {
            sessions.open("other".into(), Role::Viewer);
        }
        assert!(sessions.get(&first).is_some(), "full, nothing given up yet");
        let newest = sessions.open("newest".into(), Role::Viewer);
        assert!(sessions.get(&newest).is_some(), "a login always gets in");
        assert!(sessions.get(&first).is_none(), "the oldest made room");
        assert!(ends.is_some_and(|e| e.is_cancelled()), "and its event streams end");
        assert_eq!(sessions.lock().len(), MAX);
    }
}
