"""The data -> base -> acceptance path through the `tabrl` CLI, as `dvc repro` and `make demo` run it."""

import json
import re

import typer
from typer.testing import CliRunner

from flows.cli.main import app
from tests.conftest import TINY_MODEL, tiny_params

runner = CliRunner()


def _sets(params_dict):
    out = []
    for section, kv in params_dict.items():
        for key, value in kv.items():
            out += ["--set", f"{section}.{key}={json.dumps(value)}"]
    return out


def test_pipeline_commands_end_to_end(tmp_path):
    tiny = tiny_params()
    sets = _sets(
        {
            "data": {"source": tiny.data.source, "test_fraction": 0.3},
            "fim": {"n_train": 40, "n_test": 20},
            "model": TINY_MODEL | {"pretrain_steps": 5},
            "evaluate": {"n_samples": 8, "n_requests": 8, "max_new_tokens": 8},
            "traffic": {"train_regions": 30, "eval_regions": 10},
            "serving": {"min_logprob": None},  # the test model is sure of nothing: shown whole, it shows something
        }
    )
    none = ["--params", str(tmp_path / "none.yaml")]
    assert runner.invoke(app, ["corpus", *none]).exit_code == 2  # missing params file: exit 2 with a sentence
    (tmp_path / "params.yaml").write_text("{}\n")
    common = ["--params", str(tmp_path / "params.yaml"), *sets]
    r = runner.invoke(app, ["corpus", "--out", str(tmp_path / "corpus"), *common])
    assert r.exit_code == 0, r.output
    corpus = str(tmp_path / "corpus" / "files.parquet")
    r = runner.invoke(app, ["data", "--corpus", corpus, "--out", str(tmp_path / "fim"), *common])
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["build-base", "--corpus", corpus, "--out", str(tmp_path / "model"), *common])
    assert r.exit_code == 0, r.output
    out = tmp_path / "acc.json"
    r = runner.invoke(
        app,
        [
            "acceptance",
            "--model",
            str(tmp_path / "model"),
            "--regions",
            str(tmp_path / "fim" / "typing_test.parquet"),
            "--json",
            str(out),
            *common,
        ],
    )
    assert r.exit_code == 0, r.output
    assert "Held-out editor traffic" in r.output and "chars_saved" in r.output and "noise floor" in r.output
    assert "suggestions shown whole (serving.min_logprob: null)" in r.output  # what users are shown, said
    numbers = json.loads(out.read_text())
    assert numbers["requests"] >= 8 and 0 <= numbers["suggest_rate"] <= 1 and numbers["noise_floor"] == 0.0225
    low, high = numbers["intervals"]["suggest_rate"]
    assert low <= numbers["suggest_rate"] <= high
    out = tmp_path / "headroom.json"
    r = runner.invoke(
        app,
        [
            "headroom",
            "--model",
            str(tmp_path / "model"),
            "--regions",
            str(tmp_path / "fim" / "typing_test.parquet"),
            "--requests",
            "6",
            "--k",
            "2",
            "--json",
            str(out),
            *common,
        ],
    )
    assert r.exit_code == 0, r.output
    room = json.loads(out.read_text())
    assert room["requests"] == 6 and room["k"] == 2 and 0 <= room["greedy_right"] <= room["greedy_shown"] <= 1
    assert 0 < room["middle_loss"] < 20 and "loss of the true continuation" in r.output


def test_bad_params_exit_2_with_the_key(tmp_path):
    r = runner.invoke(app, ["params", "--params", str(tmp_path / "x.yaml")])
    assert r.exit_code == 2 and "not found" in r.output
    (tmp_path / "p.yaml").write_text("train:\n  lr: -1\n")
    r = runner.invoke(app, ["params", "--params", str(tmp_path / "p.yaml")])
    assert r.exit_code == 2 and "train.lr = -1" in r.output


def test_missing_model_is_a_clear_error(tmp_path):
    (tmp_path / "p.yaml").write_text("{}\n")
    r = runner.invoke(
        app,
        [
            "acceptance",
            "--params",
            str(tmp_path / "p.yaml"),
            "--model",
            str(tmp_path / "nomodel"),
            "--regions",
            str(tmp_path / "none.parquet"),
        ],
    )
    assert r.exit_code == 2 and "nomodel is not a model directory" in r.output  # named before the data is read


# `tabrl --help` and every command's help (issue 42): grouped by job, one example each, no code internals.
PANELS = ("Data and models", "The cycle", "Serving", "Deployment and schedules", "Keys and privacy")
INTERNALS = re.compile(r"\b(tasks|serving|flows|bench|tests)/|\.py\b|\b(tasks|flows)\.[a-z_]")


def _plain(text: str) -> str:
    """Help text without the boxes rich draws and the line breaks it wraps at."""
    return " ".join(re.sub(r"[│╭╮╰╯─]", " ", text).split())


def _command_paths(command, path=()):
    for name, sub in getattr(command, "commands", {}).items():
        yield (*path, name)
        yield from _command_paths(sub, (*path, name))


def test_the_root_help_groups_commands_by_job_and_says_nothing_of_the_code():
    r = runner.invoke(app, ["--help"])
    assert r.exit_code == 0, r.output
    text = _plain(r.output)
    for panel in PANELS:
        assert panel in text
    assert not INTERNALS.search(text), INTERNALS.search(text)


def test_every_command_help_shows_one_example_and_no_code_internals():
    paths = list(_command_paths(typer.main.get_command(app)))
    assert ("keys", "add") in paths and ("vllm", "status") in paths and len(paths) > 25
    for path in paths:
        r = runner.invoke(app, [*path, "--help"])
        assert r.exit_code == 0, (path, r.output)
        text = _plain(r.output)
        assert text.count("Example: tabrl ") == 1, (path, text)
        assert f"Example: tabrl {' '.join(path)}" in text, (path, text)
        found = INTERNALS.search(text)
        assert not found, (path, found.group(0), text)


def test_version():
    r = runner.invoke(app, ["--version"])
    assert r.exit_code == 0 and re.fullmatch(r"tabrl \d+\.\d+\.\d+\S*\n", r.output), r.output
