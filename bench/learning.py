"""Does acceptance rise on held-out code? K online cycles per setting and seed, against a control.

    python bench/learning.py --quick          # defaults vs control, 1 seed, 3 cycles (<= 15 min on 2 cores)
    python bench/learning.py                  # defaults, rlinf, grpo, control; 3 seeds
    python bench/learning.py --corpus DIR     # held-out samples cut from another code directory

Settings, all from the same base model, evaluated on the same held-out test files (files never used
for training or for the simulated traffic), greedy decoding, simulated users, reference judge:
  defaults  params.yaml (Cursor's rewards +0.75 / -0.25 / 0)
  rlinf     RLinf's online setting: accepted 1, rejected 0, raw advantage
  grpo      offline GRPO (lr 1e-4, see GRPO): G = train.group_size samples per FIM train prompt,
            scored by the simulated user's rule, normalised within the group, same loss; no traffic
  control   no training: the base model (the same at every cycle)
Online settings run the real gateway, log store and flows (flows/online_loop.py); each gated
candidate is promoted at once, so the next cycle's traffic comes from the newest model. Writes
bench/out/learning/results.json and curves.png; prints the per-cycle table and mean ± spread.
Each finished (setting, seed) is stored under OUT/runs/ and reused by a later invocation with the
same params and loop size, so a long run can be stopped and resumed (--fresh reruns everything).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

ONLINE = {
    "defaults": [],
    "rlinf": ["reward.accepted=1.0", "reward.rejected=0.0", "reward.abstained=0.0", "reward.advantage=raw"],
}
# Group-normalised advantages are about 1 in size, 2-4x the raw Cursor rewards: a third of the lr keeps
# the step comparable (at the defaults' lr 3e-4 the first GRPO update jumped to approx-KL 3.8 in one step).
GRPO = ["train.algorithm=grpo", "train.lr=1e-4"]
KEYS = ("suggest_rate", "accept_rate", "reward_per_request", "judge_mean", "exact_match", "mean_len")


def _pick(metrics: dict) -> dict:
    return {k: metrics.get(f"eval/{k}") for k in KEYS}


def run_online(setting, seed, args, base: dict) -> list[dict]:
    from flows.online_loop import run_online_loop

    rows = run_online_loop(args.params, [*ONLINE[setting], *args.set], args.cycles, args.requests, args.users,
                           args.out / f"{setting}-seed{seed}", seed=seed, ab_test=False)
    curve, last = [], base
    for row in rows:
        last = _pick(row.serving_eval) if row.serving_eval else last  # a skipped or diverged cycle keeps the model
        curve.append(last)
    return curve


def run_grpo(seed, args, base_dir, test, base: dict) -> list[dict]:
    from tasks.config import load_params
    from tasks.evaluate.evaluate import compare
    from tasks.ingest.corpus import read_samples
    from tasks.train.grpo import grpo_snapshot
    from tasks.train.launch import launch_train
    from tasks.train.ppo import TrainingDiverged

    out = args.out / f"grpo-seed{seed}"
    params = load_params(args.params, [*args.set, *GRPO, f"train.seed={seed}", f"simulator.seed={seed}"])
    prompts = read_samples(Path(params.paths.data_dir) / "fim" / "train.parquet")
    current, curve, last = str(base_dir), [], base
    for cycle in range(1, args.cycles + 1):
        start = ((cycle - 1) * params.train.grpo_prompts + seed * 997) % len(prompts)
        batch = (prompts * 2)[start:start + params.train.grpo_prompts]
        snapshot = out / f"cycle{cycle}.parquet"
        grpo_snapshot(current, batch, params, snapshot)
        candidate = out / f"model{cycle}"
        try:
            launch_train(snapshot, current, candidate, params)
        except TrainingDiverged as err:  # as in the online cycle: no candidate, the current model stays
            print(f"grpo seed {seed} cycle {cycle}: {err}", flush=True)
            curve.append(last)
            continue
        result = compare(str(candidate), current, test, params)
        chosen = result.candidate if result.decision.passed else result.champion
        current = str(candidate) if result.decision.passed else current
        last = _pick(chosen.metrics)
        curve.append(last)
    return curve


def corpus_data_dir(args) -> Path:
    """A data dir whose held-out test samples come from --corpus (all its files), traffic from the usual train split."""
    import shutil

    from tasks.config import load_params
    from tasks.ingest.corpus import iter_source_files, sample_spans, write_samples

    params = load_params(args.params, args.set)
    out = (args.out / "corpus-data").resolve()
    files = list(iter_source_files(args.corpus, params.data))
    write_samples(sample_spans(files, "test", params.evaluate.n_samples, params.fim, params.fim.seed), out / "fim" / "test.parquet")
    shutil.copy(Path(params.paths.data_dir) / "fim" / "train.parquet", out / "fim" / "train.parquet")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="defaults vs control, 1 seed, 3 cycles, 240 requests")
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--set", action="append", default=[], help="override for every setting: section.key=value")
    parser.add_argument("--settings", nargs="+", default=["defaults", "rlinf", "grpo", "control"])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--cycles", type=int, default=4)
    parser.add_argument("--requests", type=int, default=240, help="simulated requests per online cycle")
    parser.add_argument("--users", type=int, default=16)
    parser.add_argument("--corpus", type=Path, help="evaluate on FIM samples cut from this code directory instead")
    parser.add_argument("--out", type=Path, default=Path("bench/out/learning"))
    parser.add_argument("--fresh", action="store_true", help="rerun (setting, seed) pairs already stored under --out")
    parser.add_argument("--report-only", action="store_true", help="report the stored runs; train nothing")
    args = parser.parse_args(argv)
    if args.quick:
        args.settings, args.seeds, args.cycles, args.requests = ["defaults", "control"], 1, 3, 240
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    os.chdir(ROOT)

    from tasks.config import load_params
    from tasks.evaluate.evaluate import evaluate_model
    from tasks.ingest.corpus import read_samples

    if args.corpus:
        args.set = [*args.set, f"paths.data_dir={corpus_data_dir(args)}"]
    params = load_params(args.params, args.set)
    test = read_samples(Path(params.paths.data_dir) / "fim" / "test.parquet")[: params.evaluate.n_samples]
    started = time.time()
    bases: dict[int, dict] = {}

    def base_at(seed: int) -> dict:
        """The base model scored by seed's simulated users (each setting's seed draws its own users)."""
        if seed not in bases:
            seeded = load_params(args.params, [*args.set, f"simulator.seed={seed}"])
            bases[seed] = _pick(evaluate_model(seeded.model.base_dir, test, seeded).metrics)
        return bases[seed]

    key = run_key(params, args)
    curves: dict[str, list[list[dict]]] = {}
    for setting in args.settings:
        for seed in range(args.seeds):
            stored = args.out / "runs" / f"{setting}-seed{seed}.json"
            if stored.is_file() and not args.fresh and json.loads(stored.read_text())["key"] == key:
                curve = json.loads(stored.read_text())["curve"]  # resumed: finished by an earlier invocation
                print(f"{setting} seed {seed}: stored result reused ({stored})", flush=True)
            elif args.report_only:
                print(f"{setting} seed {seed}: no stored result for these params; left out of the report", flush=True)
                continue
            else:
                if setting == "control":
                    curve = [base_at(seed)] * args.cycles
                elif setting == "grpo":
                    curve = run_grpo(seed, args, params.model.base_dir, test, base_at(seed))
                else:
                    curve = run_online(setting, seed, args, base_at(seed))
                stored.parent.mkdir(parents=True, exist_ok=True)
                stored.write_text(json.dumps({"setting": setting, "seed": seed, "key": key, "curve": curve}))
            curves.setdefault(setting, []).append(curve)
            print(json.dumps({"setting": setting, "seed": seed, "curve": curve}), flush=True)
    # cycle 0 of every curve: the base model scored by the same seeds' users (as the control is)
    base = {k: statistics.mean(base_at(seed)[k] for seed in range(args.seeds)) for k in KEYS}
    for entry in [base, *(e for seeds in curves.values() for curve in seeds for e in curve if e)]:
        entry["reward_per_request"] = product_reward(entry, params.reward)
    report(curves, base, args, time.time() - started)


def product_reward(entry: dict, reward) -> float:
    """Reward per request under params.yaml's (Cursor) rewards, whatever rewards the setting trained on
    (rlinf's evaluation reports its own 1 / 0 units): from the suggestion and per-shown accept rates."""
    shown, accepted = entry["suggest_rate"], entry["suggest_rate"] * entry["accept_rate"]
    return accepted * reward.accepted + (shown - accepted) * reward.rejected + (1 - shown) * reward.abstained
    return 0


def run_key(params, args) -> str:
    """What a stored (setting, seed) result depends on: the params (less where files go) and the loop's size."""
    import hashlib

    body = params.model_dump(mode="json")
    body.pop("paths")
    body["evaluate"]["judge"].pop("cache_path")
    body["model"]["base_dir"] = hashlib.sha256((Path(params.model.base_dir) / "model.safetensors").read_bytes()).hexdigest()
    body["loop"] = [args.cycles, args.requests, args.users, str(args.corpus), "control scored by each seed's users"]
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]


