"""bench.learning's runs: an online setting's loop, offline GRPO, and the final models typed through held-out
requests (the seen window and the unseen half)."""

from __future__ import annotations

from pathlib import Path

from tasks.core import vocab

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
