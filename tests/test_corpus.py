import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from flows.loop_state import CycleRow
from tasks.core.config import SHIPPED_CORPUS, load_params
from tasks.core.fim import QWEN
from tasks.sim.corpus import (
    CorpusError,
    build_fim,
    read_corpus,
    read_samples,
    resolve_source,
    split_files,
    split_of,
    stdlib_root,
    write_corpus,
    write_fim,
)
from tests.conftest import tiny_params

REPO = Path(__file__).resolve().parents[1]
# What a fresh clone needs to run the corpus and fim stages: the pipeline, its params, its code, the shipped corpus.
PIPELINE_FILES = ("dvc.yaml", "dvc.lock", "params.yaml", ".dvc/config", ".dvcignore", "data/.gitignore", SHIPPED_CORPUS)


def _md5(path: Path) -> str:
    return hashlib.md5(path.read_bytes()).hexdigest()


def test_split_is_by_file_and_no_file_is_in_both():
    params = tiny_params()
    files = split_files(params.data)
    train, test = {f.path for f in files["train"]}, {f.path for f in files["test"]}
    assert train and test and not train & test
    samples = build_fim(params.data, params.fim, files)
    assert {s["path"] for s in samples["train"]} <= train
    assert {s["path"] for s in samples["test"]} <= test
    assert len(samples["train"]) == 60 and len(samples["test"]) == 30


def test_split_depends_on_path_and_salt_only():
    a = load_params(None, environ={}).data
    b = load_params(None, ["data.split_salt=other"], environ={}).data
    paths = [f"pkg/mod{i}.py" for i in range(400)]
    assert [split_of(p, a) for p in paths] == [split_of(p, a) for p in paths]
    share = sum(split_of(p, a) == "test" for p in paths) / len(paths)
    assert 0.15 < share < 0.35  # test_fraction 0.25
    assert [split_of(p, a) for p in paths] != [split_of(p, b) for p in paths]


def test_deterministic_for_a_seed_and_different_for_another(tmp_path):
    params = tiny_params()
    files = split_files(params.data)
    once, twice = build_fim(params.data, params.fim, files), build_fim(params.data, params.fim, files)
    assert once == twice
    other = tiny_params(fim={"seed": 7})
    assert build_fim(other.data, other.fim, files)["train"] != once["train"]


def test_short_middles_are_dropped_and_caps_hold():
    params = tiny_params(fim={"min_middle_nonblank": 12, "max_prefix_chars": 100, "max_suffix_chars": 20})
    samples = build_fim(params.data, params.fim, split_files(params.data))
    for row in samples["train"] + samples["test"]:
        assert sum(not c.isspace() for c in row["middle"]) >= 12
        assert len(row["prefix"]) <= 100 and len(row["suffix"]) <= 20
    kinds = {row["span_kind"] for row in samples["train"]}
    assert kinds == {"rest_of_line", "line", "lines"}


def test_spans_come_from_the_file_text():
    params = tiny_params()
    files = split_files(params.data)
    texts = {f.path: f.text for f in files["train"]}
    for row in build_fim(params.data, params.fim, files)["train"][:30]:
        assert row["prefix"] + row["middle"] + row["suffix"] in texts[row["path"]]


def test_corpus_and_fim_files_round_trip(tmp_path):
    params = tiny_params()
    counts = write_corpus(params.data, tmp_path / "corpus")
    files = read_corpus(tmp_path / "corpus" / "files.parquet")
    assert counts == {"train_files": len(files["train"]), "test_files": len(files["test"])}
    stats = write_fim(params.data, params.fim, params.traffic, files, tmp_path / "fim")
    assert stats["train_samples"] == 60 and len(read_samples(tmp_path / "fim" / "test.parquet")) == 30
    assert json.loads((tmp_path / "fim" / "stats.json").read_text()) == stats


def test_external_jsonl_fim_sets_load(tmp_path):
    rows = []
    for i in range(40):
        prefix, suffix, middle = f"def f{i}(x):\n    ", "\n", f"return x * {i} + helper_{i}(x)"
        rows.append({"prompt": QWEN.render(prefix, suffix), "solutions": [middle], "path": f"repo/file{i}.py"})
    code_fim = tmp_path / "code-fim.jsonl"
    code_fim.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    params = tiny_params(data={"source": str(code_fim)}, fim={"n_train": 100, "n_test": 100})
    files = split_files(params.data)
    samples = build_fim(params.data, params.fim, files)
    assert len(samples["train"]) + len(samples["test"]) == 40
    assert not {s["path"] for s in samples["train"]} & {s["path"] for s in samples["test"]}
    one = next(s for s in samples["train"] + samples["test"] if s["path"] == "repo/file3.py")
    assert (one["prefix"], one["middle"], one["suffix"]) == ("def f3(x):\n    ", "return x * 3 + helper_3(x)", "\n")

    plain = tmp_path / "plain.jsonl"
    plain.write_text(
        "\n".join(json.dumps({"prefix": "a = ", "suffix": "", "middle": f"compute({i}, {i})"}) for i in range(10))
        + "\n"
    )
    params = tiny_params(data={"source": str(plain)}, fim={"n_train": 100, "n_test": 100})
    got = build_fim(params.data, params.fim, split_files(params.data))
    assert len(got["train"]) + len(got["test"]) == 10


