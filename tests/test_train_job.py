"""The training job on the tiny model: packing, pi_prox, one step, invariances, guards, checkpoint, CLI."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from tasks.core.config import TrainParams
from tasks.core.fim import QWEN
from tasks.core.generate import generate, load_model, prompt_limit, split_stops, stops_of
from tasks.core.schema import REWARDED_SCHEMA
from tasks.train.batching import Example, SnapshotError, build_examples, pack, plan_epoch, read_snapshot
from tasks.train.engines import CompletionPolicy, first_token_logp, row_log_softmax, token_logp
from tasks.train.launch import launch_train
from tasks.train.loss import ppo_loss
from tasks.train.policy import RESULT_FILE
from tasks.train.ppo import TrainingDiverged, inputs_digest, train
from tests.conftest import tiny_params

MAX_NEW = 8
TEMPERATURE = 0.7


def _row(prompt, text, ids, logps, advantage, outcome="rejected"):
    return {
        "completion_id": f"c{random.random()}",
        "created_at": 0.0,
        "user_id": "u",
        "arm": "champion",
        "model_version": "v0",
        "prompt": prompt,
        "completion": text,
        "token_ids": ids,
        "logprobs": logps,
        "temperature": TEMPERATURE,
        "outcome": outcome,
        "accepted_chars": None,
        "reward": advantage,
        "advantage": advantage,
    }


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory, tiny_model_dir, fim_samples) -> Path:
    """16 sampled completions with behaviour log-probs, plus the edge rows of real logs."""
    model, tok, template = load_model(tiny_model_dir)
    prompts = [QWEN.render(s["prefix"][-300:], s["suffix"][:60]) for s in fim_samples[:16]]  # short: fast on 2 cores
    gens = generate(model, tok, template, prompts, MAX_NEW, temperature=TEMPERATURE, seed=0)
    rng = random.Random(0)
    rows = [
        _row(p, g.text, g.token_ids, g.logprobs, rng.choice([0.75, -0.25])) for p, g in zip(prompts, gens, strict=True)
    ]
    rows[3]["logprobs"] = None  # a client that logged no log-probs: pi_prox recomputed, weight 1
    eos = tok.eos_token_id
    rows.append(_row(prompts[0], "", [], [], 0.0, "abstained"))  # nothing generated: no gradient
    rows.append(_row(prompts[1], "", [eos], [-0.1], 0.0, "abstained"))  # stop token only: trains
    path = tmp_path_factory.mktemp("snap") / "snapshot.parquet"
    pq.write_table(pa.Table.from_pylist(rows, schema=REWARDED_SCHEMA), path)
    return path


def _params(tmp, **train):
    base = {
        "lr": 1e-3,
        "epochs": 1,
        "micro_batch": 8,
        "grad_accum": 1,
        "grad_clip": 1e6,
        "max_approx_kl": 10.0,
        "target_kl": 10.0,
        # the PPO update alone, the embeddings in it: the tests turn on the term they test
        "train_embeddings": True,
        "abstain_weight": 0.0,
    }
    serving = {"max_tokens": MAX_NEW, "temperature": TEMPERATURE}
    return tiny_params(tmp, train=base | train, serving=serving, reward={"typed_demo": None})


def _examples(model_dir, snapshot, params):
    model, tok, template = load_model(model_dir)
    return model, build_examples(read_snapshot(snapshot), tok, template, prompt_limit(model, MAX_NEW), 512)


def _logps(model, examples, one_row=False):
    """Completion log-probs of all examples in one packed batch, back in example order."""
    packed = pack(examples, range(len(examples)), one_row=one_row)
    with torch.no_grad():
        logits = CompletionPolicy(model)(packed.input_ids, packed.position_ids, packed.gather_idx)
    flat = token_logp(logits, packed.targets, packed.inv_temp)[0].split(
        [examples[i].n_completion for i in packed.example_idx]
    )
    by_example = dict(zip(packed.example_idx, flat, strict=True))
    return torch.cat([by_example[i] for i in range(len(examples))])


def test_packed_logps_match_unpacked_and_serving_logprobs(tiny_model_dir, snapshot, tmp_path):
    model, examples = _examples(tiny_model_dir, snapshot, _params(tmp_path))
    assert len(examples) == 17  # 18 rows, the one with no tokens is left out; the stop-token-only row stays
    packed = _logps(model, examples)
    assert torch.allclose(_logps(model, examples, one_row=True), packed, atol=1e-4)
    single, behaviour = [], []
    for ex in examples:
        with torch.no_grad():
            logits = model(torch.tensor([ex.input_ids])).logits[0, ex.n_prompt - 1 : -1]
        single.append(
            torch.log_softmax(logits / ex.temperature, -1).gather(
                -1, torch.tensor(ex.input_ids[ex.n_prompt :])[:, None]
            )[:, 0]
        )
        if ex.behaviour_logp is not None and ex.n_completion > 1:
            behaviour.append((single[-1], torch.tensor(ex.behaviour_logp)))
    assert torch.allclose(packed, torch.cat(single), atol=1e-4)  # no cross-talk between packed sequences
    for mine, served in behaviour:  # same prompt ids, same temperature as serving: IS weight ~ 1
        assert torch.allclose(mine, served, atol=1e-3)


def test_one_step_changes_params_and_lowers_the_loss_on_its_batch(tiny_model_dir, snapshot, tmp_path):
    params = _params(tmp_path, micro_batch=32, lr=3e-3)
    out = tmp_path / "out"
    result = train(snapshot, tiny_model_dir, out, params)
    assert result.steps == 1 and result.rows_used == 17 and result.engine == "torch"
    before, examples = _examples(tiny_model_dir, snapshot, params)
    after = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    assert after.dtype == torch.float32
    changed = [n for n, p in after.named_parameters() if not torch.equal(p, dict(before.named_parameters())[n])]
    assert len(changed) == len(list(after.named_parameters()))
    old = _logps(before, examples)
    adv = torch.cat([torch.full((e.n_completion,), e.advantage) for e in examples])
    ones = torch.ones_like(old)
    loss_before, _ = ppo_loss(old, old, adv, ones, clip_low=0.2, clip_high=0.28)
    loss_after, _ = ppo_loss(_logps(after, examples), old, adv, ones, clip_low=0.2, clip_high=0.28)
    assert loss_after.item() < loss_before.item() - 1e-3
    assert result.final["train/loss"] == pytest.approx(loss_before.item(), abs=0.05)  # IS weights ~ 1 here
    # the one step ran on the starting weights: its top-k KL compares every position with its own kept top k
    assert result.final["train/approx_kl"] == pytest.approx(0.0, abs=1e-5) and "train/kl_k3" in result.final
    # the checkpoint is a complete HF directory, written atomically
    assert (out / "tokenizer.json").is_file() and json.loads((out / "train_result.json").read_text())["steps"] == 1
    assert not (tmp_path / ".out.tmp").exists()


def test_a_bf16_update_computes_pi_prox_in_bf16_too_and_keeps_fp32_weights(tiny_model_dir, snapshot, tmp_path):
    fp32 = train(snapshot, tiny_model_dir, tmp_path / "fp32", _params(tmp_path, micro_batch=32, lr=3e-3))
    params = _params(tmp_path, micro_batch=32, lr=3e-3, compute_dtype="bfloat16")
    out = tmp_path / "bf16"
    result = train(snapshot, tiny_model_dir, out, params)
    assert (result.compute_dtype, fp32.compute_dtype) == ("bfloat16", "float32")
    # pi_prox came from the same bf16 forward as the step: at the starting weights their KL is 0 (one in fp32
    # against the other in bf16 would differ by the rounding of every matrix product)
    assert result.final["train/approx_kl"] == pytest.approx(0.0, abs=1e-6)
    assert result.final["train/loss"] == pytest.approx(fp32.final["train/loss"], abs=0.02)
    after = load_file(out / "model.safetensors")
    assert all(w.dtype == torch.float32 for w in after.values())  # fp32 on disk: small updates do not vanish
    reference = load_file(tmp_path / "fp32" / "model.safetensors")
    name = "model.layers.0.mlp.up_proj.weight"
    assert not torch.equal(after[name], reference[name])  # bf16 arithmetic: another, close update
    assert torch.allclose(after[name], reference[name], atol=1e-2)


@pytest.mark.parametrize(("rows", "sizes"), [(17, [8, 9]), (20, [8, 8, 4]), (19, [8, 11]), (5, [5]), (16, [8, 8])])
def test_a_short_tail_joins_the_step_before(rows, sizes):
    examples = [Example([1, 2, 3], 2, 0.5, 1.0, None) for _ in range(rows)]
    tp = TrainParams(micro_batch=4, grad_accum=2)
    plans = plan_epoch(examples, tp, epoch=0, rank=0, world=1)
    assert [sum(len(m) for m in p.micro) for p in plans] == sizes
    assert sorted(i for p in plans for m in p.micro for i in m) == list(range(rows))  # every row once


def test_frozen_embeddings_keep_the_tied_rows_and_train_the_rest(tiny_model_dir, snapshot, tmp_path):
    params = _params(tmp_path, micro_batch=32, train_embeddings=False)
    result = train(snapshot, tiny_model_dir, tmp_path / "out", params)
    assert result.steps == 1
    before, after = _weights(tiny_model_dir), _weights(tmp_path / "out")
    frozen = [n for n in before if "embed_tokens" in n or n.startswith("lm_head")]
    assert frozen and all(torch.equal(before[n], after[n]) for n in frozen)  # the head is tied to them
    rest = [n for n in before if n not in frozen]
    assert all(not torch.equal(before[n], after[n]) for n in rest)


def _weights(d: Path) -> dict[str, torch.Tensor]:
    return load_file(d / "model.safetensors")


def _assert_same_update(a: Path, b: Path, start: Path, ra, rb):
    assert ra.final["train/grad_norm"] == pytest.approx(rb.final["train/grad_norm"], rel=1e-4)
    assert ra.final["train/loss"] == pytest.approx(rb.final["train/loss"], rel=1e-4, abs=1e-6)
    wa, wb, w0 = _weights(a), _weights(b), _weights(start)
    for name in wa:
        step = (wa[name] - w0[name]).abs().max()
        # Adam divides each element by its own gradient scale, so rounding noise in near-zero gradients
        # reaches ~1% of the largest update; the grad norm above is the scale-sensitive check
        assert (wa[name] - wb[name]).abs().max() <= 2e-2 * max(step.item(), 1e-8) + 1e-6, name


def test_grad_accumulation_1x8_equals_8x1(tiny_model_dir, snapshot, tmp_path):
    # 17 rows, 8 per step: 2 steps (8, 9: the one-row tail joins the step before) either way; Adam is
    # scale-free, so grad norms are compared too. The abstain term is on: its rows count like tokens.
    ra = train(
        snapshot, tiny_model_dir, tmp_path / "a", _params(tmp_path, micro_batch=8, grad_accum=1, abstain_weight=0.5)
    )
    rb = train(
        snapshot, tiny_model_dir, tmp_path / "b", _params(tmp_path, micro_batch=1, grad_accum=8, abstain_weight=0.5)
    )
    assert ra.steps == rb.steps == 2
    _assert_same_update(tmp_path / "a", tmp_path / "b", tiny_model_dir, ra, rb)


def test_two_gloo_ranks_equal_one_process(tiny_model_dir, snapshot, tmp_path):
    r1 = launch_train(snapshot, tiny_model_dir, tmp_path / "one", _params(tmp_path, micro_batch=4, grad_accum=2))
    r2 = launch_train(
        snapshot, tiny_model_dir, tmp_path / "two", _params(tmp_path, micro_batch=4, grad_accum=1, nproc=2)
    )
    assert (r1.world_size, r2.world_size) == (1, 2) and r1.steps == r2.steps == 2
    _assert_same_update(tmp_path / "one", tmp_path / "two", tiny_model_dir, r1, r2)
    # same inputs again: the finished result is returned, nothing retrains
    mtime = (tmp_path / "two" / "model.safetensors").stat().st_mtime_ns
    again = launch_train(
        snapshot, tiny_model_dir, tmp_path / "two", _params(tmp_path, micro_batch=4, grad_accum=1, nproc=2)
    )
    assert again == r2 and (tmp_path / "two" / "model.safetensors").stat().st_mtime_ns == mtime


def _rewarded_copy(snapshot: Path, out: Path, reward: float | None) -> Path:
    """The snapshot with every row's reward set and advantage 0: only the abstain term carries a gradient."""
    rows = pq.read_table(snapshot).to_pylist()
    for row in rows:
        row["reward"], row["advantage"] = reward, 0.0
    pq.write_table(pa.Table.from_pylist(rows, schema=REWARDED_SCHEMA), out)
    return out


