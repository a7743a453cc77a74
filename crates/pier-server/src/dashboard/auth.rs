//! Dashboard sessions: the API token, given once at `/ui/login`, buys a session — a random
//! id in an `HttpOnly`, `SameSite=Strict` cookie, with a CSRF token for its forms — held in
//! memory for [`TTL`]. A restart revokes them all; logging out revokes one.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use axum::extract::{Form, FromRequestParts, Request, State};
use axum::http::request::Parts;
use axum::http::{HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Redirect, Response};
use serde::Deserialize;

use crate::Shared;

const COOKIE: &str = "pier_session";
/// How long a session lasts after login.
pub const TTL: Duration = Duration::from_secs(12 * 3600);
/// Most sessions held at once (memory stays bounded whatever logs in).
const MAX: usize = 4096;

#[derive(Default)]
pub struct Sessions {
    map: Mutex<HashMap<String, (String, Instant)>>,
}

impl Sessions {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, (String, Instant)>> {
        self.map.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A new session: its id and CSRF token; `None` when the table is full of live sessions.
    fn open(&self) -> Option<(String, String)> {
        let mut map = self.lock();
        let now = Instant::now();
        map.retain(|_, (_, until)| *until > now);
        if map.len() >= MAX {
            return None;
        }
        let (id, csrf) = (random(), random());
        map.insert(id.clone(), (csrf.clone(), now + TTL));
        Some((id, csrf))
    }

    fn get(&self, id: &str) -> Option<String> {
        let map = self.lock();
        map.get(id).filter(|(_, until)| *until > Instant::now()).map(|(csrf, _)| csrf.clone())
    }

    fn close(&self, id: &str) {
        self.lock().remove(id);
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
}

impl Session {
    /// A state-changing form must carry this session's CSRF token.
    pub fn check(&self, csrf: &str) -> Result<(), Response> {
        if crate::same(csrf.as_bytes(), self.csrf.as_bytes()) {
            Ok(())
        } else {
            Err((StatusCode::FORBIDDEN, "the form is stale or not from this dashboard; reload the page")
                .into_response())
        }
    }

    /// A short, non-secret name for the record (who answered).
    pub fn short(&self) -> String {
        self.id.chars().take(8).collect()
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

/// Every guarded page: a live session, else to the login page.
pub async fn require(State(app): State<Shared>, mut req: Request, next: Next) -> Response {
    let session = cookie(req.headers()).and_then(|id| app.ui.get(&id).map(|csrf| Session { id, csrf }));
    match session {
        Some(s) => {
            req.extensions_mut().insert(s);
            next.run(req).await
        }
        None if req.method() == axum::http::Method::GET => Redirect::to("/ui/login").into_response(),
        None => (StatusCode::UNAUTHORIZED, "log in again: /ui/login").into_response(),
    }
}

#[derive(Deserialize)]
pub struct LoginForm {
    token: String,
}

pub async fn login(State(app): State<Shared>, Form(f): Form<LoginForm>) -> Response {
    if !crate::same(f.token.trim().as_bytes(), app.token.as_bytes()) {
        let page = super::pages::login(Some("That is not the token of this server."));
        return (StatusCode::UNAUTHORIZED, axum::response::Html(page.into_string())).into_response();
    }
    let Some((id, _)) = app.ui.open() else {
        return (StatusCode::SERVICE_UNAVAILABLE, "too many sessions are open; try again later").into_response();
    };
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
