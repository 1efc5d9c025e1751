"""The benchmark harness (``mixgemm bench``): mixgemm against cuBLAS and its peers.

Every implementation runs in one process, on the same GPU, on the same random inputs:

* ``cublas``: ``torch.nn.functional.linear(x, W)`` on the dense weight (the float weight rounded
  to the activation dtype): the baseline every speedup is measured against. Always run.
* ``torch_int4``: PyTorch's tinygemm kernel (``aten._convert_weight_to_int4pack`` +
  ``aten._weight_int4pack_mm``), bf16 activations, asymmetric int4.
* ``gemlite-u4``, ``gemlite-u2``: gemlite's Triton kernels (``GemLiteLinearTriton`` through
  ``gemlite.helper.A16Wn``), asymmetric 4- and 2-bit.
* ``scaled_mm``: ``torch._scaled_mm`` e4m3 x e4m3 with per-row scales on both (the W8A8-FP8
  GEMM): the weight quantized once, the activations per token in the timed call.
* ``mixgemm-<wt>`` for wt in s8, u8, s4, u4, s2, u2: :func:`mixgemm.ops.gemm` (the heuristic's
  kernel); with ``--all-configs`` also ``mixgemm-<wt>@<label>``, one per
  :data:`mixgemm.jit.catalog.TILE_CONFIGS` entry, through :func:`mixgemm.ops.gemm_with_spec`.
* ``mixgemm-<wt>-fp8`` for wt in s4, u4, s2, u2: ``mixgemm.gemm(x, w, act_format="fp8")``, x
  rounded to e4m3 per token (the quantizer is in the timed call) and the e4m3 GEMM.

One module per concern:

* :mod:`.timing`: CUDA-event timing with the L2 flushed, the copy / read bandwidth and the dense
  rate measured in the same process;
* :mod:`.peers`: the implementations' adapters; :mod:`.peer_formats`: the peers' weight conventions;
* :mod:`.grid`: the default mode, every implementation x layer shape x token count, and its
  analysis (bytes, GB/s, speedups, FAIL flags);
* :mod:`.block`: ``--block``, a LLaMA MLP block under CUDA graphs;
* :mod:`.decoder`, :mod:`.variants`, :mod:`.model`, :mod:`.model_run`: ``--model``, a decoder
  layer stack with a real model's shapes (the layer, the bf16 / mixgemm (exact or e4m3
  activations) / torch int4 / scaled_mm variants, what is reported, the GPU run);
* :mod:`.moe`, :mod:`.moe_run`: ``--moe``, one mixture-of-experts layer with a real model's expert
  shapes (bf16 ``torch._grouped_mm``, torch int4 per expert, mixgemm's ``fused_moe``) under CUDA
  graphs: what is reported, and the GPU run;
* :mod:`.host`: ``--host``, the host's microseconds per call and the eager decode step;
* :mod:`.generate`, :mod:`.generate_run`: ``--generate``, transformers' ``generate()`` on a causal
  LM with a preset's shapes (or a model directory), bf16 against mixgemm's weight types (exact,
  e4m3 or per-call activations) with and without ``fuse_layers``, in four modes (eager, torch.compile, generate()'s own compile with a
  static cache, reduce-overhead): what is reported, and the GPU run;
* :mod:`.report` and :mod:`.plots`: tables, JSON, merges and plots; :mod:`.preset_report`: the
  report that ``--model`` and ``--moe`` share (JSON, split per preset, merge, table layout);
* :mod:`.options` and :mod:`.command`: the command line (``add_arguments``; ``run_cli``, ``main``).

Everything that needs no GPU (byte counting, bandwidth, speedups, the best-peer choice, the
tables, the JSON, the plots, the decoder layer's math) is a pure function of its inputs, tested
on the CPU. The package never imports :mod:`mixgemm.cli.main`; its errors come from
:mod:`mixgemm.errors`.
"""
from ..errors import BenchError, CliError
from .block import BLOCK_HIDDEN, BLOCK_INTERMEDIATE, BlockResult, bench_block, run_block_cli
from .command import NO_GPU_MESSAGE, list_kernels, main, require_cuda, run_cli, write_model_outputs, write_outputs
from .options import (add_arguments, build_parser, config_from_args, host_step_config, model_config_from_args,
                      parse_int_list, parse_name_list, parse_presets, parse_shapes)