def _p_abstain(model_dir: Path, examples) -> torch.Tensor:
    """pi(a stop token first) per example at its temperature: the probability the model shows nothing."""
    model, tok, template = load_model(model_dir)
    packed = pack(examples, range(len(examples)))
    stops = torch.tensor(split_stops(tok, stops_of(template, tok))[0])
    with torch.no_grad():
        logits = CompletionPolicy(model)(packed.input_ids, packed.position_ids, packed.gather_idx)
        p = first_token_logp(row_log_softmax(logits, packed.inv_temp), packed.first_idx, stops).exp()
    return p[torch.tensor([packed.example_idx.index(i) for i in range(len(examples))])]


@pytest.mark.parametrize(("reward", "direction"), [(-0.25, 1.0), (0.75, -1.0)])
def test_the_abstain_term_moves_pi_stop_by_the_known_reward(tiny_model_dir, snapshot, tmp_path, reward, direction):
    """Showing nothing earns reward.abstained (0): after rejects the update makes an empty suggestion likelier,
    after accepts less likely; with the term off and zero advantages nothing moves."""
    snap = _rewarded_copy(snapshot, tmp_path / "snap.parquet", reward)
    params = _params(tmp_path, micro_batch=32, abstain_weight=1.0)
    assert params.reward.abstained == 0.0
    result = train(snap, tiny_model_dir, tmp_path / "on", params)
    _, examples = _examples(tiny_model_dir, snap, params)
    before, after = _p_abstain(tiny_model_dir, examples), _p_abstain(tmp_path / "on", examples)
    moved = direction * (after - before)
    assert (moved > 0).float().mean() >= 0.9 and moved.mean() > 0  # nearly every prompt, and on average
    assert result.final["train/abstain_p"] == pytest.approx(float(before.mean()), rel=1e-3)  # logged before the step
    train(snap, tiny_model_dir, tmp_path / "off", _params(tmp_path, micro_batch=32))
    start, off = _weights(tiny_model_dir), _weights(tmp_path / "off")
    assert start.keys() == off.keys() and all(torch.equal(start[n], off[n]) for n in start)


