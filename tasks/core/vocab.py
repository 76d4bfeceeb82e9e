"""The words tabrl writes and reads back: MLflow tag keys, run kinds, cycle statuses, deploy actions, the
training step's metric names. One place for each, as constants and `Literal` types; every use imports them.

The MLflow tags are listed, with what each holds, in `TAGS`; the docs' reference page of them
(docs/reference/mlflow.md) is generated from it (docs/gen_ref.py).
"""

from __future__ import annotations

from typing import Literal

# MLflow tag keys (runs and model versions)
KIND = "tabrl.kind"
CYCLE = "tabrl.cycle"
CYCLE_RUN_ID = "tabrl.cycle_run_id"
CYCLE_STATUS = "tabrl.cycle_status"
CYCLE_REASON = "tabrl.cycle_reason"
GATE_WINDOW = "tabrl.gate_window"
VERSION = "tabrl.version"
BASE_DIR = "tabrl.base_dir"
BASE_VERSION = "tabrl.base_version"
BASE_SHA256 = "tabrl.base_sha256"
WEIGHTS = "tabrl.weights"
CHARS_SAVED_HOLDER = "tabrl.chars_saved_holder"
SNAPSHOT = "tabrl.snapshot"
SNAPSHOT_SHA256 = "tabrl.snapshot_sha256"
SNAPSHOT_DVC_MD5 = "tabrl.snapshot_dvc_md5"
TRAIN_STOPPED_EARLY = "tabrl.train_stopped_early"
TRAIN_OUTCOME = "tabrl.train_outcome"
TRAIN_REASON = "tabrl.train_reason"
ACTION = "tabrl.action"
REASON = "tabrl.reason"
APPLIED = "tabrl.applied"
CHALLENGER_VERSION = "tabrl.challenger_version"
CHAMPION_VERSION = "tabrl.champion_version"
AB_DECISION = "tabrl.ab_decision"
AB_REASON = "tabrl.ab_reason"
TEAM = "tabrl.team"

SNAPSHOT_TAGS = (SNAPSHOT, SNAPSHOT_SHA256, SNAPSHOT_DVC_MD5)  # a cycle run's, copied onto its model version

TAGS: dict[str, tuple[str, str]] = {  # key -> (where it is set, what it holds)
    KIND: ("run, model version", "what the run is: `cycle`, `base`, `ab_decision` or `loop_summary` (`RunKind`)"),
    CYCLE: ("cycle run", "the cycle's number, 1 for the first cycle run of the experiment"),
    CYCLE_RUN_ID: ("model version, decision run", "the cycle run that trained the version"),
    CYCLE_STATUS: ("cycle run", "how the cycle ended (`CycleStatus`)"),
    CYCLE_REASON: ("cycle run", "why, in words"),
    GATE_WINDOW: ("cycle run", "the window of held-out regions the cycle's gate typed"),
    VERSION: ("cycle run, base run", "the registered NAME/VERSION, where one was registered"),
    BASE_DIR: ("base run", "the checkpoint directory the base model was registered from"),
    BASE_VERSION: ("model version", "an adapter's base: NAME/VERSION of a full version"),
    BASE_SHA256: ("model version", "an adapter's base checkpoint's sha256"),
    WEIGHTS: ("model version", "`full` or `lora`"),
    CHARS_SAVED_HOLDER: (
        "model version",
        "the ancestor that saved the most characters in the gates along its lineage (absent: the version itself)",
    ),
    SNAPSHOT: ("cycle run, model version", "the outcome snapshot the cycle trained on (a path in the DVC repo)"),
    SNAPSHOT_SHA256: ("cycle run, model version", "that snapshot's sha256"),
    SNAPSHOT_DVC_MD5: ("cycle run, model version", "its md5 in DVC's cache, where it is tracked"),
    TRAIN_STOPPED_EARLY: ("cycle run", "why training stopped before its planned steps (a KL target, a guard)"),
    TRAIN_OUTCOME: ("cycle run", "how training on the `gpu` pool ended: `trained` or `diverged`"),
    TRAIN_REASON: ("cycle run", "why it diverged, in words"),
    ACTION: ("decision run", "the A/B decision: `promote`, `rollback` or `continue` (`Action`)"),
    REASON: ("decision run", "why, in words, with the numbers"),
    APPLIED: ("decision run", "`true` when the decision changed the arms and aliases"),
    CHALLENGER_VERSION: ("decision run", "the challenger under test"),
    CHAMPION_VERSION: ("decision run", "the champion it was tested against (`none` when there was none)"),
    AB_DECISION: ("cycle run", "the applied A/B decision on the version the cycle trained (`ChangeAction`)"),
    AB_REASON: ("cycle run", "why, in words"),
    TEAM: (
        "cycle run, decision run, registered model",
        "the team whose model it is (`org`: the organisation's; docs/how-to/teams.md)",
    ),
}

RunKind = Literal["cycle", "base", "ab_decision", "loop_summary"]

CycleStatus = Literal["deployed", "gate_failed", "diverged", "train_failed", "skipped"]
"""How a cycle ended: a candidate passed the gate and went out; it failed the gate; a training guard fired;
training failed; nothing to train on (or a challenger still under test)."""
DEPLOYED: CycleStatus = "deployed"

Action = Literal["promote", "rollback", "continue"]
"""An A/B decision: the challenger takes over, it is removed, or the test goes on."""
ChangeAction = Literal["promote", "rollback"]
"""A change applied to the arms and aliases (a decision that is not `continue`, or one made by hand)."""

# the training step's metrics (MLflow keys, logged each optimiser step)
LOSS = "train/loss"
CLIPFRAC = "train/clipfrac"
APPROX_KL = "train/approx_kl"
KL_K3 = "train/kl_k3"
ENTROPY = "train/entropy"
GRAD_NORM = "train/grad_norm"
LR = "train/lr"
IS_WEIGHT = "train/is_weight"
RATIO_MAX = "train/ratio_max"
TOKENS = "train/tokens"
ABSTAIN_P = "train/abstain_p"  # only with train.abstain_weight > 0
STEP_METRICS = (LOSS, CLIPFRAC, APPROX_KL, KL_K3, ENTROPY, GRAD_NORM, LR, IS_WEIGHT, RATIO_MAX, TOKENS, ABSTAIN_P)
