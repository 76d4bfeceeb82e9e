"""API keys, the opt-in cohort and the rate limits.

A key is shown once, when `tabrl keys add USER` creates it; the store keeps only its sha256. The
gateway maps ``Authorization: Bearer KEY`` to a user id and caches the answer (and the user's
opt-out flag) for ``serving.config_ttl_s`` seconds, so revoking a key or opting a user out takes
effect without a restart, in every replica (they read the same store).

Rate limits count requests per user and per key in one-minute windows: in the process
(``RateLimiter``, one gateway) or in Redis (``RedisRateLimiter``, ``serving.redis_url``), where every
replica counts in the same windows, so a limit holds in total however many replicas serve.
"""

from __future__ import annotations

import asyncio
import hashlib
import secrets
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import redis.asyncio
import redis.exceptions
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from serving.errors import RETRY_AFTER_S, ApiError
from tasks.core.store import api_keys, users

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


class TtlCache:
    """Values read from the store, kept ttl_s seconds. Concurrent misses for one key share one read (at
    every expiry a busy gateway would otherwise send one read per request in flight for that key).
    `keep(value)` says whether a value is cached at all; a read that fails is not cached."""

    def __init__(self, ttl_s: float, keep: Callable[[Any], bool] = lambda value: True):
        self.ttl_s, self.keep = ttl_s, keep
        self._hits: dict[str, tuple[Any, float]] = {}
        self._reads: dict[str, asyncio.Future] = {}

    async def get(self, key: str, read: Callable[[], Any]) -> Any:
        hit = self._hits.get(key)
        if hit is not None and time.monotonic() - hit[1] < self.ttl_s:
            return hit[0]
        pending = self._reads.get(key)
        if pending is None:
            pending = self._reads[key] = asyncio.ensure_future(asyncio.to_thread(read))
            pending.add_done_callback(lambda done: self._store(key, done))
        return await asyncio.shield(pending)

    def _store(self, key: str, done: asyncio.Future) -> None:
        del self._reads[key]
        if not done.cancelled() and done.exception() is None and self.keep(done.result()):
            self._hits[key] = (done.result(), time.monotonic())


class Directory:
    """Key -> user and user -> opted-out, read from the store with a TTL cache."""

    def __init__(self, engine: Engine, ttl_s: float):
        self.engine = engine
        self._users = TtlCache(ttl_s, keep=lambda user: user is not None)  # unknown keys are not cached
        self._opted_out = TtlCache(ttl_s)

    async def user_for_key(self, key_hash: str) -> str | None:
        """The user of the key with this sha256 (hash_key), None when no such key is live."""
        return await self._users.get(key_hash, lambda: _lookup_key(self.engine, key_hash))

    async def opted_out(self, user_id: str) -> bool:
        return await self._opted_out.get(user_id, lambda: _lookup_opted_out(self.engine, user_id))


@dataclass(frozen=True)
class Caller:
    user_id: str
    logged: bool  # False: opted out; served, never stored
    owner_checked: bool  # True with auth: feedback only for the caller's own completions
    key_hash: str | None = None  # sha256 of the API key (auth on), for the per-key rate limit


async def resolve_caller(
    headers: Mapping[str, str], claimed_user: str | None, directory: Directory, require_auth: bool
) -> Caller:
    """Who is asking: the API key's user (auth on; 401 without a valid key) or the claimed user (auth off),
    and whether their requests may be logged (opt-out header or the opted-out cohort)."""
    header_opt_out = headers.get("x-tabrl-opt-out", "").strip() == "1"
    if require_auth:
        scheme, _, key = headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise ApiError(
                401, "missing API key: send `Authorization: Bearer KEY` (create one with `tabrl keys add USER`)"
            )
        key_hash = hash_key(key.strip())
        user_id = await directory.user_for_key(key_hash)
        if user_id is None:
            raise ApiError(401, "invalid or revoked API key")
    else:
        user_id = claimed_user or headers.get("x-tabrl-user") or "anonymous"
        key_hash = None
    logged = not header_opt_out and not await directory.opted_out(user_id)
    return Caller(user_id, logged, owner_checked=require_auth, key_hash=key_hash)


class RateLimiter:
    """Fixed one-minute windows per user and per API key, in this process; 429 with Retry-After when either
    is full. At most max_windows windows are kept (claimed user ids, auth off, are unbounded)."""

    def __init__(self, per_user: int, per_key: int, max_windows: int):
        self.per_user, self.per_key, self.max_windows = per_user, per_key, max_windows
        self._windows: dict[str, tuple[float, int]] = {}  # "user:ID" / "key:HASH" -> (window start, requests)

    async def acquire(self, caller: Caller) -> None:
        self.check(caller)

    async def aclose(self) -> None:
        return None

    def check(self, caller: Caller, now: float | None = None) -> None:
        """Count one request of the caller, or raise ApiError(429) and count nothing."""
        now = time.monotonic() if now is None else now
        if len(self._windows) > self.max_windows:  # forget finished windows
            for name in [n for n, (start, _) in self._windows.items() if now - start >= 60]:
                del self._windows[name]
        limits = [(f"user:{caller.user_id}", self.per_user, "user")]
        if caller.key_hash is not None:
            limits.append((f"key:{caller.key_hash}", self.per_key, "API key"))
        counted = []
        for name, limit, what in limits:
            start, count = self._windows.get(name, (now, 0))
            if now - start >= 60:
                start, count = now, 0
            if count >= limit:
                raise ApiError(
                    429,
                    f"rate limit: at most {limit} requests per minute per {what}",
                    headers={"Retry-After": str(max(1, int(60 - (now - start)) + 1))},
                )
            counted.append((name, start, count + 1))
        for name, start, count in counted:
            self._windows[name] = (start, count)