def test_the_train_cache_key_follows_the_abstain_reward_only_when_the_term_reads_it(tiny_model_dir, snapshot, tmp_path):
    def key(abstain_weight: float, abstained: float) -> str:
        params = _params(tmp_path, abstain_weight=abstain_weight)
        params = params.model_copy(update={"reward": params.reward.model_copy(update={"abstained": abstained})})
        return inputs_digest(snapshot, Path(tiny_model_dir), params)

    assert key(1.0, 0.0) != key(1.0, 0.1)  # the term's advantage changed: a stored result is not reused
    assert key(0.0, 0.0) == key(0.0, 0.1)  # without the term the trainer never reads it


def test_the_abstain_term_needs_every_rows_reward(tiny_model_dir, snapshot, tmp_path):
    snap = _rewarded_copy(snapshot, tmp_path / "snap.parquet", None)
    with pytest.raises(SnapshotError, match="row 0: reward is None; the abstain term needs every row's reward"):
        train(snap, tiny_model_dir, tmp_path / "out", _params(tmp_path, abstain_weight=1.0))
    train(snap, tiny_model_dir, tmp_path / "off", _params(tmp_path))  # without the term the reward is not read
    assert not (tmp_path / "out").exists()


TYPED_LINE = "config = load_settings(path)"


