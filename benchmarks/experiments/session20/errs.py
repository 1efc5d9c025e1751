"""Session 20: the relative error of mixgemm.gemm (the planner's or the table's split factor) on
layer shapes of other models, M = 1, 5 and 16, every code width and activation dtype, against a
float64 matmul on the weights dequantized by the reference dequantizer.
usage: errs.py OUT.json"""
import json
import sys

import torch

import mixgemm
from mixgemm.quantize import dequantize_reference


def main():
    rows = []
    for n, k in ((3072, 2048), (5120, 3072), (16384, 2048), (2048, 8192), (3584, 14336)):
        for bits, sym in ((4, False), (2, False), (8, True)):
            for dtype in (torch.bfloat16, torch.float16):
                q = mixgemm.quantize(torch.randn(n, k, device="cuda") * 0.02, bits, 128, symmetric=sym, dtype=dtype)
                w = mixgemm.prepack(q)
                ref_w = dequantize_reference(q).to("cuda").double()
                for m in (1, 5, 16):
                    x = torch.randn(m, k, device="cuda", dtype=dtype)
                    y = mixgemm.gemm(x, w)
                    ref = x.double() @ ref_w.T
                    err = ((y.double() - ref).norm() / ref.norm()).item()
                    rows.append(dict(n=n, k=k, bits=bits, dtype=str(dtype), m=m, err=err))
    json.dump(rows, open(sys.argv[1], "w"), indent=1)
    worst = max(rows, key=lambda r: r["err"])
    print(f"{len(rows)} points, max relative error {worst['err']:.2e} ({worst})")
    for b in (4, 2, 8):
        print(f"  {b}-bit: max {max(r['err'] for r in rows if r['bits'] == b):.2e}")


if __name__ == "__main__":
    main()
