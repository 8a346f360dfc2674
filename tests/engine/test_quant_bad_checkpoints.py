"""Bad quantized checkpoints: each refused before any model is built, naming the file and tensor."""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

import engine
from engine.checkpoint import CheckpointError, expected_shapes, seeded_tensors
from engine.config import tiny_k2_config
from engine.quant import INT4, MXFP4, reference
from tests.checkpoint_support import write_quantized_checkpoint

EXPERT = "model.layers.1.mlp.experts.3.up_proj"
_TENSORS: dict = {}


def _quantized(fmt: str) -> dict[str, torch.Tensor]:
    if fmt not in _TENSORS:
        cfg = tiny_k2_config()
        _TENSORS[fmt] = reference.quantize(seeded_tensors(cfg, 5), reference.quantization_config(fmt),
                                           expected_shapes(cfg))
    return dict(_TENSORS[fmt])


def _write(tmp_path, fmt=INT4, edit=None, qconfig_edit=None):
    tensors = _quantized(fmt)
    if edit:
        edit(tensors)
    write_quantized_checkpoint(tmp_path, tiny_k2_config(), fmt, tensors=tensors)
    if qconfig_edit:
        path = tmp_path / "config.json"
        raw = json.loads(path.read_text())
        qconfig_edit(raw["quantization_config"])
        path.write_text(json.dumps(raw))
    return str(tmp_path)


def _fails(directory: str, *patterns: str) -> None:
    with pytest.raises(CheckpointError) as err:
        engine.load_model(directory)
    for p in patterns:
        assert re.search(p, str(err.value)), str(err.value)


def test_a_good_one_loads(tmp_path):
    assert engine.load_model(_write(tmp_path, MXFP4)).cfg.num_experts == 8


def test_unknown_quantization_format(tmp_path):
    d = _write(tmp_path, qconfig_edit=lambda q: q.update(format="nvfp4-pack-quantized"))
    _fails(d, r"model\.safetensors: tensor model\.layers\.\d+\.mlp\.experts\.\d+\.\w+_proj",
           "quantization format 'nvfp4-pack-quantized'", r"config\.json: quantization_config\.config_groups\.group_0",
           "pack-quantized and mxfp4-pack-quantized")
    d2 = _write(tmp_path / "b", qconfig_edit=lambda q: q.update(quant_method="fp8"))
    _fails(d2, r"config\.json: quantization_config\.quant_method 'fp8' is not supported")
    d3 = _write(tmp_path / "c", qconfig_edit=lambda q: q["config_groups"]["group_0"].update(format="gguf"))
    _fails(d3, r"config\.json: quantization_config is not a valid compressed-tensors config",
           r"config_groups\.group_0\.format")


def test_missing_scale(tmp_path):
    d = _write(tmp_path, edit=lambda t: t.pop(EXPERT + ".weight_scale"))
    _fails(d, f"missing tensor {re.escape(EXPERT)}\\.weight_scale", f"{re.escape(EXPERT)}\\.weight_packed in .*"
           r"model\.safetensors")


def test_packed_shape_that_does_not_match_weight_shape(tmp_path):
    def shorten(t):
        t[EXPERT + ".weight_packed"] = t[EXPERT + ".weight_packed"][:, :-1].contiguous()

    d = _write(tmp_path, edit=shorten)
    _fails(d, rf"model\.safetensors: tensor {re.escape(EXPERT)}\.weight_packed is \[256, 31\] torch\.int32",
           r"weight_shape \[256, 256\] needs \[256, 32\]")


def test_scale_shape_that_does_not_match(tmp_path):
    def drop_group(t):
        t[EXPERT + ".weight_scale"] = t[EXPERT + ".weight_scale"][:, :-1].contiguous()

    _fails(_write(tmp_path, edit=drop_group), rf"tensor {re.escape(EXPERT)}\.weight_scale is \[256, 7\]",
           r"group_size 32 needs \[256, 8\]")


def test_weight_shape_that_does_not_match_the_config(tmp_path):
    wide = torch.tensor([256, 512], dtype=torch.int32)
    d = _write(tmp_path, edit=lambda t: t.update({EXPERT + ".weight_shape": wide}))
    _fails(d, rf"model\.safetensors: tensor {re.escape(EXPERT)}\.weight_shape is \[256, 512\], the config expects "
           r"\[256, 256\]")


def test_group_size_that_does_not_divide_the_input(tmp_path):
    def group_48(q):
        q["config_groups"]["group_0"]["weights"]["group_size"] = 48

    _fails(_write(tmp_path, qconfig_edit=group_48), r"model\.safetensors: tensor model\.layers\.\d+\.mlp\.experts\.\d+"
           r"\.\w+\.weight_packed: group_size 48 \(config group group_0\) does not divide the input dimension 256")


def test_mxfp4_needs_blocks_of_32(tmp_path):
    def group_64(q):
        q["config_groups"]["group_0"]["weights"]["group_size"] = 64

    _fails(_write(tmp_path, MXFP4, qconfig_edit=group_64), r"group_size=64 \(MXFP4 blocks are 32 values\)")


def test_activation_quantization_refused(tmp_path):
    def w4a4(q):
        q["config_groups"]["group_0"]["input_activations"] = {"num_bits": 4, "type": "int", "strategy": "token",
                                                              "dynamic": True, "symmetric": True}

    _fails(_write(tmp_path, qconfig_edit=w4a4), "quantizes activations; Tidekv computes weight-only")


def test_quantized_attention_refused_by_name(tmp_path):
    def no_ignore(q):
        q["ignore"] = ["lm_head"]

    _fails(_write(tmp_path, qconfig_edit=no_ignore),
           r"tensor model\.layers\.0\.(self_attn|mlp)\.\w+ is quantized", "feed-forward layers only")


def test_dense_tensor_where_the_config_quantizes(tmp_path):
    def densify(t):
        for part in ("weight_packed", "weight_scale", "weight_shape"):
            t.pop(f"{EXPERT}.{part}")
        t[EXPERT + ".weight"] = torch.zeros(256, 256)

    _fails(_write(tmp_path, edit=densify), rf"tensor {re.escape(EXPERT)}\.weight is stored dense",
           r"expected .*weight_packed")


def test_quantized_parts_the_config_leaves_dense(tmp_path):
    def ignore_layer_1(q):
        q["ignore"].append("re:model\\.layers\\.1\\..*")

    _fails(_write(tmp_path, qconfig_edit=ignore_layer_1),
           r"model\.safetensors: tensor model\.layers\.1\.mlp\.experts\.\d+\.\w+\.weight_\w+ is a quantized part",
           "leaves .* dense")


def test_wrong_packed_dtype_names_the_shard(tmp_path):
    tensors = _quantized(INT4)
    write_quantized_checkpoint(tmp_path, tiny_k2_config(), INT4, tensors=tensors, num_shards=3)
    shard = next(p for p in sorted(tmp_path.glob("model-*.safetensors")) if EXPERT + ".weight_packed" in load_file(p))
    part = load_file(shard)
    part[EXPERT + ".weight_packed"] = part[EXPERT + ".weight_packed"].to(torch.int64)
    save_file(part, str(shard))
    _fails(str(tmp_path), rf"{re.escape(shard.name)}: tensor {re.escape(EXPERT)}\.weight_packed is \[256, 32\] "
           r"torch\.int64", "torch.int32")
