"""Evaluate a model, or a candidate against the champion, on held-out FIM samples.

    tabrl evaluate --model models/candidate --against models/tabrl-tiny

Two held-out workloads, both from test files only, the same for both models:

* editor traffic: the same simulated users type the same held-out regions, the model asked at
  every pause (greedy, batched across sessions: ``tasks.sim.acceptance.type_regions``), about
  ``evaluate.n_requests`` requests. The headline and the gate's reward:

    eval/typing/suggest_rate        shown / requests
    eval/typing/accept_rate         accepted / shown (persona noise included)
    eval/typing/right_rate          right / shown by the noise-free rule (noise is never learning)
    eval/typing/chars_saved         right-and-accepted characters / typed characters
    eval/typing/reward_per_request  mean reward (params.reward) per request
    eval/typing/requests            requests asked

* span FIM samples: the first ``evaluate.n_samples`` held-out spans, completed greedily, replayed
  to the same users and scored by one judge (``judge.py``). Metrics:

    eval/judge_mean          mean judge score (0-10) over scored shown suggestions (0 when none)
    eval/judge_scored        shown suggestions the judge scored
    eval/judge_unscored      shown suggestions the judge answered but could not be scored
    eval/suggest_rate        shown / requests (an empty completion shows nothing)
    eval/accept_rate         accepted / shown, simulated users
    eval/reward_per_request  mean reward (params.reward) per request, abstentions included
    eval/exact_match         share of requests completed exactly (trailing whitespace aside)
    eval/edit_sim            mean difflib similarity to the true middle per request (abstain = 0)
    eval/parse_ok            share of parse-checked shown suggestions that keep the file parsing
    eval/parse_checked       shown suggestions the parse check applied to
    eval/mean_len            characters per shown suggestion
    eval/latency_ms          generation wall time per sample (batched greedy decoding)

With an active MLflow run, the candidate's metrics are logged as ``eval/*``, the champion's as
``eval/champion/*``, the gate as ``eval/gate_passed`` and ``eval/gate.json``, the per-sample rows
as a table (``eval/samples.json``) and a bar plot of both models' metrics (``eval/metrics.png``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import mlflow
from prefect import task
from prefect.cache_policies import NO_CACHE

from tasks.core.config import Params
from tasks.core.engines import open_engine
from tasks.core.outcomes import reward_of, reward_per_request
from tasks.evaluate.completions import fim_completions
from tasks.evaluate.gate import GateDecision, gate
from tasks.evaluate.judge import JudgeRun, JudgeUnavailable, Verdict, judge
from tasks.evaluate.reference import checks
from tasks.sim.acceptance import TypingRun, type_regions, typing_acceptance
from tasks.sim.editor import Region
from tasks.sim.sessions import TypingSummary
from tasks.sim.users import make_users, replay, summarise

METRICS = (
    "eval/judge_mean",
    "eval/judge_scored",
    "eval/judge_unscored",
    "eval/suggest_rate",
    "eval/accept_rate",
    "eval/reward_per_request",
    "eval/exact_match",
    "eval/edit_sim",
    "eval/parse_ok",
    "eval/parse_checked",
    "eval/mean_len",
    "eval/latency_ms",
    "eval/typing/suggest_rate",
    "eval/typing/accept_rate",
    "eval/typing/right_rate",
    "eval/typing/chars_saved",
    "eval/typing/reward_per_request",
    "eval/typing/requests",
)


@dataclass(frozen=True)
class Suggestions:
    model_dir: str
    texts: list[str]
    latency_ms: float  # generation wall time per sample
    typing: TypingRun  # the model typed through the held-out regions


@dataclass(frozen=True)
class EvalResult:
    model_dir: str
    judge: str  # which judge scored it ("reference", "llm:<model>", "reference (fallback: ...)")
    metrics: dict[str, float]  # the METRICS
    rows: list[dict] = field(repr=False)  # one per sample: ids, middle, completion, outcome, reward, scores
    typing: TypingRun | None = field(default=None, repr=False)  # per-turn and per-session editor traffic


@dataclass(frozen=True)
class Comparison:
    candidate: EvalResult
    champion: EvalResult
    decision: GateDecision
    judge_requests: int  # prompts sent to the LLM judge (0 for the reference judge or a warm cache)
    judge_cache_hits: int


def held_out(samples: Sequence[dict], params: Params) -> list[dict]:
    """The samples every evaluation uses: the first evaluate.n_samples, in file order."""
    return list(samples)[: params.evaluate.n_samples]


def suggest(
    model_dir: str | Path,
    samples: Sequence[dict],
    regions: Sequence[Region],
    params: Params,
    base_dir: str | Path | None = None,
) -> Suggestions:
    """Greedy batched completions of a model (a checkpoint, or an adapter on base_dir) for the samples (timed; those
    it made before remembered, `tasks.evaluate.completions`) and its typing sessions, on the engine
    serving.backend names (in process, or vLLM)."""
    with open_engine(model_dir, params, base_dir) as engine:
        texts, latency_ms = fim_completions(engine, model_dir, samples, params, desc=f"generate {Path(model_dir).name}")
        typing = type_regions(engine, regions, params, desc=f"type with {Path(model_dir).name}")
    return Suggestions(str(model_dir), texts, latency_ms, typing)


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def score_suggestions(
    samples: Sequence[dict], made: Suggestions, verdicts: Sequence[Verdict | None], judge_name: str, params: Params
) -> EvalResult:
    """Metrics and per-sample rows of one model's suggestions, given the judge's verdicts."""
    users = make_users(params.evaluate.sim_users, params.simulator)
    outcomes = replay(samples, made.texts, users, params.simulator.seed)
    summary = summarise(outcomes, made.texts)
    rows = []
    for sample, text, outcome, verdict in zip(samples, made.texts, outcomes, verdicts, strict=True):
        c = checks(sample, text)
        rows.append(
            {
                "sample_id": sample["sample_id"],
                "path": sample["path"],
                "span_kind": sample["span_kind"],
                "middle": sample["middle"],
                "completion": text,
                "outcome": outcome,
                "reward": reward_of(outcome, params.reward),
                "judge_score": verdict.score if verdict else None,
                "judge_note": verdict.note if verdict else "",
                "exact": c.exact,
                "edit_sim": c.edit_sim,
                "parse_ok": c.parse_ok,
            }
        )
    shown = [r for r in rows if r["outcome"] != "abstained"]
    scored = [r["judge_score"] for r in rows if r["judge_score"] is not None]
    parse_checked = [r["parse_ok"] for r in shown if r["parse_ok"] is not None]
    judged = [v for v in verdicts if v is not None]
    metrics = {
        "eval/judge_mean": _mean(scored),
        "eval/judge_scored": float(len(scored)),
        "eval/judge_unscored": float(len(judged) - len(scored)),
        "eval/suggest_rate": summary.suggest_rate,
        "eval/accept_rate": summary.accept_rate,
        "eval/reward_per_request": _mean([r["reward"] for r in rows]),
        "eval/exact_match": _mean([float(r["exact"]) for r in rows]),
        "eval/edit_sim": _mean([r["edit_sim"] for r in rows]),
        "eval/parse_ok": _mean([float(ok) for ok in parse_checked]),
        "eval/parse_checked": float(len(parse_checked)),
        "eval/mean_len": summary.mean_len,
        "eval/latency_ms": made.latency_ms,
    } | typing_metrics(made.typing.summary, params)
    return EvalResult(made.model_dir, judge_name, metrics, rows, made.typing)


def typing_metrics(s: TypingSummary, params: Params) -> dict[str, float]:
    return {
        "eval/typing/suggest_rate": s.suggest_rate,
        "eval/typing/accept_rate": s.accept_rate,
        "eval/typing/right_rate": s.right_rate,
        "eval/typing/chars_saved": s.chars_saved,
        "eval/typing/reward_per_request": reward_per_request(s, params.reward),
        "eval/typing/requests": float(s.requests),
    }


def _judge_all(samples: Sequence[dict], made: Sequence[Suggestions], params: Params) -> tuple[JudgeRun, list[list]]:
    """One judge run over every model's suggestions, so all are scored by the same judge."""
    pairs = [(s, text) for m in made for s, text in zip(samples, m.texts, strict=True)]
    run = judge(pairs, params.evaluate.judge)
    n = len(samples)
    return run, [run.verdicts[i * n : (i + 1) * n] for i in range(len(made))]


