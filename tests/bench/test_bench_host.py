"""``mixgemm bench --host`` without a GPU: the host-or-GPU verdict, the sleep length, the medians,
the report's JSON and table, and the step's options."""
from __future__ import annotations

import json

import pytest
import torch

from mixgemm import bench
from mixgemm.bench import host as H
from mixgemm.bench.model import StepMeasurement, analyze_model

from bench_helpers import machine, parse



def test_loop_bound():
    assert H.loop_bound(12.0, 5.0) == "host"
    assert H.loop_bound(3.0, 5.0) == "gpu"
    assert H.loop_bound(None, 5.0) is None and H.loop_bound(3.0, None) is None


def test_sleep_cycles():
    assert H.sleep_cycles(20_000.0, 1755.0) == 35_100_000      # 20 ms at 1.755 GHz
    assert H.sleep_cycles(0.0, 1755.0) == 1


def test_host_point_takes_medians():
    p = H.host_point("QuantLinear", 16, 4096, 4096, [30.0, 10.0, 12.0], [5.0, 6.0, 40.0], 9.5, True)
    assert (p.host_us, p.host_min_us, p.gpu_loop_us, p.gpu_us) == (12.0, 10.0, 6.0, 9.5)
    assert p.bound == "host" and p.queued and p.repeats == 3 and p.status == bench.OK


def host_report():
    calls = [H.host_point(impl, m, 4096, 4096, [10.0 + i, 11.0], [4.0 * m ** 0.5, 4.0], 20.0, True)
             for i, impl in enumerate(H.HOST_IMPLS) for m in H.HOST_MS]
    calls.append(H.HostPoint("torch-int4", 1, 4096, 4096, "n/a", note="no tinygemm"))
    step = analyze_model([StepMeasurement("llama3-8b", "decode", 1, 1, 1024, 8, v, mode,
                                          timing=bench.summarize_times([t / 1e3] * 5),
                                          err=None if v == "bf16" else 1e-3, kv_err=None if v == "bf16" else 1e-3)
                          for v, base in (("bf16", 1200.0), ("mixgemm-u4", 700.0))
                          for mode, t in (("graph", base), ("eager", base * 1.5))], 3200.0)
    return H.HostReport(machine(read_bw_gbps=3200.0), {"calls": 200, "repeats": 9}, calls, step)


def test_host_report_json_round_trip(tmp_path):
    rep = host_report()
    path = H.write_host_json(tmp_path / "h.json", rep)
    doc = json.loads(path.read_text())
    assert doc["schema"] == H.HOST_SCHEMA
    assert {(c["impl"], c["m"]) for c in doc["calls"]} >= {(i, m) for i in H.HOST_IMPLS for m in H.HOST_MS}
    assert H.host_report_from_dict(doc) == rep
    with pytest.raises(ValueError):
        H.host_report_from_dict({**doc, "schema": "x"})


def test_host_table():
    text = H.format_host_table(host_report())
    for col in ("host us", "GPU us (loop)", "GPU us (flushed)", "bound", "queued", "us/step", "x bf16"):
        assert col in text
    for impl in H.HOST_IMPLS:
        assert impl in text
    assert "torch-int4 M=1: n/a: no tinygemm" in text
    assert "1800.0" in text and "1.71x" in text           # eager bf16 step; 1200 / 700 in graph mode


def test_host_table_of_the_compiled_modes_compares_with_f_linear():
    """The chained ops' rows: per mode, each op's host time over F.linear's in the same mode."""
    import dataclasses

    rep = host_report()
    chained = []
    for mode, base in (("compile", 20.0), ("reduce-overhead", 2.0)):
        for impl, host in (("F.linear", base), ("QuantLinear", base * 0.75), ("rms_norm", base * 1.5)):
            p = H.host_point(impl, 1, 4096, 4096, [host], [5.0], 6.0, True)
            chained.append(dataclasses.replace(p, mode=mode, chain=H.HOST_CHAIN))
    text = H.format_host_table(dataclasses.replace(rep, calls=rep.calls + chained))
    lines = text.splitlines()
    row = next(line for line in lines if line.startswith("QuantLinear") and "compile (chain 32)" in line)
    assert "0.75x" in row
    row = next(line for line in lines if line.startswith("rms_norm") and "reduce-overhead (chain 32)" in line)
    assert "1.50x" in row
    assert H.host_report_from_dict(H.host_report_to_dict(dataclasses.replace(rep, calls=chained))).calls == chained


def test_host_step_config():
    cfg = bench.host_step_config(parse("--host"))
    assert cfg.presets == ("llama3-8b",) and cfg.batches == (1,) and cfg.prefill == 0
    assert [v.name for v in cfg.variants] == ["bf16", "mixgemm-u4"] and cfg.modes == ("graph", "eager")
    cfg = bench.host_step_config(parse("--host", "--layers", "2", "--batch", "1,16", "--quick"))
    assert (cfg.layers, cfg.batches, cfg.quick) == (2, (1, 16), True)
    with pytest.raises(bench.BenchError, match="--quick"):
        bench.host_step_config(parse("--host", "--iters", "3"))


@pytest.mark.skipif(not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"), reason="no CPU tinygemm")
def test_host_callables_on_the_cpu():
    """The per-call functions compute the layer (dense bf16, and tinygemm on the same u4 codes);
    the weight is quantized once, whatever the M."""
    w = torch.randn(256, 512, generator=torch.Generator().manual_seed(0)) * 0.02
    calls = H.host_callables(w, ["F.linear", "torch-int4"])
    assert set(calls) == {"F.linear", "torch-int4"}
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    ref = x.double() @ w.double().t()
    assert bench.relative_error(calls["F.linear"](x), ref) < 1e-2
    assert bench.relative_error(calls["torch-int4"](x), ref) < 0.2         # int4 g128 on a Gaussian weight
    assert set(H.host_callables(w, ["F.linear"])) == {"F.linear"}
