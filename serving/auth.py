"""API keys and the opt-in cohort.

A key is shown once, when `tabrl keys add USER` creates it; the store keeps only its sha256. The
gateway maps ``Authorization: Bearer KEY`` to a user id and caches the answer (and the user's
opt-out flag) for ``serving.config_ttl_s`` seconds, so revoking a key or opting a user out takes
effect without a restart.
"""

from __future__ import annotations

import asyncio
import hashlib
import secrets
import time

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from serving.store import api_keys, users

KEY_PREFIX = "tabrl-"


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def add_key(engine: Engine, user_id: str) -> str:
    """Create a key for user_id (the user row too, opted in); returns the key, which is not stored."""
    if not user_id.strip() or len(user_id) > 128:
        raise ValueError(f"user id {user_id!r} must be 1-128 characters")
    key = KEY_PREFIX + secrets.token_urlsafe(24)
    now = time.time()
    with engine.begin() as conn:
        conn.execute(api_keys.insert().values(key_hash=hash_key(key), user_id=user_id, created_at=now))
        if conn.execute(sa.select(users.c.user_id).where(users.c.user_id == user_id)).first() is None:
            conn.execute(users.insert().values(user_id=user_id, opted_out=False, updated_at=now))
    return key


def set_opt_out(engine: Engine, user_id: str, opted_out: bool) -> None:
    """Put a user outside (or back inside) the logged cohort; their requests are still served."""
    now = time.time()
    with engine.begin() as conn:
        done = conn.execute(
            users.update().where(users.c.user_id == user_id).values(opted_out=opted_out, updated_at=now)
        )
        if done.rowcount == 0:
            conn.execute(users.insert().values(user_id=user_id, opted_out=opted_out, updated_at=now))


def _lookup_key(engine: Engine, key_hash: str) -> str | None:
    with engine.connect() as conn:
        return conn.execute(
            sa.select(api_keys.c.user_id).where(api_keys.c.key_hash == key_hash, api_keys.c.revoked == sa.false())
        ).scalar()


def _lookup_opted_out(engine: Engine, user_id: str) -> bool:
    with engine.connect() as conn:
        return bool(conn.execute(sa.select(users.c.opted_out).where(users.c.user_id == user_id)).scalar())


class Directory:
    """Key -> user and user -> opted-out, read from the store with a TTL cache."""

    def __init__(self, engine: Engine, ttl_s: float):
        self.engine = engine
        self.ttl_s = ttl_s
        self._users: dict[str, tuple[str, float]] = {}
        self._opted_out: dict[str, tuple[bool, float]] = {}

    async def user_for_key(self, key: str) -> str | None:
        digest = hash_key(key)
        hit = self._users.get(digest)
        if hit is None or time.monotonic() - hit[1] >= self.ttl_s:
            user_id = await asyncio.to_thread(_lookup_key, self.engine, digest)
            if user_id is None:
                return None  # unknown keys are not cached: the cache holds only real keys
            hit = (user_id, time.monotonic())
            self._users[digest] = hit
        return hit[0]

    async def opted_out(self, user_id: str) -> bool:
        hit = self._opted_out.get(user_id)
        if hit is None or time.monotonic() - hit[1] >= self.ttl_s:
            hit = (await asyncio.to_thread(_lookup_opted_out, self.engine, user_id), time.monotonic())
            self._opted_out[user_id] = hit
        return hit[0]
