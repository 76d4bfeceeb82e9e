"""Editor-like traffic: simulated users type regions of real files, and the editor asks at every pause.

Real Tab traffic is not random spans. A person types; the editor requests a completion at each
pause (Continue debounces keystrokes): after a word, after `.` `(` `=` `,` `:` `[`, at a new
indented line, and now and then in the middle of a word. So most requests sit mid-line, often
mid-identifier, and many right answers are short (the rest of a name used above, a closing bracket).

A typing session is one user typing one region (a few whole lines) of a real file:

    prefix = the file up to the cursor        suffix = the file after the region
    truth  = the rest of the region           (what the user is about to type)

The user presses Tab iff the suggestion is what they were about to type (``is_right``: a
whitespace-normalised prefix of the truth covering at least K non-blank characters; persona noise
on top) and the cursor jumps past it; otherwise they type on to the next pause, and the suggestion
counts as rejected. After a newline the editor indents by itself (the cursor skips the indentation).

Pause positions are a pure function of (region, position), so two models are asked at the same
places as long as they get the same Tabs. Everything is seeded. This module holds the regions and
where the editor asks in them (and the training samples cut at those places); the users typing them
and what a run reports are in `tasks.sim.sessions`.

    regions = pick_regions(files, n, params.traffic, seed, "eval")
    turns, typed = run_sessions(regions, users, suggest_batch, n_requests, batch_size, seed, traffic)
    summarise_turns(turns, typed)
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from tasks.core.config import TrafficParams
from tasks.sim.users import nonblank


@dataclass(frozen=True)
class Region:
    """Characters [start, end) of one file: what a user types in one session."""

    region_id: str
    path: str
    text: str  # the whole file
    start: int
    end: int


def _line_offsets(lines: Sequence[str]) -> list[int]:
    offsets = [0]
    for line in lines:
        offsets.append(offsets[-1] + len(line))
    return offsets


def pick_regions(files: Sequence, n: int, traffic: TrafficParams, seed: int, tag: str) -> list[Region]:
    """n distinct regions (1..traffic.region_lines whole lines from a line with code), uniform over files.

    ``files`` are objects with ``path`` and ``text`` (``tasks.sim.corpus.SourceFile``). A region
    starts at its first line's first non-blank character (the editor indented the empty line)."""
    if not files:
        raise ValueError(f"no files to type {tag} regions from")
    rng = random.Random(f"regions:{seed}:{tag}")
    found: dict[str, Region] = {}
    attempts = 0
    while len(found) < n:
        attempts += 1
        if attempts > 50 * n + 1000:
            raise ValueError(
                f"only {len(found)} of {n} {tag} regions have code; add files or lower traffic.min_region_nonblank"
            )
        file = rng.choice(files)
        lines = file.text.splitlines(keepends=True)
        candidates = [i for i, line in enumerate(lines) if nonblank(line) >= traffic.min_line_nonblank]
        if not candidates:
            continue
        first = rng.choice(candidates)
        last = min(len(lines) - 1, first + rng.randrange(traffic.region_lines))
        offsets = _line_offsets(lines)
        body = lines[first]
        start = offsets[first] + len(body) - len(body.lstrip())
        end = offsets[last] + len(lines[last].rstrip("\r\n"))
        if nonblank(file.text[start:end]) < traffic.min_region_nonblank or end - start > traffic.max_region_chars:
            continue
        region_id = hashlib.sha1(f"{file.path}:{start}:{end}".encode()).hexdigest()[:16]
        found.setdefault(region_id, Region(region_id, file.path, file.text, start, end))
    return list(found.values())


REGION_SCHEMA = pa.schema(
    [
        ("region_id", pa.string()),
        ("path", pa.string()),
        ("text", pa.string()),
        ("start", pa.int64()),
        ("end", pa.int64()),
    ]
)


def windowed(region: Region, traffic: TrafficParams) -> Region:
    """The region with only the text any of its requests can show (prefix and suffix caps): small to store."""
    lo = max(0, region.start - traffic.max_prefix_chars)
    hi = min(len(region.text), region.end + traffic.max_suffix_chars)
    return replace(region, text=region.text[lo:hi], start=region.start - lo, end=region.end - lo)


def write_regions(regions: Sequence[Region], path: Path, traffic: TrafficParams) -> Path:
    """Regions as Parquet (windowed), as the `fim` stage stores them next to the FIM samples."""
    rows = [vars(windowed(r, traffic)) for r in regions]
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=REGION_SCHEMA), path)
    return path


