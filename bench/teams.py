"""Do team adapters beat one organisation adapter on each team's own code? (issue 57, item 5)

    python -m bench.teams --seeds 3 --cycles 4 --requests 300 --final-requests 1000

A simulated organisation of three teams, each typing only its own code base: two third-party libraries per team
that the base was not pre-trained on (LIBRARIES, read from this environment's site-packages). Each team's code
base is split by file (data.test_fraction): its train files are its users' traffic, its test files its gate and
the final evaluation. Per seed, two settings get the same traffic, request for request in count (each cycle, every
team's users type --requests of their own train regions through the real gateway, with keys of their team):

- `teams`: each cycle runs one online cycle per team (`online_rl_cycle(team=...)`): each team's LoRA adapter
  trains on its own rows only, is gated on its own held-out files and promoted at once when it passes;
- `org`: each cycle runs the organisation's one cycle, whose adapter trains on every team's rows, gated on the
  organisation's held-out files, promoted at once when it passes;
- and the control: the base, never trained.

Then every team's final model of each setting, and the base, type that team's unseen held-out regions (the second
half, which no gate reaches) with the same users and noise draws: characters saved and accept/shown, with paired
95 % intervals over seeds and typing sessions, and the noise floor (accept/shown of a model never right) beside.
Each (seed, setting) run is stored under --out and reused by a later invocation with the same arguments.
Writes results.json and results.md there and prints the table.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

from tasks.core.teams import ORG

LIBRARIES = {"cli": ("click", "rich"), "web": ("jinja2", "werkzeug"), "http": ("requests", "httpx")}
SETTINGS = ("teams", "org")
METRICS = ("chars_saved", "accept_rate")
# Gates of 300 typed requests and 100 FIM samples (the learning bench's real-model size): a gate of the default
# 1000 for each of 3 teams x 4 cycles would be most of the run. LoRA at 10x the full-weight lr (5e-5): the rule of
# thumb of "LoRA Without Regret" (Schulman et al., 2025); at 5e-5 a first smoke run's adapter typed exactly as the
# base. Both settings use the same. --set overrides any of them.
DEFAULTS = ["evaluate.n_requests=300", "evaluate.n_samples=100", "train.lr=5e-4"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", default="params.yaml", help="params.yaml to read")
    parser.add_argument("--set", action="append", default=[], help="override one key: section.key=value")
    parser.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1")
    parser.add_argument("--cycles", type=int, default=4, help="online cycles per setting and seed")
    parser.add_argument("--requests", type=int, default=300, help="requests each team's users type per cycle")
    parser.add_argument("--users", type=int, default=8, help="simulated users per team")
    parser.add_argument("--final-requests", type=int, default=1000, help="unseen held-out requests per team")
    parser.add_argument("--out", type=Path, default=Path("bench/out/teams"), help="results and runs")
    return parser


def sources(out: Path) -> dict[str, str]:
    """Each team's code base: its two libraries' .py files copied under out/src/TEAM (once)."""
    import importlib.util

    found = {}
    for team, libraries in LIBRARIES.items():
        root = out / "src" / team
        if not root.is_dir():
            for library in libraries:
                spec = importlib.util.find_spec(library)
                if spec is None or spec.origin is None:
                    raise SystemExit(f"error: {library} is not installed here (team {team}'s code base)")
                shutil.copytree(Path(spec.origin).parent, root / library, ignore=shutil.ignore_patterns("*.pyc"))
        found[team] = str(root.resolve())
    return found


def overrides(args, out: Path, seed: int, setting: str) -> list[str]:
    from flows.online_loop import loop_overrides

    teams = json.dumps(sources(out))
    state = out / f"seed{seed}" / setting
    own = [f"paths.data_dir={state / 'repo' / 'data'}", f"teams.sources={teams}", "train.adapter=lora", *DEFAULTS]
    return [*loop_overrides([*own, *args.set], state, seed), "serving.auth=true"]


def org_data(params) -> None:
    """Every team's held-out files (written from its code base first), and the organisation's: all of theirs, its
    FIM samples and its typing regions interleaved team by team, so each gate window types every team's code. In
    the run's snapshot repo (its data dir), where its snapshots are versioned too."""
    from itertools import chain, zip_longest

    from tasks.sim.corpus import read_samples, write_samples
    from tasks.sim.editor import read_regions, regions_path, write_regions
    from tasks.sim.team_data import held_out_dir

    dirs = [held_out_dir(params, team) for team in LIBRARIES]
    org = Path(params.paths.data_dir)

    def mixed(lists):
        return [x for x in chain.from_iterable(zip_longest(*lists)) if x is not None]

    write_samples(mixed([read_samples(d / "fim" / "test.parquet") for d in dirs]), org / "fim" / "test.parquet")
    for split in ("train", "test"):
        regions = mixed([read_regions(regions_path(d, split)) for d in dirs])
        write_regions(regions, regions_path(org, split), params.traffic)


