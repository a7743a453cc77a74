//! The schema, written once for both databases. A backend's migrations are lists of these
//! statements (SQLite's history is longer: its stores predate PostgreSQL's); `{INT}` is the
//! dialect's 64-bit integer (`INTEGER` in SQLite, where `seq INTEGER PRIMARY KEY` numbers
//! events in the writing transaction; `BIGINT` in PostgreSQL, which numbers them at commit).

/// A migration: its statements, in order.
pub(crate) type Migration = &'static [&'static str];

/// What the two databases spell differently in a migration.
pub(crate) struct Dialect {
    /// `{INT}`: the 64-bit integer type.
    pub(crate) int: &'static str,
    /// `{SPEC_PRIORITY}`: a task row's `spec` (JSON text) `priority`, as an integer (null when absent).
    pub(crate) spec_priority: &'static str,
    /// `{SPEC_CONCURRENCY}`: a task row's `spec` `concurrency`, as JSON text.
    pub(crate) spec_concurrency: &'static str,
}

pub(crate) const SQLITE: Dialect = Dialect {
    int: "INTEGER",
    spec_priority: "CAST(json_extract(spec, '$.priority') AS INTEGER)",
    spec_concurrency: "json_extract(spec, '$.concurrency')",
};
pub(crate) const POSTGRES: Dialect = Dialect {
    int: "BIGINT",
    spec_priority: "CAST(CAST(spec AS jsonb) ->> 'priority' AS BIGINT)",
    spec_concurrency: "CAST(CAST(spec AS jsonb) -> 'concurrency' AS TEXT)",
};

/// The statements of `migration` as one batch in `dialect`.
pub(crate) fn batch(migration: Migration, dialect: &Dialect) -> String {
    let statement = |s: &&str| {
        s.replace("{INT}", dialect.int)
            .replace("{SPEC_PRIORITY}", dialect.spec_priority)
            .replace("{SPEC_CONCURRENCY}", dialect.spec_concurrency)
    };
    migration.iter().map(statement).collect::<Vec<_>>().join(";\n")
}

/// A backend's migrations in order: its own `first`, then every one of [`LATER`] — chained
/// here, so a migration added to `LATER` reaches both databases (a list kept by hand in each
/// once left one out of both).
pub(crate) fn migrations(first: &'static [Migration]) -> impl Iterator<Item = Migration> {
    first.iter().chain(LATER.iter()).copied()
}

/// How many migrations a backend with its own `first` has: its newest schema version.
pub(crate) fn version_count(first: &'static [Migration]) -> usize {
    first.len() + LATER.len()
}

pub(crate) const RUNS: &str = "CREATE TABLE runs (id TEXT PRIMARY KEY, source TEXT NOT NULL, plan TEXT NOT NULL, \
     created_at_ms {INT} NOT NULL)";

pub(crate) const TASKS: &str = "CREATE TABLE tasks (
    run_id TEXT NOT NULL REFERENCES runs(id),
    id TEXT NOT NULL,
    ord {INT} NOT NULL,
    state TEXT NOT NULL CHECK (state IN ('pending','running','awaiting_input','completed','failed','cancelled')),
    version {INT} NOT NULL,
    attempt {INT} NOT NULL DEFAULT 0,
    failures {INT} NOT NULL DEFAULT 0,
    lease_owner TEXT,
    lease_expires_at_ms {INT},
    not_before_ms {INT} NOT NULL DEFAULT 0,
    result TEXT,
    usage TEXT,
    error TEXT,
    spec TEXT NOT NULL,
    PRIMARY KEY (run_id, id))";

/// Pending tasks across all runs, for handing worker tasks out without reading every run.
pub(crate) const TASKS_PENDING: &str = "CREATE INDEX tasks_pending ON tasks(run_id, ord) WHERE state = 'pending'";

/// The tasks a host drives.
pub(crate) const TASKS_UNFINISHED: &str = "CREATE INDEX tasks_unfinished ON tasks(run_id, ord) \
     WHERE state IN ('pending', 'running', 'awaiting_input')";

