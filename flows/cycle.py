"""online_rl_cycle: ingest -> reward -> train -> evaluate -> register -> rollout (one MLflow run per cycle).

    tabrl cycle                                   # a manual run (Prefect ephemeral mode without a server)
    prefect deployment run 'online-rl-cycle/online-rl-cycle'   # against `tabrl schedule`

The flow holds no logic but the gate: it skips (and says why) while another cycle runs (one at a
time, flows/slots.py), while a challenger is still under test (unless forced) or when the snapshot is
too small to train on, and keeps the champion when a training guard (non-finite loss, approx-KL) stops
the update. Training runs here or, with `cluster.train_on: pool` (`tabrl deploy`), as the
`train-candidate` deployment on the gpu pool (flows/remote_training.py); a training run that fails, is
cancelled or loses its worker ends the cycle as `train_failed` with the champion and the ingest
watermark as they were (the snapshot's rows are trained on by the next cycle). Every cycle, a skipped
one too, leaves an MLflow run named for its outcome (`cycle 3 · deployed · tabrl-completion/4`,
`cycle 4 · skipped: challenger under test`), so the runs list of the MLflow UI tells the loop's story.
A cycle not skipped first deletes this host's copies of
retired versions older than `deploy.retired_retention_hours` (tasks/deploy/model_retention.py).

    tabrl cycle --team payments                   # one team's cycle (docs/how-to/teams.md)

A cycle works for one team (`team`, the organisation's by default: tasks/core/teams.py): its slots, its rows past
its watermark, its registered model and experiment, its gate on its own held-out files (tasks/sim/team_data.py)
and its arms. A team's first adapter continues from the organisation's champion. Cycles of different teams run
side by side.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import mlflow
from prefect import flow, get_run_logger

from flows.remote_training import TrainingLost, train_step
from flows.slots import CycleRunning, arms_slot, cycle_slot
from tasks.core import vocab
from tasks.core.config import DEFAULT_PARAMS_FILE, Params, load_params
from tasks.core.store import CHALLENGER
from tasks.core.teams import ORG, check_team
from tasks.deploy.model_cache import resolve_model_dir
from tasks.deploy.model_retention import model_retention_task
from tasks.deploy.registry import Lineage, Registry
from tasks.deploy.rollout import rollout
from tasks.deploy.tracking import CycleRuns
from tasks.deploy.versions import ModelVersion
from tasks.evaluate.evaluate import Comparison, compare_task
from tasks.ingest.task import commit_ingest_task, ingest_task
from tasks.ingest.versioning import ensure_repo
from tasks.reward.task import reward_task
from tasks.sim.acceptance import gate_regions
from tasks.sim.corpus import read_samples
from tasks.sim.editor import read_regions, regions_path
from tasks.sim.team_data import held_out_dir
from tasks.train.ppo import TrainingDiverged


@dataclass
class CycleReport:
    status: vocab.CycleStatus
    reason: str
    run_id: str  # the cycle's MLflow run (skipped cycles have one too), named `cycle N · status · version`
    snapshot: str | None = None
    version: str | None = None  # registered NAME/VERSION when deployed
    metrics: dict[str, float] = field(default_factory=dict)


def challenger_under_test(registry: Registry) -> bool:
    return registry.aliased(CHALLENGER) is not None


def _skipped(runs: CycleRuns, log, reason: str, why: str) -> CycleReport:
    """A cycle that does not train (reason: the run's name says it); it still leaves a run."""
    log.info(f"skipped: {why}")
    report = CycleReport("skipped", reason, run_id=runs.start())
    runs.name_outcome(report.run_id, report.status, report.reason)  # every cycle leaves a run
    runs.end(report.run_id)
    return report


def _evaluate(
    candidate_dir: Path, lineage: Lineage, holder: ModelVersion | None, runs: CycleRuns, timing: dict[str, float]
) -> Comparison:
    """The candidate against the champion on the team's held-out FIM samples and this cycle's gate window of its
    typing regions (the window is tagged on the run); the time it took goes into `timing`."""
    params = runs.params
    data_dir = held_out_dir(params, runs.team)
    test = read_samples(data_dir / "fim" / "test.parquet")[: params.evaluate.n_samples]
    windows = params.evaluate.gate_windows
    window = runs.next_gate_window(windows)
    mlflow.set_tag(vocab.GATE_WINDOW, str(window))
    regions = gate_regions(read_regions(regions_path(data_dir, "test")), window, windows)
    mark_dir = str(resolve_model_dir(holder.uri, params)) if holder else None
    started = time.perf_counter()
    champion_dir, base_dir = str(lineage.champion_dir), str(lineage.base_dir)
    comparison = compare_task(str(candidate_dir), champion_dir, test, regions, params, mark_dir, base_dir)
    timing["time/evaluate_s"] = time.perf_counter() - started
    typed = (comparison.candidate.typing, comparison.champion.typing)
    timing["time/typing_s"] = sum(run.seconds for run in typed if run is not None)  # of which the two typed regions
    return comparison


def _cycle_metrics(comparison: Comparison, steps: int, timing: dict[str, float]) -> dict[str, float]:
    champion_metrics = {k.replace("eval/", "eval/champion/", 1): v for k, v in comparison.champion.metrics.items()}
    return dict(comparison.candidate.metrics) | champion_metrics | {"train/steps": steps} | timing


def _deploy(
    candidate_dir: Path,
    comparison: Comparison,
    lineage: Lineage,
    holder: ModelVersion | None,
    registry: Registry,
    run_id: str,
) -> ModelVersion:
    """A candidate that passed the gate: registered (carrying the chars-saved mark when it holds it) and rolled
    out as the challenger."""
    held_by = comparison.decision.mark_holder_after(lineage.champion, holder)
    carried = {vocab.CHARS_SAVED_HOLDER: str(held_by.version)} if held_by else {}
    numbers = comparison.decision.numbers
    version = registry.register(candidate_dir, run_id, tags=carried, gate=numbers, base=lineage.base)
    params = registry.params
    with arms_slot(params.paths.database_url, registry.team):  # never while the A/B decision changes the arms
        rollout(version, str(resolve_model_dir(version.uri, params)), params, str(lineage.base_dir), registry.team)
    return version


@flow(name="online-rl-cycle", log_prints=True)
def online_rl_cycle(
    params_file: str = str(DEFAULT_PARAMS_FILE),
    overrides: list[str] | None = None,
    force: bool = False,
    repo_dir: str | None = None,
    team: str = ORG,
) -> CycleReport:
    """One cycle of `team`; its snapshot is versioned in `repo_dir` (a git + DVC repo), by default
    paths.snapshots_repo (made on first use), never the project's checkout."""
    params = load_params(params_file, overrides or [])
    log = get_run_logger()
    runs = CycleRuns(params, check_team(team))
    try:
        with cycle_slot(params.paths.database_url, team):  # one cycle of a team at a time: a second ends now
            repo = Path(repo_dir) if repo_dir else ensure_repo(Path(params.paths.snapshots_repo))
            return _cycle(params, runs, log, force, repo)
    except CycleRunning as err:  # only the cycle slot's own refusal: an arms wait that timed out fails the cycle
        return _skipped(runs, log, "another cycle is running", f"{err}; the next scheduled cycle tries again")


def _cycle(params: Params, runs: CycleRuns, log, force: bool, repo_dir: Path) -> CycleReport:
    registry = Registry(params, runs.team)
    if challenger_under_test(registry) and not force:
        why = "a challenger is still under test (the A/B decision flow promotes or rolls it back; force=True trains)"
        return _skipped(runs, log, "challenger under test", why)
    lineage = registry.lineage()
    model_retention_task(params)  # local copies of retired versions go after deploy.retired_retention_hours
    run_id = runs.start()
    report = CycleReport("skipped", "", run_id)
    mlflow.set_tracking_uri(params.paths.mlflow_tracking_uri)  # the stages log into the active run
    with mlflow.start_run(run_id=run_id, log_system_metrics=False):  # ends FAILED if a stage raises
        pending = ingest_task(params, repo_dir, team=runs.team)  # the watermark moves once training has finished
        ingested = pending.result
        report.snapshot = str(ingested.snapshot) if ingested.snapshot else None
        if ingested.snapshot is None or ingested.rows < params.train.min_rows:
            commit_ingest_task(params, pending)
            report.reason = f"too few rows to train on ({ingested.rows} < train.min_rows={params.train.min_rows})"
            log.info(f"skipped training: {report.reason}")
        else:
            rewarded = reward_task(
                ingested.snapshot, params.reward, ingested.snapshot.with_suffix(".rewarded.parquet"), ingested.arms
            )
            started = time.perf_counter()
            try:
                trained, candidate_dir = train_step(rewarded.path, lineage, params, run_id)
            except TrainingDiverged as err:  # a guard stopped the update: nothing to evaluate, the champion stays
                commit_ingest_task(params, pending)
                report.status, report.reason = "diverged", f"training stopped by a guard: {err}"
                log.warning(f"candidate not trained: {report.reason}")
            except TrainingLost as err:  # the watermark stays: the next cycle trains on these rows
                report.status, report.reason = "train_failed", str(err)
                log.error(f"candidate not trained: {report.reason}")
            else:
                commit_ingest_task(params, pending)
                timing = {"time/train_s": time.perf_counter() - started}
                if trained.stopped_early:
                    log.info(f"update ended early: {trained.stopped_early}")
                    mlflow.set_tag(vocab.TRAIN_STOPPED_EARLY, trained.stopped_early[:5000])
                holder = registry.chars_saved_holder(lineage.champion)
                comparison = _evaluate(candidate_dir, lineage, holder, runs, timing)
                mlflow.log_metrics(timing)
                report.metrics = _cycle_metrics(comparison, trained.steps, timing)
                if not comparison.decision.passed:  # the gate
                    report.status, report.reason = "gate_failed", "; ".join(comparison.decision.reasons)
                    log.info(f"candidate not deployed: {report.reason}")
                else:
                    version = _deploy(candidate_dir, comparison, lineage, holder, registry, run_id)
                    report.status, report.version = "deployed", version.label
                    report.reason = "; ".join(comparison.decision.reasons)
                    log.info(f"{version.label} is the challenger at {params.deploy.challenger_share:.0%} of traffic")
        runs.name_outcome(run_id, report.status, report.reason, report.version)
    return report
