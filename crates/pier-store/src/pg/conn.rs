//! Connections: the pool the reads and the committer draw from, errors as the store's,
//! and rows as cells.

use std::collections::HashMap;
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::{Client, Statement};

use super::target::{Target, tls_advice};
use crate::backend::{Cell, Query, Row};
use crate::ops::Arg;
use crate::{StoreError, lock};

/// Connections one store opens at most; callers beyond it wait for one to come back.
pub(super) const MAX_CONNECTIONS: usize = 16;
// One write connection per store, on the committer thread: measured on B5, four writers
// were slower (115 vs 172 tasks/s): smaller groups, more WAL flushes, and the counter row
// serialises their commits anyway.

thread_local! {
    /// The committer thread's runtime, which drives its connection; none elsewhere.
    pub(super) static LOCAL: std::cell::RefCell<Option<tokio::runtime::Runtime>> = const { std::cell::RefCell::new(None) };
}

/// Waits for `f`: on the committer thread by driving its own runtime (and with it the
/// connection), elsewhere by parking until the store's runtime has done the work.
pub(crate) fn block_on<F: std::future::Future>(f: F) -> F::Output {
    LOCAL.with(|l| match l.borrow().as_ref() {
        Some(rt) => rt.block_on(f),
        None => futures::executor::block_on(f),
    })
}
/// How long an operation waits for the database to come back before it fails.
pub(super) const PATIENCE: Duration = Duration::from_secs(60);
/// Transactions retried at most after a serialization failure, a deadlock or a lost connection.
pub(super) const RETRIES: u32 = 8;

impl From<tokio_postgres::Error> for StoreError {
    fn from(e: tokio_postgres::Error) -> Self {
        if e.code() == Some(&tokio_postgres::error::SqlState::UNIQUE_VIOLATION) {
            return StoreError::Duplicate(describe(&e));
        }
        StoreError::Db(describe(&e))
    }
}

pub(super) fn describe(e: &tokio_postgres::Error) -> String {
    match e.as_db_error() {
        Some(db) => format!("PostgreSQL: {} ({})", db.message(), db.code().code()),
        None => {
            // The cause is in the chain ("error performing TLS handshake" alone says little).
            let mut text = format!("PostgreSQL: {e}");
            let mut cause = std::error::Error::source(e);
            while let Some(c) = cause {
                text.push_str(&format!(": {c}"));
                cause = c.source();
            }
            text
        }
    }
}

/// Whether the transaction that met `e` was rolled back and may simply run again.
pub(super) fn retryable(e: &tokio_postgres::Error) -> bool {
    use tokio_postgres::error::SqlState;
    if e.is_closed() {
        return true;
    }
    e.code().is_some_and(|c| {
        [
            SqlState::T_R_SERIALIZATION_FAILURE,
            SqlState::T_R_DEADLOCK_DETECTED,
            SqlState::ADMIN_SHUTDOWN,
            SqlState::CRASH_SHUTDOWN,
            SqlState::CANNOT_CONNECT_NOW,
        ]
        .contains(c)
    }) || e.as_db_error().is_none() && e.to_string().contains("connection")
}

/// A pooled connection and its prepared statements.
pub(super) struct Conn {
    pub(super) client: Client,
    pub(super) statements: HashMap<&'static str, Statement>,
    /// The runs its claims found tasks with concurrency keys in.
    pub(super) keyed_runs: super::tx::KeyedRuns,
    /// A read on it failed in a way that another try on a fresh connection may not.
    pub(super) broken: bool,
}

pub(super) struct Pool {
    pub(super) target: Target,
    /// The store's runtime, which drives the connections.
    pub(super) rt: tokio::runtime::Handle,
    pub(super) idle: Mutex<(Vec<Conn>, usize)>,
    pub(super) returned: Condvar,
    /// When the current outage began, if the database is unreachable (one log line each way).
    pub(super) outage: Mutex<Option<Instant>>,
}

