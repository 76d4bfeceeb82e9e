"""`tabrl`: the command line of the pipeline and the gateway.

Every command reads params.yaml (``--params``) and takes ``--set section.key=value`` overrides;
``TABRL_SECTION__KEY`` environment variables override too. Run ``tabrl COMMAND --help``.

The root app: the commands live in ``flows/cli/``, one module per noun, and share ``flows/cli/console.py``;
this file imports them and names them.
"""

from __future__ import annotations

import json

import typer

from flows.cli.console import ParamsOpt, SetOpt, console, params_or_exit
from flows.cli.cycle import cycle_cmd, deploy_cmd, schedule_cmd
from flows.cli.data import corpus_cmd, data_cmd, ingest_cmd
from flows.cli.deploy import ab_status_cmd, export_cmd, model_retention_cmd, promote_cmd, rollback_cmd, vllm_app
from flows.cli.evaluate import acceptance_cmd, evaluate_cmd, headroom_cmd
from flows.cli.keys import keys_app, purge_cmd
from flows.cli.serve import arms_cmd, import_continue_cmd, serve_cmd, simulate_cmd
from flows.cli.train import build_base_cmd, import_model_cmd, train_cmd
from tasks.core.config import DEFAULT_PARAMS_FILE

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