def evaluate_model(
    model_dir: str | Path,
    samples: Sequence[dict],
    regions: Sequence[Region],
    params: Params,
    base_dir: str | Path | None = None,
) -> EvalResult:
    """Metrics of one model on the held-out samples and regions; logged to the active MLflow run, if any."""
    samples = held_out(samples, params)
    made = suggest(model_dir, samples, regions, params, base_dir)
    run, (verdicts,) = _judge_all(samples, [made], params)
    result = score_suggestions(samples, made, verdicts, run.judge, params)
    if mlflow.active_run() is not None:
        log_results({"candidate": result}, None)
    return result


def compare(
    candidate_dir: str | Path,
    champion_dir: str | Path,
    samples: Sequence[dict],
    regions: Sequence[Region],
    params: Params,
    mark_dir: str | Path | None = None,
    base_dir: str | Path | None = None,
) -> Comparison:
    """Candidate vs champion on the same samples, regions, decoding, simulated users and judge; then the gate.

    mark_dir: the ancestor holding the champion's lineage mark for characters saved (None: the champion
    holds it); it types the same regions, and its characters saved are the gate's mark. base_dir: the base of
    the adapters among them (a LoRA lineage)."""
    samples = held_out(samples, params)
    chars_mark = None
    if mark_dir is not None:
        chars_mark = typing_acceptance(mark_dir, regions, params, base_dir).summary.chars_saved
    made = [
        suggest(candidate_dir, samples, regions, params, base_dir),
        suggest(champion_dir, samples, regions, params, base_dir),
    ]
    run, (cand_verdicts, champ_verdicts) = _judge_all(samples, made, params)
    candidate = score_suggestions(samples, made[0], cand_verdicts, run.judge, params)
    champion = score_suggestions(samples, made[1], champ_verdicts, run.judge, params)
    decision = gate(candidate.metrics, champion.metrics, params.evaluate, chars_mark)
    comparison = Comparison(candidate, champion, decision, run.requests, run.cache_hits)
    if mlflow.active_run() is not None:
        log_results({"candidate": candidate, "champion": champion}, decision)
        mlflow.log_metrics({"eval/judge_requests": run.requests, "eval/judge_cache_hits": run.cache_hits})
    return comparison