# For each request of a batch, in order: count it in every one of its windows, or in none when one is full.
# ARGV[1]: window length (ms); then per request its number of windows n and their n limits; KEYS: the windows,
# request after request. Answers two numbers per request: the full window (1-based; 0: counted) and its ms
# left. A window starts with its first request, as RateLimiter's do. Atomic: Redis runs a script alone.
_ACQUIRE = """
local out, k, a = {}, 1, 2
while a <= #ARGV do
  local n, full, left = tonumber(ARGV[a]), 0, 0
  for i = 0, n - 1 do
    if tonumber(redis.call('GET', KEYS[k + i]) or '0') >= tonumber(ARGV[a + 1 + i]) then
      full, left = i + 1, redis.call('PTTL', KEYS[k + i])
      break
    end
  end
  if full == 0 then
    for i = 0, n - 1 do
      if redis.call('INCR', KEYS[k + i]) == 1 then redis.call('PEXPIRE', KEYS[k + i], ARGV[1]) end
    end
  end
  out[#out + 1], out[#out + 2] = full, left
  k, a = k + n, a + 1 + n
end
return out
"""
WINDOW_MS = 60_000
KEY_PREFIX_REDIS = "tabrl:ratelimit:"


@dataclass
class _Ask:
    keys: list[str]
    limits: list[int]
    answer: asyncio.Future  # (full window index, ms left)


class RedisRateLimiter:
    """RateLimiter's windows, kept in Redis and shared by every gateway replica: 429 with Retry-After when the
    user's or the key's window is full, counted in neither then. Redis unreachable: 503 with Retry-After
    (nothing is served unlimited).

    Requests that arrive while a round trip is in flight go together in the next one: one script call per
    batch, as the log writer commits a group (a call per request cost as much CPU as the rest of a request)."""

    def __init__(self, url: str, per_user: int, per_key: int, timeout_s: float):
        self.url, self.per_user, self.per_key = url, per_user, per_key
        self._redis = redis.asyncio.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self._script = self._redis.register_script(_ACQUIRE)
        self._waiting: list[_Ask] = []
        self._sender: asyncio.Task | None = None

    async def acquire(self, caller: Caller) -> None:
        keys, limits, names = [f"{KEY_PREFIX_REDIS}user:{caller.user_id}"], [self.per_user], ["user"]
        if caller.key_hash is not None:
            keys.append(f"{KEY_PREFIX_REDIS}key:{caller.key_hash}")
            limits.append(self.per_key)
            names.append("API key")
        ask = _Ask(keys, limits, asyncio.get_running_loop().create_future())
        self._waiting.append(ask)
        if self._sender is None or self._sender.done():
            self._sender = asyncio.ensure_future(self._send())
        full, left_ms = await ask.answer
        if full:
            raise ApiError(
                429,
                f"rate limit: at most {limits[full - 1]} requests per minute per {names[full - 1]}",
                headers={"Retry-After": str(max(1, int(left_ms) // 1000 + 1))},
            )

    async def _send(self) -> None:
        while self._waiting:
            batch, self._waiting = self._waiting, []
            try:
                args: list[int] = [WINDOW_MS]
                for ask in batch:
                    args += [len(ask.keys), *ask.limits]
                replies = await self._script(keys=[key for ask in batch for key in ask.keys], args=args)
            except redis.exceptions.RedisError as err:
                why = f"the rate-limit store (Redis, serving.redis_url) is unavailable: {type(err).__name__}: {err}"
                for ask in batch:
                    if not ask.answer.done():
                        ask.answer.set_exception(
                            ApiError(
                                503,
                                f"{why}; retry after {RETRY_AFTER_S} s",
                                headers={"Retry-After": str(RETRY_AFTER_S)},
                            )
                        )
                continue
            except BaseException as err:  # a bug or a cancellation: the waiters get it instead of hanging
                for ask in batch:
                    if not ask.answer.done():
                        ask.answer.set_exception(err)
                raise
            for i, ask in enumerate(batch):
                if not ask.answer.done():  # (its request may have been cancelled meanwhile)
                    ask.answer.set_result((int(replies[2 * i]), int(replies[2 * i + 1])))

    async def aclose(self) -> None:
        if self._sender is not None:
            await self._sender
        await self._redis.aclose()