def test_bad_sources_fail_with_a_sentence(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "x"}) + "\n")
    params = tiny_params(data={"source": str(bad)})
    with pytest.raises(CorpusError, match="needs columns prefix/suffix/middle or prompt/solutions"):
        split_files(params.data)
    params = tiny_params(data={"source": str(tmp_path / "missing")})
    with pytest.raises(CorpusError, match="does not exist"):
        split_files(params.data)
    with pytest.raises(CorpusError, match="run `dvc repro fim`"):
        read_samples(tmp_path / "nope.parquet")


def test_the_default_source_is_the_shipped_corpus_kept_byte_for_byte(tmp_path):
    assert load_params(None, environ={}).data.source == SHIPPED_CORPUS
    assert load_params(REPO / "params.yaml", environ={}).data.source == SHIPPED_CORPUS
    shipped = REPO / SHIPPED_CORPUS
    data = load_params(None, [f"data.source={shipped}"], environ={}).data
    counts = write_corpus(data, tmp_path / "same")
    # Not re-encoded: the same bytes as the shipped file (the md5 dvc.lock records), whichever pyarrow runs.
    assert _md5(tmp_path / "same" / "files.parquet") == _md5(shipped)
    assert counts == {"train_files": 1298, "test_files": 449}

    resalted = load_params(None, [f"data.source={shipped}", "data.split_salt=another"], environ={}).data
    write_corpus(resalted, tmp_path / "resplit")
    before = pq.read_table(shipped).to_pylist()
    after = pq.read_table(tmp_path / "resplit" / "files.parquet").to_pylist()
    assert {(r["path"], r["text"]) for r in after} == {(r["path"], r["text"]) for r in before}
    assert [r["split"] for r in after] == [split_of(r["path"], resalted) for r in after]
    assert {r["path"]: r["split"] for r in after} != {r["path"]: r["split"] for r in before}


def test_stdlib_stays_the_running_interpreters_and_a_missing_shipped_corpus_says_how_to_restore(tmp_path, monkeypatch):
    stdlib = load_params(None, ["data.source=stdlib"], environ={}).data
    assert resolve_source(stdlib) == stdlib_root() and (stdlib_root() / "os.py").is_file()
    monkeypatch.chdir(tmp_path)  # no data/corpus here: as if the shipped file were deleted
    with pytest.raises(CorpusError, match="git checkout data/corpus"):
        split_files(load_params(None, environ={}).data)


# 20-25 s on 2 busy cores (the fim stage: 4000 spans, 4600 typing regions): under the ~30 s that would make it `slow`.
def test_a_fresh_clone_builds_the_corpus_and_fim_data_dvc_lock_records(tmp_path):
    """`dvc repro -f fim` (corpus, then fim) in a copy of the project must give the outputs' md5s in dvc.lock:
    otherwise `make data` leaves dvc.lock modified, and the held-out data is not what the numbers were measured on."""
    clone = tmp_path / "clone"
    for name in PIPELINE_FILES:
        (clone / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(REPO / name, clone / name)
    for package in ("tasks", "serving", "flows"):  # `tabrl` is flows/cli/main.py
        shutil.copytree(REPO / package, clone / package, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run(["git", "init", "-q"], cwd=clone, check=True)
    env = os.environ | {
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",  # the venv's `tabrl`, as make's
        "PYTHONPATH": str(clone),
        "DVC_SITE_CACHE_DIR": str(tmp_path / "dvc-site"),
    }
    run = subprocess.run(
        [sys.executable, "-m", "dvc", "repro", "-f", "fim"], cwd=clone, env=env, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stdout + run.stderr
    recorded = yaml.safe_load((REPO / "dvc.lock").read_text())["stages"]
    built = yaml.safe_load((clone / "dvc.lock").read_text())["stages"]
    for stage in ("corpus", "fim"):
        assert built[stage]["outs"] == recorded[stage]["outs"], f"stage {stage}'s outputs differ from dvc.lock"
    assert _md5(clone / SHIPPED_CORPUS) == _md5(REPO / SHIPPED_CORPUS)  # rebuilt in place, left as shipped
    # dvc.yaml's plot: the demo's cycles.json (flows/report.py writes CycleRow rows) drawn by `dvc plots show`
    (plot,) = yaml.safe_load((REPO / "dvc.yaml").read_text())["plots"]
    ((path, spec),) = plot.items()
    fields = {f.name for f in dataclasses.fields(CycleRow)}
    assert {spec["x"], *spec["y"]} <= fields, f"dvc.yaml plots names a field cycles.json lacks: {spec}"
    rows = [{**dict.fromkeys(fields, None), "cycle": c, **dict.fromkeys(spec["y"], 0.1 * c)} for c in (1, 2)]
    (clone / path).parent.mkdir(parents=True)
    (clone / path).write_text(json.dumps(rows))
    shown = subprocess.run(
        [sys.executable, "-m", "dvc", "plots", "show", "--json"], cwd=clone, env=env, capture_output=True, text=True
    )
    assert shown.returncode == 0, shown.stdout + shown.stderr
    drawn = json.loads(shown.stdout)["data"][path]
    assert drawn and not json.loads(shown.stdout).get("errors"), shown.stdout[:500]