pub(crate) const ATTEMPTS: &str = "CREATE TABLE attempts (run_id TEXT NOT NULL, task_id TEXT NOT NULL, \
     attempt {INT} NOT NULL, evidence TEXT NOT NULL DEFAULT '[]', PRIMARY KEY (run_id, task_id, attempt))";

/// What each attempt showed (its text, its tool calls), kept when it ends, whatever ended it.
pub(crate) const ATTEMPTS_OUTPUT: &str = "ALTER TABLE attempts ADD COLUMN output TEXT";

/// The first answer to each idempotency key.
pub(crate) const UPDATES: &str = "CREATE TABLE updates (run_id TEXT NOT NULL, task_id TEXT NOT NULL, \
     key TEXT NOT NULL, answer TEXT NOT NULL, PRIMARY KEY (run_id, task_id, key))";

/// The body an idempotency key first came with: a repeat with another body is refused.
pub(crate) const UPDATES_REQUEST: &str = "ALTER TABLE updates ADD COLUMN request TEXT";

pub(crate) const QUESTIONS: &str = "CREATE TABLE questions (run_id TEXT NOT NULL, task_id TEXT NOT NULL, \
     attempt {INT} NOT NULL, n {INT} NOT NULL, request TEXT NOT NULL, answer TEXT, answered_by TEXT, \
     PRIMARY KEY (run_id, task_id, attempt, n))";

pub(crate) const EVENTS: &str = "CREATE TABLE events (seq {INT} PRIMARY KEY, run_id TEXT NOT NULL, task_id TEXT, \
     type TEXT NOT NULL, at_ms {INT} NOT NULL, data TEXT NOT NULL)";

pub(crate) const EVENTS_BY_RUN: &str = "CREATE INDEX events_by_run ON events(run_id, seq)";

/// `pier serve` nodes, and the runs each drives.
pub(crate) const NODES: &str = "CREATE TABLE nodes (id TEXT PRIMARY KEY, started_at_ms {INT} NOT NULL, \
     heartbeat_at_ms {INT} NOT NULL, expires_at_ms {INT} NOT NULL)";

pub(crate) const RUN_LEASES: &str =
    "CREATE TABLE run_leases (run_id TEXT PRIMARY KEY, owner TEXT NOT NULL, expires_at_ms {INT} NOT NULL)";

pub(crate) const RUN_LEASES_BY_OWNER: &str = "CREATE INDEX run_leases_by_owner ON run_leases(owner)";

/// Each agent spec's last `initialize` answer: what it can do.
pub(crate) const AGENTS: &str =
    "CREATE TABLE agents (spec TEXT PRIMARY KEY, init TEXT NOT NULL, seen_at_ms {INT} NOT NULL)";

/// People's messages to running tasks (`pier say`), and which attempt sent each.
pub(crate) const MESSAGES: &str = "CREATE TABLE messages (run_id TEXT NOT NULL, task_id TEXT NOT NULL, \
     n {INT} NOT NULL, text TEXT NOT NULL, interrupt {INT} NOT NULL, at_ms {INT} NOT NULL, sent_attempt {INT}, \
     PRIMARY KEY (run_id, task_id, n))";

/// Once how an inbox closed; it closes with the attempt's ending now (`Last::unless_messages`).
pub(crate) const MESSAGES_CLOSED: &str = "CREATE TABLE messages_closed (run_id TEXT NOT NULL, \
     task_id TEXT NOT NULL, attempt {INT} NOT NULL, PRIMARY KEY (run_id, task_id, attempt))";

pub(crate) const DROP_MESSAGES_CLOSED: &str = "DROP TABLE messages_closed";

/// A run's spend is summed from its `model_request` events: found without reading the rest of
/// its log (the queries name the type as this literal, so both planners use the index).
pub(crate) const EVENTS_MODEL_REQUESTS: &str =
    "CREATE INDEX events_model_requests ON events(run_id, seq) WHERE type = 'model_request'";

/// Pull workers, as they last asked for work.
pub(crate) const WORKERS: &str =
    "CREATE TABLE workers (name TEXT PRIMARY KEY, capabilities TEXT NOT NULL, seen_at_ms {INT} NOT NULL)";

