r"""Load a quantized Hugging Face checkpoint straight into a transformers model.

:func:`from_pretrained` reads a local model directory -- ``config.json`` with its
``quantization_config`` (AWQ, GPTQ v1/v2 with or without act-order, compressed-tensors
pack-quantized, or a mixgemm checkpoint: :mod:`mixgemm.formats.config` says what each means) and
its safetensors shards -- and returns the transformers model (``AutoModelForCausalLM``) with
every quantized ``nn.Linear`` replaced by a :class:`~mixgemm.nn.QuantLinear` filled from the
checkpoint's own codes, scales and zero points, converted without re-quantizing
(:mod:`mixgemm.formats`).

It never builds a full-precision copy of the quantized layers: the model is instantiated on the
meta device (its parameters hold no memory; its buffers, e.g. the rotary frequencies, are
computed as the model computes them), each quantized layer is converted and prepacked on its
own, and only the other tensors (embeddings, norms, the LM head, layers kept in full precision)
are read at their full size. One log line (logger ``mixgemm.hf``, level INFO) gives the bytes
the model holds against what bf16 weights would take.

It works in two steps, and the first touches no device:

1. On the CPU: parse the config, open every shard (a truncated or corrupt file is refused
   here), build the model on the meta device, import and prepack every quantized layer (the
   bits and group size of the config are checked against the tensors), fuse the attentions'
   q, k and v projections and the gated MLPs' gate and up projections, and check every other
   tensor's shape against the model's. A
   missing, unknown or mis-shaped tensor raises :class:`~mixgemm.errors.CheckpointError` (a
   layer whose tensors do not form a valid layer: :class:`~mixgemm.errors.FormatError`) here,
   before anything is allocated on the device.
2. On the device: wrap the packed weights in ``QuantLinear`` modules and load the other tensors.

The projections are fused as :func:`mixgemm.nn.quantize_model` fuses them (``fuse_projections``),
into the same modules (:mod:`mixgemm.nn.blocks`): four GEMM launches per LLaMA-style decoder layer
instead of seven.

* Attentions of a recognized family (LLaMA, Mistral, Mixtral, Qwen2, Qwen3 and their MoE
  variants: :data:`mixgemm.nn.blocks.ATTENTIONS`) whose q, k and v projections agree on bits,
  group size, symmetry, dtype, zero offsets, bias and act-order permutation become a
  :class:`FusedQKVAttention`: one QuantLinear holds the three weights stacked along N
  (``[q; k; v]``: codes, scales, zeros and biases as the checkpoint holds them, nothing
  re-quantized) and computes q, k and v in one launch.
* Gated MLPs (modules with ``gate_proj``, ``up_proj`` and ``down_proj`` linears and a SiLU
  ``act_fn``, e.g. LLaMA's, Mistral's, Qwen2's) whose gate and up projections have the same
  weight type, group size and act-order permutation become a :class:`GatedMLP`: one
  ``QuantLinear(activation="swiglu")`` computes ``silu(gate(x)) * up(x)`` in one launch
  (:func:`mixgemm.weights.quantize.interleave_gate_up`), then ``down_proj``.

Where the parts disagree they stay separate layers, and the ``mixgemm.hf`` logger (INFO) says
why (``mixgemm.hf: model.layers.3.self_attn: q, k and v not fused: ...``); a model with no
recognized attention keeps its q, k and v apart, with a log line that says so. With
``fuse_layers=True`` each decoder layer then becomes a :class:`mixgemm.nn.blocks.FusedDecoderLayer`
(:func:`mixgemm.nn.blocks.fuse_decoder_layers`), as ``quantize_model(..., fuse_layers=True)`` makes it.

A layer mixgemm cannot represent (a shape the kernels cannot take, 3-bit codes, ...: the
importers raise :class:`~mixgemm.errors.UnsupportedLayerError`) is kept as an ``nn.Linear``
holding its weight dequantized with its format's own formula
(:func:`mixgemm.hf.dequant.dequantize_layer`), with a warning that names it and says why.

transformers is an optional dependency (``pip install 'mixgemm[hf]'``), imported when
:func:`from_pretrained` is called; the rest of the package needs none of it.

Tensor parallelism: ``from_pretrained(..., tp_rank=r, tp_size=P)`` in each of ``P`` processes
(``torchrun --nproc-per-node P``, ``torch.distributed`` initialized with NCCL, ``device=f"cuda:{r}"``)
loads the rank's part of the model: column-parallel q/k/v and gate/up, row-parallel o and down
(one all-reduce each), the heads and MLP features divided by ``P``, the embeddings and
``lm_head`` replicated (:mod:`mixgemm.hf.parallel`). Each rank reads and keeps only its slices;
a fused q/k/v layer stacks the rank's rows of each (``[q_r; k_r; v_r]``), and its
:class:`FusedQKVAttention` has the rank's heads.

Modules: :mod:`~mixgemm.formats.config` (the ``quantization_config``), :mod:`~mixgemm.hf.shards`
(reading the safetensors shards), :mod:`~mixgemm.hf.dequant` (the formats' own formulas),
:mod:`~mixgemm.hf.parallel` (tensor parallelism),
:mod:`~mixgemm.hf.plan` (step 1), :mod:`~mixgemm.hf.materialize` (step 2).
"""
from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Optional, Union