impl Pool {
    pub(super) fn connect(&self) -> Result<Conn, StoreError> {
        let deadline = Instant::now() + PATIENCE;
        let mut delay = Duration::from_millis(50);
        loop {
            match connect_on(&self.rt, &self.target) {
                Ok(client) => {
                    if let Some(since) = lock(&self.outage).take() {
                        tracing::warn!(after = ?since.elapsed(), "the database is back");
                    }
                    return Ok(Conn {
                        client,
                        statements: HashMap::new(),
                        keyed_runs: Default::default(),
                        broken: false,
                    });
                }
                Err(e) if e.permanent => return Err(StoreError::Db(e.text)),
                Err(ConnectError { text: e, .. }) => {
                    {
                        let mut outage = lock(&self.outage);
                        if outage.is_none() {
                            *outage = Some(Instant::now());
                            tracing::warn!(error = %e, "cannot reach the database; retrying with backoff");
                        }
                    }
                    if Instant::now() + delay > deadline {
                        return Err(StoreError::Db(format!(
                            "the database has been unreachable for {}s: {}; check that PostgreSQL runs and the \
                             store URL is right",
                            PATIENCE.as_secs(),
                            e
                        )));
                    }
                    std::thread::sleep(delay);
                    delay = (delay * 2).min(Duration::from_secs(2));
                }
            }
        }
    }

    pub(super) fn get(&self) -> Result<Conn, StoreError> {
        {
            let mut idle = lock(&self.idle);
            loop {
                if let Some(c) = idle.0.pop() {
                    if !c.client.is_closed() {
                        return Ok(c);
                    }
                    idle.1 -= 1;
                    continue;
                }
                if idle.1 < MAX_CONNECTIONS {
                    idle.1 += 1;
                    break;
                }
                idle = self.returned.wait(idle).unwrap_or_else(std::sync::PoisonError::into_inner);
            }
        }
        self.connect().inspect_err(|_| {
            lock(&self.idle).1 -= 1;
            self.returned.notify_one();
        })
    }

    pub(super) fn put(&self, c: Conn) {
        let mut idle = lock(&self.idle);
        if c.client.is_closed() {
            idle.1 -= 1;
        } else {
            idle.0.push(c);
        }
        self.returned.notify_one();
    }

    /// Runs `f` on a pooled connection, once more on a fresh one if the connection broke.
    pub(super) fn with<T>(&self, f: impl Fn(&mut Conn) -> Result<T, tokio_postgres::Error>) -> Result<T, StoreError> {
        let mut tries = 0;
        loop {
            let mut c = self.get()?;
            let out = f(&mut c);
            self.put(c);
            match out {
                Err(e) if retryable(&e) && tries < RETRIES => tries += 1,
                out => return out.map_err(StoreError::from),
            }
        }
    }
}

/// Why a connection could not be made, and whether trying again could help: not when the
/// server refused who we are (authentication, `pg_hba.conf`), the database does not exist,
/// or TLS cannot be had or trusted.
pub(super) struct ConnectError {
    pub(super) text: String,
    pub(super) permanent: bool,
}

impl ConnectError {
    pub(super) fn of(e: &tokio_postgres::Error) -> ConnectError {
        let text = describe(e);
        let refused = e.as_db_error().is_some_and(|db| {
            let code = db.code().code();
            code.starts_with("28") || code == "3D000"
        });
        match tls_advice(&text) {
            Some(advice) => ConnectError { permanent: true, text: format!("{text}; {advice}") },
            None => ConnectError { permanent: refused, text },
        }
    }
}

/// Connects on the store's runtime, which then drives the connection until it closes.
pub(super) fn connect_on(rt: &tokio::runtime::Handle, target: &Target) -> Result<Client, ConnectError> {
    // Connects, and leaves the connection to the runtime this runs on.
    async fn connect(Target { config, tls }: Target) -> Result<Client, ConnectError> {
        let (client, connection) = config.connect(tls).await.map_err(|e| ConnectError::of(&e))?;
        tokio::spawn(async move {
            if let Err(e) = connection.await {
                tracing::debug!(error = %e, "a database connection ended");
            }
        });
        Ok(client)
    }
    // The committer thread's connection is driven by its own runtime, while it waits.
    let here = LOCAL.with(|l| l.borrow().as_ref().map(|local| local.block_on(connect(target.clone()))));
    if let Some(connected) = here {
        return connected;
    }
    let connected = rt.spawn(connect(target.clone()));
    // A join error: the runtime is shutting down with the store.
    block_on(connected)
        .unwrap_or_else(|e| Err(ConnectError { text: format!("the database runtime stopped: {e}"), permanent: true }))
}

