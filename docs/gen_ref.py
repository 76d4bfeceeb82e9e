"""The reference pages, generated from the code at build time so they cannot drift (an MkDocs hook).

`mkdocs.yml` names this file under `hooks:`; `on_files` adds four pages that exist only in the built site:

* `reference/params.md`: every params key with its type, default and description, from the pydantic tree
  (`Params` in the module that defines it; descriptions are the field docstrings);
* `reference/cli.md`: every `tabrl` command with its arguments and options, from the Typer app that the
  `tabrl` console script of `pyproject.toml` points at (so it follows the app if it moves);
* `reference/http.md`: every gateway route with its request body, from the gateway's OpenAPI schema, and
  `reference/openapi.json` beside it;
* `reference/mlflow.md`: every MLflow tag tabrl sets, where and what it holds, from `tasks/core/vocab.py`'s `TAGS`.

Product modules are imported lazily, by name, so importing this file costs nothing and a moved module
needs one name changed here (or none, for the CLI). MkDocs' own hooks are used rather than a plugin such as
mkdocs-gen-files: four pages need `File.generated` (MkDocs >= 1.6) and nothing more.
"""

from __future__ import annotations

import html
import importlib
import inspect
import json
import re
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PARAMS_MODULE = "tasks.core.config"  # where `Params` (the root of the params tree) is defined
GATEWAY_MODULE = "serving.gateway"  # `create_app(params, engine=...)` builds the gateway
VOCAB_MODULE = "tasks.core.vocab"  # `TAGS`: every MLflow tag key, where it is set and what it holds
PAGES = ("reference/params.md", "reference/cli.md", "reference/http.md", "reference/mlflow.md")


def _cell(text: Any) -> str:
    """Text fit for one Markdown table cell."""
    return " ".join(str(text).split()).replace("|", "\\|")


def _literal(text: str) -> str:
    """Inline code fit for a table cell: an HTML <code> element, since a backslash-escaped pipe inside a Markdown
    code span stays a backslash (types such as `str | None`)."""
    return "<code>" + html.escape(" ".join(text.split())).replace("|", "&#124;") + "</code>"


def _code(value: Any) -> str:
    """A default value as inline code: JSON for data, Python's repr for strings."""
    return _literal(json.dumps(value) if not isinstance(value, str) else repr(value))


# ---- params -------------------------------------------------------------------------------------------------


def _type_name(annotation: Any) -> str:
    text = inspect.formatannotation(annotation)
    # sections live in the modules of the params package: drop `tasks.core.config.MODULE.` whole
    return re.sub(rf"\b{re.escape(PARAMS_MODULE)}\.(?:\w+\.)*", "", text.replace("typing.", ""))


def _section_fields(model: type, prefix: str) -> Iterator[tuple[str, Any, Any, str]]:
    from pydantic import BaseModel

    for name, field in model.model_fields.items():  # type: ignore[attr-defined]
        annotation = field.annotation
        if inspect.isclass(annotation) and issubclass(annotation, BaseModel):
            yield from _section_fields(annotation, f"{prefix}{name}.")
            continue
        default = field.get_default(call_default_factory=True)
        if isinstance(default, BaseModel):
            default = default.model_dump(mode="json")
        elif isinstance(default, tuple):
            default = [d.model_dump(mode="json") if isinstance(d, BaseModel) else d for d in default]
        yield f"{prefix}{name}", annotation, default, field.description or ""