def _typed_snapshot(snapshot: Path, tmp_path: Path) -> Path:
    """12 rows: rejected, abstained, accepted in turn; the first nine users typed TYPED_LINE and a line end after
    the request, the last three TYPED_LINE only (no whole line)."""
    rows = pq.read_table(snapshot).to_pylist()[:12]
    for k, row in enumerate(rows):
        row["outcome"] = ("rejected", "abstained", "accepted")[k % 3]
        row["reward"] = row["advantage"] = {"rejected": -0.25, "abstained": 0.0, "accepted": 0.75}[row["outcome"]]
        row["continuation"] = TYPED_LINE + "\n    return config\n" if k < 9 else TYPED_LINE
    snap = tmp_path / "snap.parquet"
    pq.write_table(pa.Table.from_pylist(rows, schema=REWARDED_SCHEMA), snap)
    return snap


def test_typed_demo_trains_on_the_line_the_user_typed(tiny_model_dir, snapshot, tmp_path):
    """With reward.typed_demo a rejected or abstained request whose continuation holds a whole line adds that
    line and the end token as an example with that reward; one update makes those lines likelier. Accepted
    requests, and continuations without a line end, add none."""
    _, tok, _ = load_model(tiny_model_dir)
    snap = _typed_snapshot(snapshot, tmp_path)
    on = _params(tmp_path, micro_batch=32)
    on = on.model_copy(update={"reward": on.reward.model_copy(update={"typed_demo": 0.75})})
    model, plain = _examples(tiny_model_dir, snap, _params(tmp_path))
    with_demos = build_examples(read_snapshot(snap), tok, QWEN, prompt_limit(model, MAX_NEW), 512, typed_demo=0.75)
    expected = tok.encode(TYPED_LINE, add_special_tokens=False) + [tok.eos_token_id]
    demos = [ex for ex in with_demos if ex.input_ids[ex.n_prompt :] == expected]
    assert len(demos) == 6  # rows 0, 1, 3, 4, 6, 7
    assert all(ex.advantage == 0.75 and ex.behaviour_logp is None and ex.temperature == 1.0 for ex in demos)
    assert len(with_demos) == len(plain) + 6

    def demo_logp(model_dir: Path) -> torch.Tensor:
        lm, _, _ = load_model(model_dir)
        return torch.stack([t.sum() for t in _logps(lm, demos).split([ex.n_completion for ex in demos])])

    train(snap, tiny_model_dir, tmp_path / "on", on)
    assert (demo_logp(tmp_path / "on") > demo_logp(tiny_model_dir)).all()
    half = on.model_copy(update={"reward": on.reward.model_copy(update={"typed_demo": 0.5})})
    keys = {inputs_digest(snap, Path(tiny_model_dir), p) for p in (on, half, _params(tmp_path, micro_batch=32))}
    assert len(keys) == 3  # a stored update is reused only with the same examples and rewards


