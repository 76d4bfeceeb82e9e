"""Rate limits: requests per user and per key in one-minute windows, in the process (``RateLimiter``, one
gateway) or in Redis (``RedisRateLimiter``, ``serving.redis_url``), where every replica counts in the same
windows, so a limit holds in total however many replicas serve. ``make_limiter`` chooses one from params.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import redis.asyncio
import redis.exceptions

from serving.auth import Caller
from serving.errors import RETRY_AFTER_S, ApiError
from tasks.core.config import ServingParams

MAX_RATE_WINDOWS = 100_000  # rate-limit windows kept before finished ones are dropped


def make_limiter(s: ServingParams) -> RateLimiter | RedisRateLimiter:
    """In Redis when serving.redis_url is set (replicas share the windows), else in this process."""
    if s.redis_url:
        return RedisRateLimiter(s.redis_url, s.rate_limit_per_minute, s.rate_limit_per_key_per_minute, s.db_timeout_s)
    return RateLimiter(s.rate_limit_per_minute, s.rate_limit_per_key_per_minute, MAX_RATE_WINDOWS)


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
