"""Teams: the unit that owns a model. Each team has its own champion and challenger adapters on the organisation's
base, its own cycle, watermark, snapshots, gate (on its own held-out files) and A/B decisions.

A team is a name (`check_team`). `ORG` is the organisation itself: the scope of every caller without a team,
of the organisation's model (which learns from every team that shares its outcomes with it, and serves every team
without arms of its own), and of everything a store made before teams existed. One name per scope runs through
the code: the arms' `team`, the completions' `team` (the caller's) and `arm_team` (whose arms served it), the
watermark, the snapshots' folder, the Prefect slots, the registered model and the cycles' experiment (`scoped`).

The log store writes NULL for ORG in the columns teams added to old tables (their rows predate teams), and the
queries read NULL as ORG (`scope_is`).
"""

from __future__ import annotations

import re
from pathlib import Path

import sqlalchemy as sa

ORG = "org"
"""The organisation's scope: callers without a team, the organisation's model, rows older than teams."""

TEAM_NAME = re.compile(r"[a-z0-9][a-z0-9_-]{0,31}")


def check_team(name: str) -> str:
    """A team name as given, or a ValueError that says what a name may be."""
    if not TEAM_NAME.fullmatch(name):
        raise ValueError(
            f"team name {name!r}: 1-32 characters of a-z, 0-9, '-' and '_', starting with a letter or digit"
        )
    return name


def stored(team: str) -> str | None:
    """What a team column holds for `team`: NULL for the organisation (as in rows older than teams)."""
    return None if team == ORG else team


def loaded(value: str | None) -> str:
    """The team a stored team column names (NULL: the organisation)."""
    return ORG if value is None else value


def scope_is(column: sa.ColumnElement, team: str) -> sa.ColumnElement[bool]:
    """SQL: `column` (a team column, NULL for the organisation) names `team`."""
    return sa.or_(column.is_(None), column == ORG) if team == ORG else column == team


def scoped(name: str, team: str) -> str:
    """The team's own MLflow name for the organisation's `name` (its registered model `deploy.registered_model`,
    its cycles' experiment `deploy.experiment`): `name` itself for the organisation, `NAME.TEAM` for a team."""
    return name if team == ORG else f"{name}.{team}"


def watermark_name(team: str) -> str:
    """The team's row in the watermarks table (the organisation's keeps its pre-teams name)."""
    return "ingest" if team == ORG else f"ingest.{team}"


def team_dir(root: str | Path, team: str) -> Path:
    """`root` for the organisation, `root/teams/TEAM` for a team: where its snapshots and held-out files live."""
    return Path(root) if team == ORG else Path(root) / "teams" / team
