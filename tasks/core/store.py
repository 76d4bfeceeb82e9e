"""The log store: every shown suggestion, every outcome, the A/B arms (SQLAlchemy Core).

SQLite (WAL, synchronous=FULL) by default, PostgreSQL through ``TABRL_DATABASE_URL``; one schema
for both, created on start and stamped with ``SCHEMA_VERSION`` in ``schema_version``. A store made by
an older tabrl is migrated in place on start (``MIGRATIONS``: columns added; only the few rows of the arms table
are rewritten, re-keyed by team), so old stores keep working; a store from a newer tabrl is refused.
A completion row is committed before its response is sent, so an acknowledged suggestion is
never lost when the gateway dies; a client that hung up before the answer was sent gets its row
stamped ``cancelled_at`` (never shown: ``tasks/core/outcomes.py``).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from tasks.core.config import BackendName, check_backend
from tasks.core.tables import (
    api_keys,
    arms,
    completions,
    feedback,
    late_feedback,
    metadata,
    schema_version,
    snapshots,
    store_info,
    teams,
    users,
    watermarks,
)
from tasks.core.teams import ORG, check_team

__all__ = [
    "metadata",
    "schema_version",
    "completions",
    "feedback",
    "arms",
    "api_keys",
    "teams",
    "users",
    "watermarks",
    "snapshots",
    "store_info",
    "late_feedback",
]

SCHEMA_VERSION = 4


def make_engine(url: str, timeout_s: float = 30.0) -> Engine:
    """An engine for the log store; SQLite gets WAL and full fsync, and its directory is created.

    timeout_s bounds the wait for a locked SQLite file (busy timeout) or for a PostgreSQL connection
    (connect and pool checkout); past it the operation raises instead of waiting on."""
    if url.startswith("sqlite"):
        db_path = sa.engine.make_url(url).database
        if db_path and db_path != ":memory:":
            Path(db_path).parent.mkdir(parents=True, exist_ok=True)
        engine = sa.create_engine(url, connect_args={"check_same_thread": False, "timeout": timeout_s})

        @sa.event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA synchronous=FULL")
            cur.execute(f"PRAGMA busy_timeout={int(timeout_s * 1000)}")
            cur.close()

        return engine
    return sa.create_engine(
        url,
        pool_pre_ping=True,
        pool_size=10,
        max_overflow=20,
        pool_timeout=timeout_s,
        connect_args={"connect_timeout": max(1, round(timeout_s))},
    )


class Store:
    """The log store at one URL: its engine, made here and nowhere else, opened once and closed once.

        with Store(url) as store:       # tables created (or migrated) on entry, the engine disposed on exit
            read_arms(store.engine)

    A long-lived owner (the gateway) keeps ``Store(url).engine`` for its process's life."""

    def __init__(self, url: str, timeout_s: float = 30.0) -> None:
        self.url = url
        self.engine = make_engine(url, timeout_s)

    def __enter__(self) -> Store:
        try:
            init_schema(self.engine)
        except BaseException:
            self.engine.dispose()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.engine.dispose()


@contextmanager
def open_store(url: str) -> Iterator[Engine]:
    """The store at url with its tables created, for one piece of work; the engine is disposed after it."""
    with Store(url) as store:
        yield store.engine


MIGRATIONS: dict[int, tuple[tuple[str, str], ...]] = {
    2: (("arms", "served_model"), ("arms", "adapter")),
    3: (
        ("completions", "cancelled_at"),
        ("completions", "reports_outcomes"),
        ("feedback", "shown"),
        ("api_keys", "reports_outcomes"),
    ),
    4: (("completions", "team"), ("completions", "arm_team"), ("api_keys", "team"), ("snapshots", "team")),
}
"""Version -> the (table, column) pairs it added: nullable columns, so an older store is brought up to date by
adding them, and its rows keep their meaning (NULL: what the older tabrl did). Schema 4 also re-keys the arms
(`_key_arms_by_team`), the one table rewritten: a few rows."""


def init_schema(engine: Engine) -> None:
    """Create missing tables, migrate an older store, stamp the schema version; refuse a store from a newer tabrl."""
    metadata.create_all(engine)
    with engine.begin() as conn:
        found = conn.execute(sa.select(sa.func.max(schema_version.c.version))).scalar()
        if found is not None and found > SCHEMA_VERSION:
            raise RuntimeError(
                f"log store schema version {found} is newer than this tabrl's {SCHEMA_VERSION}; upgrade tabrl"
            )
        for version in range((found or SCHEMA_VERSION) + 1, SCHEMA_VERSION + 1):
            _add_columns(conn, MIGRATIONS[version])
            conn.execute(schema_version.insert().values(version=version, applied_at=time.time()))
        if found is None:  # a new store, or the tables of a start that died before stamping: bring them up to date
            _add_columns(conn, [pair for pairs in MIGRATIONS.values() for pair in pairs])
            conn.execute(schema_version.insert().values(version=SCHEMA_VERSION, applied_at=time.time()))
        _key_arms_by_team(conn)
        if conn.execute(sa.select(store_info.c.value).where(store_info.c.key == "id")).first() is None:
            conn.execute(store_info.insert().values(key="id", value=uuid.uuid4().hex))


def store_id(conn_or_engine: Connection | Engine) -> str:
    """This store's id, drawn when it was made: what names it to services that several stores share (the Prefect
    slots of its cycles: two demos on one machine share Prefect's ephemeral database, not a log store)."""
    with _connect(conn_or_engine) as conn:
        return str(conn.execute(sa.select(store_info.c.value).where(store_info.c.key == "id")).scalar_one())