def run_setting(args, seed: int, setting: str) -> dict:
    """One setting's --cycles for one seed (its state dir starts fresh); the rows of its cycles."""
    from flows.cycle import online_rl_cycle
    from flows.online_loop import snapshot_repo, start_gateway
    from serving.auth import add_key
    from tasks.core.config import load_params
    from tasks.core.procs import free_port
    from tasks.core.store import open_store
    from tasks.deploy.arms import serve_champion
    from tasks.sim.users import make_users

    sets = overrides(args, args.out, seed, setting)
    params = load_params(args.params, sets)
    state = Path(params.paths.state_dir)
    shutil.rmtree(state, ignore_errors=True)
    state.mkdir(parents=True)
    serve_champion(params)
    repo = snapshot_repo(state / "repo")
    org_data(params)
    users = {team: make_users(args.users, params.simulator, prefix=f"{team}{seed}") for team in LIBRARIES}
    with open_store(params.paths.database_url) as engine:
        keys = {u.user_id: add_key(engine, u.user_id, team=team) for team, group in users.items() for u in group}
    port = free_port()
    gateway = start_gateway(args.params, sets, port, state / "gateway.log", auth=True)
    rows, t0 = [], time.perf_counter()
    try:
        for cycle in range(1, args.cycles + 1):
            started = time.perf_counter()
            _traffic(params, port, users, keys, cycle, seed, args.requests)
            time.sleep(params.ingest.feedback_timeout_s + 0.5)
            traffic_s = time.perf_counter() - started
            for scope in LIBRARIES if setting == "teams" else (ORG,):
                report = online_rl_cycle(args.params, sets, repo_dir=str(repo), team=scope)
                if report.status == "deployed":
                    _promote(params, scope)
                rows.append({"cycle": cycle, "team": scope, "status": report.status, "traffic_s": traffic_s})
                print(json.dumps(rows[-1] | {"seed": seed, "setting": setting}), flush=True)
    finally:
        gateway.terminate()
        gateway.wait(timeout=30)
    return {"cycles": rows, "seconds": time.perf_counter() - t0}


def _traffic(params, port: int, users: dict, keys: dict, cycle: int, seed: int, requests: int) -> None:
    """Each team's users type `requests` of this cycle's window of their own train regions."""
    from flows.online_loop import cycle_regions, simulate_cycle
    from tasks.sim.editor import read_regions, regions_path
    from tasks.sim.team_data import held_out_dir

    for team, group in users.items():
        regions = read_regions(regions_path(held_out_dir(params, team), "train"))
        per_cycle = cycle_regions(len(group), requests)
        simulate_cycle(port, regions, per_cycle, cycle, group, requests, seed, params, keys)


def _promote(params, team: str) -> None:
    from tasks.core.store import open_store
    from tasks.deploy.promote import promote

    with open_store(params.paths.database_url) as engine:
        promote(engine, params, team=team)


def final_models(args, seed: int) -> dict[str, dict[str, tuple[str, str]]]:
    """Per team: setting -> (model dir, base dir) of what serves the team at the end; `control`: the base."""
    from tasks.core.config import load_params
    from tasks.core.store import CHAMPION
    from tasks.deploy.model_cache import resolve_model_dir
    from tasks.deploy.registry import Registry

    models: dict[str, dict[str, tuple[str, str]]] = {team: {} for team in LIBRARIES}
    for setting in SETTINGS:
        params = load_params(args.params, overrides(args, args.out, seed, setting))
        base = str(Path(params.model.base_dir).resolve())
        for team in LIBRARIES:
            registry = Registry(params, team if setting == "teams" else ORG)
            champion = registry.aliased(CHAMPION) or Registry(params).aliased(CHAMPION)
            models[team][setting] = (str(resolve_model_dir(champion.uri, params)), base)
            models[team]["control"] = (base, base)
    return models


