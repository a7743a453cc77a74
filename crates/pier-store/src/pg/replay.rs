//! What a job of the rounds asks and is answered: its statements noted with owned arguments,
//! and the answers replayed to it when it runs again from its start.

use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::{Row, Statement};

use crate::StoreError;
use crate::ops::Arg;

/// A statement's argument, owned: it is sent after the job that asked for it has stopped.
#[derive(Debug, Clone)]
pub(crate) enum Owned {
    Int(i64),
    OptInt(Option<i64>),
    Text(String),
    OptText(Option<String>),
}

impl From<&Arg<'_>> for Owned {
    fn from(a: &Arg<'_>) -> Owned {
        match *a {
            Arg::Int(i) => Owned::Int(i),
            Arg::OptInt(i) => Owned::OptInt(i),
            Arg::Text(t) => Owned::Text(t.to_owned()),
            Arg::OptText(t) => Owned::OptText(t.map(str::to_owned)),
        }
    }
}

impl Owned {
    /// The text it holds (empty for another kind of argument).
    pub(crate) fn text(&self) -> String {
        match self {
            Owned::Text(t) | Owned::OptText(Some(t)) => t.clone(),
            _ => String::new(),
        }
    }

    fn arg(&self) -> Arg<'_> {
        match self {
            Owned::Int(i) => Arg::Int(*i),
            Owned::OptInt(i) => Arg::OptInt(*i),
            Owned::Text(t) => Arg::Text(t),
            Owned::OptText(t) => Arg::OptText(t.as_deref()),
        }
    }
}

/// Encoded as the borrowed [`Arg`] it was made from.
impl ToSql for Owned {
    fn to_sql(
        &self,
        ty: &Type,
        out: &mut tokio_postgres::types::private::BytesMut,
    ) -> Result<tokio_postgres::types::IsNull, Box<dyn std::error::Error + Sync + Send>> {
        self.arg().to_sql(ty, out)
    }

    fn accepts(ty: &Type) -> bool {
        <Arg<'_> as ToSql>::accepts(ty)
    }

    tokio_postgres::types::to_sql_checked!();
}

/// A statement a job asked for.
pub(crate) struct Want {
    pub sql: &'static str,
    pub statement: Statement,
    pub args: Vec<Owned>,
    /// Rows wanted (`query`), or the count of rows changed (`execute`).
    pub rows: bool,
}

/// What a statement answered.
#[derive(Clone)]
pub(crate) enum Answer {
    Rows(Vec<Row>),
    Count(u64),
}

/// One job's part in the rounds.
#[derive(Default)]
pub(crate) struct Replay {
    /// Each call answered so far: its statements (to tell a diverging run) and their answers.
    pub(super) calls: Vec<(Vec<&'static str>, Vec<Answer>)>,
    /// The call the current run is at.
    pub(super) next: usize,
    /// The new call the current run stopped at.
    pub wanted: Option<Vec<Want>>,
    /// The current run asked for other statements than an earlier run had at the same call.
    pub diverged: bool,
}

impl Replay {
    /// The answers to the run's next call, which asks for `sqls`; `None` if it is new (the
    /// caller notes it in `wanted`) or the run diverged or already stopped (a job that went
    /// on after its stop is dropped all the same).
    pub fn answer(&mut self, sqls: &[&'static str]) -> Option<Vec<Answer>> {
        if self.wanted.is_some() || self.diverged {
            return None;
        }
        let (asked, answers) = self.calls.get(self.next)?;
        if asked.as_slice() != sqls {
            self.diverged = true;
            return None;
        }
        self.next += 1;
        Some(answers.clone())
    }
}

impl Answer {
    pub fn rows(self) -> Result<Vec<Row>, StoreError> {
        match self {
            Answer::Rows(rows) => Ok(rows),
            Answer::Count(_) => Err(no_answer()),
        }
    }

    pub fn count(self) -> Result<u64, StoreError> {
        match self {
            Answer::Count(n) => Ok(n),
            Answer::Rows(_) => Err(no_answer()),
        }
    }
}

/// A call answered with something else than it asked for (a defect, never the database's doing).
pub(crate) fn no_answer() -> StoreError {
    StoreError::Db("a statement of a round came back without the answer it asked for".into())
}
