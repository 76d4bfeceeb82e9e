"""FIM samples from real code: the shipped corpus, the interpreter's standard library, a directory,
or a FIM data set.

    tabrl corpus --out data/corpus     # stage `corpus`: files.parquet (path, split, text)
    tabrl data --out data/fim          # stage `fim`: train.parquet, test.parquet

The default source is the corpus shipped in git (``data/corpus/files.parquet``, what the shipped
base was trained on): the same bytes on every machine, whichever Python runs. ``stdlib`` reads the
running interpreter's standard library instead, which differs between Python builds.

Files are split train/test by a salted hash of their path, never by sample, so no file's code
is seen in both. Spans are cut the way an editor cursor meets code: the rest of a line from a
cursor inside it, one whole line, or a few lines. Everything is deterministic for a seed.
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
import sysconfig
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from tasks.core.config import SHIPPED_CORPUS, DataParams, FimParams, TrafficParams
from tasks.core.fim import QWEN, FimFormatError
from tasks.core.schema import CORPUS_SCHEMA, FIM_SCHEMA
from tasks.sim.editor import pick_regions, write_regions

SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", ".git", ".venv", "node_modules"}


class CorpusError(ValueError):
    """A corpus source that cannot be read; the message names it and says why."""


@dataclass(frozen=True)
class SourceFile:
    path: str  # relative to the corpus root
    text: str


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def split_of(path: str, params: DataParams) -> str:
    """'test' or 'train' from a salted hash of the file path (stable across machines)."""
    digest = hashlib.sha256(f"{params.split_salt}\0{path}".encode()).digest()
    return "test" if int.from_bytes(digest[:8], "big") / 2**64 < params.test_fraction else "train"


def iter_source_files(root: Path, params: DataParams) -> Iterator[SourceFile]:
    """Readable UTF-8 source files under root, sorted by path; others are skipped."""
    if not root.is_dir():
        raise CorpusError(f"corpus directory {root} does not exist")
    for file in sorted(root.rglob("*")):
        rel = file.relative_to(root)
        if any(part in SKIP_DIRS for part in rel.parts) or not file.is_file():
            continue
        if not file.name.endswith(params.extensions) or file.stat().st_size > params.max_file_bytes:
            continue
        try:
            text = file.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # a few stdlib test files are deliberately not UTF-8
        if text.strip():
            yield SourceFile(path=rel.as_posix(), text=text)


def resolve_source(params: DataParams) -> Path:
    return stdlib_root() if params.source == "stdlib" else Path(params.source)


def is_corpus_file(source: Path) -> bool:
    """A corpus file as `tabrl corpus` writes it (Parquet with the path, split, text columns), like the shipped one."""
    return source.is_file() and source.suffix == ".parquet" and pq.read_schema(source).names == CORPUS_SCHEMA.names


def is_dataset_file(source: Path) -> bool:
    return source.is_file() and source.suffix in {".jsonl", ".json", ".parquet"} and not is_corpus_file(source)


def _nonblank(text: str) -> int:
    return sum(1 for ch in text if not ch.isspace())


def cut_span(text: str, kind: str, rng: random.Random, params: FimParams) -> tuple[int, int] | None:
    """Character offsets [start, end) of a middle of the given kind, or None if the file has none."""
    lines = text.splitlines(keepends=True)
    candidates = [i for i, line in enumerate(lines) if _nonblank(line) >= params.min_middle_nonblank]
    if not candidates:
        return None
    i = rng.choice(candidates)
    offsets = [0]
    for line in lines:
        offsets.append(offsets[-1] + len(line))
    line = lines[i]
    body = line.rstrip("\n")
    indent = len(body) - len(body.lstrip())
    if kind == "rest_of_line":
        # The cursor sits somewhere after the indentation; the middle runs to the end of the line.
        if len(body) - indent < 2:
            return None
        start = offsets[i] + rng.randrange(indent + 1, len(body))
        return start, offsets[i] + len(body)
    if kind == "line":
        return offsets[i] + indent, offsets[i] + len(body)
    last = min(len(lines) - 1, i + rng.randrange(1, params.max_span_lines))
    return offsets[i] + indent, offsets[last] + len(lines[last].rstrip("\n"))


def sample_spans(files: list[SourceFile], split: str, n: int, params: FimParams, seed: int) -> list[dict]:
    """n FIM samples from files (uniform over files, then over candidate lines)."""
    if not files:
        raise CorpusError(f"no {split} files to sample FIM spans from")
    rng = random.Random(f"{seed}:{split}")
    kinds = list(params.span_weights)
    weights = [params.span_weights[k] for k in kinds]
    samples: dict[str, dict] = {}
    attempts = 0
    while len(samples) < n:
        attempts += 1
        if attempts > 50 * n + 1000:
            raise CorpusError(
                f"only {len(samples)} of {n} {split} spans pass the filters; add code or relax fim params"
            )
        file = rng.choice(files)
        kind = rng.choices(kinds, weights)[0]
        span = cut_span(file.text, kind, rng, params)
        if span is None:
            continue
        start, end = span
        middle = file.text[start:end]
        if _nonblank(middle) < params.min_middle_nonblank or len(middle) > params.max_middle_chars:
            continue
        sample_id = hashlib.sha1(f"{file.path}:{start}:{end}".encode()).hexdigest()[:16]
        if sample_id in samples:
            continue
        samples[sample_id] = {
            "sample_id": sample_id,
            "path": file.path,
            "split": split,
            "span_kind": kind,
            "prefix": file.text[max(0, start - params.max_prefix_chars) : start],
            "suffix": file.text[end : end + params.max_suffix_chars],
            "middle": middle,
        }
    return list(samples.values())


def _dataset_rows(source: Path) -> Iterable[dict]:
    """Rows of a JSONL/Parquet FIM data set as (path, prefix, suffix, middle) dicts."""
    from datasets import load_dataset

    kind = "parquet" if source.suffix == ".parquet" else "json"
    table = load_dataset(kind, data_files=str(source), split="train")
    columns = set(table.column_names)
    for index, row in enumerate(table):
        if {"prefix", "suffix", "middle"} <= columns:
            prefix, suffix, middle = row["prefix"], row["suffix"], row["middle"]
        elif {"prompt", "solutions"} <= columns:
            try:
                fim = QWEN.parse(row["prompt"])  # RLinf code-fim-v2 prompts are Qwen2.5-Coder's
            except FimFormatError as err:
                raise CorpusError(f"{source} row {index}: {err}") from err
            solutions = row["solutions"]
            middle = solutions[0] if isinstance(solutions, list) else solutions
            prefix, suffix = fim.prefix, fim.suffix
        else:
            raise CorpusError(
                f"{source}: needs columns prefix/suffix/middle or prompt/solutions, found {sorted(columns)}"
            )
        path = next((row[c] for c in ("path", "filepath", "file_path", "repo_path") if c in columns), None)
        yield {
            "path": path or f"row-{hashlib.sha1(prefix.encode()).hexdigest()[:12]}",
            "prefix": prefix,
            "suffix": suffix,
            "middle": middle or "",
        }


def dataset_samples(source: Path, data: DataParams, fim: FimParams) -> dict[str, list[dict]]:
    """FIM samples from a data set file, split by the path column (or, lacking one, the prefix hash)."""
    by_split: dict[str, list[dict]] = {"train": [], "test": []}
    for row in _dataset_rows(source):
        if _nonblank(row["middle"]) < fim.min_middle_nonblank:
            continue
        split = split_of(row["path"], data)
        sample_id = hashlib.sha1(f"{row['path']}:{row['prefix']}:{row['middle']}".encode()).hexdigest()[:16]
        by_split[split].append(
            {
                "sample_id": sample_id,
                "path": row["path"],
                "split": split,
                "span_kind": "dataset",
                "prefix": row["prefix"][-fim.max_prefix_chars :],
                "suffix": row["suffix"][: fim.max_suffix_chars],
                "middle": row["middle"],
            }
        )
    rng = random.Random(fim.seed)
    for split, n in (("train", fim.n_train), ("test", fim.n_test)):
        rows = sorted(by_split[split], key=lambda r: r["sample_id"])
        rng.shuffle(rows)
        by_split[split] = rows[:n]
    return by_split


def corpus_files(data: DataParams) -> Iterator[SourceFile]:
    """The source's files; a corpus file contributes its rows in their order (their recorded split is
    ignored: split_of decides), a FIM data set one pseudo-file (prefix+middle+suffix) per row."""
    source = resolve_source(data)
    if not source.exists():
        shipped = data.source == SHIPPED_CORPUS
        restore = "; it is committed to git: `git checkout data/corpus` restores it" if shipped else ""
        raise CorpusError(f"corpus source {source} does not exist{restore}")
    if is_corpus_file(source):
        for row in pq.read_table(source, columns=["path", "text"]).to_pylist():
            yield SourceFile(path=row["path"], text=row["text"])
    elif is_dataset_file(source):
        for row in _dataset_rows(source):
            yield SourceFile(path=row["path"], text=row["prefix"] + row["middle"] + row["suffix"])
    elif source.is_file():
        raise CorpusError(f"corpus source {source} is a file but not .jsonl/.json/.parquet")
    else:
        yield from iter_source_files(source, data)


def split_files(data: DataParams) -> dict[str, list[SourceFile]]:
    files: dict[str, list[SourceFile]] = {"train": [], "test": []}
    for file in corpus_files(data):
        files[split_of(file.path, data)].append(file)
    return files


def write_corpus(data: DataParams, out_dir: Path) -> dict[str, int]:
    """The corpus stage: files.parquet (path, split, text) under out_dir; returns file counts.

    A corpus file source whose rows come out unchanged (the shipped corpus under the default split
    params) is kept byte for byte, not re-encoded: its md5 stays the one dvc.lock records, whichever
    pyarrow runs; written in place (out_dir holds the source), it is left untouched."""
    files = split_files(data)
    rows = [{"path": f.path, "split": split, "text": f.text} for split, fs in files.items() for f in fs]
    out = out_dir / "files.parquet"
    out_dir.mkdir(parents=True, exist_ok=True)
    source = resolve_source(data)
    if is_corpus_file(source) and pq.read_table(source).to_pylist() == rows:
        if not (out.exists() and out.samefile(source)):
            shutil.copyfile(source, out)
    else:
        pq.write_table(pa.Table.from_pylist(rows, schema=CORPUS_SCHEMA), out)
    return {f"{split}_files": len(fs) for split, fs in files.items()}


def read_corpus(path: Path) -> dict[str, list[SourceFile]]:
    if not path.is_file():
        raise CorpusError(
            f"corpus {path} not found: `git checkout data/corpus` restores the shipped one, "
            "`dvc repro corpus` builds one from data.source"
        )
    files: dict[str, list[SourceFile]] = {"train": [], "test": []}
    for row in pq.read_table(path).to_pylist():
        files[row["split"]].append(SourceFile(row["path"], row["text"]))
    return files


def build_fim(data: DataParams, fim: FimParams, files: dict[str, list[SourceFile]]) -> dict[str, list[dict]]:
    """Train and test FIM samples: from the data set's own middles, or spans cut from the corpus files."""
    source = resolve_source(data)
    if is_dataset_file(source):
        return dataset_samples(source, data, fim)
    return {
        "train": sample_spans(files["train"], "train", fim.n_train, fim, fim.seed),
        "test": sample_spans(files["test"], "test", fim.n_test, fim, fim.seed),
    }