/// `?N` placeholders as PostgreSQL's `$N`.
pub(super) fn dialect(sql: &str) -> String {
    let mut out = String::with_capacity(sql.len());
    let mut chars = sql.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '?' && chars.peek().is_some_and(char::is_ascii_digit) {
            out.push('$');
        } else {
            out.push(c);
        }
    }
    out
}

impl Conn {
    pub(super) fn statement(&mut self, sql: &'static str) -> Result<Statement, tokio_postgres::Error> {
        if let Some(s) = self.statements.get(sql) {
            return Ok(s.clone());
        }
        let s = block_on(self.client.prepare(&dialect(sql)))?;
        self.statements.insert(sql, s.clone());
        Ok(s)
    }
}

impl ToSql for Arg<'_> {
    fn to_sql(
        &self,
        ty: &Type,
        out: &mut tokio_postgres::types::private::BytesMut,
    ) -> Result<tokio_postgres::types::IsNull, Box<dyn std::error::Error + Sync + Send>> {
        match self {
            Arg::Int(i) => i.to_sql(ty, out),
            Arg::OptInt(i) => i.to_sql(ty, out),
            Arg::Text(t) => t.to_sql(ty, out),
            Arg::OptText(t) => t.to_sql(ty, out),
        }
    }

    fn accepts(ty: &Type) -> bool {
        <i64 as ToSql>::accepts(ty) || <&str as ToSql>::accepts(ty)
    }

    tokio_postgres::types::to_sql_checked!();
}

pub(super) fn args<'a>(a: &'a [Arg<'a>]) -> Vec<&'a (dyn ToSql + Sync)> {
    a.iter().map(|x| x as &(dyn ToSql + Sync)).collect()
}

/// A row as cells, each column by its type: integers, booleans (as 0 or 1) and text.
pub(super) fn cells(r: &tokio_postgres::Row) -> Result<Row, tokio_postgres::Error> {
    let mut out = Vec::with_capacity(r.len());
    for (i, column) in r.columns().iter().enumerate() {
        let ty = column.type_();
        let cell = if *ty == Type::INT8 {
            r.try_get::<_, Option<i64>>(i)?.map_or(Cell::Null, Cell::Int)
        } else if *ty == Type::INT4 {
            r.try_get::<_, Option<i32>>(i)?.map_or(Cell::Null, |n| Cell::Int(n.into()))
        } else if *ty == Type::INT2 {
            r.try_get::<_, Option<i16>>(i)?.map_or(Cell::Null, |n| Cell::Int(n.into()))
        } else if *ty == Type::BOOL {
            r.try_get::<_, Option<bool>>(i)?.map_or(Cell::Null, |b| Cell::Int(b.into()))
        } else {
            r.try_get::<_, Option<String>>(i)?.map_or(Cell::Null, Cell::Text)
        };
        out.push(cell);
    }
    Ok(Row(out))
}

impl From<&tokio_postgres::Error> for StoreError {
    fn from(e: &tokio_postgres::Error) -> Self {
        StoreError::Db(describe(e))
    }
}

/// One connection for an administrative statement, on a runtime of its own.
pub(super) fn connect_once(url: &str) -> Result<Client, StoreError> {
    let target = Target::parse(url)?;
    let rt = ADMIN.get_or_init(|| {
        tokio::runtime::Builder::new_current_thread().enable_all().build().map(|rt| {
            let handle = rt.handle().clone();
            std::thread::spawn(move || rt.block_on(std::future::pending::<()>()));
            handle
        })
    });
    let rt = rt.as_ref().map_err(|e| StoreError::Db(format!("cannot start a runtime: {e}")))?;
    connect_on(rt, &target).map_err(|e| StoreError::Db(e.text))
}

/// The runtime of administrative connections (tests and benchmarks creating databases).
static ADMIN: std::sync::OnceLock<std::io::Result<tokio::runtime::Handle>> = std::sync::OnceLock::new();

impl Query for Conn {
    fn rows(&mut self, sql: &'static str, a: &[Arg<'_>]) -> Result<Vec<Row>, StoreError> {
        let read = self.statement(sql).and_then(|s| block_on(self.client.query(&s, &args(a))));
        let rows = read.and_then(|rows| rows.iter().map(cells).collect::<Result<Vec<_>, _>>());
        rows.map_err(|e| {
            self.broken = retryable(&e);
            StoreError::from(e)
        })
    }
}