def metrics_figure(results: dict[str, EvalResult]):
    """One small bar chart per metric, a bar per model (metrics live on different scales)."""
    from matplotlib.figure import Figure  # the object API: no pyplot state, no GUI backend

    cols = 4
    rows = -(-len(METRICS) // cols)
    fig = Figure(figsize=(3.2 * cols, 2.4 * rows))
    axes = fig.subplots(rows, cols, squeeze=False)
    labels = list(results)
    for ax, name in zip(axes.flat, METRICS, strict=False):
        values = [results[label].metrics[name] for label in labels]
        ax.bar(labels, values, color=["tab:blue", "tab:gray"][: len(labels)])
        ax.set_title(name.removeprefix("eval/"), fontsize=9)
        ax.tick_params(labelsize=8)
    for ax in list(axes.flat)[len(METRICS) :]:
        ax.axis("off")
    fig.tight_layout()
    return fig


def log_results(results: dict[str, EvalResult], decision: GateDecision | None) -> None:
    """Metrics, per-sample table, plot and gate decision to the active MLflow run."""
    for label, result in results.items():
        prefix = "eval/" if label == "candidate" else f"eval/{label}/"
        mlflow.log_metrics({prefix + k.removeprefix("eval/"): v for k, v in result.metrics.items()})
    mlflow.set_tag("eval.judge", next(iter(results.values())).judge[:5000])
    table: dict[str, list] = {"model": []}
    for label, result in results.items():
        for row in result.rows:
            table["model"].append(label)
            for key, value in row.items():
                table.setdefault(key, []).append(value)
    mlflow.log_table(table, artifact_file="eval/samples.json")
    fig = metrics_figure(results)
    mlflow.log_figure(fig, "eval/metrics.png")
    if decision is not None:
        mlflow.log_metric("eval/gate_passed", float(decision.passed))
        mlflow.log_dict(
            {"passed": decision.passed, "reasons": decision.reasons, "numbers": decision.numbers}, "eval/gate.json"
        )


def _judge_was_down(task, task_run, state) -> bool:
    """Retry the evaluation only when the judge endpoint was down, not on a configuration error."""
    return isinstance(state.result(raise_on_failure=False), JudgeUnavailable)


@task(
    name="evaluate", retries=2, retry_delay_seconds=[60, 300], retry_condition_fn=_judge_was_down, cache_policy=NO_CACHE
)
def compare_task(
    candidate_dir: str,
    champion_dir: str,
    samples: list[dict],
    regions: list[Region],
    params: Params,
    mark_dir: str | None = None,
    base_dir: str | None = None,
) -> Comparison:
    """The cycle's evaluate step: `compare`, retried when the LLM judge was down."""
    return compare(candidate_dir, champion_dir, samples, regions, params, mark_dir, base_dir)