def read_regions(path: Path) -> list[Region]:
    if not path.is_file():
        raise FileNotFoundError(f"typing regions {path} not found; run `dvc repro fim` (or `make data`) first")
    return [Region(**row) for row in pq.read_table(path).to_pylist()]


def regions_path(data_dir: str | Path, split: str) -> Path:
    """Where the `fim` stage writes the typing regions of a split."""
    return Path(data_dir) / "fim" / f"typing_{split}.parquet"


def _unit(*parts: object) -> float:
    """A uniform number in [0, 1) from a hash of parts: a coin that is the same in every process."""
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def is_pause(region: Region, pos: int, traffic: TrafficParams) -> bool:
    """Does the editor ask for a completion with the cursor at pos (before text[pos])?"""
    if pos == region.start:
        return True  # a fresh (auto-indented) line
    prev, here = region.text[pos - 1], region.text[pos]
    if prev in traffic.pause_after:
        return True
    if prev.isspace() and not here.isspace():
        return True  # a word boundary, or a new indented line
    return _unit(region.region_id, pos) < traffic.p_midword_pause


def skip_indent(text: str, pos: int, end: int) -> int:
    """After a newline the editor indents: the cursor lands on the line's first non-blank character."""
    while pos < end and pos > 0 and text[pos - 1] == "\n" and text[pos] in " \t":
        while pos < end and text[pos] in " \t":
            pos += 1
    return pos


def next_pause(region: Region, pos: int, traffic: TrafficParams) -> int | None:
    """The first pause at or after pos, or None when the region is typed to its end."""
    pos = skip_indent(region.text, pos, region.end)
    while pos < region.end:
        if not region.text[pos].isspace() or pos == region.start:
            if is_pause(region, pos, traffic):
                return pos
        pos += 1
        pos = skip_indent(region.text, pos, region.end)
    return None


def request_at(region: Region, pos: int, traffic: TrafficParams) -> dict:
    """The completion request (a FIM sample: prefix, suffix, the true rest of the region as middle)."""
    return {
        "sample_id": f"{region.region_id}@{pos}",
        "path": region.path,
        "split": "",
        "span_kind": "typing",
        "prefix": region.text[max(0, pos - traffic.max_prefix_chars) : pos],
        "suffix": region.text[region.end : region.end + traffic.max_suffix_chars],
        "middle": region.text[pos : region.end],
    }


def pause_requests(region: Region, traffic: TrafficParams) -> Iterator[dict]:
    """Every request of a session in which no suggestion is taken (the model-free request set)."""
    pos = next_pause(region, region.start, traffic)
    while pos is not None:
        yield request_at(region, pos, traffic)
        pos = next_pause(region, pos + 1, traffic)


def training_samples(
    regions: Sequence[Region], n: int, traffic: TrafficParams, stop_weights: dict[str, float], seed: int
) -> list[dict]:
    """FIM samples whose cursor sits where an editor asks (pause positions of typing sessions).

    The suffix is the file after the region, as at serving time; the middle runs from the cursor to
    a stop drawn by weight: the end of the current token (at least traffic.min_stop_nonblank
    non-blank characters), the end of the line, or the end of the region. The model learns to
    stop where stopping is safe; what follows the middle inside the region is not shown."""
    rng = random.Random(f"editor-samples:{seed}")
    kinds = list(stop_weights)
    weights = [stop_weights[k] for k in kinds]
    pool = [r for region in regions for r in pause_requests(region, traffic)]
    if not pool:
        raise ValueError("no pause positions in the regions")
    rng.shuffle(pool)
    samples = []
    for request in pool[:n]:
        truth = request["middle"]
        kind = rng.choices(kinds, weights)[0]
        stop = stop_of(truth, kind, traffic.min_stop_nonblank)
        samples.append({**request, "span_kind": f"typing-{kind}", "middle": truth[:stop]})
    return samples


def _is_word(ch: str) -> bool:
    return ch.isalnum() or ch == "_"


def stop_of(truth: str, kind: str, min_nonblank: int) -> int:
    """Where a middle of this kind ends inside the truth (the rest of a region)."""
    if kind == "region":
        return len(truth)
    line_end = truth.find("\n")
    line_end = len(truth) if line_end < 0 else line_end
    if kind == "line":
        return line_end if truth[:line_end].strip() else len(truth)
    # token: whole tokens (a word, or one punctuation character) until enough non-blanks.
    i = 0
    while i < line_end:
        if _is_word(truth[i]):
            while i < line_end and _is_word(truth[i]):
                i += 1
        else:
            i += 1
        if nonblank(truth[:i]) >= min_nonblank and (
            i >= line_end or not (_is_word(truth[i - 1]) and _is_word(truth[i]))
        ):
            return i
    return line_end
