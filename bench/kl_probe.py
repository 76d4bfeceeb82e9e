"""Why does one PPO step sometimes jump approx-KL (0.33 -> 49.85)? Replay one update under variants.

    python bench/kl_probe.py --snapshot S.rewarded.parquet --model DIR [--set train.lr=1e-4 ...]

Runs the real training job (tasks/train/ppo.py, in process) on one rewarded snapshot from the same
starting weights once per variant, logging every step to a throwaway MLflow store, and prints the
per-step approx-KL (to the starting weights), ratio max and clip fraction, plus how much the
probability of abstaining (end of text as the first token) moved on the snapshot's prompts:
a Cursor-reward update that mostly pushes rejected suggestions down can collapse towards
"show nothing" everywhere at once. Variants (each on top of --set):
  defaults      params.yaml
  warmup5       train.warmup_steps=5 (a fresh Adam's first steps are sign-SGD: every weight moves by lr)
  lr1e-4        train.lr=1e-4
  no-kl-stop    train.target_kl and max_approx_kl lifted: the update runs to its end
Writes bench/out/kl_probe/results.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

VARIANTS = {
    "defaults": [],
    "warmup5": ["train.warmup_steps=5"],
    "lr1e-4": ["train.lr=1e-4"],
    "no-kl-stop": ["train.target_kl=1000", "train.max_approx_kl=1000"],
}


def abstain_prob(model_dir: Path, prompts: list[str]) -> float:
    """Mean probability that the first generated token is a stop token (nothing shown)."""
    import torch

    from tasks.generate import encode_prompt, load_model, prompt_limit, stop_token_ids

    model, tok = load_model(model_dir)
    stops = stop_token_ids(tok)
    total = 0.0
    with torch.no_grad():
        for prompt in prompts:
            ids = encode_prompt(tok, prompt, prompt_limit(model, 48))
            probs = torch.softmax(model(torch.tensor([ids])).logits[0, -1], -1)
            total += float(probs[stops].sum())
    return total / len(prompts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--snapshot", type=Path, required=True, help="a rewarded snapshot (*.rewarded.parquet)")
    parser.add_argument("--model", type=Path, required=True, help="the starting checkpoint")
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--set", action="append", default=[])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS))
    parser.add_argument("--out", type=Path, default=Path("bench/out/kl_probe"))
    args = parser.parse_args(argv)

    import mlflow
    import pyarrow.parquet as pq

    from tasks.config import load_params
    from tasks.train.ppo import TrainingDiverged, train

    prompts = [r["prompt"] for r in pq.read_table(args.snapshot, columns=["prompt"]).to_pylist()][:64]
    before = abstain_prob(args.model, prompts)
    results = {"abstain_prob_before": before, "variants": {}}
    with tempfile.TemporaryDirectory() as tmp:
        mlflow.set_tracking_uri(f"sqlite:///{tmp}/mlflow.db")
        for name in args.variants:
            params = load_params(args.params, [*args.set, *VARIANTS[name]])
            with mlflow.start_run() as run:
                try:
                    result = train(args.snapshot, args.model, Path(tmp) / name, params, mlflow_run_id=run.info.run_id)
                    status, after = result.stopped_early or "ran to the end", abstain_prob(Path(tmp) / name, prompts)
                except TrainingDiverged as err:
                    status, after = f"diverged: {err}", float("nan")
            client = mlflow.MlflowClient()
            curve = {
                key: [m.value for m in sorted(client.get_metric_history(run.info.run_id, key), key=lambda m: m.step)]
                for key in ("train/approx_kl", "train/ratio_max", "train/clipfrac", "train/grad_norm")
            }
            results["variants"][name] = {"status": status, "abstain_prob_after": after, **curve}
            kl = " ".join(f"{v:.3g}" for v in curve["train/approx_kl"])
            print(
                f"{name:12s} {status[:70]:70s} abstain p {before:.3f} -> {after:.3f}\n  approx-KL per step: {kl}",
                flush=True,
            )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
