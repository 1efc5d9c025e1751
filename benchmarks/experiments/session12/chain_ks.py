"""Session 12: k-slices for 4- and 2-bit codes, measured in a chain (NOTES 14c).

step_bounds.py found the s8 decode kernel (dec8: 8 k-slices) at 7.5 us per 4096x4096 GEMM in a
chain of 8 identical launches, and the u4 kernel (1 slice) at 9.6 us with half the bytes. Session
9b chose 1 slice for 4- and 2-bit codes from one-kernel graphs, whose ~5 us harness cost hid the
difference. Here: (a) chains of 8 identical GEMMs per llama3-8b / qwen2.5-7b layer, u4 and u2,
M = 1, k-slices 1/2/4/8 x split-K 0 (planner) / 1 / 2 / 4 / 8; (b) the llama3-8b decode step
(graph, 4 layers, batch 1) with dec8's k-slices for 4- and 2-bit codes patched to 1/2/4/8.
usage: chain_ks.py OUT.json [a|b|ab]
"""
import dataclasses, json, statistics, sys
import torch
from mixgemm import codegen, ops
from mixgemm.bench import decoder, variants
from mixgemm.specs import Activation, DecodeSpec
from mixgemm.types import ActType, WeightType

from harness import DEV as dev, flush, read_gbps, time_graph

out = {"chain": [], "step": []}
parts = sys.argv[2] if len(sys.argv) > 2 else "ab"
if "a" in parts:
    for preset_name in ("llama3-8b", "qwen2.5-7b"):
        p = decoder.PRESETS[preset_name]
        for vname in ("int4", "int2"):
            proj = variants.build_layer(p, variants.parse_variant(vname), 0, 0, dev, 128)[0]
            for name, layer in proj.layers.items():
                w = layer.packed
                act = Activation.SWIGLU if name == "gate_up" else Activation.NONE
                x = torch.randn(1, w.k, device=dev, dtype=torch.bfloat16)
                ref = None
                for ks in (1, 2, 4, 8):
                    spec = DecodeSpec(ActType.BF16, w.weight_type, 8, 8, 1024, 4, act, ks)
                    for splits in (0, 1, 2, 4, 8):
                        try:
                            with torch.no_grad():
                                y = ops.gemm_with_spec(x, w, spec, splits=splits)
                                if ref is None:
                                    ref = y.float()
                                err = float((y.float() - ref).norm() / ref.norm())
                                us = time_graph(lambda: [ops.gemm_with_spec(x, w, spec, splits=splits) for _ in range(8)]) / 8
                        except Exception as e:
                            print(f"{preset_name} {name} {vname} ks{ks} s{splits}: {type(e).__name__}: {str(e)[:150]}", flush=True)
                            continue
                        row = dict(preset=preset_name, layer=name, n=w.n, k=w.k, weight=w.weight_type.value, ks=ks,
                                   splits=splits, us=round(us, 3), rel_to_ks1=round(err, 5))
                        out["chain"].append(row)
                        print(json.dumps(row), flush=True)
            del proj
            torch.cuda.empty_cache()

if "b" in parts:
    orig = codegen.DecodeConfig.spec
    p = decoder.PRESETS["llama3-8b"]
    rot = decoder.Rotary(p.head_dim, p.rope_theta, 1100, torch.bfloat16, dev)
    for ks in (1, 2, 4, 8):
        def patched(self, act, weight, activation=Activation.NONE, _ks=ks):
            s = orig(self, act, weight, activation)
            return dataclasses.replace(s, kslices=_ks) if (weight.bits < 8 and self.label == "dec8") else s
        codegen.DecodeConfig.spec = patched
        ops_cache = getattr(ops, "_SPEC_CACHE", None)
        for vname in ("int4", "int2"):
            projs = [variants.build_layer(p, variants.parse_variant(vname), l, 0, dev, 128)[0] for l in range(4)]
            states = [decoder.layer_state(p, l, 0, 1, 1025, dev, torch.bfloat16) for l in range(4)]
            stack = decoder.DecoderStack(p, projs, states, rot)
            x = torch.randn(1, 1, p.hidden, device=dev, dtype=torch.bfloat16)
            with torch.no_grad():
                us = time_graph(lambda: stack(x, 1024)) / 4
            names = sorted({pl.spec.name for pl in getattr(__import__("mixgemm.plans").plans.PLANS, "_plans", {}).values()}) if False else None
            row = dict(variant=vname, ks=ks, graph_us_per_layer=round(us, 2))
            out["step"].append(row)
            print(json.dumps(row), flush=True)
            del stack, states, projs
            torch.cuda.empty_cache()
    codegen.DecodeConfig.spec = orig
open(sys.argv[1], "w").write(json.dumps(out, indent=1))
