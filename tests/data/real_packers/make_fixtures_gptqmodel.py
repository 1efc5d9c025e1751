"""Write tests/data/real_packers/gptqmodel/ (the fixtures of tests/formats/test_formats_gptqmodel_real.py)
with GPTQModel itself.

Sibling of make_fixtures.py (AutoAWQ / AutoGPTQ). Each case runs GPTQModel's own pipeline on one
seeded ``nn.Linear`` [N=64, K=256] on the CPU, with nothing re-implemented here:

* quantize: ``gptqmodel.quantization.gptq.GPTQ`` (the GPTQ algorithm, Hessian from a seeded random
  calibration batch; ``desc_act=True`` for the act-order cases), as its looper runs it;
* pack: ``gptqmodel.utils.model.pack_module`` into a ``TorchLinear`` (its CPU/torch kernel),
  which picks the CPU block packer (``pack_block``, ``pack_impl="auto"`` without CUDA; its native
  extension disabled by GPTQMODEL_DISABLE_PACK_EXT=1, so the pure-torch path packs) and, for
  ``format="gptq"`` (v1), converts the v2 zero points it packs to v1 (``z - 1``, as words) the way
  it does before saving. ``format="gptq_v2"`` keeps them as they are. The script also checks that
  the original numpy packer (``pack_original``) writes the same words;
* reference: the layer as GPTQModel loads it back: a fresh ``TorchLinear`` given the saved
  tensors, v1 converted to its internal v2 (``convert_gptq_v1_to_v2_format_module``) as its
  loader does for this kernel, then its own ``dequantize_weight()`` (checked equal to its forward
  on the identity), transposed to [N, K], fp16.

"zero-point-zero" cases make every other output row non-negative, so GPTQ's quantizer gives those
rows' groups a zero point of 0 (v1 then stores -1, borrowing from the next packed field). The
5-bit case asks for "gptq"; GPTQModel writes it in its planar ``checkpoint_format="gptq_p"``
(5/6/7 bits exist only planar, zero points stored as they are), for mixgemm to refuse.

Re-run (any directory; no GPU, no network once installed)::

    python -m venv /tmp/gptqvenv
    /tmp/gptqvenv/bin/pip install torch==2.13.0          # CPU wheel
    /tmp/gptqvenv/bin/pip install --no-deps gptqmodel==7.7.0
    /tmp/gptqvenv/bin/pip install numpy accelerate safetensors transformers threadpoolctl \\
        packaging device-smi protobuf pillow requests pypcre tokenicer logbar jinja2 dill defuser
    GPTQMODEL_DISABLE_PACK_EXT=1 /tmp/gptqvenv/bin/python tests/data/real_packers/make_fixtures_gptqmodel.py

(gptqmodel 7.7.0 asks for torch>=2.14.1; --no-deps keeps the local 2.13.0, which its CPU
quantize/pack/dequantize paths run on; it builds no CUDA extension at install.)

Written with gptqmodel 7.7.0, torch 2.13.0+cpu, transformers 5.24.0, numpy 2.4.6.
"""
from __future__ import annotations

import copy
import importlib.metadata
import json
import os
import threading
from pathlib import Path

os.environ.setdefault("GPTQMODEL_DISABLE_PACK_EXT", "1")

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

OUT = Path(__file__).resolve().parent / "gptqmodel"
K, N = 256, 64


def saved_config(qcfg) -> dict:
    """The quantization_config GPTQModel writes for ``qcfg`` (less its run-local ``meta``)."""
    d = json.loads(json.dumps(qcfg.to_dict(), default=str))
    d.pop("meta", None)
    return d