def test_without_abstain_where_typed_rows_with_a_typed_line_carry_no_abstain_term(tiny_model_dir, snapshot, tmp_path):
    """train.abstain_where_typed False: a rejected row whose typed line trains as a demo gets no push towards
    abstaining; a rejected row without a whole line still gets +0.25, an accepted one -0.75 (as with True)."""
    model, tok, _ = load_model(tiny_model_dir)
    snap = _typed_snapshot(snapshot, tmp_path)
    demo = tok.encode(TYPED_LINE, add_special_tokens=False) + [tok.eos_token_id]

    def row_terms(where_typed: bool) -> list[float]:  # the abstain advantage of each row's own example
        examples = build_examples(
            read_snapshot(snap),
            tok,
            QWEN,
            prompt_limit(model, MAX_NEW),
            512,
            abstain_reward=0.0,
            typed_demo=0.75,
            abstain_where_typed=where_typed,
        )
        return [ex.abstain_advantage for ex in examples if ex.input_ids[ex.n_prompt :] != demo]

    rows = read_snapshot(snap)
    on, off = row_terms(True), row_terms(False)
    assert len(on) == len(rows)  # every row has completion tokens
    expected_on = [{"rejected": 0.25, "abstained": 0.0, "accepted": -0.75}[r["outcome"]] for r in rows]
    assert on == expected_on
    typed = [k < 9 and r["outcome"] != "accepted" for k, r in enumerate(rows)]
    assert off == [0.0 if t else a for t, a in zip(typed, expected_on, strict=True)]
    assert off[9] == 0.25  # rejected, no whole line typed: the term stays