/// A person's cancel of a task a live attempt holds, waiting for that attempt to end it (with
/// its output, in one commit): the reason given, or NULL.
pub(crate) const TASKS_CANCEL_REQUESTED: &str = "ALTER TABLE tasks ADD COLUMN cancel_requested TEXT";

/// A run's age beside its id, so a lookup or an ordering of runs by age is answered from this
/// index alone: in SQLite `created_at_ms` comes after the run's plan in its row, and reading
/// it there walks every overflow page of the plan (a 3,000-task plan: hundreds of pages on
/// every lease of a worker).
pub(crate) const RUNS_AGE: &str = "CREATE INDEX runs_age ON runs(id, created_at_ms)";

/// A task with concurrency keys (its spec's `concurrency`) is 1, others NULL: PostgreSQL's
/// fused claim takes only the others, and leaves these to the claim that counts their holders.
pub(crate) const TASKS_KEYED: &str = "ALTER TABLE tasks ADD COLUMN keyed {INT}";

/// Once the attempts that held each concurrency key, as their claims wrote them (dropped when
/// holders came to be read from the tasks: `TASKS_HOLDING`).
pub(crate) const KEY_HOLDERS: &str = "CREATE TABLE key_holders (key TEXT NOT NULL, run_id TEXT NOT NULL,
    task_id TEXT NOT NULL, attempt {INT} NOT NULL, PRIMARY KEY (key, run_id, task_id))";

/// Each concurrency key's count of holders as PostgreSQL's claims keep it (`pg::tx::CLAIM_HELD`):
/// never below the key's live holders, because a claim raises it under the row's lock, an
/// ending that applies lowers it by the place it gave back, and a claim that has counted the
/// key's holders under that lock sets it to their number. A key without a row is counted from
/// its holders. SQLite's claims, one writer at a time, count the holders each time and leave
/// this table empty.
pub(crate) const KEY_COUNTS: &str = "CREATE TABLE key_counts (key TEXT PRIMARY KEY, held {INT} NOT NULL)";

/// A task's concurrency keys (its spec's `concurrency`, JSON) beside it when it has any, so
/// PostgreSQL's claims and endings read them without parsing the whole spec (its prompt too).
pub(crate) const TASKS_CONCURRENCY: &str = "ALTER TABLE tasks ADD COLUMN concurrency TEXT";

/// The keys of the tasks stored before `concurrency` had a column.
pub(crate) const TASKS_CONCURRENCY_BACKFILL: &str =
    "UPDATE tasks SET concurrency = {SPEC_CONCURRENCY} WHERE keyed IS NOT NULL";

/// The tasks that may hold their concurrency keys (a running attempt, or one waiting for an
/// answer): how a key's live holders are found (`crate::keys`) without reading the pending or
/// ended ones; every live keyed task's keys are read, whatever its keys.
pub(crate) const TASKS_HOLDING: &str =
    "CREATE INDEX tasks_holding ON tasks(keyed) WHERE keyed IS NOT NULL AND state IN ('running', 'awaiting_input')";

/// Holders are read from the tasks since `tasks_holding`.
pub(crate) const DROP_KEY_HOLDERS: &str = "DROP TABLE key_holders";

/// Schedules: the spec as written (JSON), who paused it (NULL: it runs), the next occurrence not
/// yet handled (NULL: none comes), and the last one handled, with its run and what was done.
/// Hosts move `next_at_ms` fenced on the value they read, in the commit that creates the run.
pub(crate) const SCHEDULES: &str = "CREATE TABLE schedules (id TEXT PRIMARY KEY, spec TEXT NOT NULL,
    source TEXT NOT NULL, paused_by TEXT, next_at_ms {INT}, last_at_ms {INT}, last_run TEXT, last_note TEXT,
    created_at_ms {INT} NOT NULL, updated_at_ms {INT} NOT NULL)";

/// A task's stated priority (its spec's), beside it: what `rank_ms` is reckoned from.
pub(crate) const TASKS_PRIORITY: &str = "ALTER TABLE tasks ADD COLUMN priority {INT} NOT NULL DEFAULT 0";

