"""tabrl-tiny: a byte-level BPE tokenizer and a small Qwen2 model pre-trained on FIM from real code.

    tabrl build-base --corpus data/corpus/files.parquet --out models/tabrl-tiny   # `dvc repro base`

The result is an ordinary Hugging Face checkpoint directory (config.json, model.safetensors,
tokenizer.json) with Qwen2.5-Coder's special tokens, so the rest of tabrl cannot tell it from
Qwen2.5-Coder. Pre-training is PSM fill-in-the-middle with the loss on every token (the tiny model
has to learn the language and the format at once), on samples from the train files only: most cut
where an editor asks (typing-session pauses, mid-identifier too; ``tasks/sim/editor.py``), the rest
classic line spans.

Resumable: every ``model.checkpoint_every`` steps the model, optimiser, scheduler and step go to
``OUT.partial/`` (beside the output); a killed build started again with the same params resumes
there. With ``snapshots=True`` each checkpoint is also kept as a loadable model
(``OUT.partial/step-N``) for the right-rate-vs-steps curve (``bench/headroom.py``).
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import shutil
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from tqdm import tqdm
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from tasks.core.config import FimParams, ModelParams, TrafficParams
from tasks.core.fim import QWEN, SPECIAL_TOKENS, save_template
from tasks.sim.corpus import SourceFile, sample_spans
from tasks.sim.editor import pick_regions, training_samples

# The tiny base speaks Qwen2.5-Coder's FIM format: its tokenizer is trained with those special tokens,
# and the template is recorded with the checkpoint like any imported model's.
TEMPLATE = QWEN
PAD = "<|fim_pad|>"


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE (as Qwen2's) with the FIM special tokens as single ids."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=TEMPLATE.end,
        pad_token=PAD,
        additional_special_tokens=[t for t in SPECIAL_TOKENS if t not in (TEMPLATE.end, PAD)],
        clean_up_tokenization_spaces=False,
        model_max_length=1 << 20,
    )


def build_model(params: ModelParams, tokenizer: PreTrainedTokenizerFast) -> Qwen2ForCausalLM:
    """A randomly initialised Qwen2 causal LM sized by params."""
    torch.manual_seed(params.seed)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=params.hidden_size,
        intermediate_size=params.intermediate_size,
        num_hidden_layers=params.num_layers,
        num_attention_heads=params.num_heads,
        num_key_value_heads=params.num_kv_heads,
        max_position_embeddings=params.max_position,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    return Qwen2ForCausalLM(config)


def encode_fim(tokenizer: PreTrainedTokenizerFast, sample: dict, seq_len: int) -> list[int]:
    """PSM ids prefix-truncated from the left and suffix from the right to fit seq_len."""
    special = tokenizer.convert_tokens_to_ids
    pre = tokenizer(sample["prefix"], add_special_tokens=False)["input_ids"]
    suf = tokenizer(sample["suffix"], add_special_tokens=False)["input_ids"]
    mid = tokenizer(sample["middle"], add_special_tokens=False)["input_ids"]
    room = seq_len - len(mid) - 4
    if room <= 0:
        mid, room = mid[: seq_len // 2], seq_len - seq_len // 2 - 4
    suf = suf[: room // 4]
    pre = pre[max(0, len(pre) - (room - len(suf))) :]
    t = TEMPLATE
    return [special(t.prefix), *pre, special(t.suffix), *suf, special(t.middle), *mid, special(t.end)]


def _batches(seqs: Sequence[list[int]], batch: int, pad_id: int, middle_id: int, rng: random.Random):
    """(ids, attention mask, labels, middle mask): the middle mask marks tokens after <|fim_middle|>."""
    order = list(range(len(seqs)))
    while True:
        rng.shuffle(order)
        for i in range(0, len(order) - batch + 1, batch):
            rows = [seqs[j] for j in order[i : i + batch]]
            width = max(len(r) for r in rows)
            ids = torch.full((batch, width), pad_id, dtype=torch.long)
            labels = torch.full((batch, width), -100, dtype=torch.long)
            mask = torch.zeros((batch, width), dtype=torch.long)
            middle = torch.zeros((batch, width), dtype=torch.bool)
            for k, r in enumerate(rows):
                ids[k, : len(r)] = torch.tensor(r)
                labels[k, : len(r)] = torch.tensor(r)
                mask[k, : len(r)] = 1
                middle[k, r.index(middle_id) + 1 : len(r)] = True
            yield ids, mask, labels, middle


def _lr_lambda(params: ModelParams):
    warmup = max(1, params.pretrain_steps // 20)

    def lr_at(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, params.pretrain_steps - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    return lr_at


def _fingerprint(params: ModelParams, seqs: Sequence[list[int]]) -> str:
    """What a checkpoint must match to be resumed: the params and the exact training sequences."""
    digest = hashlib.sha256(params.model_dump_json().encode())
    for seq in seqs:
        digest.update(b"%d," % len(seq) + bytes(str(seq[:8]), "ascii"))
    return digest.hexdigest()[:16]


def pretrain(
    model: Qwen2ForCausalLM,
    seqs: Sequence[list[int]],
    params: ModelParams,
    pad_id: int,
    middle_id: int,
    checkpoint_dir: Path | None = None,
    snapshot: Callable[[int], None] | None = None,
) -> list[float]:
    """FIM pre-training with AdamW, linear warm-up and cosine decay; returns the loss curve.

    The loss is the token mean over the whole sequence plus the token mean over the middle and its
    <|endoftext|>: the language is learnt everywhere, and the completion task (including when to
    stop) gets the extra weight a model this small needs to learn it in a few hundred steps.
    With checkpoint_dir, resumes from its trainer state when the fingerprint matches and saves it
    every params.checkpoint_every steps (then calls snapshot(step), if given)."""
    torch.manual_seed(params.seed)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=params.pretrain_lr, betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr_lambda(params))
    batches = _batches(seqs, params.pretrain_batch, pad_id, middle_id, random.Random(params.seed))
    trainer = _Trainer(model, opt, sched, _fingerprint(params, seqs), checkpoint_dir)
    start, losses = trainer.resume(batches)
    bar = tqdm(
        range(start, params.pretrain_steps),
        desc="pre-train tabrl-tiny",
        unit="step",
        initial=start,
        total=params.pretrain_steps,
    )
    for step in bar:
        loss = _fim_loss(model, next(batches))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        recent = losses[-50:]
        bar.set_postfix(loss=f"{losses[-1]:.3f}", avg50=f"{sum(recent) / len(recent):.3f}")
        done = step + 1
        if trainer.state_file is not None and (done % params.checkpoint_every == 0 or done == params.pretrain_steps):
            trainer.save(done, losses)
            if snapshot is not None:
                model.eval()
                snapshot(done)
                model.train()
    model.eval()
    return losses


def _fim_loss(model: Qwen2ForCausalLM, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The pre-training loss of one batch: token mean over the sequence plus token mean over the middle."""
    ids, mask, labels, middle = batch
    # fp32 on purpose: bf16 autocast is ~20x slower on CPUs without bf16 units (measured here).
    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]  # (B, T-1, V)
    targets, on_middle = labels[:, 1:], middle[:, 1:]  # (B, T-1)
    token_loss = torch.nn.functional.cross_entropy(logits.transpose(1, 2), targets, reduction="none")  # (B, T-1)
    valid = targets != -100
    return token_loss[valid].mean() + token_loss[on_middle].mean()