def test_non_finite_loss_stops_without_checkpoint(tiny_model_dir, snapshot, tmp_path):
    rows = pq.read_table(snapshot).to_pylist()
    rows[0]["advantage"] = 1e39  # finite in the log, inf in fp32
    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist(rows, schema=REWARDED_SCHEMA), bad)
    (tmp_path / ".out.tmp").mkdir()  # a temp dir left by a killed job
    with pytest.raises(TrainingDiverged, match="non-finite loss at step 0"):
        train(bad, tiny_model_dir, tmp_path / "out", _params(tmp_path))
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("top_k", "name"), [(64, r"approx-KL \(top-64 KL to the starting weights\)"), (0, r"approx-KL \(k3\)")]
)
def test_approx_kl_guard(tiny_model_dir, snapshot, tmp_path, top_k, name):
    with pytest.raises(TrainingDiverged, match=f"{name} .* exceeds train.max_approx_kl"):
        train(
            snapshot,
            tiny_model_dir,
            tmp_path / "out",
            _params(tmp_path, micro_batch=4, lr=5e-2, max_approx_kl=1e-6, kl_top_k=top_k),
        )
    assert not (tmp_path / "out").exists()


def test_target_kl_stops_the_update_early_and_keeps_the_checkpoint(tiny_model_dir, snapshot, tmp_path):
    """Past train.target_kl (below the divergence guard) the update ends before that step, weights kept."""
    # No guard in the full run: its approx-KL depends on the session's tiny model (at lr 5e-2 it once reached
    # 10.75 and tripped the old limit of 10 in a fresh clone).
    loose = {"micro_batch": 4, "lr": 1e-2, "max_approx_kl": 1e3}
    full = train(snapshot, tiny_model_dir, tmp_path / "full", _params(tmp_path, **loose, target_kl=1e3))
    early = train(snapshot, tiny_model_dir, tmp_path / "early", _params(tmp_path, **loose, target_kl=1e-6))
    assert full.stopped_early == "" and full.steps > 1
    assert "exceeds train.target_kl=1e-06" in early.stopped_early and 1 <= early.steps < full.steps
    assert json.loads((tmp_path / "early" / RESULT_FILE).read_text())["stopped_early"] == early.stopped_early
    start, *_ = load_model(tiny_model_dir)
    stopped, *_ = load_model(tmp_path / "early")
    pairs = zip(start.state_dict().values(), stopped.state_dict().values(), strict=True)
    assert any(not torch.equal(a, b) for a, b in pairs)


def test_rows_another_family_sampled_are_not_trained_on(tiny_model_dir):
    from transformers import AutoTokenizer

    from tasks.train.batching import sampled_by_another_model

    tok = AutoTokenizer.from_pretrained(tiny_model_dir, local_files_only=True)
    ids = tok("return x", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert not sampled_by_another_model({"token_ids": ids, "completion": "return x"}, tok)
    assert sampled_by_another_model({"token_ids": [len(tok) + 5], "completion": ""}, tok)  # outside the vocabulary
    assert sampled_by_another_model({"token_ids": ids, "completion": "import os"}, tok)  # decodes to another text


def test_a_snapshot_is_read_in_the_same_order_however_its_users_requests_interleaved(tmp_path):
    """Training reads the rows round-robin over users, each user's in the order it asked: two snapshots of the same
    requests that arrived interleaved differently train alike (what `python -m flows.demo --replay` needs)."""
    asked = {u: [_row(f"{u}{k}", "x", [1], [-0.1], 0.5) | {"user_id": u} for k in range(3)] for u in "ab"}
    one = [*asked["a"], *asked["b"]]
    other = [asked["b"][0], asked["a"][0], asked["a"][1], asked["b"][1], asked["b"][2], asked["a"][2]]
    orders = []
    for name, rows in (("one", one), ("other", other)):
        path = tmp_path / f"{name}.parquet"
        pq.write_table(pa.Table.from_pylist(rows, schema=REWARDED_SCHEMA), path)
        orders.append([r["prompt"] for r in read_snapshot(path)])
    assert orders[0] == orders[1] == ["a0", "b0", "a1", "b1", "a2", "b2"]
