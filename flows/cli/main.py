"""`tabrl`: online reinforcement learning for a code-completion service, on the command line.

Every command reads params.yaml (``--params``) and takes ``--set section.key=value`` overrides;
``TABRL_SECTION__KEY`` environment variables override too. ``tabrl COMMAND --help`` shows one command with
an example. Commands are grouped by job: data and models, the cycle, serving, deployment and schedules, keys
and privacy.
"""

from __future__ import annotations

import json
from importlib.metadata import version as installed_version
from pathlib import Path
from typing import Annotated

import typer

from flows.cli.console import ParamsOpt, SetOpt, console, fail, params_or_exit
from flows.cli.cycle import cycle_cmd, deploy_cmd, schedule_cmd
from flows.cli.data import corpus_cmd, data_cmd, ingest_cmd
from flows.cli.deploy import ab_status_cmd, export_cmd, model_retention_cmd, promote_cmd, rollback_cmd, vllm_app
from flows.cli.doctor import doctor_cmd
from flows.cli.evaluate import acceptance_cmd, evaluate_cmd, headroom_cmd
from flows.cli.keys import keys_app, purge_cmd, teams_app
from flows.cli.serve import arms_cmd, import_continue_cmd, serve_cmd, simulate_cmd
from flows.cli.train import build_base_cmd, import_model_cmd, train_cmd
from flows.cli.up import up_cmd
from tasks.core.config import DEFAULT_PARAMS_FILE

HELP = """tabrl: online reinforcement learning for a code-completion service.

Every command reads params.yaml (--params) and takes --set section.key=value overrides; TABRL_SECTION__KEY
environment variables override too. Run `tabrl COMMAND --help` for one command and an example."""

DATA, CYCLE, SERVING, DEPLOYMENT, KEYS, MACHINE = (
    "Data and models",
    "The cycle",
    "Serving",
    "Deployment and schedules",
    "Keys and privacy",
    "This machine",
)

# add_completion: `tabrl --install-completion` (bash, zsh, fish, PowerShell; click's completion through Typer)
app = typer.Typer(help=HELP, no_args_is_help=True, add_completion=True, pretty_exceptions_enable=False)


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"tabrl {installed_version('tabrl')}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool, typer.Option("--version", help="Print tabrl's version and exit.", callback=_print_version, is_eager=True)
    ] = False,
) -> None:
    pass


@app.command("params", rich_help_panel=DATA, epilog="Example: tabrl params --set train.lr=1e-4")
def show_params(params: ParamsOpt = DEFAULT_PARAMS_FILE, set_: SetOpt = None) -> None:
    """Print the resolved config (file + env + --set) as YAML-like dotted keys."""
    resolved = params_or_exit(params, set_)
    for key, value in resolved.flat().items():
        console.print(f"{key} = {json.dumps(value)}", highlight=False)


@app.command("init", rich_help_panel=DATA, epilog="Example: tabrl init my-service && cd my-service && tabrl params")
def init_cmd(
    directory: Annotated[Path, typer.Argument(help="Directory for params.yaml (made when missing).")] = Path("."),
) -> None:
    """Write DIRECTORY/params.yaml with the installed tabrl's defaults, each key with its one-line description: what
    every command reads, outside a checkout of the project. An existing params.yaml is never overwritten."""
    from tasks.core.config import Params
    from tasks.core.config.render import params_yaml

    target = directory / DEFAULT_PARAMS_FILE.name
    if target.exists():
        fail(f"{target} exists; edit it, or init another directory (nothing is overwritten)", 1)
    directory.mkdir(parents=True, exist_ok=True)
    target.write_text(params_yaml(Params(), f"tabrl {installed_version('tabrl')}: the shipped defaults"))
    console.print(f"wrote {target}: tabrl's defaults; `tabrl params --params {target}` shows them", highlight=False)


# name, the function, its panel, one example ("": its docstring ends with one). In `tabrl --help`'s order.
COMMANDS = (
    ("corpus", corpus_cmd, DATA, "tabrl corpus --out data/corpus"),
    ("data", data_cmd, DATA, "tabrl data --corpus data/corpus/files.parquet --out data/fim"),
    ("build-base", build_base_cmd, DATA, "tabrl build-base --corpus data/corpus/files.parquet --out models/tabrl-tiny"),
    ("import-model", import_model_cmd, DATA, "tabrl import-model --from ~/models/coder.gguf --out models/coder"),
    ("export", export_cmd, DATA, ""),
    ("model-retention", model_retention_cmd, DATA, ""),
    ("ingest", ingest_cmd, CYCLE, "tabrl ingest --repo ."),
    (
        "train",
        train_cmd,
        CYCLE,
        "tabrl train --from models/tabrl-tiny --snapshot data/interactions/S.parquet --out models/candidates/c1",
    ),
    ("evaluate", evaluate_cmd, CYCLE, "tabrl evaluate --model models/candidates/c1 --against models/tabrl-tiny"),
    ("acceptance", acceptance_cmd, CYCLE, "tabrl acceptance --model models/tabrl-tiny --json state/acceptance.json"),
    ("headroom", headroom_cmd, CYCLE, "tabrl headroom --model models/tabrl-tiny --k 8"),
    ("cycle", cycle_cmd, CYCLE, "tabrl cycle --repo ."),
    ("serve", serve_cmd, SERVING, "tabrl serve --port 8000"),
    ("arms", arms_cmd, SERVING, "tabrl arms --arm name=champion,uri=models/tabrl-tiny,share=1"),
    ("simulate", simulate_cmd, SERVING, "tabrl simulate --url http://127.0.0.1:8000 --users 10 --requests 200"),
    (
        "import-continue",
        import_continue_cmd,
        SERVING,
        "tabrl import-continue ~/.continue/dev_data/0.2.0/autocomplete.jsonl",
    ),
    ("promote", promote_cmd, DEPLOYMENT, "tabrl promote"),
    ("rollback", rollback_cmd, DEPLOYMENT, "tabrl rollback"),
    ("ab-status", ab_status_cmd, DEPLOYMENT, ""),
    ("schedule", schedule_cmd, DEPLOYMENT, "tabrl schedule --params params.yaml"),
    ("deploy", deploy_cmd, DEPLOYMENT, "tabrl deploy --repo ."),
    ("up", up_cmd, DEPLOYMENT, ""),
    ("purge", purge_cmd, KEYS, "tabrl purge --older-than 30d --dry-run"),
    ("doctor", doctor_cmd, MACHINE, "tabrl doctor --set serving.vllm_python=.venv-vllm/bin/python"),
)
for name, command, panel, example in COMMANDS:
    app.command(name, rich_help_panel=panel, epilog=f"Example: {example}" if example else None)(command)
app.add_typer(vllm_app, name="vllm", rich_help_panel=SERVING, epilog="Example: tabrl vllm status")
app.add_typer(keys_app, name="keys", rich_help_panel=KEYS, epilog="Example: tabrl keys add alice")
app.add_typer(teams_app, name="teams", rich_help_panel=KEYS, epilog="Example: tabrl teams list")