from .decoder import PRESETS, DecoderStack, DenseProjections, LayerState, ModelPreset, Projections, Rotary
from .grid import (ACT_BYTES, DEFAULT_CHECK_ROWS, DEFAULT_GROUP_SIZE, DEFAULT_MAX_ERROR, DEFAULT_MS,
                   DEFAULT_PEER_MAX_ERROR, DEFAULT_SEED, DEFAULT_SHAPES, DEFAULT_WARMUP, ERROR, FAIL, MIN_ITERS, OK,
                   QUICK_ITERS, QUICK_WARMUP, UNAVAILABLE, WEIGHT_STD, BenchConfig, Measurement, PointResult, analyze,
                   check_rows, classify, e4m3_activations, error_bar, expected_weight_bytes, fp8_error_bar,
                   reference_matmul, reference_product, relative_error, run_benchmark, traffic_bytes)
from .host import HOST_SCHEMA, HostPoint, HostReport, format_host_table, host_report_from_dict, host_report_to_dict
from .model import (MODEL_SCHEMA, LayerTraffic, ModelConfig, ModelPoint, ModelReport, StepMeasurement, StepShape,
                    analyze_model, format_model_table, layer_traffic, merge_model_reports, model_report_from_dict,
                    model_report_to_dict, split_by_preset)
from .peer_formats import (TORCH_INT4_GROUP_SIZES, TORCH_INT4_INNER_K_TILES, ImplUnavailable, e4m3_rows,
                           gemlite_dequant, scaled_mm, scaled_mm_problem, scaled_mm_weight, torch_int4_dequant,
                           torch_int4_mm, torch_int4_pack, torch_int4_params)
from .peers import (BASELINE, E4M3, EXACT, MIXGEMM_FP8_TYPES, MIXGEMM_TYPES, NAMED_ONLY, PEER_NAMES, SCALED_MM,
                    CublasImpl, GemliteImpl, Impl, MixgemmImpl, QuantCache, ScaledMmImpl, TorchInt4Impl,
                    activations_of, exact_weight, impl_names, is_peer, make_impls, select_impl_names)
from .plots import write_model_plot, write_plot
from .report import (JSON_SCHEMA, BenchReport, MachineInfo, default_results_root, format_table, machine_info,
                     merge_reports, read_json, report_from_dict, report_to_dict, results_dir, slugify, write_json)
from .timing import (COPY_BYTES, DENSE_N, FLUSH_L2_MULTIPLE, HOST_LEAD_CYCLES, Clock, CudaEventClock, TimingStats,
                     effective_gbps, flush_size, measure_copy_bandwidth, measure_dense_tflops, measure_read_bandwidth,
                     summarize_times, tflops, time_cuda)
from .variants import Variant, VariantKind, layer_weight_bytes, parse_variants
from .moe import (MOE_PRESETS, MOE_SCHEMA, MoeConfig, MoeMeasurement, MoePoint, MoePreset, MoeReport, analyze_moe,
                  format_moe_table, make_routing, moe_report_from_dict, moe_report_to_dict, moe_traffic)
from .command import write_moe_outputs
from .options import moe_config_from_args
from .plots import write_moe_plot
from .generate import (GEN_MODES, GENERATE_SCHEMA, GenerateConfig, GenerateReport, GenMeasurement, GenPoint,
                       analyze_generate, format_generate_table)
from .command import run_generate_cli, write_generate_outputs
from .options import generate_config_from_args
from .plots import write_generate_plot

