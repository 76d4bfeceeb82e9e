import os

import pytest
import sqlalchemy as sa

from tasks.core.store import (
    SCHEMA_VERSION,
    Arm,
    ArmError,
    Store,
    init_schema,
    make_engine,
    open_store,
    read_arms,
    replace_arms,
    schema_version,
)
from tests.support.harness import throwaway_schema


def _engines(tmp_path):
    yield make_engine(f"sqlite:///{tmp_path}/store.db")
    url = os.environ.get("TABRL_TEST_POSTGRES_URL")
    if url:
        with throwaway_schema(url) as schema_url:
            yield make_engine(schema_url)


def test_schema_and_arms_round_trip_on_every_backend(tmp_path):
    for engine in _engines(tmp_path):
        init_schema(engine)
        init_schema(engine)  # idempotent
        with engine.connect() as conn:
            assert conn.execute(sa.select(schema_version.c.version)).scalars().all() == [SCHEMA_VERSION]
        arms = [
            Arm("champion", "m/1", "/models/a", "embedded", 0.5),
            Arm("challenger", "m/2", "/models/b", "embedded", 0.5),
        ]
        replace_arms(engine, arms)
        assert read_arms(engine) == sorted(arms, key=lambda a: a.name)
        with pytest.raises(ArmError, match="sum to 1"):
            replace_arms(engine, [Arm("champion", "m/1", "/a", "embedded", 0.7)])
        with pytest.raises(ArmError, match="unique"):
            replace_arms(engine, [arms[0], arms[0]])
        assert len(read_arms(engine)) == 2  # a rejected change leaves the live arms as they were
        engine.dispose()
    if not os.environ.get("TABRL_TEST_POSTGRES_URL"):
        pytest.skip("PostgreSQL part skipped: set TABRL_TEST_POSTGRES_URL to run it")


def test_open_store_creates_the_tables_and_disposes_the_engine(tmp_path):
    url = f"sqlite:///{tmp_path}/fresh/store.db"
    with open_store(url) as engine:
        replace_arms(engine, [Arm("champion", "m/1", "/models/m1", "embedded", 1.0)])
        pool = engine.pool
    assert pool.checkedout() == 0  # nothing left open
    with open_store(url) as engine:  # the same store, its rows kept
        assert [a.name for a in read_arms(engine)] == ["champion"]


V1_ARMS = """CREATE TABLE arms (name VARCHAR(64) PRIMARY KEY, model_version VARCHAR(256) NOT NULL,
model_uri TEXT NOT NULL, backend VARCHAR(32) NOT NULL, share FLOAT NOT NULL, updated_at FLOAT NOT NULL)"""
V1_STAMP = "CREATE TABLE schema_version (version INTEGER PRIMARY KEY, applied_at FLOAT NOT NULL)"


def test_a_store_of_schema_1_is_migrated_in_place_and_keeps_its_arms(tmp_path):
    for engine in _engines(tmp_path):
        with engine.begin() as conn:  # what tabrl with schema 1 left: arms without served_model / adapter
            conn.execute(sa.text(V1_ARMS))
            conn.execute(sa.text("INSERT INTO arms VALUES ('champion', 'm/1', '/models/a', 'embedded', 1.0, 0.0)"))
            conn.execute(sa.text(V1_STAMP))
            conn.execute(sa.text("INSERT INTO schema_version VALUES (1, 0.0)"))
        init_schema(engine)
        init_schema(engine)  # idempotent once migrated
        assert read_arms(engine) == [Arm("champion", "m/1", "/models/a", "embedded", 1.0)]  # NULL: as before
        with engine.connect() as conn:
            assert conn.execute(sa.select(schema_version.c.version)).scalars().all() == [1, 2, 3, 4]
        assert read_arms(engine)[0].team == "org"  # schema 4 re-keyed the arms by team: the old ones, the org's
        adapter_arm = Arm("champion", "m/2", "http://127.0.0.1:9", "vllm", 1.0, "m-v2-abc", "/models/v2")
        replace_arms(engine, [adapter_arm])
        assert read_arms(engine) == [adapter_arm]
        engine.dispose()


def test_each_team_changes_only_its_own_arms(tmp_path):
    """Arms are keyed by (team, name): a team's arm set is replaced alone, the organisation's stays; a team may
    have none (its callers get the organisation's), the organisation may not."""
    for engine in _engines(tmp_path):
        init_schema(engine)
        org = [Arm("champion", "m/1", "/models/base", "embedded", 1.0)]
        replace_arms(engine, org)
        team_arms = [
            Arm("champion", "m/1", "/models/base", "embedded", 0.8, team="alpha"),
            Arm("challenger", "m.alpha/1", "/models/base", "embedded", 0.2, None, "/adapters/a1", "alpha"),
        ]
        replace_arms(engine, team_arms, "alpha")
        replace_arms(engine, [Arm("champion", "m.beta/2", "/models/base", "embedded", 1.0, team="beta")], "beta")
        assert read_arms(engine) == org and read_arms(engine, "alpha") == sorted(team_arms, key=lambda a: a.name)
        assert [(a.team, a.name) for a in read_arms(engine, None)] == [
            ("alpha", "challenger"),
            ("alpha", "champion"),
            ("beta", "champion"),
            ("org", "champion"),
        ]
        with pytest.raises(ArmError, match="belongs to team 'alpha', not 'beta'"):
            replace_arms(engine, team_arms, "beta")
        replace_arms(engine, [], "alpha")  # back to the organisation's arms
        assert read_arms(engine, "alpha") == [] and read_arms(engine) == org and len(read_arms(engine, "beta")) == 1
        with pytest.raises(ArmError, match="at least one arm"):
            replace_arms(engine, [])
        with pytest.raises(ValueError, match="team name 'Bad Team'"):
            replace_arms(engine, [], "Bad Team")
        engine.dispose()


def test_a_store_creates_its_tables_on_entry_and_disposes_its_engine_once_on_exit(tmp_path):
    disposed = []
    store = Store(f"sqlite:///{tmp_path}/store.db")
    sa.event.listen(store.engine, "engine_disposed", lambda engine: disposed.append(engine))
    with store as opened:
        assert opened is store and read_arms(store.engine) == []  # the tables exist
        assert disposed == []
    assert disposed == [store.engine]


def test_a_store_that_cannot_create_its_tables_disposes_its_engine(tmp_path):
    disposed = []
    store = Store(f"sqlite:///{tmp_path}/store.db")
    with store.engine.begin() as conn:  # a store written by a newer tabrl
        conn.execute(sa.text("CREATE TABLE schema_version (version INTEGER PRIMARY KEY, applied_at FLOAT NOT NULL)"))
        conn.execute(sa.text(f"INSERT INTO schema_version VALUES ({SCHEMA_VERSION + 1}, 0)"))
    sa.event.listen(store.engine, "engine_disposed", lambda engine: disposed.append(engine))
    with pytest.raises(RuntimeError, match="newer"), store:
        pass
    assert disposed == [store.engine]


def test_the_store_fixture_is_open_for_the_test(store):
    replace_arms(store.engine, [Arm("champion", "m/1", "/models/a", "embedded", 1.0)])
    assert [a.name for a in read_arms(store.engine)] == ["champion"]
