"""The log store's tables (SQLAlchemy Core), one definition for SQLite and PostgreSQL; `tasks/core/store.py` makes,
migrates and reads them (and re-exports every name here)."""

from __future__ import annotations

import sqlalchemy as sa

metadata = sa.MetaData()

schema_version = sa.Table(
    "schema_version",
    metadata,
    sa.Column("version", sa.Integer, primary_key=True),
    sa.Column("applied_at", sa.Float, nullable=False),
)

completions = sa.Table(
    "completions",
    metadata,
    sa.Column("seq", sa.BigInteger().with_variant(sa.Integer, "sqlite"), primary_key=True, autoincrement=True),
    sa.Column("id", sa.String(64), nullable=False, unique=True),
    sa.Column("created_at", sa.Float, nullable=False, index=True),  # unix seconds
    sa.Column("user_id", sa.String(128), nullable=False, index=True),
    sa.Column("arm", sa.String(64), nullable=False),
    sa.Column("model_version", sa.String(256), nullable=False),
    sa.Column("prompt", sa.Text, nullable=False),
    sa.Column("prefix", sa.Text, nullable=False),
    sa.Column("suffix", sa.Text, nullable=False),
    sa.Column("completion", sa.Text, nullable=False),
    sa.Column("token_ids", sa.JSON, nullable=True),  # list[int] of the completion, as sampled
    sa.Column("logprobs", sa.JSON, nullable=True),  # list[float] behaviour log-probs, same length
    sa.Column("temperature", sa.Float, nullable=False),
    sa.Column("latency_ms", sa.Float, nullable=False),
    sa.Column("abstained", sa.Boolean, nullable=False),
    sa.Column("prompt_hash", sa.String(64), nullable=False, index=True),  # sha256(prompt + "\0" + completion)
    sa.Column("source", sa.String(32), nullable=False, server_default="gateway"),
    # schema 3: when the gateway saw the client hang up before the answer was sent (NULL: answered), and whether
    # the caller reports its own outcomes (its key's setting when served; NULL: no, as older rows)
    sa.Column("cancelled_at", sa.Float, nullable=True),
    sa.Column("reports_outcomes", sa.Boolean, nullable=True),
    # schema 4: the caller's team and the team whose arms served it (NULL: the organisation, as older rows;
    # tasks/core/teams.py)
    sa.Column("team", sa.String(32), nullable=True),
    sa.Column("arm_team", sa.String(32), nullable=True),
)

feedback = sa.Table(
    "feedback",
    metadata,
    sa.Column("seq", sa.BigInteger().with_variant(sa.Integer, "sqlite"), primary_key=True, autoincrement=True),
    # The completion this outcome is about: ours when matched, else the client's id (unmatched).
    sa.Column("completion_id", sa.String(128), nullable=False, unique=True),
    sa.Column("matched", sa.Boolean, nullable=False),
    sa.Column("accepted", sa.Boolean, nullable=False),
    sa.Column("accepted_chars", sa.Integer, nullable=True),
    sa.Column("received_at", sa.Float, nullable=False, index=True),
    sa.Column("source", sa.String(32), nullable=False),  # api | rlinf | continue | import
    sa.Column("user_id", sa.String(128), nullable=True),
    sa.Column("trainable", sa.Boolean, nullable=False, server_default=sa.true()),  # False for noCode events
    sa.Column("payload", sa.JSON, nullable=True),  # the client's texts when the completion is not ours
    # schema 3: False when the client says it never displayed the suggestion (NULL: displayed, as older rows)
    sa.Column("shown", sa.Boolean, nullable=True),
)

arms = sa.Table(
    "arms",
    metadata,
    # schema 4: arms are keyed by (team, name): each team its own champion and challenger (`org`: the organisation's)
    sa.Column("team", sa.String(32), primary_key=True),
    sa.Column("name", sa.String(64), primary_key=True),
    sa.Column("model_version", sa.String(256), nullable=False),
    sa.Column("model_uri", sa.Text, nullable=False),  # local checkpoint dir (the base of an adapter), or vLLM base URL
    sa.Column("backend", sa.String(32), nullable=False),
    sa.Column("share", sa.Float, nullable=False),
    sa.Column("updated_at", sa.Float, nullable=False),
    # schema 2: the model name the arm asks its server for (a vLLM adapter's load name; NULL: the server's one
    # model) and the adapter directory it serves on model_uri's base (NULL: a full checkpoint)
    sa.Column("served_model", sa.String(256), nullable=True),
    sa.Column("adapter", sa.Text, nullable=True),
)

api_keys = sa.Table(
    "api_keys",
    metadata,
    sa.Column("key_hash", sa.String(64), primary_key=True),  # sha256 of the key; the key is never stored
    sa.Column("user_id", sa.String(128), nullable=False, index=True),
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("revoked", sa.Boolean, nullable=False, server_default=sa.false()),
    # schema 3: the key's client reports every outcome itself (Continue's data destination): a completion it
    # never reported was not shown, not rejected (NULL: it does not)
    sa.Column("reports_outcomes", sa.Boolean, nullable=True),
    sa.Column("team", sa.String(32), nullable=True),  # schema 4: the key's team (NULL: the organisation)
)

teams = sa.Table(
    "teams",
    metadata,
    sa.Column("name", sa.String(32), primary_key=True),
    # out of the logged cohort, as a user can be: served, never stored
    sa.Column("opted_out", sa.Boolean, nullable=False, server_default=sa.false()),
    # its outcomes also train the organisation's model (False: only its own adapter)
    sa.Column("shares_with_org", sa.Boolean, nullable=False, server_default=sa.true()),
    sa.Column("updated_at", sa.Float, nullable=False),
)

users = sa.Table(
    "users",
    metadata,
    sa.Column("user_id", sa.String(128), primary_key=True),
    sa.Column("opted_out", sa.Boolean, nullable=False, server_default=sa.false()),
    sa.Column("updated_at", sa.Float, nullable=False),
)

watermarks = sa.Table(
    "watermarks",
    metadata,
    sa.Column("name", sa.String(64), primary_key=True),
    sa.Column("completion_seq", sa.BigInteger, nullable=False),  # last completions.seq snapshotted
    sa.Column("snapshot", sa.Text, nullable=True),  # path of the snapshot that advanced it
    sa.Column("snapshot_sha256", sa.String(64), nullable=True),
    sa.Column("updated_at", sa.Float, nullable=False),
)

snapshots = sa.Table(
    "snapshots",
    metadata,
    sa.Column("name", sa.String(128), primary_key=True),  # file name under data/interactions/
    sa.Column("first_seq", sa.BigInteger, nullable=False),  # completions.seq range the cycle covered
    sa.Column("last_seq", sa.BigInteger, nullable=False),
    sa.Column("rows", sa.Integer, nullable=False),
    sa.Column("sha256", sa.String(64), nullable=False),
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("team", sa.String(32), nullable=True),  # schema 4: whose cycle took it (NULL: the organisation's)
)

store_info = sa.Table(
    "store_info",
    metadata,
    sa.Column("key", sa.String(32), primary_key=True),
    sa.Column("value", sa.Text, nullable=False),
)
"""Facts about the store itself: `id`, drawn once when the store is made (`store_id`)."""

late_feedback = sa.Table(
    "late_feedback",
    metadata,
    sa.Column("completion_id", sa.String(128), primary_key=True),
    sa.Column("snapshot", sa.Text, nullable=False),
    sa.Column("accepted", sa.Boolean, nullable=False),
    sa.Column("recorded_at", sa.Float, nullable=False),
)
