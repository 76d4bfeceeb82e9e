"""Rows for the ingest and reward tests, inserted the way the gateway writes them (SQLAlchemy Core)."""

from __future__ import annotations

import hashlib
import os
from contextlib import contextmanager

import pytest

from tasks.core.store import completions, feedback, open_store, users
from tests.support.harness import throwaway_schema

AWS_KEY_LINE = 'aws_access_key_id = "AKIAIOSFODNN7EXAMPLE"'
PRIVATE_KEY = (
    "-----BEGIN RSA PRIVATE KEY-----\n"
    "MIIEpAIBAAKCAQEAu1SU1LfVLPHCozMxH2Mo4lgOEePzNm0tRgeLezV6ffAt0gun\n"
    "-----END RSA PRIVATE KEY-----\n"
)


def completion_row(
    cid: str,
    created_at: float,
    user: str = "u1",
    prompt: str | None = None,
    completion: str = "x = 1",
    arm: str = "champion",
    seq: int | None = None,
    **extra,
) -> dict:
    prompt = f"<|fim_prefix|>def f_{cid}():\n    <|fim_suffix|>\n<|fim_middle|>" if prompt is None else prompt
    row = {
        "id": cid,
        "created_at": created_at,
        "user_id": user,
        "arm": arm,
        "model_version": f"m/{arm}",
        "prompt": prompt,
        "prefix": "",
        "suffix": "",
        "completion": completion,
        "token_ids": [3, 4, 5] if completion else [],
        "logprobs": [-0.5, -0.25, -0.125] if completion else [],
        "temperature": 0.7,
        "latency_ms": 12.0,
        "abstained": completion == "",
        "prompt_hash": hashlib.sha256(f"{prompt}\0{completion}".encode()).hexdigest(),
        "source": "gateway",
    }
    if seq is not None:
        row["seq"] = seq
    row.update(extra)
    return row


def add_completions(engine, rows: list[dict]) -> None:
    with engine.begin() as conn:
        for row in rows:  # one by one: rows with and without an explicit seq may be mixed
            conn.execute(completions.insert().values(**row))


def add_feedback(
    engine, cid: str, accepted: bool, received_at: float, trainable: bool = True, user: str = "u1"
) -> None:
    with engine.begin() as conn:
        conn.execute(
            feedback.insert().values(
                completion_id=cid,
                matched=True,
                accepted=accepted,
                received_at=received_at,
                source="api",
                user_id=user,
                trainable=trainable,
                accepted_chars=5 if accepted else None,
            )
        )


def opt_out(engine, user: str) -> None:
    with engine.begin() as conn:
        conn.execute(users.insert().values(user_id=user, opted_out=True, updated_at=0.0))


@contextmanager
def store(kind: str, tmp_path):
    """An initialised log store: SQLite in tmp_path, or a fresh PostgreSQL schema (dropped after)."""
    if kind == "sqlite":
        with open_store(f"sqlite:///{tmp_path}/store.db") as engine:
            yield engine
        return
    url = os.environ.get("TABRL_TEST_POSTGRES_URL")
    if not url:
        pytest.skip("PostgreSQL log store: set TABRL_TEST_POSTGRES_URL to run it")
    with throwaway_schema(url) as schema_url, open_store(schema_url) as engine:
        yield engine