def params_page() -> str:
    from pydantic import BaseModel

    config = importlib.import_module(PARAMS_MODULE)
    root = config.Params
    out = [
        "# Params reference",
        "",
        "Every key of `params.yaml`, generated from the typed tree in "
        f"`{PARAMS_MODULE}` when the site is built. Override one with `tabrl CMD --set section.key=VALUE` "
        "or the environment (`TABRL_SECTION__KEY=VALUE`); `tabrl params` prints the resolved tree. "
        "The default is the code's and the shipped one: `params.yaml` repeats it (`tests/test_config.py` fails "
        "when they drift), and the [decision records](../decisions/index.md) say why it is what it is.",
        "",
    ]
    for name, field in root.model_fields.items():
        section = field.annotation
        out += [f"## `{name}`", "", field.description or "", ""]
        out += ["| key | type | default | description |", "| --- | --- | --- | --- |"]
        for key, annotation, default, description in _section_fields(section, f"{name}."):
            out.append(
                f"| {_literal(key)} | {_literal(_type_name(annotation))} | {_code(default)} | {_cell(description)} |"
            )
        nested = [
            (key, t)
            for key, f in section.model_fields.items()
            for t in getattr(f.annotation, "__args__", ())
            if inspect.isclass(t) and issubclass(t, BaseModel)
        ]
        for key, model in nested:  # a list of sub-sections (simulator.personas): one table for its items
            out += ["", f"Each item of `{name}.{key}` (a `{model.__name__}`):", ""]
            out += ["| key | type | default | description |", "| --- | --- | --- | --- |"]
            for sub, annotation, default, description in _section_fields(model, f"{name}.{key}."):
                shown = "required" if repr(default) == "PydanticUndefined" else _code(default)
                out.append(f"| {_literal(sub)} | {_literal(_type_name(annotation))} | {shown} | {_cell(description)} |")
        out.append("")
    return "\n".join(out)


# ---- CLI ----------------------------------------------------------------------------------------------------


def _console_app() -> tuple[str, Any]:
    """The `tabrl` console script's target, as pyproject.toml names it (`module:attribute`)."""
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    target = scripts["tabrl"]
    module, _, attr = target.partition(":")
    return target, getattr(importlib.import_module(module), attr)


def _command_lines(name: str, command: Any) -> list[str]:
    out = [f"## `{name}`", ""]
    if command.help:
        out += [inspect.cleandoc(command.help), ""]
    ctx = command.context_class(command, info_name=name)  # Typer vendors click: its own classes, not `click`'s
    out += ["```text", f"Usage: {name} {' '.join(command.collect_usage_pieces(ctx))}".rstrip(), "```", ""]
    rows = []
    for param in command.params:
        record = param.get_help_record(ctx)  # (names with metavar, help with default), as `--help` prints them
        if record is None:  # hidden
            continue
        names, help_text = record
        required = "yes" if param.required else ""
        rows.append(f"| {_literal(names)} | {param.param_type_name} | {required} | {_cell(help_text)} |")
    if rows:
        out += ["| name | kind | required | help |", "| --- | --- | --- | --- |", *rows, ""]
    return out


def cli_page() -> str:
    import typer

    target, app = _console_app()
    root = typer.main.get_command(app)
    out = [
        "# CLI reference",
        "",
        f"Every `tabrl` command, generated from the Typer app `{target}` (the `tabrl` console script) when the "
        "site is built. `tabrl COMMAND --help` prints the same in a terminal.",
        "",
    ]
    if root.help:
        out += [inspect.cleandoc(root.help), ""]

    def walk(prefix: str, command: Any) -> Iterator[list[str]]:
        if hasattr(command, "list_commands"):  # a group
            ctx = command.context_class(command, info_name=prefix)
            for sub in command.list_commands(ctx):
                yield from walk(f"{prefix} {sub}", command.get_command(ctx, sub))
        else:
            yield _command_lines(prefix, command)

    for lines in walk("tabrl", root):
        out += lines
    return "\n".join(out)


# ---- HTTP API -----------------------------------------------------------------------------------------------


def openapi_schema() -> dict[str, Any]:
    """The gateway's OpenAPI schema, from an app built on default params and a throwaway in-memory store."""
    import sqlalchemy

    params = importlib.import_module(PARAMS_MODULE).Params()
    hot = importlib.import_module(GATEWAY_MODULE).create_app(params, engine=sqlalchemy.create_engine("sqlite://"))
    app = getattr(hot, "app", hot)  # create_app returns the ASGI fast path; its FastAPI app is `.app`
    schema: dict[str, Any] = app.openapi()
    return schema


