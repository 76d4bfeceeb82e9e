"""Why does one PPO step sometimes move approx-KL from ~0.3 to ~50?  Step-by-step approx-KL of the update.

    python -m bench.kl_probe                                 # shipped base, 3 seeds, the variants below
    python -m bench.kl_probe --model DIR --rows 240 --seeds 0 1 2 --variants defaults lr=1e-4,epochs=2
    python -m bench.kl_probe --snapshot S.rewarded.parquet --model DIR --seeds 0 --variants defaults
                                                             # a logged cycle's update, from its champion

One online-like rollout per seed: simulated users type train-split regions and the model's suggestions
are sampled at the serving temperature, as the online loop serves them; the users' outcomes (persona
noise included) are priced by params.reward. The same rewarded snapshot is then trained on with
each variant (``defaults``: params.yaml's train section; else overrides of it), with the guards lifted
(target_kl and max_approx_kl set very high) so every step runs and its approx-KL is recorded. For
each run the bench also reports which parameters the update moved most (relative change of
each weight tensor) and the tokens whose log-prob moved most, with how often each token occurs
in the snapshot's completions: the evidence for (or against) rarely-seen rows; and the tokens whose
probability rose most, with what each adds to approx-KL's sum ((r - 1) - log r grows like the ratio
r, so one rarely-sampled token that became likely can carry a step's approx-KL on its own).
With --snapshot a logged, rewarded snapshot (a cycle's DVC snapshot) replaces the rollout: --model is
then the checkpoint that cycle started from, and the seeds only seed the update.

Prints a table, writes bench/out/kl_probe/results.json and curve.png (approx-KL per step).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

# The settings before (2 epochs, embeddings trained), each change alone, and both (today's params.yaml).
DEFAULT_VARIANTS = [
    "epochs=2,train_embeddings=true",
    "epochs=2,train_embeddings=true,lr=1e-4",
    "epochs=2,train_embeddings=true,warmup_steps=4",
    "epochs=2,train_embeddings=false",
    "epochs=1,train_embeddings=true",
    "epochs=1,train_embeddings=false",
]


def rollout(model_dir: Path, params, rows: int, seed: int, out: Path) -> dict:
    """A rewarded snapshot of `rows` online-like requests: sampled suggestions, simulated users' outcomes."""
    from tasks.core.generate import generate, load_model
    from tasks.core.outcomes import reward_of
    from tasks.core.schema import sampled_row, write_rewarded
    from tasks.sim.editor import read_regions, regions_path
    from tasks.sim.sessions import run_sessions
    from tasks.sim.users import make_users

    lm = load_model(model_dir)
    regions = read_regions(regions_path(params.paths.data_dir, "train"))
    regions = random.Random(seed).sample(regions, len(regions))
    users = make_users(24, params.simulator, prefix=f"probe{seed}")
    sampled: dict[str, tuple[str, object]] = {}

    def suggest(requests: list[dict]) -> list[str]:
        prompts = [lm.template.render(r["prefix"], r["suffix"]) for r in requests]
        gens = generate(
            *lm,
            prompts,
            params.serving.max_tokens,
            temperature=params.serving.temperature,
            top_p=params.serving.top_p,
            seed=seed * 1_000_003 + len(sampled),
        )
        for r, p, g in zip(requests, prompts, gens, strict=True):
            sampled[r["sample_id"]] = (p, g)
        return [g.text for g in gens]

    turns, _ = run_sessions(regions, users, suggest, rows, params.evaluate.batch_size, seed, params.traffic)
    table = []
    for t in turns:
        prompt, gen = sampled[t.request["sample_id"]]
        reward = reward_of(t.outcome, params.reward)
        table.append(
            sampled_row(
                user_id=t.user_id,
                arm="probe",
                model_version=str(model_dir),
                prompt=prompt,
                completion=t.suggestion,
                token_ids=gen.token_ids,
                logprobs=gen.logprobs,
                temperature=params.serving.temperature,
                outcome=t.outcome,
                reward=reward,
                advantage=reward,  # reward.advantage: raw (the default)
            )
        )
    write_rewarded(table, out)
    counts = Counter(t.outcome for t in turns)
    return {"rows": len(table), **counts}


def moved_most(before: dict, after: dict, n: int = 5) -> list[tuple[str, float]]:
    """The weight tensors with the largest relative change |after - before| / |before|."""
    rel = {k: float((after[k] - before[k]).norm() / (before[k].norm() + 1e-12)) for k in before}
    return sorted(rel.items(), key=lambda kv: -kv[1])[:n]


