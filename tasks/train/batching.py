"""Batching for the training job: snapshot rows -> examples -> packed micro-batches, planned per step.

Rows become examples (prompt ids exactly as served, completion ids as sampled); each optimiser step
takes ``micro_batch x grad_accum x world`` examples, balanced over ranks by tokens; a rank packs its
examples into micro-batches with no padding between sequences (``pack``). Used by ``tasks/train/ppo.py``.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from tasks.core.config import TrainParams
from tasks.core.fim import FimTemplate
from tasks.core.generate import encode_prompt

SNAPSHOT_COLUMNS = ("prompt", "token_ids", "logprobs", "temperature", "advantage")


class SnapshotError(ValueError):
    """A snapshot that cannot be trained on; the message names the column or row."""


@dataclass
class Example:
    input_ids: list[int]  # prompt ids + completion ids
    n_prompt: int
    advantage: float
    temperature: float  # the scale of the sampling distribution (1.0 for greedy)
    behaviour_logp: list[float] | None  # logged at serving, one per completion token
    abstain_advantage: float = 0.0  # reward of showing nothing minus the row's reward (0: no abstain term)

    @property
    def n_completion(self) -> int:
        return len(self.input_ids) - self.n_prompt


def read_snapshot(path: str | Path) -> list[dict]:
    """Rows of a reward-labelled snapshot (tasks/core/schema.py REWARDED_SCHEMA)."""
    import pyarrow.parquet as pq  # here, not at the top: pack() also runs on GPU images without pyarrow

    path = Path(path)
    if not path.is_file():
        raise SnapshotError(f"snapshot {path} not found")
    table = pq.read_table(path)
    missing = [c for c in SNAPSHOT_COLUMNS if c not in table.column_names]
    if missing:
        raise SnapshotError(f"snapshot {path} lacks column(s) {missing}; run the reward stage first")
    optional = [c for c in ("completion", "reward", "outcome", "continuation", "user_id") if c in table.column_names]
    return in_user_order(table.select([*SNAPSHOT_COLUMNS, *optional]).to_pylist())


def in_user_order(rows: list[dict]) -> list[dict]:
    """The rows taken round-robin over users (each user's first row, by user, then each one's second, ...), each
    user's in the order it asked: what training reads does not depend on how concurrent users' requests happened
    to interleave as they arrived, only on what each user asked."""
    asked: Counter[str] = Counter()
    keys = []
    for i, row in enumerate(rows):
        user = row.get("user_id") or ""
        keys.append((asked[user], user, i))
        asked[user] += 1
    return [rows[i] for _, _, i in sorted(keys)]


def sampled_by_another_model(row: dict, tokenizer) -> bool:
    """Rows an arm of another family served (two families A/B tested): ids outside this vocabulary, or ids
    that do not decode to the suggestion that was shown. Trained on, they would teach the wrong tokens."""
    ids, size = row["token_ids"] or [], len(tokenizer)
    if any(not 0 <= t < size for t in ids):
        return True
    shown = row.get("completion")
    # (leading blanks aside: a SentencePiece detokenizer may write the first one differently)
    return bool(shown) and not tokenizer.decode(ids, skip_special_tokens=False).lstrip().startswith(shown.lstrip())


def demo_text(continuation: str) -> str | None:
    """The rest of the line a user typed after a request (None when the continuation holds no whole line)."""
    from tasks.sim.editor import stop_of  # here, not at the top: tasks.sim.editor needs pyarrow, which pack() does not

    end = stop_of(continuation, "line", 1)
    return continuation[:end] if end < len(continuation) and continuation[:end].strip() else None


def _row_reward(row: dict, i: int, needs: str) -> float:
    if row.get("reward") is None or not math.isfinite(row["reward"]):
        raise SnapshotError(f"row {i}: reward is {row.get('reward')!r}; {needs} needs every row's reward")
    return float(row["reward"])


def build_examples(
    rows: Sequence[dict],
    tokenizer,
    template: FimTemplate,
    limit: int,
    max_len: int,
    abstain_reward: float | None = None,
    typed_demo: float | None = None,
    abstain_where_typed: bool = True,
) -> list[Example]:
    """Training sequences from snapshot rows; rows with no completion tokens carry no gradient and are left out,
    and so are rows another model's tokenizer sampled. With abstain_reward, each example also carries
    abstain_reward - its row's reward (the known-reward abstain term's advantage; rows need `reward`). With
    typed_demo, a rejected or abstained row whose continuation holds a whole line adds an example of that line
    and the end token, advantage the row's + typed_demo - its reward, no behaviour log-probs; with
    abstain_where_typed False, a row that adds such an example carries no abstain term (its advantage 0)."""
    examples = []
    for i, row in enumerate(rows):
        demo = _demo_ids(row, tokenizer) if typed_demo is not None else None
        completion = row["token_ids"] or []
        trains = bool(completion) and not sampled_by_another_model(row, tokenizer)
        if not trains and demo is None:
            continue
        if row["advantage"] is None or not math.isfinite(row["advantage"]):
            raise SnapshotError(f"row {i}: advantage is {row['advantage']!r}; every row needs a finite advantage")
        prompt = encode_prompt(tokenizer, row["prompt"], limit, template)  # once, for the row and its demo
        typed = demo is not None and len(prompt) + len(demo) <= max_len
        if typed:
            advantage = float(row["advantage"]) + typed_demo - _row_reward(row, i, "reward.typed_demo")
            examples.append(Example(prompt + demo, len(prompt), advantage, 1.0, None))
        if not trains:
            continue
        behaviour = row["logprobs"]
        if behaviour is not None and len(behaviour) != len(completion):
            raise SnapshotError(f"row {i}: {len(behaviour)} logprobs for {len(completion)} token_ids")
        ids = prompt + list(completion)
        if len(ids) > max_len:
            raise SnapshotError(f"row {i}: {len(ids)} tokens exceed the model's {max_len} positions")
        temperature = row["temperature"] if row["temperature"] and row["temperature"] > 0 else 1.0
        abstain_advantage = 0.0
        if abstain_reward is not None and (abstain_where_typed or not typed):
            abstain_advantage = abstain_reward - _row_reward(row, i, "the abstain term")
        examples.append(
            Example(
                ids,
                len(prompt),
                float(row["advantage"]),
                float(temperature),
                None if behaviour is None else [float(x) for x in behaviour],
                abstain_advantage,
            )
        )
    return examples


def _demo_ids(row: dict, tokenizer) -> list[int] | None:
    """The completion ids of a row's demo: the line its user typed and the end token (None: the row has none)."""
    if row.get("outcome") not in ("rejected", "abstained") or not row.get("continuation"):
        return None
    if tokenizer.eos_token_id is None:  # a model with no end token cannot be shown where a line stops
        return None
    text = demo_text(row["continuation"])
    if text is None:
        return None
    return tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]


