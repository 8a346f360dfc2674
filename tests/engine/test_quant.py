"""Quantized experts as the Kimi family ships them (INT4 pack-quantized, MXFP4), against
compressed-tensors' own dequantization, on both architectures (Kimi Linear, DeepSeek-V3/K2).

The reference is the full-precision engine on the weights compressed-tensors dequantizes
(that engine is itself held to transformers by test_parity.py and test_parity_k2.py); the K2
case is also checked against transformers' DeepseekV3ForCausalLM directly."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import engine
from engine.checkpoint import expected_shapes, seeded_tensors
from engine.config import tiny_config, tiny_k2_config
from engine.quant import INT4, MXFP4, reference
from engine.quant.accounting import weight_bytes
from engine.quant.formats import QuantConfig
from engine.quant.kernels import CodebookLinear, Int4KernelLinear, build
from engine.quant.loader import take_packed
from tests.checkpoint_support import write_dequantized_checkpoint, write_quantized_checkpoint

ARCHS = {"kimi_linear": tiny_config, "k2": tiny_k2_config}
CASES = [(a, f) for a in ARCHS for f in (INT4, MXFP4)]
_CACHE: dict = {}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(arch, format) -> (quantized dir, dequantized dir), written once per module."""

    def get(arch: str, fmt: str):
        if (arch, fmt) not in _CACHE:
            cfg = ARCHS[arch]()
            qdir, ddir = tmp_path_factory.mktemp(f"{arch}-{fmt}-q"), tmp_path_factory.mktemp(f"{arch}-{fmt}-d")
            quantized = write_quantized_checkpoint(qdir, cfg, fmt, num_shards=2 if arch == "k2" else 1)
            write_dequantized_checkpoint(ddir, cfg, fmt, quantized)
            _CACHE[arch, fmt] = (str(qdir), str(ddir))
        return _CACHE[arch, fmt]

    return get


def _one_linear(fmt: str, n: int, k: int, seed: int = 0):
    """A single routed-expert linear quantized by compressed-tensors: (dense W, library's dequantization, packed)."""
    name = "model.layers.1.mlp.experts.0.gate_proj.weight"
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05
    qconfig = reference.quantization_config(fmt, ignore=())
    shapes = {name: (n, k)}
    parts = reference.quantize({name: w}, qconfig, shapes)
    ref = reference.dequantize(parts, qconfig, shapes)[name]
    packed = take_packed(parts, dict.fromkeys(parts, "test.safetensors"), QuantConfig.from_dict(qconfig, "t"),
                         shapes)[name]
    return w, ref, packed


@pytest.mark.parametrize("fmt", [INT4, MXFP4])
@pytest.mark.parametrize("n", [64, 40])  # 40: not a multiple of 16, so never the int4 kernel
def test_linear_matches_library_dequantization(fmt, n):
    w, ref, packed = _one_linear(fmt, n, 256)
    assert (ref - w).abs().max() > 1e-4  # really quantized
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(1))
    # fp32: the expanded tile is bit for bit the library's dequantized weight.
    lin32 = build(packed.to(dtype=torch.float32))
    assert isinstance(lin32, CodebookLinear)
    assert torch.equal(lin32.dequantize(), ref)
    assert (lin32(x) - F.linear(x, ref)).abs().max() < 1e-6
    # bf16: INT4 runs torch's int4 kernel where it can, MXFP4 the codebook tile; both within bf16 rounding.
    lin16 = build(packed.to(dtype=torch.bfloat16))
    kernel = fmt == INT4 and n % 16 == 0
    assert isinstance(lin16, Int4KernelLinear if kernel else CodebookLinear)
    xb = x.to(torch.bfloat16)
    want = F.linear(xb.float(), ref)
    assert (lin16(xb).float() - want).abs().max() < 1e-2 * want.abs().max()
    if fmt == MXFP4:  # e2m1 times a power of two is exact in bf16
        assert torch.equal(lin16.dequantize().float(), ref)