import torch
from torch import nn

from ..aot import prebuild as _prebuild
from ..formats.config import resolve_dtype
from ..nn.blocks import fuse_decoder_layers
from ..nn.linear import apply_act_format, QuantLinear
from ..nn.parallel import tp_rank_and_size
from ..ops.fp8 import unknown_act_format
from ..ops.norm import replace_rms_norms
from . import materialize as _step2
from . import plan as _step1
from .materialize import FusedQKVAttention, GatedMLP, LoadSummary
from .parallel import TensorParallel

__all__ = ["from_pretrained", "FusedQKVAttention", "GatedMLP", "LoadSummary"]

_log = logging.getLogger("mixgemm.hf")


def _import_transformers():
    try:
        import transformers   # deferred: optional dependency (mixgemm[hf])
    except ImportError as e:
        raise ImportError("mixgemm.hf needs transformers: pip install 'mixgemm[hf]' "
                          "(or pip install transformers)") from e
    return transformers


def from_pretrained(model_dir: Union[str, Path], device: Union[str, torch.device] = "cuda",
                    dtype: Union[torch.dtype, str, None] = None, *, fuse_projections: bool = True,
                    fuse_gate_up: Optional[bool] = None, fuse_norms: bool = True, fuse_layers: bool = False,
                    attn_implementation: Optional[str] = None, prebuild: bool = False,
                    jobs: Optional[int] = None, tp_rank: Optional[int] = 0, tp_size: Optional[int] = 1,
                    tp_group=None, act_format: str = "bf16") -> nn.Module:
    """Load a quantized checkpoint directory into a transformers causal-LM model.

    Parameters
    ----------
    model_dir : str or Path
        A local directory: ``config.json`` with a ``quantization_config`` whose ``quant_method``
        is ``"awq"``, ``"gptq"``, ``"compressed-tensors"`` or ``"mixgemm"``
        (:mod:`mixgemm.formats.config`), and its ``*.safetensors`` shards (with
        ``model.safetensors.index.json`` when sharded). ``generation_config.json`` is read if
        present.
    device : str or torch.device, default "cuda"
        Where the model goes. The QuantLinear layers run on an sm_90 GPU; ``"cpu"`` loads the
        model (to inspect or convert it) but cannot run them.
    dtype : torch.dtype or str, optional
        The activation dtype, bf16 or fp16: of the QuantLinear scales, the other weights and the
        computation. Default: the config's ``torch_dtype`` (``dtype``) if it is one of them, else
        bf16. A checkpoint whose scales are in the other dtype has them rounded (see
        :mod:`mixgemm.formats`, "Bit-exactness").
    fuse_projections : bool, default True
        As for :func:`mixgemm.nn.quantize_model`: fuse each recognized attention's q, k and v
        projections into one QuantLinear (:class:`FusedQKVAttention`) and each gated MLP's gate
        and up into one swiglu QuantLinear (:class:`GatedMLP`), where the parts agree (see the
        module docstring). False: every quantized layer is its own QuantLinear (unless
        ``fuse_gate_up=True`` asks for the gate/up fusion alone).
    fuse_gate_up : bool, optional
        The gate/up fusion alone: None (default) follows ``fuse_projections``; False keeps gate
        and up apart while q, k and v are fused; True fuses them even with
        ``fuse_projections=False``.
    fuse_norms : bool, default True
        Replace the model's LLaMA-style RMSNorm modules (``LlamaRMSNorm``, ``Qwen2RMSNorm``,
        ``MistralRMSNorm``, ...: :data:`mixgemm.ops.norm.LLAMA_STYLE_NORMS`) by
        :class:`mixgemm.nn.RMSNorm`, their weights shared: one kernel launch per norm on an
        sm_90 GPU instead of transformers' ~7, the same formula rounded once (at most an ulp of
        the dtype from transformers' result).
    fuse_layers : bool, default False
        Also replace each decoder layer whose projections were fused (a
        :class:`FusedQKVAttention`, a :class:`GatedMLP` and LLaMA-style norms) by a
        :class:`mixgemm.nn.blocks.FusedDecoderLayer` (:func:`mixgemm.nn.blocks.fuse_decoder_layers`,
        after the norms are replaced), and make transformers' static cache ``generate()``'s
        default (``generation_config.cache_implementation = "static"``) with
        :func:`mixgemm.nn.guards.decode_compile_config` as its compile config, as
        ``quantize_model(..., fuse_layers=True)`` does. Needs ``fuse_projections`` and the
        gate/up fusion.
    attn_implementation : str, optional
        Passed to transformers (``"sdpa"``, ``"eager"``, ...); default transformers' choice.
    prebuild : bool, default False
        Before returning, build (or find in the kernel cache) every kernel the model's
        QuantLinear layers can select at any token count, in parallel with a progress bar, and
        the compiled launcher (:func:`mixgemm.aot.prebuild.build_for`): no call then waits for
        nvcc. Without it each kernel compiles on its first use (65-100 s for a GEMM kernel).
        ``mixgemm generate --build --for MODEL_DIR`` builds the same set ahead of time.
    jobs : int, optional
        Parallel nvcc builds for ``prebuild`` (default: half the CPU cores; each takes about
        5 GB of memory).
    tp_rank, tp_size : int, default 0, 1
        Tensor parallelism (:mod:`mixgemm.hf.parallel`): load this rank's part of the model,
        with ``num_attention_heads``, ``num_key_value_heads`` and ``intermediate_size``
        divided by ``tp_size``; q/k/v and gate/up become
        :class:`~mixgemm.nn.ColumnParallelQuantLinear` (not gathered), o and down
        :class:`~mixgemm.nn.RowParallelQuantLinear` (all-reduce); embeddings and ``lm_head``
        are replicated, so every rank computes the whole logits. Run the model in every rank
        at once (the all-reduces wait for each other), each on its own ``device``. ``None``:
        the initialized process group's rank / size.
    tp_group : torch.distributed.ProcessGroup, optional
        The group of the all-reduces (default: the world, which must then have ``tp_size``
        ranks if initialized).
    act_format : {"bf16", "fp8", "auto"}, default "bf16"
        The activations of the quantized layers (:class:`~mixgemm.nn.QuantLinear`'s
        ``act_format``). ``"fp8"`` rounds each call's activations to e4m3 with a scale per token
        and runs the e4m3 GEMM (docs/fp8.md): the numerics change. A layer the e4m3 kernels do
        not compute (8-bit codes, fractional zero points, a group size that is not a multiple
        of 32) keeps bf16 activations;
        ``model.mixgemm_summary.bf16_activations`` names it with the reason. A compressed-tensors
        checkpoint's static input scales (W4A8, ``dynamic: false``) are applied: each layer
        quantizes with its own, a fused q/k/v or gate/up layer with the largest of its parts'
        (they are kept on the layers, unused, with ``"bf16"``). ``"auto"``: per call, the e4m3
        path where the GPU's tuning table measured it faster for the layer and token count,
        else exact activations (the numerics change with M). Neither with tensor parallelism.

    Returns
    -------
    transformers.PreTrainedModel
        In eval mode, without gradients, every tensor on ``device``; ``model.mixgemm_summary``
        is its :class:`LoadSummary` (its ``fused_attentions``, ``fused`` MLPs and
        ``fused_layers``: what was fused), which is also logged (logger ``mixgemm.hf``, INFO).
        ``model.generate()`` works in eager mode and with ``cache_implementation="static"``
        under ``torch.compile``.

    Raises
    ------
    ImportError
        transformers is not installed.
    ValueError
        A bad ``device``, ``dtype`` or ``act_format``, ``device="cuda"`` without CUDA,
        ``fuse_layers=True`` without the fused projections, or ``act_format="fp8"`` with
        ``tp_size > 1``.
    CheckpointError
        A missing directory, config or shard; a shard that is not valid safetensors (truncated,
        corrupt); a missing tensor, one the model does not have, or a shape that disagrees with
        the config; an unsupported ``quant_method`` or format variant. Raised before anything is
        put on the device.
    FormatError
        A layer's tensors do not form a valid layer of its format, or disagree with the bits or
        group size of the config (the message names the layer). Raised before anything is put
        on the device.
    BuildError
        ``prebuild``: a kernel did not build (the others are built and cached).
    ShardError
        ``tp_size`` does not divide the heads, KV heads or intermediate size; a layer's shard
        would cut a 16-row or 64-column atom or a group; an act-order layer would be split
        along K; a linear layer that is not a LLaMA-family projection. Raised before anything
        is put on the device.

    Warns
    -----
    UserWarning
        For each quantized layer kept in full precision, with the reason.
    """
    transformers = _import_transformers()
    device = torch.device(device)
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"device must be a CUDA device (or 'cpu' to load without running), got {device}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={str(device)!r}, but CUDA is not available")
    if dtype is not None:
        resolve_dtype(dtype, {})
    if jobs is not None and (isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1):
        raise ValueError(f"jobs must be a positive int, got {jobs!r}")
    fuse_gate_up = fuse_projections if fuse_gate_up is None else fuse_gate_up
    if fuse_layers and not (fuse_projections and fuse_gate_up):
        raise ValueError("fuse_layers=True needs fuse_projections=True and the gate/up fusion (a fused layer runs "
                         "the fused projections)")

    why = unknown_act_format(act_format)
    if why:
        raise ValueError(why)
    tp_rank, tp_size = tp_rank_and_size(tp_rank, tp_size, tp_group)
    if act_format in ("fp8", "auto") and tp_size > 1:
        raise ValueError(f"act_format={act_format!r} does not run tensor-parallel yet: a row-parallel layer's rank sees part "
                         "of each token's activations, so the ranks would scale a token differently")
    tp = TensorParallel(tp_rank, tp_size, tp_group)
    model_dir = Path(model_dir)
    plan = _step1.plan(transformers, model_dir, dtype, fuse_gate_up, attn_implementation, tp,   # no device work
                       fuse_qkv=fuse_projections)
    try:
        quantized = list(plan.quantized)
        model = _step2.materialize(plan, device)
    finally:
        plan.shards.close()
    gen = model_dir / "generation_config.json"
    if gen.is_file():
        try:
            model.generation_config = transformers.GenerationConfig.from_pretrained(str(model_dir))
        except (OSError, ValueError) as e:
            warnings.warn(f"mixgemm.hf: ignoring {gen}: {e}", stacklevel=2)
    summary = _step2.summary(model, plan, model_dir, quantized)
    if fuse_norms:
        summary.norms = replace_rms_norms(model)
    if fuse_layers:
        summary.fused_layers = fuse_decoder_layers(model)
    if act_format != "bf16":
        kept = apply_act_format(((n, m) for n, m in model.named_modules() if isinstance(m, QuantLinear)), act_format)
        if kept:
            _log.info("mixgemm.hf: %d quantized layer(s) keep bf16 activations (act_format=%r): %s", len(kept),
                      act_format, "; ".join(sorted(set(kept.values()))))
        summary.bf16_activations = kept
    model.mixgemm_summary = summary
    _log.info("%s", summary)
    if prebuild:
        arts = _prebuild.build_for(model, jobs=jobs, progress=True)   # (the fused layers' kernels included)
        _log.info("mixgemm.hf: %d kernels built or found in the cache", len(arts))
    return model

