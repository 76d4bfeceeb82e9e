"""One typed, frozen config tree loaded from ``params.yaml``.

Every knob of tabrl lives in ``params.yaml`` (DVC tracks it as the params of every stage) and is
described here, once, by the docstring under its field. Values are overridden one key at a time:

* CLI: ``tabrl ... --set train.lr=1e-5`` (the value is parsed as YAML: numbers, booleans, lists);
* an overlay file: ``tabrl ... --set @params.real-model.yaml`` (sections of params.yaml's shape, applied
  where it stands among the other ``--set``s);
* environment: ``TABRL_TRAIN__LR=1e-5`` (section and key joined by a double underscore);
  ``TABRL_DATABASE_URL`` is a short alias for ``paths.database_url``.

CLI beats environment beats file. Unknown keys and bad values fail with a message naming the key,
the value and what is allowed.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic_core import ErrorDetails

ENV_PREFIX = "TABRL_"
ENV_ALIASES = {"TABRL_DATABASE_URL": "paths.database_url", "TABRL_MLFLOW_TRACKING_URI": "paths.mlflow_tracking_uri"}
DEFAULT_PARAMS_FILE = Path("params.yaml")
# The corpus committed to git: CPython 3.11.7's standard library as `tabrl corpus` read it, the base's training data.
SHIPPED_CORPUS = "data/corpus/files.parquet"


class ParamsError(ValueError):
    """A params file, override or value that cannot be used; the message says which and why."""


class Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)


class DataParams(Section):
    source: str = SHIPPED_CORPUS
    """Where the code comes from. By default the corpus shipped in git, `data/corpus/files.parquet`
    (CPython 3.11.7's standard library, 1,747 files; md5 in dvc.lock): what the shipped base was trained
    on and the numbers of docs/results.md were measured on, the same bytes on every machine. Any corpus file
    `tabrl corpus` wrote (Parquet: path, split, text) works alike: its files are split again by
    test_fraction and split_salt. `stdlib`: the running interpreter's standard library, an explicit
    choice, since it differs between Python builds (Debian's 3.11.2 has 663 files). Or a directory of
    source files, or a JSONL/Parquet FIM data set (`prompt`+`solutions` or `prefix`/`suffix`/`middle`).
    The corpus stage writes any other source over data/corpus/files.parquet: `git checkout data/corpus`
    brings the shipped one back."""
    extensions: tuple[str, ...] = (".py",)
    """File name endings read from a directory source."""
    max_file_bytes: int = Field(200_000, gt=0)
    """Files larger than this are skipped (generated tables, vendored blobs)."""
    test_fraction: float = Field(0.25, gt=0, lt=1)
    """Share of files (by hash of their path, never by sample) that go to the held-out test split."""
    split_salt: str = "tabrl-split-v1"
    """Salt of the path hash that assigns a file to train or test; change it to draw a new split."""


class FimParams(Section):
    n_train: int = Field(3000, ge=1)
    """FIM samples drawn from the train files (RLinf's setup uses 3000)."""
    n_test: int = Field(1000, ge=1)
    """FIM samples drawn from the held-out test files (RLinf's setup uses 1000)."""
    seed: int = 0
    """Seed of the span sampler; the same seed and corpus give the same samples."""
    span_weights: dict[Literal["rest_of_line", "line", "lines"], float] = {
        "rest_of_line": 0.5,
        "line": 0.3,
        "lines": 0.2,
    }
    """Relative frequency of cursor spans: the rest of a line from the cursor, one whole line, or a few lines."""
    max_span_lines: int = Field(3, ge=2)
    """Most lines in a `lines` span."""
    min_middle_nonblank: int = Field(6, ge=1)
    """Middles with fewer non-blank characters are dropped (nothing worth suggesting)."""
    max_middle_chars: int = Field(200, ge=1)
    """Middles longer than this are dropped (a completion is a few lines, not a file)."""
    max_prefix_chars: int = Field(1200, ge=1)
    """Prefix text kept before the cursor (the nearest characters)."""
    max_suffix_chars: int = Field(300, ge=0)
    """Suffix text kept after the middle (the nearest characters)."""


class ModelParams(Section):
    base_dir: str = "models/tabrl-tiny"
    """Where the base model is built, or a local Hugging Face checkpoint directory (e.g. Qwen2.5-Coder)
    to use as the base instead; the rest of tabrl treats both the same."""
    vocab_size: int = Field(4096, ge=300)
    """Byte-level BPE vocabulary of the tiny model's tokenizer (special tokens included)."""
    hidden_size: int = Field(256, ge=32)
    """Width of the tiny model."""
    num_layers: int = Field(4, ge=1)
    """Transformer blocks of the tiny model."""
    num_heads: int = Field(4, ge=1)
    """Attention heads; hidden_size / num_heads must be >= 32 (vLLM's CPU attention needs head dim >= 32)."""
    num_kv_heads: int = Field(2, ge=1)
    """Key/value heads (grouped-query attention, as in Qwen2.5)."""
    intermediate_size: int = Field(704, ge=32)
    """MLP width of the tiny model."""
    max_position: int = Field(1024, ge=128)
    """Longest sequence (prompt + completion) the tiny model supports."""
    pretrain_steps: int = Field(500, ge=1)
    """Optimiser steps of FIM pre-training."""
    pretrain_batch: int = Field(16, ge=1)
    """Sequences per pre-training step."""
    pretrain_seq_len: int = Field(320, ge=32)
    """Tokens per pre-training sequence (longer FIM samples are truncated on the prefix side)."""
    pretrain_lr: float = Field(3e-3, gt=0)
    """Peak learning rate of pre-training (linear warm-up, cosine decay)."""
    pretrain_samples_per_file: int = Field(40, ge=1)
    """FIM spans drawn per train file for pre-training (more spans, more variety)."""
    pretrain_editor_share: float = Field(0.75, ge=0, le=1)
    """Share of pre-training samples cut where an editor asks (typing-session pauses, tasks/sim/editor.py);
    the rest are classic line spans (fim.span_weights)."""
    checkpoint_every: int = Field(250, ge=1)
    """Pre-training saves a resumable checkpoint every this many steps (a killed build resumes there)."""
    tokenizer_max_files: int = Field(2000, ge=1)
    """Train files the tokenizer is fitted on."""
    seed: int = 0
    """Seed of tokenizer sampling, weight init and pre-training order."""

    @model_validator(mode="after")
    def _head_dim(self) -> ModelParams:
        if self.hidden_size % self.num_heads or self.hidden_size // self.num_heads < 32:
            raise ValueError(
                f"hidden_size / num_heads must be a whole number >= 32, got {self.hidden_size}/{self.num_heads}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        return self


class Persona(Section):
    name: str
    """Label shown in reports."""
    weight: float = Field(1.0, gt=0)
    """Relative share of simulated users with this persona."""
    min_accept_chars: int = Field(4, ge=1)
    """K: the suggestion must cover at least this many non-blank characters of the true middle."""
    p_accept_wrong: float = Field(0.0, ge=0, le=1)
    """Noise: probability of accepting a suggestion that is not what the user was about to type."""
    p_ignore_right: float = Field(0.0, ge=0, le=1)
    """Noise: probability of not pressing Tab on a right suggestion."""
    think_s: float = Field(0.0, ge=0)
    """Seconds the user waits before answering (over HTTP)."""


class SimulatorParams(Section):
    personas: tuple[Persona, ...] = (
        Persona(name="careful", weight=1.0, min_accept_chars=6, p_accept_wrong=0.0, p_ignore_right=0.05),
        Persona(name="typical", weight=2.0, min_accept_chars=4, p_accept_wrong=0.02, p_ignore_right=0.1),
        Persona(name="hasty", weight=1.0, min_accept_chars=3, p_accept_wrong=0.05, p_ignore_right=0.2),
    )
    """Kinds of simulated users; each user gets one persona, drawn by weight from its seed."""
    seed: int = 0
    """Seed of persona assignment and noise."""

    @model_validator(mode="after")
    def _unique(self) -> SimulatorParams:
        names = [p.name for p in self.personas]
        if not names or len(set(names)) != len(names):
            raise ValueError(f"personas need at least one entry and unique names, got {names}")
        return self


class TrafficParams(Section):
    """Editor-like traffic (tasks/sim/editor.py): typing sessions over regions of real files."""

    region_lines: int = Field(3, ge=1)
    """A session types 1..region_lines whole lines."""
    min_line_nonblank: int = Field(6, ge=1)
    """A region starts at a line with at least this many non-blank characters."""
    min_region_nonblank: int = Field(8, ge=1)
    """Regions with fewer non-blank characters are skipped."""
    max_region_chars: int = Field(400, ge=1)
    """Regions longer than this are skipped (a very long line is rarely typed in one go)."""
    pause_after: str = ".(=,:["
    """The editor asks after each of these characters (and at word boundaries and new lines)."""
    p_midword_pause: float = Field(0.08, ge=0, le=1)
    """Chance of a pause before any other character (mid-word pauses, like Continue's debounce)."""
    max_prefix_chars: int = Field(600, ge=1)
    """Characters of the file before the cursor sent as the prefix (about 170 tabrl-tiny tokens: prompts
    stay inside the 256-token context it was pre-trained on)."""
    max_suffix_chars: int = Field(200, ge=0)
    """Characters of the file after the region sent as the suffix."""
    min_stop_nonblank: int = Field(4, ge=1)
    """Pre-training: a 'token' middle covers at least this many non-blank characters (the personas' usual K)."""
    stop_weights: dict[Literal["token", "line", "region"], float] = {"token": 0.4, "line": 0.45, "region": 0.15}
    """Pre-training: where an editor-like middle ends (token end, line end, region end), by weight."""
    train_regions: int = Field(4000, ge=1)
    """Regions of train files the online loop's simulated users type (drawn in order, round-robin)."""
    eval_regions: int = Field(600, ge=1)
    """Regions of test files held out for evaluation (enough for evaluate.n_requests)."""

    @model_validator(mode="after")
    def _weights(self) -> TrafficParams:
        if (
            not self.stop_weights
            or any(w < 0 for w in self.stop_weights.values())
            or not sum(self.stop_weights.values())
        ):
            raise ValueError(f"stop_weights need a positive weight, got {self.stop_weights}")
        return self


class RewardParams(Section):
    accepted: float = 0.75
    """Reward of a suggestion the user took (Tab). Cursor's Tab RL uses +0.75."""
    rejected: float = -0.25
    """Reward of a suggestion shown and not taken (no Tab in time, or another edit)."""
    abstained: float = 0.0
    """Reward of showing nothing (an empty completion)."""
    accepted_per_char: float = Field(0.0, ge=0)
    """Training only: extra reward per character of an accepted suggestion, so a long accepted suggestion
    outweighs a short one (Copilot: an accept-rate reward favours short suggestions; characters saved is what
    users feel). Reported rewards per request stay the per-outcome ones above. 0: none (0.1 raised neither
    characters saved nor accept rate: docs/lab, "Two tries at characters saved")."""
    typed_demo: float | None = None
    """Training only: every rejected or abstained request whose continuation is known also trains on the rest
    of the line the user typed there (then the end token), as a suggestion that earned this reward: what a right
    suggestion would have been, on every request instead of the few accepted ones. Its tokens were not sampled
    (importance weight 1, as rows logged without log-probs); the ratio clip bounds each update. None: off
    (params.yaml: 0.75, the accepted reward; 3 seeds x 5 cycles vs control: characters saved +0.0084 [+0.0025,
    +0.0152], accept/shown +23.8 % [+3.1 %, +51.5 %]: docs/lab, "Learning from what users typed")."""
    continuation_chars: int = Field(200, ge=1)
    """Characters of what a user typed after a request kept in the rewarded snapshot (``continuation``)."""
    advantage: Literal["raw", "batch_mean", "batch_norm", "shown_mean"] = "raw"
    """`raw`: the reward (one-step Monte-Carlo return); `batch_mean`: minus the batch mean;
    `batch_norm`: whitened over the batch (REINFORCE++ style); `shown_mean`: minus the mean over the
    shown suggestions (accepted and rejected pull equally; nothing-shown rows 0; tasks/reward/reward.py; with the
    tiny base no better than raw: docs/lab, "Balanced advantages")."""


class TrainParams(Section):
    algorithm: Literal["ppo", "grpo"] = "ppo"
    """`ppo`: critic-free PPO on logged interactions; `grpo`: offline, G samples per FIM train prompt."""
    lr: float = Field(2e-5, gt=0)
    """Peak learning rate (AdamW)."""
    lr_schedule: Literal["constant", "cosine", "linear"] = "constant"
    """Learning-rate schedule after warm-up."""
    warmup_steps: int = Field(0, ge=0)
    """Optimiser steps of linear warm-up."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""
    train_embeddings: bool = True
    """Update the token embeddings (and a head tied to them). Adam gives a row's tiny but steady gradient
    a full lr-sized step, so rows of tokens sampled once and rejected drop by many nats in one
    update: bench/kl_probe.py measures it (docs/lab, "Why approx-KL jumped")."""
    epochs: int = Field(2, ge=1)
    """Passes over the snapshot."""
    micro_batch: int = Field(8, ge=1)
    """Sequences per forward/backward on one rank."""
    grad_accum: int = Field(2, ge=1)
    """Micro-batches accumulated per optimiser step."""
    max_tokens_per_micro_batch: int = Field(16384, ge=64)
    """Packing budget: real tokens per micro-batch (no padding is spent)."""
    grad_clip: float = Field(1.0, gt=0)
    """Global gradient-norm clip."""
    clip_low: float = Field(0.2, ge=0, lt=1)
    """PPO ratio clip below 1 (epsilon_low)."""
    clip_high: float = Field(0.28, ge=0)
    """PPO ratio clip above 1 (epsilon_high; a wider upper clip keeps exploration alive)."""
    kl_beta: float = Field(0.0, ge=0)
    """Weight of the k3 KL to the starting model; 0 disables it (and the reference forward)."""
    is_cap: float = Field(2.0, ge=1)
    """C of the truncated importance weight min(pi_recomputed / pi_behaviour, C)."""
    kl_top_k: int = Field(64, ge=0)
    """What approx-KL (the guards' statistic) is: with k > 0, KL(pi_prox || pi_theta) over the starting
    weights' k most likely tokens at each completion position, the rest lumped into one (a lower bound of the
    exact KL, exact when the k hold all the mass; pi_prox's top k are kept per token, k x 12 bytes); 0: the
    sampled k3 estimate (r - 1) - log r, which one rarely sampled token that became likely can send past
    the guards while the distribution moved little (docs/lab, "Is the gate what stops learning?")."""
    max_approx_kl: float = Field(1.0, gt=0)
    """Divergence guard: the job fails (no checkpoint) when approx-KL of a step exceeds this."""
    abstain_weight: float = Field(0.0, ge=0)
    """Weight of the known-reward abstain term: showing nothing earns reward.abstained whatever the user
    would have done, so every logged row also says whether abstaining there would have been better
    (advantage reward.abstained - the row's reward) without the empty suggestion having been sampled. The
    term is -weight x that advantage x log pi(stop as the first token), one per row, counted like a
    completion token in the token mean (tasks/train/loss.py, abstain_loss). 0 disables it."""
    abstain_where_typed: bool = True
    """With abstain_weight > 0 and reward.typed_demo: also push towards abstaining on the rows whose typed line
    trains as a suggestion. False: where the line the user typed is known the loop teaches that line only (the
    better action), and the abstain term acts where no line is known (params.yaml: false; 3 seeds x 5 cycles:
    characters saved +0.0062 vs control where True gave +0.0011: docs/lab, "Teach the typed line")."""
    target_kl: float = Field(0.5, gt=0)
    """PPO's early stop: when approx-KL of a step (to the starting weights) exceeds this, the update ends
    before that step and the checkpoint so far is kept. Set it above max_approx_kl to turn it off."""
    zero_stage: Literal[0, 1, 2, 3] = 2
    """DeepSpeed ZeRO stage on GPUs."""
    engine: Literal["auto", "deepspeed", "torch"] = "auto"
    """`auto`: DeepSpeed on GPUs, plain torch (DDP over gloo for nproc > 1) on CPU, where DeepSpeed's
    first start JIT-compiles a comm op for minutes; `deepspeed` forces DeepSpeed's CPU accelerator too."""
    nproc: int = Field(1, ge=1)
    """Processes (GPUs, or CPU ranks under torchrun/gloo)."""
    group_size: int = Field(8, ge=2)
    """G: completions sampled per prompt for `grpo`."""
    grpo_prompts: int = Field(64, ge=1)
    """FIM train prompts per GRPO run."""
    min_rows: int = Field(32, ge=1)
    """A cycle skips training when its snapshot has fewer usable rows."""
    seed: int = 0
    """Seed of shuffling and dropout."""
    adapter: Literal["none", "lora"] = "none"
    """What a trained version is: `none`, a full checkpoint (tabrl-tiny and the demo); `lora`, a PEFT LoRA adapter
    on the champion's base (MBs in the registry, every arm of a base on one vLLM server; the real-model overlay
    params.real-model.yaml sets it). A next version continues the champion's adapter on the same base."""
    lora_rank: int = Field(16, ge=1)
    """r of the LoRA adapters (serving.vllm_max_lora_rank must be at least this)."""
    lora_alpha: float = Field(32.0, gt=0)
    """LoRA alpha: the update is scaled by alpha / r."""
    lora_targets: tuple[str, ...] = ("all-linear",)
    """Modules that get adapters: `all-linear` (every linear layer but the LM head, as "LoRA Without Regret"
    recommends for RL), or module names such as q_proj, v_proj."""
    lora_dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapters' input during training (0: the update sees what serving computes)."""
    num_nodes: int = Field(1, ge=1)
    """Hosts of one DeepSpeed job (GPUs only; the launcher's `--num_nodes`), each running train.nproc ranks;
    more than 1 needs train.hostfile."""
    hostfile: str | None = None
    """DeepSpeed hostfile on the GPU worker that launches the job (`HOST slots=GPUS` per line; the launcher's
    `--hostfile`, reached over passwordless ssh/pdsh); null: this host only."""

    @model_validator(mode="after")
    def _nodes(self) -> TrainParams:
        if self.num_nodes > 1 and not self.hostfile:
            raise ValueError(f"num_nodes = {self.num_nodes} needs a hostfile listing the nodes (train.hostfile)")
        return self


class JudgeParams(Section):
    kind: Literal["reference", "llm"] = "reference"
    """`reference`: deterministic score from the true middle (offline); `llm`: an OpenAI-compatible model."""
    base_url: str = "http://127.0.0.1:8001/v1"
    """OpenAI-compatible endpoint of the LLM judge."""
    model: str = "deepseek-chat"
    """Judge model name."""
    api_key_env: str = "TABRL_JUDGE_API_KEY"
    """Name of the environment variable holding the judge's API key (the key never goes in params)."""
    concurrency: int = Field(8, ge=1)
    """Judge requests in flight at once."""
    timeout_s: float = Field(60.0, gt=0)
    """Per-request timeout."""
    max_retries: int = Field(4, ge=0)
    """Retries (with backoff) on 429, 5xx and timeouts."""
    cache_path: str = "state/judge_cache.sqlite"
    """Persistent cache keyed by (judge model, prompt hash)."""
    on_failure: Literal["fail", "reference"] = "fail"
    """When the judge endpoint is down: fail the evaluation, or fall back to the reference judge."""


class EvaluateParams(Section):
    n_requests: int = Field(1000, ge=1)
    """Editor-traffic requests per evaluated model: simulated users type held-out regions (the headline numbers)."""
    chars_saved_tolerance: float = Field(0.2, ge=0)
    """The gate refuses a candidate whose characters saved (per typed character, editor traffic) fall more
    than this fraction below the champion's (and its lineage's best), however its accept rate or reward
    moved (no reward hacking by showing less). Relative, since the level depends on the code (0.2: about the
    absolute 0.005 it replaced at the standard library's ~0.022-0.025; 1 or more: never refuses on it). params.yaml
    sets 0.05, the A/B decision's deploy.chars_tolerance (docs/lab, "The 5 % tolerance again")."""
    gate_windows: int = Field(3, ge=1)
    """Windows the gate's half of the held-out regions is cut into (`tasks.sim.acceptance.gate_regions`): each gate
    types the window after the last gate's, so candidate and champion are compared on requests the champion
    was not chosen on. 1: every gate types the same requests, where a champion's lucky score there is the
    bar every later candidate must clear (the winner's curse; docs/lab, "On requests the gate never
    saw"). 3 windows of 100 regions hold 1000 requests of the standard library's held-out files."""
    n_samples: int = Field(200, ge=1)
    """Held-out FIM test samples scored per evaluation."""
    max_new_tokens: int = Field(48, ge=1)
    """Completion length limit."""
    batch_size: int = Field(16, ge=1)
    """Prompts generated together."""
    sim_users: int = Field(16, ge=1)
    """Simulated users replaying the samples round-robin (the same users for candidate and champion)."""
    judge: JudgeParams = JudgeParams()
    """The judge scoring each completion 0-10."""
    gate_tolerance: float = Field(0.02, ge=0)
    """Largest allowed drop (absolute) in reward per request, and x10 in judge mean, for the candidate."""
    gate_margin: float = Field(0.005, ge=0)
    """Least improvement (absolute) in reward per request, or x10 in judge mean, needed to pass."""


class DeployParams(Section):
    registered_model: str = "tabrl-completion"
    """MLflow registered model name."""
    challenger_share: float = Field(0.5, gt=0, lt=1)
    """Traffic share of the challenger arm while under test."""
    min_samples: int = Field(200, ge=1)
    """Shown suggestions per arm before an A/B decision is made."""
    alpha: float = Field(0.05, gt=0, lt=1)
    """Significance level of the A/B tests."""
    decision_every_minutes: float = Field(5.0, gt=0)
    """Schedule of the A/B decision flow."""
    cycle_every_minutes: float = Field(60.0, gt=0)
    """Schedule of the online RL cycle (interval)."""
    cycle_cron: str | None = None
    """A cron expression for the cycle; overrides the interval when set."""
    chars_tolerance: float = Field(0.05, ge=0, lt=1)
    """A challenger is never promoted when its accepted characters per request fall more than this
    fraction below the champion's, whatever its reward or accept rate: showing less to be accepted
    more while users type more themselves is reward hacking; such a challenger is rolled back."""
    max_samples: int | None = Field(5000, ge=1)
    """Requests per arm after which a still undecided A/B test ends in a rollback (the champion stays and
    the next cycle may start; a challenger that abstains too often to reach min_samples ends here too);
    null keeps collecting for ever."""
    experiment: str = "tabrl"
    """MLflow experiment of the cycle runs (one run per cycle; compare them in the MLflow UI)."""
    decisions_experiment: str = "tabrl-ab-decisions"
    """MLflow experiment of the A/B decision records (one run per decision, kept apart from the cycles)."""
    retired_retention_hours: float = Field(72.0, ge=0)
    """Local copies of versions no arm serves and no alias names (trained candidates under paths.models_dir,
    downloaded versions in the model cache) are deleted this long after they were last written, by each online
    cycle and by `tabrl model-retention` (tasks/deploy/model_retention.py); the registry keeps every version's
    artifact. 0: as soon as they retire."""

    @model_validator(mode="after")
    def _sample_bounds(self) -> DeployParams:
        if self.max_samples is not None and self.max_samples < self.min_samples:
            raise ValueError(f"max_samples ({self.max_samples}) must be >= min_samples ({self.min_samples}) or null")
        return self


class ServingParams(Section):
    host: str = "127.0.0.1"
    """Address the gateway binds."""
    port: int = Field(8000, ge=1, le=65535)
    """Port the gateway binds."""
    backend: Literal["embedded", "vllm"] = "embedded"
    """How arms generate: transformers in the gateway process, or a vLLM server over HTTP."""
    temperature: float = Field(0.7, ge=0)
    """Default sampling temperature (training scores log-probs at the same temperature)."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Default nucleus sampling cut."""
    min_logprob: float | None = Field(None, le=0)
    """Show a suggestion only up to the model's first unsure token: cut before the first token whose log-prob
    under logits / temperature is below this (nothing left: no suggestion). None shows every suggestion whole.
    The gateway's arms (embedded and vLLM) and the held-out evaluation apply the same rule (tasks/core/generate.py)."""
    explore_fraction: float = Field(0.0, ge=0, le=1)
    """Fraction of served requests (drawn per request) cut at explore_min_logprob instead of min_logprob, so
    the logs hold users' verdicts on text the strict rule hides: an accepted one raises those tokens'
    log-probs, and the next model shows them under min_logprob. Evaluations never explore. 0: never (at 0.25
    and -1.0 not shown to beat a stricter threshold, and it costs live accepts: docs/lab, "Two tries")."""
    explore_min_logprob: float | None = Field(-1.0, le=0)
    """The looser cut of an exploring request (below min_logprob); None shows an exploring suggestion whole."""
    seed: int | None = None
    """Seed of the embedded arms' sampling, set once when the gateway starts; None draws one from the OS
    (torch's own default seed is the same in every fresh process, so restarts would replay one stream)."""
    max_tokens: int = Field(48, ge=1)
    """Default and largest completion length."""
    max_prompt_chars: int = Field(32_000, ge=1)
    """Longest accepted prompt (413/422 beyond)."""
    auth: bool = True
    """Require an API key; switch off only for the local demo."""
    experiment_salt: str = "ab-v1"
    """Salt of the sticky user-to-arm hash; a new salt reshuffles users."""
    rate_limit_per_minute: int = Field(600, ge=1)
    """Requests per user per minute before 429."""
    config_ttl_s: float = Field(2.0, ge=0)
    """Seconds the gateway caches arms, API keys and opt-outs read from the store: a change made
    with `tabrl arms` / `tabrl keys` takes effect within this time, without a restart."""
    max_text_chars: int = Field(8_000, ge=1)
    """Longest prefix, suffix or completion text accepted in a feedback/outcome body (413 beyond)."""
    log_batch: int = Field(256, ge=1)
    """Most rows committed together by the log writer (group commit; each caller still waits for its commit)."""
    latency_window: int = Field(1000, ge=1)
    """Latest completions per arm whose latencies each gateway process keeps for the p50/p95 gauges of /metrics
    (`tabrl_arm_latency_ms`): a bounded rolling window, sorted only when /metrics is read."""
    backend_timeout_s: float = Field(30.0, gt=0)
    """Per-request timeout of a vLLM backend call (502 naming the arm after it)."""
    vllm_python: str = "python"
    """Interpreter of the environment vLLM is installed in (its own venv: its pins conflict with prefect's);
    the rollout starts `{vllm_python} -m vllm.entrypoints.openai.api_server` for each new version."""
    vllm_args: tuple[str, ...] = ("--logprobs-mode", "processed_logprobs")
    """Extra vLLM server flags. processed_logprobs: logged behaviour log-probs are under the temperature-scaled
    distribution training uses. On CPU add --dtype float32 --enforce-eager."""
    vllm_start_timeout_s: float = Field(420.0, gt=0)
    """A new vLLM server must answer /health within this many seconds, else the rollout is undone."""
    vllm_max_loras: int = Field(4, ge=3)
    """Adapters one vLLM server runs at once (its --max-loras): the champion's, the challenger's, the candidate the
    gate evaluates and the lineage's characters-saved holder (so at least 3)."""
    vllm_max_lora_rank: Literal[1, 8, 16, 32, 64, 128, 256, 320, 512] = 16
    """Largest adapter rank a vLLM server accepts (its --max-lora-rank; buffers are preallocated for
    max_loras x this rank). train.lora_rank must not exceed it."""
    vllm_url: str | None = None
    """The base's vLLM server when someone else runs it (on a GPU host, started with --enable-lora and
    VLLM_ALLOW_RUNTIME_LORA_UPDATING=True, reachable from here); null: tabrl starts one per base on this host."""
    window_chars: int = Field(2000, ge=64)
    """Longest prefix a prompt keeps before the cursor (characters). A longer one is cut at an anchor line
    (`tasks.core.generate.window_prefix`) so successive requests of a typing session share the prompt's start and
    vLLM reuses its KV cache; the gateway, the evaluation and training cut the same way."""
    window_step_chars: int = Field(1000, ge=0)
    """The stretch of a full window in which its cut is anchored (characters): the cut moves on about every half
    of this much typing. Half of window_chars or less. 0: no anchor, the last window_chars characters (the cut
    slides with every character typed; only to measure what anchoring buys: bench/inference.py)."""
    adapter_serving: Literal["lora", "merged"] = "lora"
    """How a vLLM arm serves an adapter version: `lora`, loaded at runtime into its base's one server (no new
    process; the default); `merged`, merged into a full checkpoint and served by a server of its own
    (blue/green), for hardware where LoRA kernels are slow (vLLM's CPU build)."""
    rate_limit_per_key_per_minute: int = Field(600, ge=1)
    """Requests per API key per minute before 429 (besides the per-user limit; a user may hold several keys)."""
    max_body_bytes: int = Field(1_048_576, ge=1024)
    """Largest request body in bytes (413 beyond), checked before the body is parsed."""
    db_timeout_s: float = Field(5.0, gt=0)
    """How long a request waits for a busy or unreachable log store (SQLite lock, PostgreSQL connection) or
    Redis before the gateway answers 503 with Retry-After instead of hanging the editor."""
    redis_url: str | None = None
    """Redis holding the rate-limit windows that gateway replicas share (e.g. `redis://127.0.0.1:6379/0`), so
    the per-user and per-key limits hold in total across replicas; None keeps them in the process (one
    gateway). `tabrl serve --workers N` with N > 1 needs it."""

    @model_validator(mode="after")
    def _window(self) -> ServingParams:
        if 2 * self.window_step_chars > self.window_chars:
            raise ValueError(
                f"window_step_chars ({self.window_step_chars}) must be at most half of window_chars "
                f"({self.window_chars}): the part of the window before its next anchor must be typed already"
            )
        return self

    @model_validator(mode="after")
    def _explore(self) -> ServingParams:
        if self.explore_fraction > 0:
            if self.min_logprob is None:
                raise ValueError("explore_fraction needs serving.min_logprob: suggestions are already shown whole")
            if self.explore_min_logprob is not None and self.explore_min_logprob >= self.min_logprob:
                raise ValueError(
                    f"explore_min_logprob ({self.explore_min_logprob}) must be below min_logprob "
                    f"({self.min_logprob}): exploring shows what the strict cut hides"
                )
        return self


class IngestParams(Section):
    feedback_timeout_s: float = Field(10.0, gt=0)
    """A shown suggestion with no feedback after this many seconds is rejected."""
    per_user_cap: int = Field(200, ge=1)
    """Most rows one user contributes to a cycle."""
    max_prompt_chars: int = Field(8000, ge=1)
    """Rows with longer prompts are dropped."""
    max_completion_chars: int = Field(1000, ge=1)
    """Rows with longer completions are dropped."""
    min_rows: int = Field(1, ge=1)
    """A snapshot is written only with at least this many clean rows."""
    commit_grace_s: float = Field(60.0, ge=0)
    """A gap in completion sequence numbers followed by a row younger than this may be an insert still
    committing (PostgreSQL hands out numbers before commit); the cycle stops before such a gap."""
    chunk_rows: int = Field(10_000, ge=1)
    """Rows read from the log store and written per Parquet row group at a time (bounds memory)."""
    secret_detectors: tuple[str, ...] = (
        "AWSKeyDetector",
        "AzureStorageKeyDetector",
        "BasicAuthDetector",
        "DiscordBotTokenDetector",
        "GitHubTokenDetector",
        "GitLabTokenDetector",
        "JwtTokenDetector",
        "NpmDetector",
        "OpenAIDetector",
        "PrivateKeyDetector",
        "PypiTokenDetector",
        "SendGridDetector",
        "SlackDetector",
        "SquareOAuthDetector",
        "StripeDetector",
        "TwilioKeyDetector",
    )
    """detect-secrets plugin classes run on every line of prompt and completion. The default is its
    specific, high-precision detectors; the entropy and keyword ones flag ordinary code and are slow."""
    secret_cache_lines: int = Field(500_000, ge=0)
    """Lines already scanned clean are remembered (up to this many) so the editor context repeated
    across requests is scanned once."""


class ClusterParams(Section):
    """Across machines (`tabrl deploy`): Prefect work pools, the training deployment, the shared stores."""

    cpu_pool: str = "cpu"
    """Prefect work pool of the cycle and the A/B decision flows (ingest, reward, evaluate, register, decide)."""
    gpu_pool: str = "gpu"
    """Prefect work pool of the training flow (GPU hosts run `prefect worker start --pool gpu`)."""
    train_on: Literal["process", "pool"] = "process"
    """`process`: the cycle trains in its own process (`tabrl cycle`, `tabrl schedule`); `pool`: it starts the
    training deployment on the gpu pool with run_deployment and waits for it (`tabrl deploy` sets this)."""
    train_deployment: str = "train-candidate"
    """Name of the training deployment (of the flow `train-candidate`) that `tabrl deploy` registers."""
    train_timeout_s: float = Field(6 * 3600.0, gt=0)
    """How long the cycle waits for its training run (queued and running) before it cancels the run and ends
    with status `train_failed`; a GPU worker that died leaves its run Running, and this is what ends it."""
    train_poll_s: float = Field(5.0, gt=0)
    """Seconds between the cycle's looks at the training run's state."""
    dvc_remote: str | None = None
    """DVC remote (a name from `dvc remote add` in the project repo) every snapshot is pushed to after
    `dvc add`; null: snapshots stay in the local DVC cache (one machine)."""


class PathsParams(Section):
    data_dir: str = "data"
    """Corpus, FIM samples and interaction snapshots."""
    models_dir: str = "models"
    """Checkpoints (base and trained)."""
    state_dir: str = "state"
    """Databases and caches of a local run."""
    database_url: str = "sqlite:///state/tabrl.db"
    """SQLAlchemy URL of the log store (PostgreSQL at scale)."""
    mlflow_tracking_uri: str = "sqlite:///state/mlflow.db"
    """MLflow tracking store."""


class Params(Section):
    data: DataParams = DataParams()
    """Where the code comes from and how its files are split into train and test (`tabrl corpus`)."""
    fim: FimParams = FimParams()
    """The span FIM samples drawn from the corpus for the judge and the RLinf comparison (`tabrl data`)."""
    model: ModelParams = ModelParams()
    """The base model: where it lives, and the shape and pre-training of tabrl-tiny (`tabrl build-base`)."""
    simulator: SimulatorParams = SimulatorParams()
    """The simulated users: their accept rule, personas and typing (`tabrl simulate`, the demo, evaluation)."""
    traffic: TrafficParams = TrafficParams()
    """The editor-like typing sessions simulated users type (regions of real files, pauses, requests)."""
    reward: RewardParams = RewardParams()
    """What an outcome earns (accepted, rejected, no suggestion), advantages and the typed lines."""
    train: TrainParams = TrainParams()
    """The critic-free PPO update of one cycle: optimiser, clipping, guards, launcher and adapters."""
    evaluate: EvaluateParams = EvaluateParams()
    """The held-out evaluation of a candidate against the champion, the judge and the gate."""
    deploy: DeployParams = DeployParams()
    """The registry, the A/B rollout and decision, and the cycle and decision schedules."""
    serving: ServingParams = ServingParams()
    """The gateway: arms, the show rule, sampling, auth, limits, backends and vLLM servers."""
    ingest: IngestParams = IngestParams()
    """Pulling logged completions since the watermark and cleaning them into a snapshot."""
    cluster: ClusterParams = ClusterParams()
    """Running the flows across machines: Prefect work pools, the training deployment, the DVC remote."""
    paths: PathsParams = PathsParams()
    """Where data, models, local state, the log store and the MLflow tracking store live."""

    @model_validator(mode="after")
    def _adapter_rank(self) -> Params:
        if self.train.adapter == "lora" and self.train.lora_rank > self.serving.vllm_max_lora_rank:
            raise ValueError(
                f"train.lora_rank ({self.train.lora_rank}) exceeds serving.vllm_max_lora_rank "
                f"({self.serving.vllm_max_lora_rank}): vLLM would refuse every adapter; raise the server's limit "
                "or lower the rank"
            )
        return self

    @model_validator(mode="after")
    def _shared_tracking_store(self) -> Params:
        uri = self.paths.mlflow_tracking_uri
        if self.cluster.train_on == "pool" and not uri.startswith(("http://", "https://")):
            raise ValueError(
                f"cluster.train_on = 'pool' needs an MLflow tracking server every host reaches "
                f"(paths.mlflow_tracking_uri = http://HOST:PORT), got paths.mlflow_tracking_uri = {uri!r}"
            )
        return self

    def flat(self) -> dict[str, Any]:
        """Dotted key -> value, for logging the resolved config (MLflow params)."""
        return dict(_flatten(self.model_dump(mode="json")))


def _flatten(tree: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, Mapping):
            yield from _flatten(value, dotted + ".")
        else:
            yield dotted, value


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ParamsError(f"override {dotted!r}: {part!r} is a value, not a section")
        node = child
    node[parts[-1]] = value


def parse_override(text: str) -> tuple[str, Any]:
    """`train.lr=1e-5` -> ("train.lr", 1e-05); the value is read as YAML."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ParamsError(f"override {text!r} must look like section.key=value, e.g. train.lr=1e-5")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as err:
        raise ParamsError(f"override {text!r}: the value is not valid YAML ({err})") from err
    return key.strip(), value


def overlay_overrides(path: str | os.PathLike[str]) -> list[tuple[str, Any]]:
    """The keys of an overlay file (sections of params.yaml's shape, e.g. params.real-model.yaml) as overrides:
    `--set @params.real-model.yaml` applies all of them where it stands among the other `--set`s."""
    file = Path(path)
    if not file.is_file():
        raise ParamsError(f"overlay {file} not found (`--set @FILE` names a YAML file of params sections)")
    try:
        loaded = yaml.safe_load(file.read_text()) or {}
    except yaml.YAMLError as err:
        raise ParamsError(f"overlay {file} is not valid YAML: {err}") from err
    if not isinstance(loaded, dict):
        raise ParamsError(f"overlay {file} must hold a mapping of sections, got {type(loaded).__name__}")
    return list(_flatten_sections(loaded))


def _flatten_sections(tree: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """Dotted keys down to the fields of sections (sections nest: evaluate.judge); a field whose value is a
    mapping (fim.span_weights) stays whole, as a `--set` of that key would give it."""
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, Mapping) and _is_section(dotted):
            yield from _flatten_sections(value, dotted + ".")
        else:
            yield dotted, value


def _is_section(dotted: str) -> bool:
    model: Any = Params
    for part in dotted.split("."):
        field = getattr(model, "model_fields", {}).get(part)
        if field is None:
            return False
        model = field.annotation
    return isinstance(model, type) and issubclass(model, Section)


def env_overrides(environ: Mapping[str, str]) -> list[tuple[str, Any]]:
    """`TABRL_TRAIN__LR=1e-5` -> ("train.lr", 1e-05); aliases such as TABRL_DATABASE_URL too."""
    found = []
    for name, raw in sorted(environ.items()):
        if name in ENV_ALIASES:
            found.append((ENV_ALIASES[name], raw))
        elif name.startswith(ENV_PREFIX) and "__" in name:
            dotted = name[len(ENV_PREFIX) :].lower().replace("__", ".")
            found.append(parse_override(f"{dotted}={raw}"))
    return found


def _describe(err: ErrorDetails, tree: Mapping[str, Any]) -> str:
    loc = ".".join(str(part) for part in err["loc"])
    if err["type"] == "extra_forbidden":
        return f"{loc}: unknown key (check the spelling; known keys are listed in tasks/core/config.py)"
    value = err.get("input")
    return f"{loc} = {value!r}: {err['msg']}"


def load_params(
    path: str | os.PathLike[str] | None = DEFAULT_PARAMS_FILE,
    overrides: Sequence[str] = (),
    environ: Mapping[str, str] | None = None,
) -> Params:
    """Read params.yaml (or only defaults when path is None), apply env then CLI overrides, validate."""
    tree: dict[str, Any] = {}
    if path is not None:
        file = Path(path)
        if not file.is_file():
            raise ParamsError(f"params file {file} not found (run from the repo root or pass --params PATH)")
        try:
            loaded = yaml.safe_load(file.read_text()) or {}
        except yaml.YAMLError as err:
            raise ParamsError(f"{file} is not valid YAML: {err}") from err
        if not isinstance(loaded, dict):
            raise ParamsError(f"{file} must hold a mapping of sections, got {type(loaded).__name__}")
        tree = loaded
    pairs = env_overrides(os.environ if environ is None else environ)
    for text in overrides:
        pairs += overlay_overrides(text[1:]) if text.startswith("@") else [parse_override(text)]
    for dotted, value in pairs:
        _set_dotted(tree, dotted, value)
    try:
        return Params.model_validate(tree)
    except ValidationError as err:
        lines = [_describe(e, tree) for e in err.errors()]
        where = f"{path}" if path is not None else "params"
        raise ParamsError(f"invalid {where}:\n  " + "\n  ".join(lines)) from None
