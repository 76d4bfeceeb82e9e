"""The docs site: every params field is described, and the site builds strict with its generated reference.

The reference pages (params, CLI, HTTP API) are generated from the code at build time by `docs/gen_ref.py`,
an MkDocs hook; a page that is missing or empty means the generator broke, and fails here.
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from tasks.core.config import Params
from tests.support.tree import source_files

ROOT = Path(__file__).resolve().parent.parent


def _fields(model: type[BaseModel], prefix: str = "") -> Iterator[tuple[str, FieldInfo]]:
    for name, field in model.model_fields.items():
        yield f"{prefix}{name}", field
        annotation = field.annotation
        for sub in (annotation, *getattr(annotation, "__args__", ())):
            if inspect.isclass(sub) and issubclass(sub, BaseModel):
                yield from _fields(sub, f"{prefix}{name}.")


def test_every_params_field_has_a_description() -> None:
    missing = [key for key, field in _fields(Params) if not (field.description or "").strip()]
    assert not missing, f"params fields without a description (write a docstring under each): {missing}"


@pytest.mark.skipif(
    importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None,
    reason="mkdocs and mkdocs-material are not installed (pip install -e '.[docs]'; make install does)",
)
def test_site_builds_strict_with_every_reference_page(tmp_path: Path) -> None:
    site = tmp_path / "site"
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stdout}\n{done.stderr}"
    # What each generated page must hold: every params key, every top-level command, every gateway route.
    expected = {
        "reference/params/index.html": [key for key, field in _fields(Params) if "." in key][:400],
        "reference/cli/index.html": ["tabrl serve", "tabrl cycle", "tabrl train", "tabrl params"],
        "reference/http/index.html": ["/v1/completions", "/v1/feedback", "/healthz"],
    }
    for page, needles in expected.items():
        path = site / page
        assert path.is_file(), f"generated page {page} is missing from the built site"
        text = path.read_text()
        assert "<table>" in text, f"generated page {page} is empty (no table)"
        absent = [n for n in needles if n not in text]
        assert not absent, f"generated page {page} lacks {absent[:10]}"
    assert (site / "reference/openapi.json").stat().st_size > 0


def test_the_architecture_page_names_every_module() -> None:
    """The map (docs/concepts/architecture.md) has one line per module: a module added or moved without its line
    fails here, so the map stays true."""
    page = (ROOT / "docs" / "concepts" / "architecture.md").read_text()
    modules = [
        p.relative_to(ROOT).as_posix()
        for p in source_files(ROOT, ("tasks", "serving", "flows", "bench"))
        if p.name != "__init__.py"
    ]
    missing = [m for m in modules if f"`{m}`" not in page]
    assert not missing, f"modules without a line in docs/concepts/architecture.md: {missing}"


def _continue_configs() -> list[tuple[str, dict]]:
    """Every Continue config.yaml the docs show: a yaml block with a model in the autocomplete role."""
    found = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        blocks = path.read_text().split("```yaml\n")[1:]
        for block in (b.split("```")[0] for b in blocks):
            config = yaml.safe_load(block)
            models = config.get("models") if isinstance(config, dict) else None
            if models and any("autocomplete" in m.get("roles", []) for m in models):
                found.append((path.relative_to(ROOT).as_posix(), config))
    return found


def test_every_continue_config_shown_has_the_keys_continue_requires() -> None:
    """Continue's config.yaml (issue 58, item 2): top-level name, version and `schema: v1`; a data destination
    carries its own `schema: 0.2.0` (the event format)."""
    configs = _continue_configs()
    assert {where for where, _ in configs} >= {"README.md", "docs/how-to/continue.md"}
    for where, config in configs:
        assert config.get("name") and config.get("version"), where
        assert config.get("schema") == "v1", where
        for destination in config.get("data", []):
            assert str(destination.get("schema")) == "0.2.0", (where, destination)
