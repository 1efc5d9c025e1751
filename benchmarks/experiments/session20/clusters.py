"""Session 20: how many clusters of the decode kernel an H100 holds at once
(cuOccupancyMaxActiveClusters), by cluster size (the split-K factor) and dynamic shared memory
(1, 2 or 3 CTAs per SM by shared memory), against the CTAs per SM the planner assumes.
usage: clusters.py OUT.json"""
import json
import sys

import torch

from mixgemm import runtime
from mixgemm.codegen import TILE_CONFIGS
from mixgemm.specs import Activation
from mixgemm.types import ActType, WeightType


def main():
    drv = runtime._driver()
    spec = next(t for t in TILE_CONFIGS if t.label == "dec8").spec(ActType.BF16, WeightType.U4, Activation.NONE)
    k = runtime.KERNELS.get(spec, torch.device("cuda", 0))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for smem in (200 * 1024, 100 * 1024, 60 * 1024, 30 * 1024):
        for c in range(1, 9):
            cfg = drv.CUlaunchConfig()
            cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = 1, c * 64, 1
            cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = 256, 1, 1
            cfg.sharedMemBytes = smem
            attr = drv.CUlaunchAttribute()
            attr.id = drv.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
            attr.value.clusterDim.x, attr.value.clusterDim.y, attr.value.clusterDim.z = 1, c, 1
            cfg.attrs = [attr]
            cfg.numAttrs = 1
            err, n = drv.cuOccupancyMaxActiveClusters(k.function, cfg)
            err2, per_sm = drv.cuOccupancyMaxActiveBlocksPerMultiprocessor(k.function, 256, smem)
            rows.append(dict(smem=smem, cluster=c, max_clusters=int(n) if not int(err) else None,
                             ctas=int(n) * c if not int(err) else None, per_sm=int(per_sm), sms=sms,
                             err=str(err)))
            print(rows[-1], flush=True)
    json.dump(rows, open(sys.argv[1], "w"), indent=1)


if __name__ == "__main__":
    main()
