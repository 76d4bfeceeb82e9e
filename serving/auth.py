"""Who is calling: API keys, the opt-in cohort, and the caller a request resolves to.

A key is shown once, when `tabrl keys add USER` creates it; the store keeps only its sha256. The
gateway maps ``Authorization: Bearer KEY`` to a user id and caches the answer (and the user's
opt-out flag) for ``serving.config_ttl_s`` seconds, so revoking a key or opting a user out takes
effect without a restart, in every replica (they read the same store). A key also says whether its
client reports every outcome itself (``reports_outcomes``: Continue's data destination), which the
gateway stamps on each completion it serves: the timeout rule reads it from the row, never from what
arrives later (``tasks/core/outcomes.py``). A key belongs to a team (``tabrl keys add USER --team NAME``,
or ``tabrl keys team USER NAME`` later; none: the organisation's, ``tasks/core/teams.py``): the caller is served
its team's arms and its completions are logged with it. A team can be opted out as a user can
(``tabrl teams opt-out NAME``): its callers are served, never logged.
The rate limits a caller is counted against are in ``serving/limits.py``.
"""

from __future__ import annotations

import asyncio
import hashlib
import secrets
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from serving.errors import ApiError
from tasks.core.store import api_keys, teams, users
from tasks.core.teams import ORG, check_team, loaded, stored

KEY_PREFIX = "tabrl-"


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def add_key(engine: Engine, user_id: str, reports_outcomes: bool = False, team: str = ORG) -> str:
    """Create a key for user_id (the user row too, opted in) in `team` (its row too); returns the key, which is not
    stored. reports_outcomes: its client reports every outcome itself, so a completion it never reported was not
    shown."""
    if not user_id.strip() or len(user_id) > 128:
        raise ValueError(f"user id {user_id!r} must be 1-128 characters")
    check_team(team)
    key = KEY_PREFIX + secrets.token_urlsafe(24)
    now = time.time()
    with engine.begin() as conn:
        conn.execute(
            api_keys.insert().values(
                key_hash=hash_key(key),
                user_id=user_id,
                created_at=now,
                reports_outcomes=reports_outcomes,
                team=stored(team),
            )
        )
        if conn.execute(sa.select(users.c.user_id).where(users.c.user_id == user_id)).first() is None:
            conn.execute(users.insert().values(user_id=user_id, opted_out=False, updated_at=now))
        _ensure_team(conn, team, now)
    return key


def _ensure_team(conn, team: str, now: float) -> None:
    if team != ORG and conn.execute(sa.select(teams.c.name).where(teams.c.name == team)).first() is None:
        conn.execute(teams.insert().values(name=team, opted_out=False, shares_with_org=True, updated_at=now))


def set_team(engine: Engine, user_id: str, team: str) -> int:
    """Move the live keys of user_id to `team` (ORG: no team). Completions served from now on are logged and routed
    with it; rows already logged keep the team they were served with. Returns how many keys changed."""
    check_team(team)
    with engine.begin() as conn:
        _ensure_team(conn, team, time.time())
        return conn.execute(
            api_keys.update()
            .where(api_keys.c.user_id == user_id, api_keys.c.revoked == sa.false())
            .values(team=stored(team))
        ).rowcount


def set_team_flags(
    engine: Engine, team: str, *, opted_out: bool | None = None, shares_with_org: bool | None = None
) -> None:
    """Opt a team out of (or back into) the logged cohort, or out of (into) the organisation model's training."""
    if check_team(team) == ORG:
        raise ValueError(f"{ORG!r} is the organisation, not a team: opt users out one by one (`tabrl keys opt-out`)")
    values = {k: v for k, v in {"opted_out": opted_out, "shares_with_org": shares_with_org}.items() if v is not None}
    now = time.time()
    with engine.begin() as conn:
        _ensure_team(conn, team, now)
        conn.execute(teams.update().where(teams.c.name == team).values(**values, updated_at=now))


def read_teams(engine: Engine) -> list[dict]:
    """Every team the store knows (a key's, or one opted out), with its flags and live keys, by name."""
    keys = (
        sa.select(api_keys.c.team, sa.func.count().label("keys"))
        .where(api_keys.c.revoked == sa.false())
        .group_by(api_keys.c.team)
        .subquery()
    )
    query = (
        sa.select(teams.c.name, teams.c.opted_out, teams.c.shares_with_org, sa.func.coalesce(keys.c["keys"], 0))
        .select_from(teams.outerjoin(keys, keys.c.team == teams.c.name))
        .order_by(teams.c.name)
    )
    with engine.connect() as conn:
        return [
            {"team": r[0], "opted_out": bool(r[1]), "shares_with_org": bool(r[2]), "keys": int(r[3])}
            for r in conn.execute(query)
        ]


def set_opt_out(engine: Engine, user_id: str, opted_out: bool) -> None:
    """Put a user outside (or back inside) the logged cohort; their requests are still served."""
    now = time.time()
    with engine.begin() as conn:
        done = conn.execute(
            users.update().where(users.c.user_id == user_id).values(opted_out=opted_out, updated_at=now)
        )
        if done.rowcount == 0:
            conn.execute(users.insert().values(user_id=user_id, opted_out=opted_out, updated_at=now))


