"""Params sections of the data and the simulated users: corpus, FIM samples, the base model, simulator, traffic."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from tasks.core.config.base import Section

# The corpus committed to git: CPython 3.11.7's standard library as `tabrl corpus` read it, the base's training data.
SHIPPED_CORPUS = "data/corpus/files.parquet"


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


class TeamsParams(Section):
    sources: dict[str, str] = {}
    """Each team's code base, by team name (docs/how-to/teams.md): a directory, a corpus file or a FIM data set, as
    data.source takes. Split into train and test files as data.source is (data.test_fraction, data.split_salt);
    `tabrl teams data NAME` writes its held-out FIM samples and typing regions under
    paths.data_dir/teams/NAME/, where the team's gate reads them. A team without a source is gated on the
    organisation's held-out files."""

    @model_validator(mode="after")
    def _names(self) -> TeamsParams:
        from tasks.core.teams import ORG, check_team

        for name in self.sources:
            if name == ORG:
                raise ValueError(f"teams.sources: {ORG!r} is the organisation itself (its code is data.source)")
            check_team(name)
        return self


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
    max_prefix_chars: int = Field(600, ge=1)
    """Prefix text kept before the cursor (the nearest characters)."""
    max_suffix_chars: int = Field(200, ge=0)
    """Suffix text kept after the middle (the nearest characters)."""


class ModelParams(Section):
    base_dir: str = "models/tabrl-tiny"
    """Where the base model is built, or a local Hugging Face checkpoint directory (e.g. Qwen2.5-Coder)
    to use as the base instead; the rest of tabrl treats both the same."""
    vocab_size: int = Field(4096, ge=300)
    """Byte-level BPE vocabulary of the tiny model's tokenizer (special tokens included)."""
    hidden_size: int = Field(128, ge=32)
    """Width of the tiny model (the shipped shape and budget: docs/decisions/base-shape.md)."""
    num_layers: int = Field(4, ge=1)
    """Transformer blocks of the tiny model."""
    num_heads: int = Field(2, ge=1)
    """Attention heads; hidden_size / num_heads must be >= 32 (vLLM's CPU attention needs head dim >= 32)."""
    num_kv_heads: int = Field(1, ge=1)
    """Key/value heads (grouped-query attention, as in Qwen2.5)."""
    intermediate_size: int = Field(352, ge=32)
    """MLP width of the tiny model."""
    max_position: int = Field(1024, ge=128)
    """Longest sequence (prompt + completion) the tiny model supports."""
    pretrain_steps: int = Field(5000, ge=1)
    """Optimiser steps of FIM pre-training."""
    pretrain_batch: int = Field(16, ge=1)
    """Sequences per pre-training step."""
    pretrain_seq_len: int = Field(256, ge=32)
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
    pause_s: float = Field(1.0, gt=0)
    """Median length of the user's pause at a point where the editor asks (from the last keystroke to the next):
    log-normal around it (simulator.pause_sigma). The editor asks simulator.debounce_s into the pause; an answer
    that comes after the pause ends was typed past (docs/concepts/simulated-users.md, "Pace")."""


class SimulatorParams(Section):
    personas: tuple[Persona, ...] = (
        Persona(name="careful", weight=1.0, min_accept_chars=6, p_accept_wrong=0.0, p_ignore_right=0.05, pause_s=1.4),
        Persona(name="typical", weight=2.0, min_accept_chars=4, p_accept_wrong=0.02, p_ignore_right=0.1, pause_s=1.0),
        Persona(name="hasty", weight=1.0, min_accept_chars=3, p_accept_wrong=0.05, p_ignore_right=0.2, pause_s=0.6),
    )
    """Kinds of simulated users; each user gets one persona, drawn by weight from its seed."""
    seed: int = 0
    """Seed of persona assignment and noise."""
    client: Literal["continue", "waits"] = "continue"
    """How simulated editors (`tabrl simulate`, the demo, the benches) treat answers over HTTP. `continue`: as
    Continue does: the keystrokes are debounced, one request is in flight per user and is aborted (the client
    hangs up) when the user types on before it answers, an answer seen for less than simulator.min_display_s is
    discarded (`shown: false`), and outcomes are sent only for what was displayed. `waits`: every answer is
    waited for and shown, whatever it took (tabrl before 2026-12-02; reproduces older results)."""
    debounce_s: float = Field(0.35, ge=0)
    """How long after the last keystroke the editor asks (Continue's debounceDelay, 350 ms); a pause shorter than
    this asks nothing."""
    pause_sigma: float = Field(0.6, ge=0)
    """Spread of the pauses: the standard deviation of their logarithm (0: every pause is the persona's pause_s)."""
    min_display_s: float = Field(0.25, ge=0)
    """A suggestion on screen for less than this before the user types on was not seen (Continue counts no
    rejection before 250 ms: DO_NOT_COUNT_REJECTED_BEFORE)."""
    replay: bool = False
    """Traffic that replays: each user asks a fixed share of the requests (not a shared budget the quickest users
    spend most of) and sends each request a `seed` of its own, drawn from the run's seed, the user and the request's
    number, so no suggestion depends on which request reached the model first. Needs client=waits: a cancelling
    editor's outcomes follow the wall clock."""

    @model_validator(mode="after")
    def _unique(self) -> SimulatorParams:
        names = [p.name for p in self.personas]
        if not names or len(set(names)) != len(names):
            raise ValueError(f"personas need at least one entry and unique names, got {names}")
        if self.replay and self.client != "waits":
            raise ValueError(
                "simulator.replay needs simulator.client=waits: a cancelling editor's outcomes follow the wall clock"
            )
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