#: Every name above: the public API of ``mixgemm.bench`` (tests and tools import them from here).
__all__ = [
    "BenchError", "CliError", "BLOCK_HIDDEN", "BLOCK_INTERMEDIATE", "BlockResult", "bench_block",
    "run_block_cli", "NO_GPU_MESSAGE", "add_arguments", "build_parser", "config_from_args", "host_step_config",
    "list_kernels", "main", "model_config_from_args", "parse_int_list", "parse_name_list", "parse_presets",
    "parse_shapes", "require_cuda", "run_cli", "write_model_outputs", "write_outputs", "PRESETS",
    "DecoderStack", "DenseProjections", "LayerState", "ModelPreset", "Projections", "Rotary", "ACT_BYTES",
    "DEFAULT_CHECK_ROWS", "DEFAULT_GROUP_SIZE", "DEFAULT_MAX_ERROR", "DEFAULT_MS", "DEFAULT_PEER_MAX_ERROR",
    "DEFAULT_SEED", "DEFAULT_SHAPES", "DEFAULT_WARMUP", "ERROR", "FAIL", "MIN_ITERS", "OK", "QUICK_ITERS",
    "QUICK_WARMUP", "UNAVAILABLE", "WEIGHT_STD", "BenchConfig", "Measurement", "PointResult", "analyze",
    "check_rows", "classify", "e4m3_activations", "error_bar", "expected_weight_bytes", "fp8_error_bar",
    "reference_matmul", "reference_product", "relative_error", "run_benchmark", "traffic_bytes",
    "HOST_SCHEMA", "HostPoint", "HostReport", "format_host_table", "host_report_from_dict",
    "host_report_to_dict", "MODEL_SCHEMA", "LayerTraffic", "ModelConfig", "ModelPoint", "ModelReport",
    "StepMeasurement", "StepShape", "analyze_model", "format_model_table", "layer_traffic",
    "merge_model_reports", "model_report_from_dict", "model_report_to_dict", "split_by_preset", "BASELINE",
    "MIXGEMM_TYPES", "PEER_NAMES", "TORCH_INT4_GROUP_SIZES", "TORCH_INT4_INNER_K_TILES", "CublasImpl",
    "GemliteImpl", "Impl", "ImplUnavailable", "MixgemmImpl", "QuantCache", "TorchInt4Impl", "gemlite_dequant",
    "E4M3", "EXACT", "MIXGEMM_FP8_TYPES", "NAMED_ONLY", "SCALED_MM", "ScaledMmImpl", "activations_of",
    "exact_weight", "e4m3_rows", "scaled_mm", "scaled_mm_problem", "scaled_mm_weight",
    "impl_names", "is_peer", "make_impls", "select_impl_names", "torch_int4_dequant", "torch_int4_mm",
    "torch_int4_pack", "torch_int4_params", "write_model_plot", "write_plot", "JSON_SCHEMA", "BenchReport",
    "MachineInfo", "default_results_root", "format_table", "machine_info", "merge_reports", "read_json",
    "report_from_dict", "report_to_dict", "results_dir", "slugify", "write_json", "COPY_BYTES", "DENSE_N",
    "FLUSH_L2_MULTIPLE", "HOST_LEAD_CYCLES", "Clock", "CudaEventClock", "TimingStats", "effective_gbps",
    "flush_size", "measure_copy_bandwidth", "measure_dense_tflops", "measure_read_bandwidth", "summarize_times",
    "tflops", "time_cuda", "Variant", "VariantKind", "layer_weight_bytes", "parse_variants",
    "MOE_PRESETS", "MOE_SCHEMA", "MoeConfig", "MoeMeasurement", "MoePoint", "MoePreset", "MoeReport", "analyze_moe",
    "format_moe_table", "make_routing", "moe_report_from_dict", "moe_report_to_dict", "moe_traffic",
    "write_moe_outputs", "moe_config_from_args", "write_moe_plot",
    "GEN_MODES", "GENERATE_SCHEMA", "GenerateConfig", "GenerateReport", "GenMeasurement", "GenPoint",
    "analyze_generate", "format_generate_table", "run_generate_cli", "write_generate_outputs",
    "generate_config_from_args", "write_generate_plot",
]