def set_reports_outcomes(engine: Engine, user_id: str, reports: bool) -> int:
    """Say whether the live keys of user_id belong to a client that reports every outcome itself (completions
    served from now on; rows already logged keep what they were served with). Returns how many keys changed."""
    with engine.begin() as conn:
        return conn.execute(
            api_keys.update()
            .where(api_keys.c.user_id == user_id, api_keys.c.revoked == sa.false())
            .values(reports_outcomes=reports)
        ).rowcount


@dataclass(frozen=True)
class KeyOwner:
    user_id: str
    reports_outcomes: bool  # the key's client reports every outcome itself
    team: str = ORG  # the key's team


def _lookup_key(engine: Engine, key_hash: str) -> KeyOwner | None:
    with engine.connect() as conn:
        row = conn.execute(
            sa.select(api_keys.c.user_id, api_keys.c.reports_outcomes, api_keys.c.team).where(
                api_keys.c.key_hash == key_hash, api_keys.c.revoked == sa.false()
            )
        ).first()
    return None if row is None else KeyOwner(row.user_id, bool(row.reports_outcomes), loaded(row.team))


def _lookup_opted_out(engine: Engine, user_id: str) -> bool:
    with engine.connect() as conn:
        return bool(conn.execute(sa.select(users.c.opted_out).where(users.c.user_id == user_id)).scalar())


def _lookup_team_opted_out(engine: Engine, team: str) -> bool:
    if team == ORG:
        return False
    with engine.connect() as conn:
        return bool(conn.execute(sa.select(teams.c.opted_out).where(teams.c.name == team)).scalar())


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
    """Key -> its owner (user, reporting client, team), user -> opted-out and team -> opted-out, read from the
    store with a TTL cache."""

    def __init__(self, engine: Engine, ttl_s: float):
        self.engine = engine
        self._users = TtlCache(ttl_s, keep=lambda user: user is not None)  # unknown keys are not cached
        self._opted_out = TtlCache(ttl_s)
        self._team_opted_out = TtlCache(ttl_s)

    async def owner_of_key(self, key_hash: str) -> KeyOwner | None:
        """The owner of the key with this sha256 (hash_key), None when no such key is live."""
        return await self._users.get(key_hash, lambda: _lookup_key(self.engine, key_hash))

    async def opted_out(self, user_id: str) -> bool:
        return await self._opted_out.get(user_id, lambda: _lookup_opted_out(self.engine, user_id))

    async def team_opted_out(self, team: str) -> bool:
        return await self._team_opted_out.get(team, lambda: _lookup_team_opted_out(self.engine, team))


@dataclass(frozen=True)
class Caller:
    user_id: str
    logged: bool  # False: opted out; served, never stored
    owner_checked: bool  # True with auth: feedback only for the caller's own completions
    key_hash: str | None = None  # sha256 of the API key (auth on), for the per-key rate limit
    reports_outcomes: bool = False  # its key's client reports every outcome itself (auth on)
    team: str = ORG  # its key's team (auth on), or the claimed one (auth off): whose arms serve it


async def resolve_caller(
    headers: Mapping[str, str], claimed_user: str | None, directory: Directory, require_auth: bool
) -> Caller:
    """Who is asking: the API key's user and team (auth on; 401 without a valid key) or the claimed user and team
    (auth off: the `user` field or `X-Tabrl-User`, and `X-Tabrl-Team`), and whether their requests may be logged
    (opt-out header, or the user or the team opted out)."""
    header_opt_out = headers.get("x-tabrl-opt-out", "").strip() == "1"
    if require_auth:
        scheme, _, key = headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise ApiError(
                401, "missing API key: send `Authorization: Bearer KEY` (create one with `tabrl keys add USER`)"
            )
        key_hash = hash_key(key.strip())
        owner = await directory.owner_of_key(key_hash)
        if owner is None:
            raise ApiError(401, "invalid or revoked API key")
        user_id, reports, team = owner.user_id, owner.reports_outcomes, owner.team
    else:
        user_id = claimed_user or headers.get("x-tabrl-user") or "anonymous"
        key_hash, reports, team = None, False, _claimed_team(headers)
    logged = not header_opt_out and not await directory.opted_out(user_id) and not await directory.team_opted_out(team)
    return Caller(user_id, logged, owner_checked=require_auth, key_hash=key_hash, reports_outcomes=reports, team=team)


def _claimed_team(headers: Mapping[str, str]) -> str:
    """The team an unauthenticated caller names (`X-Tabrl-Team`), ORG when none; 400 for a malformed name."""
    claimed = headers.get("x-tabrl-team", "").strip()
    try:
        return check_team(claimed) if claimed else ORG
    except ValueError as err:
        raise ApiError(400, f"X-Tabrl-Team: {err}", "X-Tabrl-Team") from None
