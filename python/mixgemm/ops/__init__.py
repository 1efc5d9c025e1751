"""The GPU operators: the mixed-input GEMM (:mod:`.dense`, and with e4m3 activations
:mod:`.fp8`; the argument checks both share in :mod:`.args`), RMSNorm (:mod:`.norm`), rotary
embedding (:mod:`.rotary`) and a decoder layer's decode step in one call (:mod:`.layer`),
registered as ``torch.ops.mixgemm`` (:mod:`mixgemm.dispatch.library`)."""
from .dense import dequantize, gemm, gemm_op, gemm_with_spec, select_spec, select_tile, supports
from .fp8 import dequantize_fp8, quantize_fp8, quantize_fp8_reference
from .layer import decode_layer
from .norm import LLAMA_STYLE_NORMS, RMSNorm, norm_spec, replace_rms_norms, rms_norm
from .rotary import rope_spec, rotary_kv_cache, rotate

__all__ = ["gemm", "gemm_op", "gemm_with_spec", "dequantize", "supports", "select_tile", "select_spec",
           "rms_norm", "norm_spec", "RMSNorm", "replace_rms_norms", "LLAMA_STYLE_NORMS",
           "rotary_kv_cache", "rope_spec", "rotate", "quantize_fp8", "quantize_fp8_reference", "dequantize_fp8",
           "decode_layer"]