def gptqmodel_case(name: str, bits: int, group: int, sym: bool, fmt: str, act_order: bool = False,
                   zero_point_zero: bool = False, seed: int = 0) -> None:
    from gptqmodel.nn_modules.qlinear.torch import TorchLinear
    from gptqmodel.quantization import FORMAT
    from gptqmodel.quantization.config import QuantizeConfig
    from gptqmodel.quantization.gptq import GPTQ
    from gptqmodel.utils.model import convert_gptq_v1_to_v2_format_module, pack_module

    fmt_enum = {"gptq": FORMAT.GPTQ, "gptq_v2": FORMAT.GPTQ_V2}[fmt]
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g) * 0.02
    if zero_point_zero:                    # rows with min >= 0: GPTQ's quantizer gives them z = 0
        w[::2] = w[::2].abs()
    lin = torch.nn.Linear(K, N, bias=False)
    lin.weight.data = w.half().float()
    x = torch.randn(4, 64, K, generator=g)

    qcfg = QuantizeConfig(bits=bits, group_size=group, desc_act=act_order, sym=sym, format=fmt_enum,
                          act_group_aware=False)
    fmt_enum = FORMAT(qcfg.format)         # GPTQModel moves 5/6/7-bit layers to its planar "gptq_p"
    fmt = fmt_enum.value
    gq = GPTQ(copy.deepcopy(lin), qcfg=qcfg)
    gq.quantizer.configure(perchannel=True)
    with torch.no_grad():
        gq.add_batch(x, gq.module(x))
    q_weight, scale, zero, g_idx, *_ = gq.quantize()
    qlin = torch.nn.Linear(K, N, bias=False)
    qlin.weight.data = q_weight.float()

    def packed(impl: str) -> TorchLinear:
        layer = TorchLinear(bits=bits, group_size=group, sym=sym, desc_act=act_order, in_features=K,
                            out_features=N, bias=False, register_buffers=False, format=fmt_enum)
        cfg = copy.deepcopy(qcfg)
        cfg.pack_impl = impl
        label = pack_module("L", {"L": layer}, scale.clone(), zero.clone(), g_idx.clone(), {"L": qlin},
                            TorchLinear, threading.Lock(), quantize_config=cfg)
        layer.packer_label = label
        return layer

    layer = packed("auto")
    assert layer.packer_label == "module.pack_block", layer.packer_label
    other = packed("original")
    for t in ("qweight", "qzeros", "scales", "g_idx"):
        assert torch.equal(getattr(layer, t), getattr(other, t)), (name, t, "pack_block != pack_original")
    saved = {"qweight": layer.qweight.clone(), "qzeros": layer.qzeros.clone(),
             "scales": layer.scales.clone(), "g_idx": layer.g_idx.to(torch.int32).clone()}

    # as GPTQModel loads the checkpoint for its torch kernel (which runs on v2 zero points)
    loaded = TorchLinear(bits=bits, group_size=group, sym=sym, desc_act=act_order, in_features=K,
                         out_features=N, bias=False, register_buffers=True, format=fmt_enum)
    loaded.load_state_dict(saved, strict=False)
    if fmt_enum == FORMAT.GPTQ:
        convert_gptq_v1_to_v2_format_module(loaded, bits=bits, pack_dtype=torch.int32)
    loaded.eval()
    with torch.no_grad():
        ref = loaded.dequantize_weight().t().contiguous()
        fwd = loaded(torch.eye(K, dtype=torch.float16)).t().contiguous()
    assert ref.dtype == torch.float16 and torch.equal(ref, fwd), name

    zeros_int = zero.to(torch.int64)
    meta = {"library": "gptqmodel", "version": importlib.metadata.version("gptqmodel"),
            "torch": torch.__version__, "packer": "TorchLinear.pack_block (pack_module)",
            "bits": bits, "group_size": group, "sym": sym, "act_order": act_order,
            "checkpoint_format": fmt, "zero_point_zero": zero_point_zero,
            "zero_points_equal_to_0": int((zeros_int == 0).sum()), "planar": bool(loaded.planar),
            "quantize_config": saved_config(qcfg)}
    save_file({**saved, "reference": ref}, str(OUT / f"{name}.safetensors"), metadata={"case": json.dumps(meta)})
    print(name, meta)


def main() -> None:
    OUT.mkdir(exist_ok=True)
    v1, v2 = "gptq", "gptq_v2"
    gptqmodel_case("gptqmodel-v1-4bit-sym-g64", 4, 64, True, v1)
    gptqmodel_case("gptqmodel-v1-4bit-asym-g64", 4, 64, False, v1)
    gptqmodel_case("gptqmodel-v1-4bit-sym-act-order-g64", 4, 64, True, v1, act_order=True)
    gptqmodel_case("gptqmodel-v1-4bit-asym-act-order-g64", 4, 64, False, v1, act_order=True)
    gptqmodel_case("gptqmodel-v1-8bit-asym-g128", 8, 128, False, v1)
    gptqmodel_case("gptqmodel-v1-2bit-asym-g64", 2, 64, False, v1)
    gptqmodel_case("gptqmodel-v1-3bit-asym-g64", 3, 64, False, v1)
    gptqmodel_case("gptqmodel-v1-4bit-zero-point-zero-g64", 4, 64, False, v1, zero_point_zero=True)
    gptqmodel_case("gptqmodel-v1-3bit-zero-point-zero-g64", 3, 64, False, v1, zero_point_zero=True)
    gptqmodel_case("gptqmodel-gptq_p-5bit-asym-g64", 5, 64, False, v1)   # written as "gptq_p"
    gptqmodel_case("gptqmodel-v2-4bit-asym-g64", 4, 64, False, v2)
    gptqmodel_case("gptqmodel-v2-4bit-sym-g128", 4, 128, True, v2)
    gptqmodel_case("gptqmodel-v2-4bit-zero-point-zero-g64", 4, 64, False, v2, zero_point_zero=True)
    gptqmodel_case("gptqmodel-v2-8bit-asym-act-order-g128", 8, 128, False, v2, act_order=True)
    gptqmodel_case("gptqmodel-v2-2bit-asym-g64", 2, 64, False, v2)
    gptqmodel_case("gptqmodel-v2-3bit-zero-point-zero-g64", 3, 64, False, v2, zero_point_zero=True)


if __name__ == "__main__":
    main()
