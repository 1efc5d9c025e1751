"""session 16: all-reduce latency of a decode step's row-parallel output (bf16 [1, hidden]) on 2 GPUs,
inside CUDA graphs: NCCL all_reduce vs torch symmetric-memory one-shot / two-shot (no multicast)."""
import os, sys, json, statistics
os.environ["NCCL_NVLS_ENABLE"] = "0"; os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
import torch, torch.distributed as dist
import torch.distributed._symmetric_memory as symm_mem
dist.init_process_group("nccl")
rank = dist.get_rank(); dev = torch.device("cuda", rank); torch.cuda.set_device(dev)
group_name = dist.group.WORLD.group_name
res = {}
REP = 20
def time_graph(fn, label):
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3): fn()
    torch.cuda.current_stream().wait_stream(s); torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, capture_error_mode="thread_local"):
        for _ in range(REP): fn()
    torch.cuda.synchronize(); dist.barrier()
    ts = []
    for _ in range(60):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); g.replay(); b.record(); torch.cuda.synchronize(); ts.append(a.elapsed_time(b) * 1000 / REP)
    med = statistics.median(ts[10:])
    res[label] = med
    if rank == 0: print(f"{label}: {med:.2f} us per op", flush=True)
for n in (8192, 5120 * 2, 28672):
    x = torch.randn(n, device=dev, dtype=torch.bfloat16)
    y = x.clone()
    def nccl(): dist.all_reduce(y)
    time_graph(nccl, f"nccl n={n}")
    try:
        buf = symm_mem.empty(n, device=dev, dtype=torch.bfloat16)
        hdl = symm_mem.rendezvous(buf, group_name)
        buf.copy_(x)
        out = torch.empty_like(x)
        # correctness
        torch.ops.symm_mem.one_shot_all_reduce_out(buf, "sum", group_name, out=out)
        ref = x.clone(); dist.all_reduce(ref); torch.cuda.synchronize()
        if rank == 0: print("one-shot err", (out.float() - ref.float()).abs().max().item(), flush=True)
        def one_shot(): torch.ops.symm_mem.one_shot_all_reduce_out(buf, "sum", group_name, out=out)
        time_graph(one_shot, f"symm one_shot n={n}")
        def one_shot_copy():
            buf.copy_(y); torch.ops.symm_mem.one_shot_all_reduce_out(buf, "sum", group_name, out=out)
        time_graph(one_shot_copy, f"symm copy+one_shot n={n}")
        def two_shot(): torch.ops.symm_mem.two_shot_all_reduce_(buf, "sum", group_name)
        time_graph(two_shot, f"symm two_shot n={n}")
    except Exception as e:
        if rank == 0: print("symm_mem failed:", type(e).__name__, str(e)[:400], flush=True)
if rank == 0 and len(sys.argv) > 1:
    json.dump(res, open(sys.argv[1], "w"), indent=1)
dist.barrier()
sys.stdout.flush(); os._exit(0)
