"""One vocabulary (tasks/core/vocab.py): every MLflow tag key is written there once, listed in `TAGS` (the
docs' reference page of tags is generated from it), and no other product module spells one out."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import get_args

from tasks.core import vocab

ROOT = Path(__file__).resolve().parents[1]


def spelled_out_tags(root: Path = ROOT) -> list[str]:
    """Each "tabrl.*" string outside vocab.py that is not a logger's name, as file:line: the string."""
    found = []
    for path in sorted(p for pkg in ("tasks", "serving", "flows", "bench") for p in (root / pkg).rglob("*.py")):
        if path == root / "tasks/core/vocab.py":
            continue
        tree = ast.parse(path.read_text(), str(path))
        loggers = {
            id(arg)
            for node in ast.walk(tree)
            if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "getLogger"
            for arg in node.args
        }
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in loggers:
                if node.value.startswith("tabrl.") and node.value[6:].replace("_", "").isalnum():
                    found.append(f"{path.relative_to(root)}:{node.lineno}: {node.value!r}")
    return found


def test_no_module_but_the_vocabulary_spells_out_a_tag_key():
    found = spelled_out_tags()
    assert not found, "tag keys written outside tasks/core/vocab.py:\n  " + "\n  ".join(found)


def test_the_check_catches_a_tag_key_but_not_a_logger(tmp_path):
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks/a.py").write_text(
        "import logging\nlog = logging.getLogger('tabrl.gateway')\ntags = {'tabrl.kind': 'cycle'}\n"
    )
    assert spelled_out_tags(tmp_path) == ["tasks/a.py:3: 'tabrl.kind'"]


def test_every_tag_key_is_listed_with_where_it_is_set_and_what_it_holds():
    keys = {v for k, v in vars(vocab).items() if k.isupper() and isinstance(v, str) and v.startswith("tabrl.")}
    assert keys == set(vocab.TAGS)
    assert all(where and what for where, what in vocab.TAGS.values())
    assert set(vocab.SNAPSHOT_TAGS) <= keys


def test_the_step_metrics_are_the_keys_one_step_logs():
    from tasks.train.step import StepSums, step_metrics

    logged = step_metrics(StepSums(tokens=4.0), 0.0, 0.0, 1e-5, 1.0, abstaining=True)
    assert tuple(logged) == vocab.STEP_METRICS
    assert set(get_args(vocab.ChangeAction)) < set(get_args(vocab.Action))  # a change is a decision, not "continue"
