"""`tabrl train` on CPU with the tiny model (PPO on a snapshot; GRPO on FIM prompts)."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from flows.cli.main import app
from tasks.core.fim import QWEN
from tasks.core.generate import generate, load_model
from tasks.sim.corpus import write_samples
from tasks.train.grpo import group_advantages
from tests.conftest import tiny_params

SETS = ["--set", "train.epochs=1", "--set", "train.micro_batch=16", "--set", "serving.max_tokens=8"]


def _params_file(tmp_path):
    import yaml

    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(tiny_params(tmp_path).model_dump(mode="json")))
    return path


def test_group_advantages_are_normalised_within_the_group():
    adv = group_advantages([0.75, -0.25, -0.25, 0.0])
    assert sum(adv) == pytest.approx(0.0, abs=1e-9)
    assert sum(a * a for a in adv) / 4 == pytest.approx(1.0)
    assert group_advantages([0.0, 0.0]) == [0.0, 0.0]


def test_cli_grpo_then_ppo_on_its_snapshot(tiny_model_dir, fim_samples, tmp_path):
    # the tiny model is rarely right on real middles; make the truth its own greedy guess so groups have signal
    model, tok, template = load_model(tiny_model_dir)
    short = [dict(s, prefix=s["prefix"][-300:], suffix=s["suffix"][:60]) for s in fim_samples[:6]]
    greedy = generate(model, tok, template, [QWEN.render(s["prefix"], s["suffix"]) for s in short], 8)
    fim = tmp_path / "train.parquet"
    write_samples([dict(s, middle=g.text or s["middle"]) for s, g in zip(short, greedy, strict=True)], fim)
    params = _params_file(tmp_path)
    out = tmp_path / "grpo"
    res = CliRunner().invoke(
        app,
        [
            "train",
            "--algorithm",
            "grpo",
            "--fim",
            str(fim),
            "--from",
            str(tiny_model_dir),
            "--out",
            str(out),
            "--params",
            str(params),
            *SETS,
            "--set",
            "train.group_size=4",
            "--set",
            "serving.temperature=1.0",
        ],
    )
    assert res.exit_code == 0, res.output
    snap = pq.read_table(tmp_path / "grpo.grpo.parquet").to_pylist()
    assert snap and len(snap) % 4 == 0 and all(r["token_ids"] for r in snap if r["completion"])
    assert (out / "model.safetensors").is_file()
    # PPO on that snapshot through the CLI; a missing snapshot is a clear exit 2
    res = CliRunner().invoke(
        app,
        [
            "train",
            "--snapshot",
            str(tmp_path / "grpo.grpo.parquet"),
            "--from",
            str(out),
            "--out",
            str(tmp_path / "ppo"),
            "--params",
            str(params),
            *SETS,
        ],
    )
    assert res.exit_code == 0, res.output
    assert "Saved" in res.output and (tmp_path / "ppo" / "config.json").is_file()
    res = CliRunner().invoke(
        app,
        [
            "train",
            "--snapshot",
            str(tmp_path / "nope.parquet"),
            "--from",
            str(out),
            "--out",
            str(tmp_path / "x"),
            "--params",
            str(params),
        ],
    )
    assert res.exit_code == 2 and "not found" in res.output