def _key_arms_by_team(conn: Connection) -> None:
    """An arms table keyed by name alone (schema < 4) becomes the (team, name) one, its arms the organisation's.
    In the migration's transaction: the table holds a few rows, and every gateway re-reads it after."""
    if "team" in {c["name"] for c in sa.inspect(conn).get_columns("arms")}:
        return
    old = [dict(row) for row in conn.execute(sa.text("SELECT * FROM arms")).mappings()]
    conn.execute(sa.text("DROP TABLE arms"))
    arms.create(conn)
    if old:
        conn.execute(arms.insert(), [{**row, "team": ORG} for row in old])


def _add_columns(conn: Connection, pairs: Sequence[tuple[str, str]]) -> None:
    """ALTER TABLE ... ADD COLUMN for each (table, column) of the metadata that the database lacks."""
    existing: dict[str, set[str]] = {}
    for table, column in pairs:
        if table not in existing:
            existing[table] = {c["name"] for c in sa.inspect(conn).get_columns(table)}
        if column in existing[table]:
            continue
        col = metadata.tables[table].c[column]
        kind = col.type.compile(dialect=conn.dialect)
        conn.execute(sa.text(f"ALTER TABLE {table} ADD COLUMN {column} {kind}"))


class ArmError(ValueError):
    """An arm set that cannot be served (bad shares, duplicate names); the message says which."""


# The two arm names; the registry's aliases carry the same names (the champion arm serves the model
# aliased `champion`).
CHAMPION = "champion"
CHALLENGER = "challenger"


@dataclass(frozen=True)
class Arm:
    name: str
    model_version: str  # what is logged with every completion (e.g. "tabrl-completion/3")
    model_uri: str  # local checkpoint directory (embedded; an adapter's base) or vLLM base URL (vllm)
    backend: BackendName  # the serving engine (tasks/core/engines) that serves it
    share: float  # traffic share; the shares of all arms sum to 1
    served_model: str | None = None  # the name asked for: an adapter's load name; None: the server's one model
    adapter: str | None = None  # the LoRA adapter directory served on model_uri's base; None: a full checkpoint
    team: str = ORG  # whose arm it is (tasks/core/teams.py): the organisation's, or a team's own


def validate_arms(new_arms: list[Arm], team: str = ORG) -> None:
    """A servable arm set of `team`: names unique, shares in [0, 1] summing to 1, known backends. A team may have no
    arms (its callers get the organisation's); the organisation needs at least one."""
    names = [a.name for a in new_arms]
    if not new_arms:
        if team == ORG:
            raise ArmError("at least one arm is needed")
        return
    if len(set(names)) != len(names):
        raise ArmError(f"arm names must be unique, got {names}")
    for arm in new_arms:
        if arm.team != team:
            raise ArmError(f"arm {arm.name!r} belongs to team {arm.team!r}, not {team!r}")
        if not 0 <= arm.share <= 1:
            raise ArmError(f"arm {arm.name!r}: share {arm.share} must be within [0, 1]")
        try:
            check_backend(arm.backend)
        except ValueError as err:
            raise ArmError(f"arm {arm.name!r}: {err}") from err
    total = sum(a.share for a in new_arms)
    if abs(total - 1.0) > 1e-6:
        raise ArmError(
            f"arm shares must sum to 1, got {total:g} ({', '.join(f'{a.name}={a.share:g}' for a in new_arms)})"
        )


def read_arms(conn_or_engine: Connection | Engine, team: str | None = ORG) -> list[Arm]:
    """The live arms of `team` (None: of every team), by team and name."""
    query = sa.select(arms).order_by(arms.c.team, arms.c.name)
    if team is not None:
        query = query.where(arms.c.team == team)
    with _connect(conn_or_engine) as conn:
        rows = conn.execute(query).mappings().all()
    return [
        Arm(
            r["name"],
            r["model_version"],
            r["model_uri"],
            check_backend(r["backend"]),
            r["share"],
            r["served_model"],
            r["adapter"],
            r["team"],
        )
        for r in rows
    ]


def replace_arms(conn_or_engine: Connection | Engine, new_arms: list[Arm], team: str = ORG) -> None:
    """Swap `team`'s whole arm set in one transaction (validated first); other teams' arms are untouched, and
    gateways pick the change up without restart. A team's empty set hands its callers back to the organisation's."""
    validate_arms(new_arms, check_team(team))
    now = time.time()
    with _begin(conn_or_engine) as conn:
        conn.execute(arms.delete().where(arms.c.team == team))
        if new_arms:
            conn.execute(arms.insert(), [{**asdict(a), "updated_at": now} for a in new_arms])


def known_teams(conn_or_engine: Connection | Engine) -> list[str]:
    """The organisation, then every team the store knows (a key's, one with arms or one opted out), by name."""
    with _connect(conn_or_engine) as conn:
        named = set(conn.execute(sa.select(teams.c.name)).scalars())
        named |= set(conn.execute(sa.select(arms.c.team)).scalars())
    return [ORG, *sorted(named - {ORG})]


@contextmanager
def _connect(conn_or_engine: Connection | Engine) -> Iterator[Connection]:
    if isinstance(conn_or_engine, Engine):
        with conn_or_engine.connect() as conn:
            yield conn
    else:
        yield conn_or_engine


@contextmanager
def _begin(conn_or_engine: Connection | Engine) -> Iterator[Connection]:
    if isinstance(conn_or_engine, Engine):
        with conn_or_engine.begin() as conn:
            yield conn
    else:
        yield conn_or_engine
