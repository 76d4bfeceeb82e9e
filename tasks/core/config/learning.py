"""Params sections of learning and judging: reward, train, the judge and evaluation."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from tasks.core.config.base import Section


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
    users feel). Reported rewards per request stay the per-outcome ones above. 0: none (why:
    docs/decisions/left-off.md)."""
    typed_demo: float | None = 0.75
    """Training only: every rejected or abstained request whose continuation is known also trains on the rest
    of the line the user typed there (then the end token), as a suggestion that earned this reward: what a right
    suggestion would have been, on every request instead of the few accepted ones. Its tokens were not sampled
    (importance weight 1, as rows logged without log-probs); the ratio clip bounds each update. None: off. The
    default is the accepted reward (docs/decisions/typed-lines.md)."""
    continuation_chars: int = Field(200, ge=1)
    """Characters of what a user typed after a request kept in the rewarded snapshot (``continuation``)."""
    advantage: Literal["raw", "batch_mean", "batch_norm", "shown_mean"] = "raw"
    """`raw`: the reward (one-step Monte-Carlo return); `batch_mean`: minus the batch mean;
    `batch_norm`: whitened over the batch (REINFORCE++ style); `shown_mean`: minus the mean over the
    shown suggestions (accepted and rejected pull equally; nothing-shown rows 0; tasks/reward/reward.py). Why `raw`:
    docs/decisions/left-off.md."""


class TrainParams(Section):
    algorithm: Literal["ppo", "grpo"] = "ppo"
    """`ppo`: critic-free PPO on logged interactions; `grpo`: offline, G samples per FIM train prompt."""
    lr: float = Field(5e-5, gt=0)
    """Peak learning rate (AdamW; docs/decisions/lr.md)."""
    lr_schedule: Literal["constant", "cosine", "linear"] = "constant"
    """Learning-rate schedule after warm-up."""
    warmup_steps: int = Field(0, ge=0)
    """Optimiser steps of linear warm-up."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""
    train_embeddings: bool = False
    """Update the token embeddings (and a head tied to them). Adam gives a row's tiny but steady gradient
    a full lr-sized step, so rows of tokens sampled once and rejected can drop by many nats in one update
    (bench/kl_probe.py measures it; why off: docs/decisions/stable-updates.md)."""
    epochs: int = Field(1, ge=1)
    """Passes over the snapshot (why one: docs/decisions/stable-updates.md)."""
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
    the guards while the distribution moved little (docs/decisions/kl-guard.md)."""
    max_approx_kl: float = Field(1.0, gt=0)
    """Divergence guard: the job fails (no checkpoint) when approx-KL of a step exceeds this."""
    abstain_weight: float = Field(1.0, ge=0)
    """Weight of the known-reward abstain term: showing nothing earns reward.abstained whatever the user
    would have done, so every logged row also says whether abstaining there would have been better
    (advantage reward.abstained - the row's reward) without the empty suggestion having been sampled. The
    term is -weight x that advantage x log pi(stop as the first token), one per row, counted like a
    completion token in the token mean (tasks/train/loss.py, abstain_loss). 0 disables it
    (docs/decisions/abstain-term.md)."""
    abstain_where_typed: bool = False
    """With abstain_weight > 0 and reward.typed_demo: also push towards abstaining on the rows whose typed line
    trains as a suggestion. False: where the line the user typed is known the loop teaches that line only (the
    better action), and the abstain term acts where no line is known (docs/decisions/abstain-term.md)."""
    target_kl: float = Field(0.5, gt=0)
    """PPO's early stop: when approx-KL of a step (to the starting weights) exceeds this, the update ends
    before that step and the checkpoint so far is kept. Set it above max_approx_kl to turn it off."""
    zero_stage: Literal[0, 1, 2, 3] = 2
    """DeepSpeed ZeRO stage on GPUs."""
    compute_dtype: Literal["float32", "bfloat16", "host"] = "float32"
    """What the plain torch engine computes in: the weights, gradients and Adam stay float32, and with `bfloat16`
    the forward runs under bf16 autocast, pi_prox's pass and the update's alike (so their ratio starts at 1).
    `host`: bfloat16 where the device multiplies bf16 in hardware (a CPU with AMX or AVX512-BF16, a CUDA GPU),
    else float32; a CPU with neither runs bf16 many times slower (`tasks/core/dtypes.py`; what it buys:
    docs/decisions/cpu-dtypes.md). DeepSpeed on GPUs computes in bf16 whatever this says."""
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
    chars_saved_tolerance: float = Field(0.05, ge=0)
    """The gate refuses a candidate whose characters saved (per typed character, editor traffic) fall more
    than this fraction below the champion's (and its lineage's best), however its accept rate or reward
    moved (no reward hacking by showing less). Relative, since the level depends on the code; 1 or more: never
    refuses on it. The same fraction as the A/B decision's deploy.chars_tolerance (docs/decisions/gate-5-percent.md)."""
    gate_windows: int = Field(3, ge=1)
    """Windows the gate's half of the held-out regions is cut into (`tasks.sim.acceptance.gate_regions`): each gate
    types the window after the last gate's, so candidate and champion are compared on requests the champion
    was not chosen on. 1: every gate types the same requests, where a champion's lucky score there is the
    bar every later candidate must clear (the winner's curse; docs/decisions/gate-windows.md)."""
    n_samples: int = Field(200, ge=1)
    """Held-out FIM test samples scored per evaluation."""
    max_new_tokens: int = Field(48, ge=1)
    """Completion length limit."""
    batch_size: int = Field(16, ge=1)
    """Prompts generated together."""
    completion_cache: bool = True
    """Remember each model's greedy completions of the FIM samples (a diskcache under paths.state_dir,
    `tasks.evaluate.completions`): a gate's champion was the last gate's candidate, whose completions that gate
    made. False: every evaluation completes every sample."""
    adapter_engine: Literal["lora", "merged"] = "lora"
    """How an evaluation on vLLM (serving.backend: vllm) types an adapter version: `lora`, loaded at runtime into
    its base's one server beside the arms (no new process; the default); `merged`, merged into a full checkpoint
    typed by a server started for the evaluation and stopped after it, faster on vLLM's CPU build, whose LoRA
    kernels are slow fallbacks, once an evaluation outlasts a server start (docs/decisions/cpu-dtypes.md).
    serving.adapter_serving: merged types merged either way."""
    sim_users: int = Field(16, ge=1)
    """Simulated users replaying the samples round-robin (the same users for candidate and champion)."""
    judge: JudgeParams = JudgeParams()
    """The judge scoring each completion 0-10."""
    gate_tolerance: float = Field(0.02, ge=0)
    """Largest allowed drop (absolute) in reward per request, and x10 in judge mean, for the candidate."""
    gate_margin: float = Field(0.005, ge=0)
    """Least improvement (absolute) in reward per request, or x10 in judge mean, needed to pass."""
