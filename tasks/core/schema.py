"""The record schemas shared between stages, written down once.

Corpus files (``data/corpus/files.parquet``): ``path`` (relative to the corpus root), ``split``
("train" | "test", by path hash), ``text``.

FIM samples (``data/fim/{train,test}.parquet``), built by ``tasks/sim/corpus.py``:

    sample_id   string   stable id: sha1 of (path, span start, span end)
    path        string   source file, relative to the corpus root (the split key)
    split       string   "train" | "test"
    span_kind   string   "rest_of_line" | "line" | "lines"
    prefix      string   text before the cursor (capped at fim.max_prefix_chars)
    suffix      string   text after the middle (capped at fim.max_suffix_chars)
    middle      string   what the user was about to type

Interaction snapshots (``data/interactions/interactions-<first seq>-<last seq>.parquet``), built by
``tasks/ingest`` from the completions with ``<first seq> <= completions.seq <= <last seq>`` that
survived cleaning, in seq order (one row per shown or abstained request; DVC-versioned, never
rewritten); the reward stage writes a copy with ``continuation``, ``reward`` and ``advantage`` added
(``REWARDED_SCHEMA``):

    completion_id       string
    created_at          float64        unix seconds the suggestion was served
    user_id             string
    arm                 string
    model_version       string
    prompt              string         the exact FIM prompt the model saw
    completion          string         the suggestion shown ("" = abstained)
    token_ids           list<int32>    completion tokens as sampled (null if unknown)
    logprobs            list<float32>  behaviour log-probs of token_ids at `temperature` (null if unknown)
    temperature         float64
    outcome             string         "accepted" | "rejected" | "abstained"
    accepted_chars      int32          null unless accepted and the client reported it
    prefix              string         the text before the cursor, as the editor sent it (null in snapshots
                                       written before 2026-11-26)
    suffix              string         the text after the cursor, as the editor sent it (idem)
    continuation        string         (reward stage) what the same user typed after this request, read from
                                       their next requests' prefixes (null when unknown; tasks/reward/typed.py)
    reward              float64        (reward stage)
    advantage           float64        (reward stage)
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

CORPUS_SCHEMA = pa.schema([("path", pa.string()), ("split", pa.string()), ("text", pa.string())])

FIM_SCHEMA = pa.schema(
    [
        ("sample_id", pa.string()),
        ("path", pa.string()),
        ("split", pa.string()),
        ("span_kind", pa.string()),
        ("prefix", pa.string()),
        ("suffix", pa.string()),
        ("middle", pa.string()),
    ]
)

INTERACTION_SCHEMA = pa.schema(
    [
        ("completion_id", pa.string()),
        ("created_at", pa.float64()),
        ("user_id", pa.string()),
        ("arm", pa.string()),
        ("model_version", pa.string()),
        ("prompt", pa.string()),
        ("completion", pa.string()),
        ("token_ids", pa.list_(pa.int32())),
        ("logprobs", pa.list_(pa.float32())),
        ("temperature", pa.float64()),
        ("outcome", pa.string()),
        ("accepted_chars", pa.int32()),
        ("prefix", pa.string()),
        ("suffix", pa.string()),
    ]
)

REWARDED_SCHEMA = pa.schema(
    [
        *INTERACTION_SCHEMA,
        pa.field("continuation", pa.string()),
        pa.field("reward", pa.float64()),
        pa.field("advantage", pa.float64()),
    ]
)


def sampled_row(
    *,
    user_id: str,
    arm: str,
    model_version: str,
    prompt: str,
    completion: str,
    token_ids: list[int] | None,
    logprobs: list[float] | None,
    temperature: float,
    outcome: str,
    reward: float,
    advantage: float,
) -> dict[str, object]:
    """One REWARDED_SCHEMA row of a suggestion sampled off-line (GRPO groups, benches), not served."""
    return {
        "completion_id": uuid.uuid4().hex,
        "created_at": 0.0,
        "user_id": user_id,
        "arm": arm,
        "model_version": model_version,
        "prompt": prompt,
        "completion": completion,
        "token_ids": token_ids,
        "logprobs": logprobs,
        "temperature": temperature,
        "outcome": outcome,
        "accepted_chars": None,
        "reward": reward,
        "advantage": advantage,
    }


def write_rewarded(rows: list[dict[str, object]], path: str | Path) -> Path:
    """Rows as a rewarded snapshot (Parquet, REWARDED_SCHEMA), the folder made if needed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=REWARDED_SCHEMA), path)
    return path