@pytest.mark.parametrize("arch,fmt", CASES)
def test_logits_match_dequantized_reference(checkpoints, arch, fmt):
    qdir, ddir = checkpoints(arch, fmt)
    quant, dense = engine.load_model(qdir), engine.load_model(ddir)
    cfg = quant.cfg
    ids = torch.randint(0, cfg.vocab_size, (150,), generator=torch.Generator().manual_seed(2)).tolist()
    got, want = engine.prompt_logits(quant, ids), engine.prompt_logits(dense, ids)
    assert (got - want).abs().max().item() < 1e-3
    # The check can fail: the weights before quantization give other logits.
    original = engine.prompt_logits(engine.HybridModel(cfg, seeded_tensors(cfg, 7), "orig"), ids)
    assert (original - want).abs().max().item() > 1e-2
    assert quant.fingerprint != dense.fingerprint
    # Decode (absorbed MLA, batched) over the same weights agrees too.
    steps = []
    for model in (quant, dense):
        cache = model.new_cache(num_pages=16, num_slots=2, block_size=engine.DEFAULT_BLOCK_SIZE)
        seqs = [cache.try_reserve(f"r{i}", 200) for i in range(2)]
        with torch.inference_mode():
            for i, seq in enumerate(seqs):
                model.prefill(cache, seq, ids[: 150 - 37 * i])
            steps.append(model.decode_step(cache, seqs, [5, 9]))
    assert (steps[0] - steps[1]).abs().max().item() < 1e-3


@pytest.mark.parametrize("arch,fmt", CASES)
def test_generation_equals_dequantized_model(checkpoints, arch, fmt):
    qdir, ddir = checkpoints(arch, fmt)
    quant, dense = engine.load_model(qdir), engine.load_model(ddir)
    ids = [(7 * i + 3) % 250 + 1 for i in range(40)]
    for sampling in ({}, {"temperature": 0.9, "top_p": 0.95, "top_k": 50, "seed": 11}):
        got = engine.generate(quant, ids, 24, **sampling)
        assert got == engine.generate(dense, ids, 24, **sampling)
        assert len(got) == 24


@pytest.mark.parametrize("arch,fmt", CASES)
def test_bf16_quantized_close_to_bf16_dequantized(checkpoints, arch, fmt):
    """The bf16 paths (the int4 kernel for INT4) agree with bf16 on the dequantized weights to
    bf16 rounding (the kernel's fp32 accumulation differs from a bf16 matmul's)."""
    qdir, ddir = checkpoints(arch, fmt)
    quant = engine.load_model(qdir, dtype=torch.bfloat16)
    dense = engine.load_model(ddir, dtype=torch.bfloat16)
    expert = quant.blocks[-1].ffn.w.w13[0]
    assert isinstance(expert, Int4KernelLinear if fmt == INT4 else CodebookLinear)
    ids = [(11 * i + 5) % 250 + 1 for i in range(64)]
    got, want = engine.prompt_logits(quant, ids), engine.prompt_logits(dense, ids)
    assert (got - want).abs().max().item() < 0.05 * want.abs().max().item()


@pytest.mark.parametrize("arch,fmt", CASES)
def test_weights_stay_packed(checkpoints, arch, fmt):
    """No full-precision copy of a quantized layer is resident: the routed experts hold 4-bit
    codes and group scales, at most 0.30x of their bf16 bytes."""
    qdir, ddir = checkpoints(arch, fmt)
    quant = engine.load_model(qdir, dtype=torch.bfloat16)
    dense = engine.load_model(ddir, dtype=torch.bfloat16)
    cfg = quant.cfg
    dense_expert = cfg.moe_intermediate_size * cfg.hidden_size
    for blk in quant.blocks:
        if hasattr(blk.ffn, "w"):
            for lin in (*blk.ffn.w.w13, *blk.ffn.w.w2):
                held = [t for t in vars(lin).values() if isinstance(t, torch.Tensor)]
                assert held and not any(t.is_floating_point() and t.numel() >= dense_expert / 8 for t in held)
    q, d = weight_bytes(quant), weight_bytes(dense)
    num_moe = sum(hasattr(blk.ffn, "w") for blk in quant.blocks)
    assert d.routed_experts == num_moe * cfg.num_experts * 3 * dense_expert * 2  # bf16
    assert q.routed_experts <= 0.30 * d.routed_experts
    assert d.total - q.total == d.routed_experts - q.routed_experts  # nothing else changed


