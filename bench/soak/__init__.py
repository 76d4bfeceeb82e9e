"""Soak: the always-on stack (`tabrl up`) for hours under editor traffic, cycles on the schedule, faults on a timer,
then a reconciliation of everything the editors were told against what the stack kept.

    python -m bench.soak --hours 2                      # the recorded run (bench/RESULTS.md)
    python -m bench.soak --minutes 10 --out bench/out/soak-ci   # the short soak .ci/run runs

The stack is `tabrl up --gateways 2` in a git + DVC repo of its own (the snapshots are versioned there), with
tabrl-tiny, the log store in a throwaway schema of the PostgreSQL at `--postgres-url`, and a Redis server of this
bench's own (`redis-server` on a free port, so restarting it disturbs no other user). Prefect fires online-rl-cycle
every `--cycle-every` minutes and ab-decision every `--decide-every` on its own schedule.

**Traffic.** Continue-like simulated editors (serving/simulate.py, `simulator.client: continue`: requests
aborted when the user types on, late answers reported `shown: false`) in rounds of `ROUND_S`: each round a
different slice of a user population types (users join and leave), at a rate that rises and falls like a working
day between `--min-rps` and `--peak-rps`. A request or feedback that fails during a fault is counted and the
editor goes on.

**The ledger.** Every completion the gateway answered (200, with its id) and every feedback it acknowledged is
written to `ledger.jsonl` as it arrives (an httpx response hook on the editors' client).

**Faults**, each `--rounds-of-faults` times (2 by default, 1 for --minutes), spread over the run with seeded
jitter: kill -9 of one gateway process and, the second time, of the whole gateway (supervisord restarts it; the
embedded backend lives inside the gateway, so this is also the model backend's kill); kill -9 of the gpu pool's
worker together with the training flow run it runs, while a cycle trains (the cycle cancels the lost run after
cluster.train_timeout_s); the MLflow server stopped for 60 s; a PostgreSQL restart (`--pg-restart`); a Redis
restart. Each fault's recovery time: until a completion through the gateway succeeds again (the worker: until
supervisord has it running again; MLflow: until /health answers).

**Reconciliation** at the end (with the stack still up, then after it stopped):
- ledger vs store: completions lost (answered, not in the store), feedback lost or attached wrongly (another
  outcome, another user or arm than the ledger says), duplicated rows;
- snapshots: the committed snapshots' seq ranges are disjoint and cover every completion up to the watermark;
  every snapshotted completion id is in exactly one snapshot file, and none is in a snapshot outside its range;
- cycles: every cycle run ended (completed, skipped with its reason, failed), no two cycles that trained
  overlapped, no flow run is left running; the MLflow aliases equal the arms table;
- processes, memory and disk sampled every `SAMPLE_S` stay bounded; after `tabrl up` stopped, nothing it started
  is alive.

Writes `soak.json` (the table, the faults, the samples) and `soak.png` (accept/shown and characters saved per
shown suggestion over wall-clock time, promotions, rollbacks and faults marked) under `--out`; prints the table;
exits 1 when any reconciliation count is not 0.
"""
