"""Parity of a parallel instance with one rank: TP=2, EP=2 and TP=2 x EP=2, both architectures.

Each case writes a random checkpoint (weights large enough that every layer moves the logits),
starts every rank as its own process over gloo (``parallel_harness.py``) and reads rank 0's
measurements: logits within 1e-5 of the single-rank model on prompts over several chunks and
snapshot points, a batch prefilled and decoded together, reuse of exported prefixes in both
directions, a cache filled as a decode worker's sink fills it; greedy and seeded generation
token for token. Then the unit pieces: the KDA state cut by head and merged back, the shape's
checks, and the shard plan's slices.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest
import torch

import engine
from engine.checkpoint import save_checkpoint, seeded_tensors
from engine.config import tiny_config, tiny_k2_config
from engine.parallel.shape import ParallelShape
from engine.parallel.shard import ShardPlan
from engine.parallel.state import conv_part, merge_convs, merge_states, state_part
from tests.engine.rank_processes import run_rank_processes

TOLERANCE = 1e-5

# Small random configs: Kimi Linear (KDA + MLA, MoE with a shared expert and a dense layer,
# grouped routing) and DeepSeek-V3/K2 (low-rank query, YaRN, grouped routing).
KIMI = dataclasses.replace(
    tiny_config(), hidden_size=128, num_hidden_layers=4, mla_layer_ids=(1, 3), kda_layer_ids=(0, 2),
    intermediate_size=256, num_attention_heads=4, kda_num_heads=4, kda_head_dim=32, kv_lora_rank=64,
    qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, num_experts=8, num_experts_per_token=2,
    moe_intermediate_size=64, num_expert_group=2, topk_group=1, vocab_size=1024, name="par-kimi")
K2 = dataclasses.replace(
    tiny_k2_config(), hidden_size=128, num_hidden_layers=3, mla_layer_ids=(0, 1, 2), intermediate_size=256,
    num_attention_heads=4, kv_lora_rank=64, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16,
    q_lora_rank=48, num_experts=8, moe_intermediate_size=64, num_expert_group=2, topk_group=1, vocab_size=1024,
    name="par-k2")
CONFIGS = {"kimi": KIMI, "k2": K2}
SHAPES = {"tp2": (2, 1), "ep2": (1, 2), "tp2xep2": (2, 2)}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    out = {}
    for name, cfg in CONFIGS.items():
        path = tmp_path_factory.mktemp(name)
        save_checkpoint(path, cfg, seeded_tensors(cfg, seed=5, std=0.08))
        out[name] = path
    return out


def run_ranks(model: Path, tp: int, ep: int, tmp: Path, timeout_s: float = 240, stages: int = 1,
              extra: tuple[str, ...] = ()) -> dict:
    world = tp * ep * stages
    init = f"file://{tmp / 'rendezvous'}"
    out = tmp / "result.json"
    cmd = [sys.executable, "-m", "tests.engine.parallel_harness", "--model", str(model), "--tp", str(tp),
           "--ep", str(ep), "--stages", str(stages), "--init", init, "--out", str(out), *extra]
    for r, (code, text) in enumerate(run_rank_processes(cmd, world, timeout_s)):
        assert code == 0, f"rank {r} exited with {code}:\n{text[-3000:]}"
    return json.loads(out.read_text())


@pytest.mark.timeout(600)
@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_parallel_matches_one_rank(arch, shape, checkpoints, tmp_path):
    tp, ep = SHAPES[shape]
    result = run_ranks(checkpoints[arch], tp, ep, tmp_path)
    for check in ("prompt_logits", "batch", "export", "reuse", "reuse_group_export", "received"):
        assert result[check] < TOLERANCE, f"{arch} {shape} {check}: max |diff| {result[check]:.2e}"
    assert result["greedy_equal"] and result["seeded_equal"], result
    assert result["greedy_len"] == result["seeded_len"] == 24
    if arch == "kimi":
        assert result["kda_heads_per_rank"] == KIMI.kda_num_heads // tp


@pytest.mark.timeout(600)
@pytest.mark.parametrize(("fmt", "shape"), [("int4", "tp2xep2"), ("mxfp4", "tp2")])
def test_quantized_experts_split_like_dense_ones(fmt, shape, tmp_path):
    """K2's INT4 experts (and MXFP4) under TP and EP: each rank keeps its experts and its share
    of every expert's packed codes and scales (rows for gate/up, whole scale groups of columns
    for down), and the instance matches the same quantized model on one rank."""
    from engine.quant import INT4, MXFP4
    from tests.checkpoint_support import write_quantized_checkpoint

    write_quantized_checkpoint(tmp_path / "model", K2, {"int4": INT4, "mxfp4": MXFP4}[fmt], seed=5)
    tp, ep = SHAPES[shape]
    result = run_ranks(tmp_path / "model", tp, ep, tmp_path)
    for check in ("prompt_logits", "batch", "export", "reuse", "reuse_group_export", "received"):
        assert result[check] < TOLERANCE, f"{fmt} {shape} {check}: max |diff| {result[check]:.2e}"
    assert result["greedy_equal"] and result["seeded_equal"], result


def test_packed_weight_narrows_rows_and_whole_groups_of_columns():
    from engine.quant import INT4
    from engine.quant.packed import PackedWeight

    w = PackedWeight(INT4, 32, torch.randint(0, 255, (8, 64), dtype=torch.uint8), torch.rand(8, 4))
    rows, cols = w.narrow(0, 4, 4), w.narrow(1, 64, 64)
    assert rows.shape == (4, 128) and torch.equal(rows.codes, w.codes[4:]) and torch.equal(rows.scale, w.scale[4:])
    assert cols.shape == (8, 64) and torch.equal(cols.codes, w.codes[:, 32:]) and torch.equal(cols.scale,
                                                                                             w.scale[:, 2:])
    with pytest.raises(ValueError, match="scale groups of 32"):
        w.narrow(1, 16, 64)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("stages", [2, 3])
@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_pipeline_stages_match_one_rank(arch, stages, checkpoints, tmp_path):
    """Chunked pipeline parallelism: each rank holds a range of layers; pipelined in chunks
    that do not fall on block or snapshot boundaries, and as one chunk, and after a reused
    prefix: logits and every exported block (the later stages' KDA state included) as one rank."""
    result = run_ranks(checkpoints[arch], 1, 1, tmp_path, stages=stages)
    for check, value in result.items():
        assert value < TOLERANCE, f"{arch} stages={stages} {check}: max |diff| {value:.2e}"
    assert set(result) == {"pipelined_logits", "pipelined_export", "one_chunk_logits", "one_chunk_export",
                           "reuse_logits"}


def test_idle_ranks_outlive_the_group_timeout(checkpoints, tmp_path):
    """Rank 0 idle for longer than the group's collective timeout (6 s): its keepalive ops keep
    the other rank, waiting for the next op, from failing, and the checks then pass."""
    result = run_ranks(checkpoints["k2"], 2, 1, tmp_path, extra=("--timeout-s", "6", "--idle-s", "10"))
    assert result["greedy_equal"] and result["prompt_logits"] < TOLERANCE


def test_layers_move_the_logits(checkpoints):
    """The parity above can fail: with these weights, perturbing one layer's o_proj (a row
    split) or one expert (an EP partition) changes the logits far beyond the tolerance."""
    for name in CONFIGS:
        model = engine.load_model(str(checkpoints[name]))
        ids = list(range(1, 120))
        base = engine.prompt_logits(model, ids)
        blk = model.blocks[-1]
        w = blk.attn.w.w_o
        w[:, : w.shape[1] // 2] *= 1.01
        assert (engine.prompt_logits(model, ids) - base).abs().max().item() > 100 * TOLERANCE
        w[:, : w.shape[1] // 2] /= 1.01
        moe = next(b.ffn for b in model.blocks if b.is_moe)
        moe.w.w2[moe.num_local - 1] *= 1.05
        assert (engine.prompt_logits(model, ids) - base).abs().max().item() > 100 * TOLERANCE


def test_kda_state_cut_by_head_and_merged():
    gen = torch.Generator().manual_seed(0)
    state = torch.randn(3, 4, 8, 8, generator=gen)
    conv = torch.randn(3, 3, 3 * 4 * 8, generator=gen)
    for tp in (1, 2, 4):
        assert torch.equal(merge_states([state_part(state, tp, t) for t in range(tp)]), state)
        assert torch.equal(merge_convs([conv_part(conv, tp, t, 8) for t in range(tp)], 8), conv)
    # rank 1 of 2 holds heads 2..3 of q, k and v: channels [16:32], [48:64], [80:96]
    part = conv_part(conv, 2, 1, 8)
    assert torch.equal(part, torch.cat([conv[..., 16:32], conv[..., 48:64], conv[..., 80:96]], -1))
    with pytest.raises(ValueError, match="does not split over tp=3"):
        state_part(state, 3, 0)


def test_shape_refuses_what_does_not_divide():
    ParallelShape(tp=2, ep=2).check(KIMI)
    with pytest.raises(ValueError, match="num_attention_heads=4 is not divisible by tp=3"):
        ParallelShape(tp=3).check(KIMI)
    with pytest.raises(ValueError, match="num_experts=8 is not divisible by ep=3"):
        ParallelShape(ep=3).check(KIMI)
    with pytest.raises(ValueError, match="tp must be >= 1"):
        ParallelShape(tp=0)
    with pytest.raises(ValueError, match="rank 4 outside"):
        ShardPlan(ParallelShape(tp=2, ep=2), 4)
    shape = ParallelShape(tp=2, ep=2)
    assert [shape.coords(r) for r in range(4)] == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1)]
    assert ParallelShape(stages=2).stage_layers(6, 0) == range(0, 3)
    assert ParallelShape(stages=4).stage_layers(6, 3) == range(5, 6)


def test_shard_plan_slices():
    w = torch.arange(24.0).view(4, 6)
    plan = ShardPlan(ParallelShape(tp=2, ep=2), 3)  # e = 1, t = 1
    assert torch.equal(plan.column(w), w[2:])
    assert torch.equal(plan.row(w), w[:, 3:])
    assert torch.equal(plan.stage_column(w), w[3:])  # stage index 3 of 4
    assert plan.experts(8) == range(4, 8)
    assert plan.vocab_range(1024) == (512, 1024)
    with pytest.raises(ValueError, match="not divisible by 2"):
        plan.column(torch.zeros(3, 2), "x")