def test_quantization_config_decides_which_layers(tmp_path):
    """Shared experts quantized, layer 3's routed experts and the dense MLP left in full precision
    by ``ignore`` patterns; a sharded checkpoint (parts of one linear in different files)."""
    cfg = tiny_config()
    ignore = ("lm_head", "re:.*self_attn.*", "re:.*mlp\\.(gate|up|down)_proj.*", "re:model\\.layers\\.3\\..*")
    qdir, ddir = tmp_path / "q", tmp_path / "d"
    quantized = write_quantized_checkpoint(qdir, cfg, INT4, ignore=ignore, num_shards=3)
    assert "model.layers.3.block_sparse_moe.experts.0.w1.weight" in quantized
    assert "model.layers.1.block_sparse_moe.shared_experts.up_proj.weight_packed" in quantized
    write_dequantized_checkpoint(ddir, cfg, INT4, quantized, ignore=ignore)
    quant = engine.load_model(str(qdir))
    assert isinstance(quant.blocks[3].ffn.w.w13, torch.Tensor)
    assert isinstance(quant.blocks[1].ffn.w.w13[0], CodebookLinear)
    assert isinstance(quant.blocks[1].ffn.w.shared.w_gate_up, CodebookLinear)
    assert isinstance(quant.blocks[0].ffn.w_gate_up, torch.Tensor)
    ids = list(range(1, 90))
    got, want = engine.prompt_logits(quant, ids), engine.prompt_logits(engine.load_model(str(ddir)), ids)
    assert (got - want).abs().max().item() < 1e-3


def test_k2_thinking_int4_matches_transformers_on_dequantized(checkpoints):
    transformers = pytest.importorskip("transformers")
    qdir, ddir = checkpoints("k2", INT4)
    ref = transformers.DeepseekV3ForCausalLM.from_pretrained(ddir, dtype=torch.float32).eval()
    ids = torch.randint(0, 8192, (120,), generator=torch.Generator().manual_seed(4)).tolist()
    got = engine.prompt_logits(engine.load_model(qdir), ids)
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0].float()
    assert (got - want).abs().max().item() < 1e-3
    assert expected_shapes(tiny_k2_config())["model.layers.1.mlp.experts.0.gate_proj.weight"] == (256, 256)


# quantization_config in the shape K2-Thinking's config.json carries it.
K2_THINKING_QUANTIZATION = {
    "config_groups": {"group_0": {
        "input_activations": None, "output_activations": None, "targets": ["Linear"],
        "weights": {"actorder": None, "block_structure": None, "dynamic": False, "group_size": 32, "num_bits": 4,
                    "observer": "minmax", "observer_kwargs": {}, "strategy": "group", "symmetric": True,
                    "type": "int"}}},
    "format": "pack-quantized",
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"],
    "kv_cache_scheme": None, "quant_method": "compressed-tensors", "quantization_status": "compressed",
}


def test_k2_thinking_quantization_config_quantizes_routed_experts_only():
    qcfg = QuantConfig.from_dict(K2_THINKING_QUANTIZATION, "config.json")
    scheme = qcfg.scheme_for("model.layers.5.mlp.experts.383.down_proj", "t")
    assert (scheme.format, scheme.group_size, scheme.group_name) == (INT4, 32, "group_0")
    for dense in ("lm_head", "model.layers.5.self_attn.q_a_proj", "model.layers.5.self_attn.kv_b_proj",
                  "model.layers.5.mlp.shared_experts.gate_proj", "model.layers.0.mlp.down_proj"):
        assert qcfg.scheme_for(dense, "t") is None, dense
    # K2.5 puts the text model under language_model.: its ignore patterns still match.
    assert qcfg.scheme_for("language_model.model.layers.5.self_attn.o_proj", "t") is None
    assert qcfg.scheme_for("language_model.model.layers.5.mlp.experts.0.up_proj", "t").format == INT4