class _Trainer:
    """The pre-training state in checkpoint_dir/trainer.pt (none without a checkpoint_dir): model, optimizer,
    scheduler, torch RNG, step and losses, under the params-and-data fingerprint that must match to resume."""

    def __init__(self, model, opt, sched, fingerprint: str, checkpoint_dir: Path | None):
        self.model, self.opt, self.sched, self.fingerprint = model, opt, sched, fingerprint
        self.state_file = checkpoint_dir / "trainer.pt" if checkpoint_dir is not None else None

    def resume(self, batches: Iterator) -> tuple[int, list[float]]:
        """(first step, losses so far): the saved ones when the fingerprint matches, with the batches advanced to
        the same data order as an uninterrupted run; else (0, [])."""
        if self.state_file is None or not self.state_file.is_file():
            return 0, []
        state = torch.load(self.state_file, weights_only=False)
        if state["fingerprint"] != self.fingerprint:
            tqdm.write(f"{self.state_file} is from other params or data: starting afresh")
            return 0, []
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["optimizer"])
        self.sched.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["torch_rng"])
        for _ in range(state["step"]):
            next(batches)
        tqdm.write(f"resuming pre-training at step {state['step']} from {self.state_file}")
        return state["step"], state["losses"]

    def save(self, step: int, losses: list[float]) -> None:
        assert self.state_file is not None
        self.state_file.parent.mkdir(parents=True, exist_ok=True)
        state = {
            "fingerprint": self.fingerprint,
            "step": step,
            "losses": losses,
            "model": self.model.state_dict(),
            "optimizer": self.opt.state_dict(),
            "scheduler": self.sched.state_dict(),
            "torch_rng": torch.get_rng_state(),
        }
        torch.save(state, self.state_file.with_suffix(".tmp"))
        self.state_file.with_suffix(".tmp").replace(self.state_file)  # a kill mid-write keeps the last good one