def write_samples(rows: list[dict], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=FIM_SCHEMA), path)
    return path


def read_samples(path: Path) -> list[dict]:
    if not path.is_file():
        raise CorpusError(f"FIM samples {path} not found; run `dvc repro fim` (or `make data`) first")
    return pq.read_table(path).to_pylist()


def write_fim(
    data: DataParams, fim: FimParams, traffic: TrafficParams, files: dict[str, list[SourceFile]], out_dir: Path
) -> dict[str, int]:
    """Build and write train/test.parquet (FIM spans), typing_train/test.parquet (editor-traffic
    regions, tasks/sim/editor.py) and stats.json under out_dir; returns counts."""
    samples = build_fim(data, fim, files)
    for split, rows in samples.items():
        write_samples(rows, out_dir / f"{split}.parquet")
    stats = {f"{split}_samples": len(rows) for split, rows in samples.items()}
    for split, n in (("train", traffic.train_regions), ("test", traffic.eval_regions)):
        regions = pick_regions(files[split], n, traffic, fim.seed, split)
        write_regions(regions, out_dir / f"typing_{split}.parquet", traffic)
        stats[f"typing_{split}_regions"] = len(regions)
    stats |= {f"{split}_files": len({r["path"] for r in rows}) for split, rows in samples.items()}
    (out_dir / "stats.json").write_text(json.dumps(stats, indent=2) + "\n")
    return stats