def completion_logps(model, examples) -> list[list[float]]:
    """log pi(token) of every completion token of every example (a plain forward per example), at the
    temperature the row was sampled at: the distribution the update's ratios and approx-KL are taken on."""
    import torch

    out = []
    with torch.no_grad():
        for e in examples:
            ids = torch.tensor([e.input_ids])
            logits = model(ids).logits[0, e.n_prompt - 1 : -1] / e.temperature
            out.append(torch.log_softmax(logits, -1).gather(-1, ids[0, e.n_prompt :, None])[:, 0].tolist())
    return out


@dataclass
class SnapshotTokens:
    """A snapshot's completion tokens as the job reads them, their counts, and log-probs at the start."""

    tokenizer: object
    examples: list
    counts: Counter
    before: list[list[float]]

    @classmethod
    def read(cls, model_dir: Path, model, snapshot: Path, params) -> SnapshotTokens:
        from transformers import AutoTokenizer

        from tasks.core.generate import model_template, prompt_limit
        from tasks.train.batching import build_examples, read_snapshot

        tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        examples = build_examples(
            read_snapshot(snapshot),
            tok,
            model_template(model_dir, tok),
            prompt_limit(model, params.serving.max_tokens),
            model.config.max_position_embeddings,
        )
        counts: Counter = Counter()
        for e in examples:
            counts.update(e.input_ids[e.n_prompt :])
        return cls(tok, examples, counts, completion_logps(model, examples))


def kl_term(log_r: float) -> float:
    """A token's term in approx-KL's sum, (r - 1) - log r (tasks/train/loss.py), from its log ratio."""
    return math.exp(log_r) - 1 - log_r