def final_sessions(args, seed: int) -> dict:
    """Per team and model: the typing sessions through the team's unseen held-out regions (seed's users)."""
    from tasks.core.config import load_params
    from tasks.sim.acceptance import typing_acceptance, unseen_regions
    from tasks.sim.editor import read_regions, regions_path
    from tasks.sim.team_data import held_out_dir

    sets = [*overrides(args, args.out, seed, "teams"), f"evaluate.n_requests={args.final_requests}"]
    params = load_params(args.params, sets)
    out: dict = {}
    for team, models in final_models(args, seed).items():
        regions = unseen_regions(read_regions(regions_path(held_out_dir(params, team), "test")))
        out[team] = {}
        for name, (model_dir, base_dir) in models.items():
            run = typing_acceptance(model_dir, regions, params, base_dir)
            out[team][name] = {"sessions": [list(s) for s in run.sessions], "model": model_dir}
    return out


def report(args, runs: dict) -> dict:
    """Per team and metric: each setting's level, teams - org, teams - control, org - control (paired 95 %
    intervals over seeds and sessions), and the noise floor."""
    from tasks.core.config import load_params
    from tasks.core.intervals import difference, interval, metric_fns
    from tasks.sim.acceptance import noise_floor

    params = load_params(args.params, args.set)
    fns = metric_fns(params.reward)
    seeds = sorted(runs)
    table: dict = {"noise_floor_accept_rate": noise_floor(params.simulator), "teams": {}}
    for team in LIBRARIES:
        per = {m: [runs[s]["final"][team][m]["sessions"] for s in seeds] for m in ("teams", "org", "control")}
        rows = {}
        for metric in METRICS:
            fn = fns[metric]
            level = {m: str(interval(per[m], fn)) for m in per}
            pairs = {"teams - org": ("teams", "org"), "teams - control": ("teams", "control")}
            pairs["org - control"] = ("org", "control")
            rows[metric] = {"level": level} | {
                name: str(difference(per[a], per[b], fn, paired=True)) for name, (a, b) in pairs.items()
            }
        table["teams"][team] = rows
    return table


def write(args, runs: dict, table: dict) -> None:
    lines = [
        f"# Team adapters vs one organisation adapter ({len(runs)} seeds x {args.cycles} cycles, "
        f"{args.requests} requests per team per cycle, {args.final_requests} unseen requests per team)",
        "",
        f"Noise floor (accept/shown of a model never right): {table['noise_floor_accept_rate']:.4f}",
        "",
        "| team | metric | teams | org | control | teams - org | teams - control | org - control |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for team, rows in table["teams"].items():
        for metric, row in rows.items():
            level = row["level"]
            cells = [level["teams"], level["org"], level["control"]]
            cells += [row["teams - org"], row["teams - control"], row["org - control"]]
            lines.append(f"| {team} | {metric} | " + " | ".join(cells) + " |")
    text = "\n".join(lines) + "\n"
    (args.out / "results.md").write_text(text)
    (args.out / "results.json").write_text(json.dumps({"args": vars(args) | {"out": str(args.out)}, "table": table}))
    print(text)


def main(argv: list[str] | None = None) -> int:
    import os

    args = build_parser().parse_args(argv)
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    args.out.mkdir(parents=True, exist_ok=True)
    key = {k: v for k, v in vars(args).items() if k not in ("out", "seeds")}
    runs = {}
    for seed in range(args.seeds):
        stored = args.out / f"seed{seed}.json"
        if stored.is_file() and json.loads(stored.read_text())["key"] == json.loads(json.dumps(key, default=str)):
            runs[seed] = json.loads(stored.read_text())
            print(f"seed {seed}: reused {stored}", flush=True)
            continue
        run = {"key": key, "settings": {s: run_setting(args, seed, s) for s in SETTINGS}}
        run["final"] = final_sessions(args, seed)
        stored.write_text(json.dumps(run, default=str))
        runs[seed] = json.loads(stored.read_text())
    write(args, runs, report(args, runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