def pretrain_samples(
    train_files: Sequence[SourceFile], model_params: ModelParams, fim_params: FimParams, traffic: TrafficParams
) -> list[dict]:
    """Editor-like samples (typing-session pauses) and classic line spans, shuffled together."""
    n_samples = min(
        model_params.pretrain_steps * model_params.pretrain_batch,
        model_params.pretrain_samples_per_file * len(train_files),
    )
    n_editor = round(n_samples * model_params.pretrain_editor_share)
    samples = []
    if n_editor:
        # About four pauses used per region: many regions, so many files and contexts.
        regions = pick_regions(list(train_files), max(1, n_editor // 4), traffic, model_params.seed, "pretrain")
        samples += training_samples(regions, n_editor, traffic, traffic.stop_weights, model_params.seed)
    if n_samples - n_editor:
        samples += sample_spans(list(train_files), "pretrain", n_samples - n_editor, fim_params, model_params.seed)
    random.Random(model_params.seed).shuffle(samples)
    return samples


def _save(model: Qwen2ForCausalLM, tokenizer: PreTrainedTokenizerFast, out: Path) -> None:
    """A loadable checkpoint directory, written to a temp name and renamed (never half-written)."""
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    save_template(tmp, TEMPLATE)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


def build_base(
    train_files: Sequence[SourceFile],
    model_params: ModelParams,
    fim_params: FimParams,
    traffic: TrafficParams,
    out: Path,
    snapshots: bool = False,
) -> dict:
    """Tokenizer + model + FIM pre-training, written atomically to out; returns build stats.

    Resumes from ``out.partial/`` when a build with the same params was interrupted; removes it
    when done unless snapshots were asked for (then ``out.partial/step-N`` are kept)."""
    started = time.time()
    rng = random.Random(model_params.seed)
    tok_files = rng.sample(list(train_files), min(len(train_files), model_params.tokenizer_max_files))
    tokenizer = train_tokenizer((f.text for f in tok_files), model_params.vocab_size)
    model = build_model(model_params, tokenizer)
    samples = pretrain_samples(train_files, model_params, fim_params, traffic)
    seqs = [encode_fim(tokenizer, s, model_params.pretrain_seq_len) for s in samples]
    partial = out.with_name(out.name + ".partial")
    keep = (lambda step: _save(model, tokenizer, partial / f"step-{step}")) if snapshots else None
    losses = pretrain(
        model,
        seqs,
        model_params,
        tokenizer.pad_token_id,
        tokenizer.convert_tokens_to_ids(TEMPLATE.middle),
        checkpoint_dir=partial,
        snapshot=keep,
    )
    _save(model, tokenizer, out)
    stats = {
        "parameters": sum(p.numel() for p in model.parameters()),
        "vocab_size": len(tokenizer),
        "pretrain_sequences": len(seqs),
        "pretrain_editor_share": model_params.pretrain_editor_share,
        "pretrain_tokens_per_step_mean": sum(map(len, seqs)) / len(seqs) * model_params.pretrain_batch,
        "loss_first": losses[0],
        "loss_last10_mean": sum(losses[-10:]) / len(losses[-10:]),
        "seconds_this_run": round(time.time() - started, 1),
    }
    (out / "build_stats.json").write_text(json.dumps(stats, indent=2) + "\n")
    if not snapshots:
        shutil.rmtree(partial, ignore_errors=True)
    return stats