def token_shifts(start: SnapshotTokens, model_after, n: int = 8) -> dict:
    """Per completion token: log-prob before vs after the update; the largest drops, with token counts."""
    after = completion_logps(model_after, start.examples)
    drops = sorted(
        (a - b, t, b, a, e.advantage)
        for e, lbs, las in zip(start.examples, start.before, after, strict=True)
        for t, b, a in zip(e.input_ids[e.n_prompt :], lbs, las, strict=True)
    )
    worst = [
        {
            "token": start.tokenizer.convert_ids_to_tokens(t),
            "count_in_snapshot": start.counts[t],
            "logp_before": round(b, 3),
            "logp_after": round(a, 3),
            "advantage": adv,
        }
        for _, t, b, a, adv in drops[:n]
    ]
    rises = [
        {
            "token": start.tokenizer.convert_ids_to_tokens(t),
            "p_before": round(math.exp(b), 4),
            "p_after": round(math.exp(a), 4),
            "approx_kl_term": round(kl_term(a - b), 2),
            "advantage": adv,
        }
        for _, t, b, a, adv in drops[::-1][:n]
    ]
    big = [d for d in drops if d[0] < -2.0]
    rare = sum(start.counts[d[1]] <= 2 for d in big)
    return {
        "tokens": len(drops),
        "dropped_over_2_nats": len(big),
        "of_them_rare_tokens": rare,
        "worst": worst,
        "rose_most": rises,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None, help="checkpoint (default: params model.base_dir)")
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--set", action="append", default=[], help="override for every run: section.key=value")
    parser.add_argument("--rows", type=int, default=240, help="requests per rollout (the bench's online cycle)")
    parser.add_argument(
        "--snapshot", type=Path, default=None, help="a rewarded snapshot to train on instead of a rollout"
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument(
        "--variants", nargs="+", default=DEFAULT_VARIANTS, help="`defaults` or train.KEY=VALUE[,KEY=VALUE]"
    )
    parser.add_argument("--out", type=Path, default=Path("bench/out/kl_probe"))
    args = parser.parse_args(argv)
    if args.snapshot and not args.snapshot.is_file():
        parser.error(f"--snapshot {args.snapshot}: no such file")

    import shutil

    import mlflow
    import torch
    from rich.table import Table
    from transformers import AutoModelForCausalLM

    from flows.cli.console import console, print_table
    from tasks.core.config import load_params
    from tasks.train import ppo

    args.out.mkdir(parents=True, exist_ok=True)
    mlflow.set_tracking_uri(f"sqlite:///{args.out.resolve()}/mlflow.db")
    mlflow.set_experiment("kl-probe")
    base = load_params(args.params, args.set)
    model = args.model or Path(base.model.base_dir)
    results = []
    for seed in args.seeds:
        work = args.out / f"seed{seed}"
        shutil.rmtree(work, ignore_errors=True)
        snap = work / "snapshot.parquet"
        started = time.time()
        if args.snapshot:
            work.mkdir(parents=True)
            shutil.copy(args.snapshot, snap)
        else:
            roll = rollout(model, base, args.rows, seed, snap)
            console.print(f"seed {seed}: rollout {roll} in {time.time() - started:.0f} s")
        before = AutoModelForCausalLM.from_pretrained(model, local_files_only=True, dtype=torch.float32).eval()
        start = SnapshotTokens.read(model, before, snap, base)  # once per seed: every variant starts there
        for variant in args.variants:
            sets = [] if variant == "defaults" else [f"train.{kv}" for kv in variant.split(",")]
            params = load_params(
                args.params,
                [*args.set, *sets, "train.target_kl=1e9", "train.max_approx_kl=1e9", f"train.seed={seed}"],
            )
            out = work / variant.replace("=", "_").replace(",", "+")
            started = time.time()
            with mlflow.start_run(run_name=f"seed{seed}-{variant}") as run:  # the job logs train/* per step
                res = ppo.train(snap, model, out, params, mlflow_run_id=run.info.run_id)
            client = mlflow.MlflowClient()
            per_step = {
                key: [m.value for m in sorted(client.get_metric_history(run.info.run_id, key), key=lambda m: m.step)]
                for key in ("train/approx_kl", "train/ratio_max", "train/tokens")
            }
            kls = per_step["train/approx_kl"]
            top = max(range(len(kls)), key=kls.__getitem__, default=0)
            r_max = per_step["train/ratio_max"][top] if kls else 1.0
            # the step's largest ratio, alone: its term over the step's tokens
            alone = kl_term(math.log(r_max)) / per_step["train/tokens"][top] if kls else 0.0
            after = AutoModelForCausalLM.from_pretrained(out, local_files_only=True, dtype=torch.float32).eval()
            row = {
                "seed": seed,
                "variant": variant,
                "steps": res.steps,
                "approx_kl": kls,
                "max_kl": max(kls) if kls else 0.0,
                "max_kl_step": top,
                "max_kl_step_ratio_max": r_max,
                "max_kl_step_from_that_token": alone,
                "final_kl": kls[-1] if kls else 0.0,
                "moved_most": moved_most(before.state_dict(), after.state_dict()),
                "token_shifts": token_shifts(start, after),
                "seconds": round(time.time() - started, 1),
            }
            results.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "token_shifts"}), flush=True)
            shutil.rmtree(out, ignore_errors=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=2) + "\n")

    source = f"snapshot {args.snapshot.name}" if args.snapshot else f"{args.rows} online-like rows per seed"
    table = Table(title=f"approx-KL per PPO update ({source}, guards lifted)")
    for col in (
        "variant",
        "seed",
        "steps",
        "max approx-KL (step): its largest ratio r, that token's share",
        "final approx-KL",
        "logp drops > 2 nats",
        "moved most",
        "rose most: p before -> after (its KL term)",
    ):
        table.add_column(col)
    for r in results:
        ts = r["token_shifts"]
        top = r["moved_most"][0]
        table.add_row(
            r["variant"],
            str(r["seed"]),
            str(r["steps"]),
            f"{r['max_kl']:.3g} ({r['max_kl_step']}): r = {r['max_kl_step_ratio_max']:.3g}, "
            f"{r['max_kl_step_from_that_token']:.3g}",
            f"{r['final_kl']:.3g}",
            f"{ts['dropped_over_2_nats']} of {ts['tokens']} ({ts['of_them_rare_tokens']} rare)",
            f"{top[0]} ({top[1]:.3g})",
            ", ".join(
                f"{t['token']!r} {t['p_before']:.3g} -> {t['p_after']:.3g} ({t['approx_kl_term']:.3g})"
                for t in ts["rose_most"][:2]
            ),
        )
    print_table(table)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in results:
        ax.plot(range(len(r["approx_kl"])), r["approx_kl"], label=f"{r['variant']} (seed {r['seed']})")
    ax.set_yscale("log")
    ax.set_xlabel("PPO optimiser step")
    ax.set_ylabel("approx-KL to the starting weights")
    ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(args.out / "curve.png", dpi=120)
    console.print(f"wrote {args.out / 'results.json'} and {args.out / 'curve.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