/// Once how pull workers found the tasks with a priority; `tasks_queue` since.
pub(crate) const TASKS_URGENT: &str =
    "CREATE INDEX tasks_urgent ON tasks(priority, run_id, ord) WHERE state = 'pending' AND priority > 0";

/// A task's transitions (its attempts' times), found without reading the rest of its run's log
/// (the query names the type as this literal, so both planners use the index).
pub(crate) const EVENTS_TRANSITIONS: &str =
    "CREATE INDEX events_transitions ON events(run_id, task_id, seq) WHERE type = 'transition'";

/// Tasks stored before `priority` had a column (migration 12) read 0 there whatever their spec
/// says: a pending one gets its spec's, so it is claimed in its place.
pub(crate) const TASKS_PRIORITY_BACKFILL: &str = "UPDATE tasks SET priority = {SPEC_PRIORITY} \
    WHERE state = 'pending' AND priority = 0 AND {SPEC_PRIORITY} > 0";

/// Where a pending task stands in the queue pull workers lease from (`crate::queue::rank`):
/// when it last became pending, earlier by a minute per level of priority. Written by the
/// statement that makes it pending (its insert, `ops::transition_event` for every move back).
pub(crate) const TASKS_RANK: &str = "ALTER TABLE tasks ADD COLUMN rank_ms {INT} NOT NULL DEFAULT 0";

/// The pending tasks of a store written before `rank_ms`: ranked from their last move as the
/// log says (60,000 ms a level, `queue::AGE_MS` when this was written).
pub(crate) const TASKS_RANK_BACKFILL: &str = "UPDATE tasks SET rank_ms = COALESCE((SELECT MAX(e.at_ms) \
    FROM events e WHERE e.run_id = tasks.run_id AND e.task_id = tasks.id AND e.type IN ('task_created', 'transition')), \
    0) - priority * 60000 WHERE state = 'pending'";

/// The queue in lease order: lowest rank first, then by run and place in the plan.
pub(crate) const TASKS_QUEUE: &str = "CREATE INDEX tasks_queue ON tasks(rank_ms, run_id, ord) WHERE state = 'pending'";

pub(crate) const DROP_TASKS_URGENT: &str = "DROP INDEX tasks_urgent";

/// The rest of `TASKS_PRIORITY_BACKFILL`: a task stored before the column that is not pending
/// now but may be again (a retry, a person's, a lost attempt) gets its spec's priority too, so
/// its rank on the way back counts it. A completed task never returns and is left as it is.
pub(crate) const TASKS_PRIORITY_BACKFILL_REST: &str = "UPDATE tasks SET priority = {SPEC_PRIORITY} \
    WHERE state <> 'completed' AND priority = 0 AND {SPEC_PRIORITY} > 0";

/// The migrations both databases end with, after each one's first.
pub(crate) const LATER: [Migration; 17] = [
    &[NODES, RUN_LEASES, RUN_LEASES_BY_OWNER],
    &[ATTEMPTS_OUTPUT],
    &[AGENTS],
    &[MESSAGES, MESSAGES_CLOSED],
    &[DROP_MESSAGES_CLOSED],
    &[EVENTS_MODEL_REQUESTS],
    &[WORKERS],
    &[TASKS_CANCEL_REQUESTED],
    &[RUNS_AGE],
    &[TASKS_KEYED, KEY_HOLDERS],
    &[SCHEDULES],
    &[TASKS_PRIORITY, TASKS_URGENT],
    &[EVENTS_TRANSITIONS],
    &[TASKS_PRIORITY_BACKFILL],
    &[TASKS_RANK, TASKS_RANK_BACKFILL, TASKS_QUEUE, DROP_TASKS_URGENT],
    &[TASKS_PRIORITY_BACKFILL_REST],
    &[KEY_COUNTS, TASKS_CONCURRENCY, TASKS_CONCURRENCY_BACKFILL, TASKS_HOLDING, DROP_KEY_HOLDERS],
];