def _schema_type(schema: dict[str, Any]) -> str:
    if "anyOf" in schema:
        return " or ".join(_schema_type(s) for s in schema["anyOf"])
    if "$ref" in schema:
        return str(schema["$ref"]).rsplit("/", 1)[-1]
    kind = schema.get("type", "any")
    if kind == "array":
        return f"array of {_schema_type(schema.get('items', {}))}"
    if "enum" in schema:
        return " \\| ".join(_code(v) for v in schema["enum"])
    return str(kind)


def _constraints(schema: dict[str, Any]) -> str:
    keys = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "minLength", "maxLength", "maxItems")
    found = {k: schema[k] for k in keys if k in schema}
    for option in schema.get("anyOf", ()):
        found.update({k: option[k] for k in keys if k in option})
    return ", ".join(f"{k} {v}" for k, v in found.items())


def http_page(schema: dict[str, Any]) -> str:
    out = [
        "# HTTP API reference",
        "",
        f"The gateway's routes, generated from its OpenAPI schema (`{GATEWAY_MODULE}.create_app`) when the site is "
        "built; the raw schema is [openapi.json](openapi.json), and a running gateway serves it at `/openapi.json` "
        "(interactive at `/docs`). Requests carry `Authorization: Bearer KEY` unless the gateway runs with "
        '`--no-auth`; errors are OpenAI error bodies (`{"error": {"message", "type", "code"}}`).',
        "",
    ]
    for path, methods in schema["paths"].items():
        for method, op in methods.items():
            out += [f"## `{method.upper()} {path}`", ""]
            if op.get("description"):
                out += [inspect.cleandoc(op["description"]), ""]
            body = op.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema")
            if body:
                required = set(body.get("required", ()))
                title = body.get("title", "body")
                out += [f"Request body (JSON, `{title}`):", ""]
                out += ["| field | type | required | constraints | description |", "| --- | --- | --- | --- | --- |"]
                for name, prop in body.get("properties", {}).items():
                    out.append(
                        f"| `{name}` | {_cell(_schema_type(prop))} | {'yes' if name in required else ''} | "
                        f"{_cell(_constraints(prop))} | {_cell(prop.get('description', ''))} |"
                    )
                if body.get("additionalProperties") is False:
                    out += ["", "Other fields are refused (400)."]
                out.append("")
            codes = ", ".join(f"{code} ({r.get('description', '')})" for code, r in op.get("responses", {}).items())
            out += [f"Responses: {codes}.", ""]
    return "\n".join(out)


def mlflow_page() -> str:
    """The MLflow tags tabrl sets on runs and model versions, one row per key of `TAGS`."""
    tags = importlib.import_module(VOCAB_MODULE).TAGS
    lines = [
        "# MLflow tags",
        "",
        "Generated from `tasks/core/vocab.py` (`TAGS`), where every tag key is defined once. Search runs by them",
        "in the MLflow UI (`tags.\"tabrl.kind\" = 'cycle'`) or with `MlflowClient().search_runs(...)`.",
        "",
        "| tag | set on | holds |",
        "| --- | --- | --- |",
    ]
    lines += [f"| `{key}` | {_cell(where)} | {_cell(what)} |" for key, (where, what) in tags.items()]
    return "\n".join(lines) + "\n"


# ---- the MkDocs hook ----------------------------------------------------------------------------------------


def generate() -> dict[str, str]:
    """Every generated file: site path -> content."""
    if str(ROOT) not in sys.path:  # this checkout's modules, not those of an installed copy elsewhere
        sys.path.insert(0, str(ROOT))
    schema = openapi_schema()
    return {
        "reference/params.md": params_page(),
        "reference/cli.md": cli_page(),
        "reference/http.md": http_page(schema),
        "reference/mlflow.md": mlflow_page(),
        "reference/openapi.json": json.dumps(schema, indent=2),
    }


def on_files(files: Any, config: Any) -> Any:
    from mkdocs.structure.files import File

    for src_uri, content in generate().items():
        files.append(File.generated(config, src_uri, content=content))
    return files
