"""`tabrl`: the command line of the pipeline and the gateway.

Every command reads params.yaml (``--params``) and takes ``--set section.key=value`` overrides;
``TABRL_SECTION__KEY`` environment variables override too. Run ``tabrl COMMAND --help``.

The root app: each stage's commands live beside the stage (``tasks/*/cli.py``, ``serving/cli.py``,
``flows/cli.py``) and share ``tasks/console.py``; this file imports them and names them.
"""

from __future__ import annotations

import json

import typer

from flows.cli import cycle_cmd, deploy_cmd, schedule_cmd
from serving.cli import arms_cmd, import_continue_cmd, keys_app, purge_cmd, serve_cmd, simulate_cmd
from tasks.config import DEFAULT_PARAMS_FILE
from tasks.console import ParamsOpt, SetOpt, console, params_or_exit
from tasks.deploy.cli import ab_status_cmd, export_cmd, model_retention_cmd, promote_cmd, rollback_cmd, vllm_app
from tasks.evaluate.cli import acceptance_cmd, evaluate_cmd, headroom_cmd
from tasks.ingest.cli import corpus_cmd, data_cmd, ingest_cmd
from tasks.train.cli import build_base_cmd, import_model_cmd, train_cmd

app = typer.Typer(help=__doc__, no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)


@app.command("params")
def show_params(params: ParamsOpt = DEFAULT_PARAMS_FILE, set_: SetOpt = None) -> None:
    """Print the resolved config (file + env + --set) as YAML-like dotted keys."""
    resolved = params_or_exit(params, set_)
    for key, value in resolved.flat().items():
        console.print(f"{key} = {json.dumps(value)}", highlight=False)


# In the order `tabrl --help` lists them: the pipeline's order of work, then serving, then flows.
app.command("corpus")(corpus_cmd)
app.command("data")(data_cmd)
app.command("build-base")(build_base_cmd)
app.command("import-model")(import_model_cmd)
app.command("acceptance")(acceptance_cmd)
app.command("headroom")(headroom_cmd)
app.command("evaluate")(evaluate_cmd)
app.command("promote")(promote_cmd)
app.command("rollback")(rollback_cmd)
app.command("ab-status")(ab_status_cmd)
app.command("model-retention")(model_retention_cmd)
app.command("serve")(serve_cmd)
app.command("arms")(arms_cmd)
app.command("import-continue")(import_continue_cmd)
app.command("simulate")(simulate_cmd)
app.add_typer(keys_app, name="keys")
app.command("train")(train_cmd)
app.command("ingest")(ingest_cmd)
app.command("cycle")(cycle_cmd)
app.command("schedule")(schedule_cmd)
app.command("deploy")(deploy_cmd)
app.command("purge")(purge_cmd)
app.add_typer(vllm_app, name="vllm")
app.command("export")(export_cmd)
