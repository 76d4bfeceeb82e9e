import json

import pytest

from tasks.config import load_params
from tasks.corpus import (
    CorpusError,
    build_fim,
    read_corpus,
    read_samples,
    split_files,
    split_of,
    write_corpus,
    write_fim,
)
from tasks.fim import QWEN
from tests.conftest import tiny_params


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
