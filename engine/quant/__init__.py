"""Quantized weights as the Kimi family ships them, computed weight-only.

Formats (compressed-tensors names): ``pack-quantized`` INT4 (K2-Thinking and later) and
``mxfp4-pack-quantized`` MXFP4 (K3's experts). The checkpoint's ``quantization_config``
decides which linears are quantized (``formats``); the loader reads their parts into
``PackedWeight`` (``loader``, ``packed``); the model runs them through ``ops.linear`` /
``ops.fused`` / ``ops.stacked`` (``kernels``: torch's CPU int4 kernel, or a codebook tile
expanded per call). ``reference`` writes and dequantizes checkpoints with compressed-tensors
itself; ``accounting`` counts a model's resident weight bytes.

Importing this package is light: compressed-tensors (and transformers) load only when a
quantized checkpoint does.
"""

from engine.quant.formats import INT4, MXFP4, SUPPORTED_FORMATS, QuantConfig, load_quant_config
from engine.quant.ops import fused, linear, stacked
from engine.quant.packed import PackedWeight

__all__ = ["INT4", "MXFP4", "SUPPORTED_FORMATS", "PackedWeight", "QuantConfig", "fused", "linear",
           "load_quant_config", "stacked"]
