"""torch.nn modules over mixgemm's kernels: :class:`QuantLinear` (:mod:`.linear`), :class:`QuantMoE`
(:mod:`.moe`), the tensor-parallel layers (:mod:`.parallel`) and the fused transformer blocks
with :func:`quantize_model` (:mod:`.blocks`)."""
from ..ops.dense import gemm_op
from ..ops.norm import RMSNorm
from .blocks import quantize_model
from .linear import QuantizeSummary, QuantLinear, unsupported_reason
from .moe import QuantMoE
from .parallel import ColumnParallelQuantLinear, RowParallelQuantLinear
from .static_kv import release_kv_storage

__all__ = ["QuantLinear", "QuantizeSummary", "gemm_op", "unsupported_reason", "RMSNorm", "quantize_model",
           "QuantMoE", "ColumnParallelQuantLinear", "RowParallelQuantLinear", "release_kv_storage"]