def _mean_spread(values: list[float]) -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.3f}"
    return f"{statistics.mean(values):.3f} ± {statistics.pstdev(values):.3f}"


def report(curves, base, args, seconds) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=170)
    table = Table(title=f"held-out metrics per cycle (mean ± spread over seeds); base model: "
                        f"accept/shown {base['accept_rate']:.3f}, suggest {base['suggest_rate']:.3f}, "
                        f"reward/req {base['reward_per_request']:.3f}")
    table.add_column("setting")
    table.add_column("cycle", justify="right")
    for key in KEYS:
        table.add_column(key, justify="right")
    for setting, seeds in curves.items():
        for cycle in range(args.cycles):
            cells = [_mean_spread([s[cycle][k] if s[cycle] else None for s in seeds]) for k in KEYS]
            table.add_row(setting, str(cycle + 1), *cells)
    console.print(table)
    final = {setting: {k: statistics.mean([s[-1][k] for s in seeds if s[-1]] or [float("nan")]) for k in KEYS}
             for setting, seeds in curves.items()}
    summary = []
    for setting in (s for s in final if s != "control" and "control" in final):
        d, c = final[setting], final["control"]
        rel = (d["accept_rate"] / c["accept_rate"] - 1) if c["accept_rate"] else float("inf")
        summary.append(f"{setting} vs control after {args.cycles} cycles (mean of {len(curves[setting])} seeds): accept/shown "
                       f"{d['accept_rate']:.3f} vs {c['accept_rate']:.3f} ({rel:+.0%}), suggestion rate "
                       f"{d['suggest_rate']:.3f} vs {c['suggest_rate']:.3f}, reward/request "
                       f"{d['reward_per_request']:.3f} vs {c['reward_per_request']:.3f}, judge mean "
                       f"{d['judge_mean']:.3f} vs {c['judge_mean']:.3f}")
        console.print(summary[-1])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "base": base,
                                                      "curves": curves, "final": final, "seconds": seconds}, indent=2))
    _plot(curves, base, args.out / "curves.png")
    (args.out / "results.md").write_text(_markdown(curves, base) + "".join(f"\n{line}\n" for line in summary))
    console.print(f"wrote {args.out / 'results.json'}, results.md and curves.png ({seconds / 60:.1f} min)")


def _markdown(curves, base) -> str:
    """The per-cycle table as Markdown (mean ± spread over seeds), for bench/RESULTS.md."""
    lines = ["| setting | seeds | cycle | " + " | ".join(KEYS) + " |", "| --- | ---: | ---: |" + " ---: |" * len(KEYS),
             "| base | - | 0 | " + " | ".join(f"{base[k]:.3f}" for k in KEYS) + " |"]
    for setting, seeds in curves.items():
        for cycle in range(len(seeds[0])):
            cells = [_mean_spread([s[cycle][k] if s[cycle] else None for s in seeds]) for k in KEYS]
            lines.append(f"| {setting} | {len(seeds)} | {cycle + 1} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _plot(curves, base, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for ax, key in zip(axes, ("accept_rate", "suggest_rate", "reward_per_request")):
        for setting, seeds in curves.items():
            cycles = range(0, len(seeds[0]) + 1)
            means = [base[key]] + [statistics.mean([s[i][key] for s in seeds if s[i]] or [float("nan")])
                                   for i in range(len(seeds[0]))]
            ax.plot(list(cycles), means, "o-", label=setting)
        ax.set_title(key)
        ax.set_xlabel("cycle (0 = base)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
