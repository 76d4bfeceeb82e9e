"""Params sections of running the system: deploy, serving, ingest, cluster and paths."""

from __future__ import annotations

from typing import Literal, cast, get_args

from pydantic import Field, model_validator

from tasks.core.config.base import Section

BackendName = Literal["embedded", "vllm"]
"""The serving engines, one module each under tasks/core/engines/ (`ENGINES` there): what serving.backend and a
live arm's backend may be."""
BACKENDS: tuple[str, ...] = get_args(BackendName)


def check_backend(name: str) -> BackendName:
    """The one check of a backend's name (serving.backend and every arm written to or read from the store)."""
    if name not in BACKENDS:
        raise ValueError(f"backend {name!r} is not a serving engine: one of {', '.join(BACKENDS)}")
    return cast(BackendName, name)


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
    """A challenger is never promoted when its accepted characters per request fall significantly (one-sided
    Welch t-test at deploy.alpha) more than this fraction below the champion's, whatever its reward or accept
    rate: showing less to be accepted more while users type more themselves is reward hacking; such a challenger
    is rolled back."""
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
    backend: BackendName = "embedded"
    """How arms generate: transformers in the gateway process, or a vLLM server over HTTP."""
    temperature: float = Field(0.3, ge=0)
    """Sampling temperature of the arms (training scores log-probs at the same temperature;
    docs/decisions/temperature.md)."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Default nucleus sampling cut."""
    min_logprob: float | None = Field(-0.25, le=0)
    """Show a suggestion only up to the model's first unsure token: cut before the first token whose log-prob
    under logits / temperature is below this (nothing left: no suggestion). None shows every suggestion whole.
    The gateway's arms (embedded and vLLM) and the held-out evaluation apply the same rule (tasks/core/generate.py;
    the threshold: docs/decisions/show-rule.md)."""
    explore_fraction: float = Field(0.0, ge=0, le=1)
    """Fraction of served requests (drawn per request) cut at explore_min_logprob instead of min_logprob, so
    the logs hold users' verdicts on text the strict rule hides: an accepted one raises those tokens'
    log-probs, and the next model shows them under min_logprob. Evaluations never explore. 0: never
    (docs/decisions/left-off.md)."""
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
    vllm_request_timeout_s: float = Field(120.0, gt=0)
    """How long the requests an evaluation sends a vLLM server (`tasks/core/inference.py`: the gate, `tabrl
    acceptance`, the benches) may go without a token streamed back to any of them before it fails. A request's
    clock starts when the server starts it (its first token), not when it is sent: a slow server is waited for,
    however slow; only a stalled one fails."""
    vllm_python: str = "python"
    """Interpreter of the environment vLLM is installed in (its own venv: its pins conflict with prefect's);
    the rollout starts `{vllm_python} -m vllm.entrypoints.openai.api_server` for each new version."""
    vllm_args: tuple[str, ...] = ("--logprobs-mode", "processed_logprobs")
    """Extra vLLM server flags. processed_logprobs: logged behaviour log-probs are under the temperature-scaled
    distribution training uses. On CPU add --enforce-eager (and set serving.vllm_dtype)."""
    vllm_dtype: Literal["float32", "bfloat16", "float16", "host"] | None = None
    """The --dtype of the vLLM servers tabrl starts; None: vLLM's own choice (the checkpoint's), or a --dtype in
    vllm_args. `host`, for vLLM's CPU build: bfloat16 on a CPU that multiplies bf16 in hardware (AMX or AVX512-BF16),
    else float32 (`tasks/core/dtypes.py`; what it buys: docs/decisions/cpu-dtypes.md)."""
    vllm_env: dict[str, str] = Field(default_factory=dict)
    """Environment variables for the vLLM servers tabrl starts (one the environment already sets wins), e.g. the
    CPU build's VLLM_CPU_NUM_OF_RESERVED_CPU and VLLM_CPU_KVCACHE_SPACE (params.vllm-cpu.yaml)."""
    vllm_start_timeout_s: float = Field(420.0, gt=0)
    """A new vLLM server must answer /health within this many seconds, else the rollout is undone."""
    vllm_max_loras: int = Field(4, ge=3)
    """Adapters one vLLM server runs in one batch (its --max-loras): the champion's, the challenger's, the candidate
    the gate evaluates and the lineage's characters-saved holder (so at least 3). Every team's adapters are loaded on
    the same server and kept in its CPU cache (--max-cpu-loras: 2 per team and 2 for the organisation's model,
    from teams.sources, and at least this); a batch that asks for more adapters than this runs them in turns
    (docs/how-to/teams.md says what it costs)."""
    vllm_max_lora_rank: Literal[1, 8, 16, 32, 64, 128, 256, 320, 512] = 16
    """Largest adapter rank a vLLM server accepts (its --max-lora-rank; buffers are preallocated for
    max_loras x this rank). train.lora_rank must not exceed it."""
    vllm_url: str | None = None
    """The base's vLLM server when someone else runs it (on a GPU host, started with --enable-lora and
    VLLM_ALLOW_RUNTIME_LORA_UPDATING=True, reachable from here); null: tabrl starts one per base on this host."""
    window_chars: int = Field(2000, ge=64)
    """Longest prefix a prompt keeps before the cursor (characters). A longer one is cut at an anchor line
    (`tasks.core.window.window_prefix`) so successive requests of a typing session share the prompt's start and
    vLLM reuses its KV cache; the gateway, the evaluation and training cut the same way."""
    window_step_chars: int = Field(1000, ge=0)
    """The stretch of a full window in which its cut is anchored (characters): the cut moves on about every half
    of this much typing. Half of window_chars or less. 0: no anchor, the last window_chars characters (the cut
    slides with every character typed; only to measure what anchoring buys: bench/inference.py)."""
    adapter_serving: Literal["lora", "merged"] = "lora"
    """How a vLLM arm serves an adapter version: `lora`, loaded at runtime into its base's one server (no new
    process; the default); `merged`, merged into a full checkpoint and served by a server of its own
    (blue/green), for hardware where LoRA kernels are slow (vLLM's CPU build)."""
    log_format: Literal["json", "text"] = "json"
    """The gateway's log lines (serving/logs.py): one JSON object per line, a request log among them (`json`, for log
    shippers and `jq`), or plain text."""
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
    def _one_dtype(self) -> ServingParams:
        if self.vllm_dtype is not None and any(a == "--dtype" or a.startswith("--dtype=") for a in self.vllm_args):
            raise ValueError(
                f"vllm_dtype ({self.vllm_dtype}) and a --dtype in vllm_args both set the servers' dtype: keep one"
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
    """A shown suggestion with no feedback after this many seconds is rejected (the timeout rule,
    tasks/core/outcomes.py): the client's silence is its answer."""
    reported_timeout_s: float = Field(60.0, gt=0)
    """How long a completion served to a client that reports its own outcomes (a key with `reports_outcomes`,
    like Continue's data destination) waits for its report; with none by then it was not shown, never
    rejected. Longer than Continue's 10 s from display (COUNT_COMPLETION_REJECTED_AFTER) plus the latency."""
    per_user_cap: int = Field(200, ge=1)
    """Most rows one user contributes to a cycle."""
    max_prompt_chars: int = Field(8000, ge=1)
    """Rows with longer prompts are dropped."""
    max_completion_chars: int = Field(1000, ge=1)
    """Rows with longer completions are dropped."""
    min_rows: int = Field(1, ge=1)
    """A snapshot is written only with at least this many clean rows."""
    max_rows: int | None = Field(20_000, ge=1)
    """Most decided rows one cycle's snapshot takes, the oldest first; the rest wait for the next cycles. A backlog
    (a paused schedule, a challenger under test for hours, trainings lost) then drains one bounded snapshot per
    cycle, instead of making each cycle's training longer than the last until it outlasts cluster.train_timeout_s
    and none finishes (the soak of 2026-12-06 saw that spiral: docs/results.md). null: every decided row."""
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

    @model_validator(mode="after")
    def _reported_wait(self) -> IngestParams:
        if self.reported_timeout_s < self.feedback_timeout_s:
            raise ValueError(
                f"reported_timeout_s ({self.reported_timeout_s}) must be at least feedback_timeout_s "
                f"({self.feedback_timeout_s}): a reporting client's rejection comes after the silent rule's deadline"
            )
        return self


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
    """DVC remote (a name from `dvc remote add` in the snapshots repo, paths.snapshots_repo) every snapshot is pushed
    to after `dvc add`; null: snapshots stay in the local DVC cache (one machine)."""


class PathsParams(Section):
    data_dir: str = "data"
    """Corpus and FIM samples (the held-out files the gates read); interaction snapshots go under it in the snapshots
    repo."""
    snapshots_repo: str = "state/snapshots"
    """The git + DVC repository the cycles' interaction snapshots are versioned in (`dvc add`, a commit of the
    `.dvc` file), made on first use: a data repository of its own, so the project's working branch gets no commit per
    cycle. Snapshots land in its `<data_dir>/interactions` (a team's in `<data_dir>/teams/TEAM/interactions`)."""
    models_dir: str = "models"
    """Checkpoints (base and trained)."""
    state_dir: str = "state"
    """Databases and caches of a local run."""
    database_url: str = "sqlite:///state/tabrl.db"
    """SQLAlchemy URL of the log store (PostgreSQL at scale)."""
    mlflow_tracking_uri: str = "sqlite:///state/mlflow.db"
    """MLflow tracking store."""