@dataclass
class Packed:
    """Sequences packed into R rows of width W, position ids restarting at each sequence (no attention mask).

    With flash-attention (varlen kernels) everything goes into one row. Otherwise rows are bins as wide
    as the longest sequence, filled first-fit-decreasing: sdpa then builds a block-diagonal mask per
    row, so attention costs sum(T) * W rather than sum(T)^2, and the rest of each row is padding that
    forms its own sequence and is never gathered."""

    input_ids: torch.Tensor  # (R, W)
    position_ids: torch.Tensor  # (R, W)
    gather_idx: torch.Tensor  # (N,) flat positions (row * W + col) whose hidden state predicts a completion token
    targets: torch.Tensor  # (N,) the completion tokens
    inv_temp: torch.Tensor  # (N,) 1 / temperature of each token's row
    example_idx: list[int]  # in the order their tokens appear in targets
    first_idx: torch.Tensor  # (E,) index in targets of each example's first completion token, example_idx order
    n_tokens: int  # real tokens, padding excluded

    def to(self, device) -> Packed:
        for name in ("input_ids", "position_ids", "gather_idx", "targets", "inv_temp", "first_idx"):
            setattr(self, name, getattr(self, name).to(device))
        return self


def pack(examples: Sequence[Example], idx: Sequence[int], one_row: bool = False, pad_id: int = 0) -> Packed:
    lengths = {i: len(examples[i].input_ids) for i in idx}
    width = sum(lengths.values()) if one_row else max(lengths.values())
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(idx, key=lambda j: (-lengths[j], j)):
        k = next((b for b, r in enumerate(room) if r >= lengths[i]), None)
        if k is None:
            bins.append([])
            room.append(width)
            k = len(bins) - 1
        bins[k].append(i)
        room[k] -= lengths[i]
    ids = torch.full((len(bins), width), pad_id, dtype=torch.long)
    pos = torch.zeros((len(bins), width), dtype=torch.long)
    gather, targets, inv_temp, order, first = [], [], [], [], []
    for r, members in enumerate(bins):
        col = 0
        for i in members:
            ex = examples[i]
            n = len(ex.input_ids)
            ids[r, col : col + n] = torch.tensor(ex.input_ids)
            pos[r, col : col + n] = torch.arange(n)
            # the hidden state at position t predicts token t + 1
            gather.extend(range(r * width + col + ex.n_prompt - 1, r * width + col + n - 1))
            first.append(len(targets))
            targets.extend(ex.input_ids[ex.n_prompt :])
            inv_temp.extend([1.0 / ex.temperature] * ex.n_completion)
            order.append(i)
            col += n
        pos[r, col:] = torch.arange(width - col)  # padding: a sequence of its own
    return Packed(
        input_ids=ids,
        position_ids=pos,
        gather_idx=torch.tensor(gather, dtype=torch.long),
        targets=torch.tensor(targets, dtype=torch.long),
        inv_temp=torch.tensor(inv_temp, dtype=torch.float32),
        example_idx=order,
        first_idx=torch.tensor(first, dtype=torch.long),
        n_tokens=sum(lengths.values()),
    )


