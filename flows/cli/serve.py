"""`tabrl serve | arms | import-continue | simulate`: the gateway, its arms, and traffic to it."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from flows.cli.console import OutputOpt, ParamsOpt, SetOpt, console, fail, params_or_exit, print_json, print_table
from tasks.core.config import DEFAULT_PARAMS_FILE
from tasks.core.store import open_store
from tasks.core.teams import ORG


def _params(path: Path, overrides: list[str] | None):
    return params_or_exit(path, overrides)


def _fail(message: str, code: int = 2) -> None:
    fail(message, code)


def serve_cmd(
    model: Annotated[
        Path | None,
        typer.Option(
            help="Checkpoint to serve as the single champion arm when the store has no arms (default: model.base_dir)."
        ),
    ] = None,
    host: Annotated[str | None, typer.Option(help="Bind address (default: serving.host).")] = None,
    port: Annotated[int | None, typer.Option(help="Port (default: serving.port).")] = None,
    workers: Annotated[
        int,
        typer.Option(
            min=1,
            help="Gateway processes sharing the port (replicas). More than 1 needs serving.redis_url, where the "
            "rate limits are counted in total; use a PostgreSQL log store for them.",
        ),
    ] = 1,
    no_auth: Annotated[
        bool,
        typer.Option(
            "--no-auth", help="Serve without API keys (local demo only); users are taken from the `user` field."
        ),
    ] = False,
    params: ParamsOpt = DEFAULT_PARAMS_FILE,
    set_: SetOpt = None,
) -> None:
    """Run the gateway (uvicorn): completions, feedback, A/B arms, a durable log."""
    from serving.gateway import serve
    from serving.logs import configure as configure_logs
    from tasks.core.generate import describe_rule, show_rule
    from tasks.core.store import Arm, read_arms, replace_arms

    p = _params(params, [*(set_ or []), *(["serving.auth=false"] if no_auth else [])])
    if workers > 1 and not p.serving.redis_url:
        _fail(
            f"--workers {workers}: each process would count the rate limits on its own; set serving.redis_url "
            "(e.g. --set serving.redis_url=redis://127.0.0.1:6379/0) so the replicas share them"
        )
    with open_store(p.paths.database_url) as engine:
        if not read_arms(engine):
            target = model or Path(p.model.base_dir)
            if not (target / "config.json").is_file():
                _fail(
                    f"the store has no arms and {target} is not a model directory; pass --model DIR "
                    "(or build the base model with `make base`)"
                )
            replace_arms(engine, [Arm("champion", target.name, str(target.resolve()), "embedded", 1.0)])
            console.print(f"Seeded arm 'champion' -> {target}")
        elif model is not None:
            console.print(f"The store already has arms; --model {model} ignored (change arms with `tabrl arms`).")
    console.print(describe_rule(show_rule(p.serving)), highlight=False)
    if p.serving.explore_fraction > 0:
        console.print(
            f"exploring: {p.serving.explore_fraction:.0%} of requests "
            + describe_rule(show_rule(p.serving, explore=True), "serving.explore_min_logprob"),
            highlight=False,
        )
    configure_logs(p.serving.log_format)
    serve(p, host or p.serving.host, port or p.serving.port, workers)


ARM_FIELDS = {"name", "uri", "backend", "share", "version", "model", "adapter"}


def parse_arm_spec(spec: str, team: str = ORG):
    """`name=champion,uri=models/x,share=0.5[,backend=embedded][,version=v1][,model=NAME][,adapter=DIR]` -> Arm
    (model: the name asked of the server, e.g. a vLLM adapter's; adapter: a LoRA adapter on uri's base)."""
    from tasks.core.store import Arm

    fields = {}
    for part in spec.split(","):
        key, sep, value = part.partition("=")
        if not sep or key.strip() not in ARM_FIELDS:
            raise ValueError(f"arm spec {spec!r}: {part!r} must be one of {sorted(ARM_FIELDS)} as key=value")
        fields[key.strip()] = value.strip()
    missing = {"name", "uri", "share"} - fields.keys()
    if missing:
        raise ValueError(f"arm spec {spec!r} lacks {sorted(missing)}")
    try:
        share = float(fields["share"])
    except ValueError:
        raise ValueError(f"arm spec {spec!r}: share {fields['share']!r} is not a number") from None
    uri = fields["uri"]
    return Arm(
        fields["name"],
        fields.get("version") or Path(fields.get("adapter") or uri).name,
        uri,
        fields.get("backend", "embedded"),
        share,
        fields.get("model"),
        fields.get("adapter"),
        team,
    )


def arms_cmd(
    arm: Annotated[
        list[str] | None,
        typer.Option(
            "--arm",
            help="Replace the arms: name=N,uri=DIR|URL,share=S[,backend=embedded|vllm][,version=V][,model=NAME]"
            "[,adapter=DIR] (repeat per arm; adapter: a LoRA adapter served on uri's base).",
        ),
    ] = None,
    from_json: Annotated[
        Path | None,
        typer.Option(
            "--json",
            help="Replace the arms from a JSON list of {name, model_version, model_uri, backend, share[, served_model]"
            "[, adapter]}.",
        ),
    ] = None,
    team: Annotated[str, typer.Option(help="Whose arms --arm/--json replace (`org`: the organisation's).")] = ORG,
    output: OutputOpt = "table",
    params: ParamsOpt = DEFAULT_PARAMS_FILE,
    set_: SetOpt = None,
) -> None:
    """Show every team's live A/B arms, or replace one team's (shares must sum to 1; gateways pick the change up
    without restart)."""
    from tasks.core.store import Arm, ArmError, read_arms, replace_arms

    p = _params(params, set_)
    with open_store(p.paths.database_url) as engine:
        new = None
        try:
            if from_json is not None:
                if not from_json.is_file():
                    _fail(f"{from_json} not found")
                new = [Arm(**{**item, "team": team}) for item in json.loads(from_json.read_text())]
            elif arm:
                new = [parse_arm_spec(spec, team) for spec in arm]
            if new is not None:
                replace_arms(engine, new, team)
        except (ArmError, ValueError, TypeError) as err:
            _fail(str(err))
        if output == "json":  # the fields `--json FILE` reads, and the team
            print_json([asdict(a) for a in read_arms(engine, None)])
            return
        table = Table(title="A/B arms (a team without arms of its own gets the organisation's)")
        for col in ("team", "name", "share", "backend", "model_version", "model_uri", "served as", "adapter"):
            table.add_column(col)
        for a in read_arms(engine, None):
            table.add_row(
                a.team,
                a.name,
                f"{a.share:g}",
                a.backend,
                a.model_version,
                a.model_uri,
                a.served_model or "-",
                a.adapter or "-",
            )
        print_table(table)


def import_continue_cmd(
    file: Annotated[Path, typer.Argument(help="Continue's dev_data/0.2.0/autocomplete.jsonl (one event per line).")],
    level: Annotated[
        str, typer.Option(help="'all' (texts present) or 'noCode' (texts withheld: stored, not trained on).")
    ] = "all",
    params: ParamsOpt = DEFAULT_PARAMS_FILE,
    set_: SetOpt = None,
) -> None:
    """Import Continue autocomplete outcomes; matched to our log by (prompt, completion) hash, else stored unmatched."""
    from serving.compat import CompatError, outcome_from_continue
    from serving.log import record_outcome

    p = _params(params, set_)
    if not file.is_file():
        _fail(f"{file} not found")
    with open_store(p.paths.database_url) as engine:
        counts = {"recorded": 0, "matched": 0, "duplicate": 0, "conflict": 0, "bad": 0}
        bad_lines = []
        with engine.begin() as conn:
            for number, line in enumerate(file.read_text().splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    event = json.loads(line)
                    if not isinstance(event, dict):
                        raise CompatError(f"a line must be a JSON object, got {type(event).__name__}")
                    rec = record_outcome(outcome_from_continue(event, level, "import"), None, require_ours=False)(conn)
                except (json.JSONDecodeError, CompatError) as err:
                    counts["bad"] += 1
                    bad_lines.append(f"line {number}: {err}")
                    continue
                counts[rec.status] += 1
                counts["matched"] += rec.status == "recorded" and rec.matched
        for message in bad_lines[:10]:
            console.print(f"skipped {message}", highlight=False)
        console.print(f"Imported {file}: " + ", ".join(f"{k}={v}" for k, v in counts.items()), highlight=False)


def _arm_table(by_arm: dict, title: str) -> Table:
    """The per-arm numbers of a simulation, one row per arm."""
    table = Table(title=title)
    for col in (
        "arm",
        "requests",
        "suggestion rate",
        "accept / shown",
        "right / shown (no noise)",
        "chars saved",
        "mean length (chars)",
    ):
        table.add_column(col, justify="right")
    for arm, s in by_arm.items():
        table.add_row(
            arm,
            str(s.requests),
            f"{s.suggest_rate:.3f}",
            f"{s.accept_rate:.3f}",
            f"{s.right_rate:.3f}",
            f"{s.chars_saved:.3f}",
            f"{s.mean_len:.1f}",
        )
    return table


def simulate_cmd(
    users: Annotated[int, typer.Option(help="Simulated users (personas drawn by weight).", min=1)] = 8,
    requests: Annotated[int, typer.Option(help="Completion requests in all.", min=1)] = 64,
    url: Annotated[
        str | None, typer.Option(help="Gateway base URL (default: http://serving.host:serving.port).")
    ] = None,
    regions: Annotated[
        Path, typer.Option(help="Regions the users type (written by the `fim` stage; held-out by default).")
    ] = Path("data/fim/typing_test.parquet"),
    concurrency: Annotated[int, typer.Option(help="Requests in flight at once.", min=1)] = 4,
    no_auth: Annotated[
        bool, typer.Option("--no-auth", help="The gateway runs without keys: send users in the `user` field.")
    ] = False,
    json_out: Annotated[Path | None, typer.Option("--json", help="Also write the per-arm numbers here.")] = None,
    params: ParamsOpt = DEFAULT_PARAMS_FILE,
    set_: SetOpt = None,
) -> None:
    """Simulated users type real code through the gateway like editors: request at each pause, Tab or type on."""
    import httpx
    from tqdm import tqdm

    from serving.auth import add_key
    from serving.simulate import SimulationError, run_simulation
    from tasks.sim.editor import read_regions
    from tasks.sim.users import make_users

    p = _params(params, set_)
    try:
        typed_regions = read_regions(regions)
    except FileNotFoundError as err:
        _fail(str(err))
    sim_users = make_users(users, p.simulator)
    keys = None
    if not no_auth:
        # The simulator is an operator tool with store access: it mints keys for its own users.
        with open_store(p.paths.database_url) as engine:
            keys = {u.user_id: add_key(engine, u.user_id) for u in sim_users}
    base_url = url or f"http://{p.serving.host}:{p.serving.port}"
    with tqdm(total=requests, desc="simulated requests", unit="req") as bar:
        try:
            by_arm = run_simulation(
                base_url,
                typed_regions,
                sim_users,
                requests,
                keys,
                concurrency,
                p.simulator.seed,
                p.traffic,
                p.simulator,
                progress=lambda: bar.update(1),
            )
        except (SimulationError, httpx.HTTPError) as err:
            _fail(f"simulation against {base_url} failed: {err}", 1)
    print_table(_arm_table(by_arm, f"Simulated users typing over HTTP: {base_url}"))
    if json_out:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps({arm: s.as_dict() for arm, s in by_arm.items()}, indent=2) + "\n")