def split_micro(idx: Sequence[int], examples: Sequence[Example], max_rows: int, max_tokens: int) -> list[list[int]]:
    """Greedy micro-batches of at most max_rows rows and max_tokens tokens (a longer row goes alone)."""
    out: list[list[int]] = []
    cur: list[int] = []
    cur_tokens = 0
    for i in idx:
        n = len(examples[i].input_ids)
        if cur and (len(cur) >= max_rows or cur_tokens + n > max_tokens):
            out.append(cur)
            cur, cur_tokens = [], 0
        cur.append(i)
        cur_tokens += n
    if cur:
        out.append(cur)
    return out


def shard(idx: Sequence[int], examples: Sequence[Example], world: int) -> list[list[int]]:
    """Rows to ranks, longest first to the rank with fewest tokens (deterministic on every rank)."""
    ranks: list[list[int]] = [[] for _ in range(world)]
    load = [0] * world
    for i in sorted(idx, key=lambda j: (-len(examples[j].input_ids), j)):
        r = min(range(world), key=lambda k: (load[k], k))
        ranks[r].append(i)
        load[r] += len(examples[i].input_ids)
    return ranks


@dataclass
class StepPlan:
    micro: list[list[int]]  # this rank's micro-batches; [] = a dummy that keeps collectives in step
    step_tokens: int  # completion tokens of the whole step, all ranks


def plan_epoch(examples: Sequence[Example], tp: TrainParams, epoch: int, rank: int, world: int) -> list[StepPlan]:
    """The same shuffle on every rank; each step split over ranks, then into micro-batches."""
    order = list(range(len(examples)))
    random.Random(f"{tp.seed}:{epoch}").shuffle(order)
    per_step = tp.micro_batch * tp.grad_accum * world
    chunks = [order[start : start + per_step] for start in range(0, len(order), per_step)]
    if len(chunks) > 1 and 2 * len(chunks[-1]) < per_step:
        # A short tail joins the step before it: Adam's step has the same size whatever the batch, so a
        # step of one or two rows would move the weights as far as a full one on a far noisier gradient.
        chunks[-2:] = [chunks[-2] + chunks[-1]]
    plans = []
    for rows in chunks:
        per_rank = [
            split_micro(r, examples, tp.micro_batch, tp.max_tokens_per_micro_batch)
            for r in shard(rows, examples, world)
        ]
        n_micro = max(len(m) for m in per_rank)
        mine = per_rank[rank] + [[] for _ in range(n_micro - len(per_rank[rank]))]
        plans.append(StepPlan(mine, sum(examples[i].n_completion for i in rows)))
    return plans


def dummy_batch(examples: Sequence[Example]) -> Packed:
    """Two tokens, one gathered position: a forward/backward with zero loss for a rank with no rows left."""
    ids = examples[0].input_ids[:2]
    return Packed(
        torch.tensor([ids]),
        torch.tensor([[0, 1]]),
        torch.tensor([0]),
        torch.tensor([ids[1]]),
        torch.ones(1),
        [],
        torch.zeros(0, dtype=torch.long),
        0,
    )
