"""session 16: transformers' LlamaRMSNorm against mixgemm.nn.RMSNorm on the GPU (graph time per call, eager
host time per call), and an eager decode step of a 4-layer llama3-8b-shaped HF model (QuantLinear u4) with
and without the norms replaced."""
import copy, statistics, time, torch
import mixgemm
from mixgemm.nn import RMSNorm, quantize_model
from mixgemm.norm import replace_rms_norms
from transformers import LlamaConfig, LlamaForCausalLM, DynamicCache
from transformers.models.llama.modeling_llama import LlamaRMSNorm
dev = torch.device("cuda")
for h in (4096, 8192):
    hfn = LlamaRMSNorm(h, eps=1e-5).to(dev, torch.bfloat16)
    with torch.no_grad(): hfn.weight.uniform_(0.5, 1.5)
    ours = RMSNorm.from_module(hfn)
    x = torch.randn(1, 1, h, device=dev, dtype=torch.bfloat16)
    for name, mod in (("LlamaRMSNorm", hfn), ("mixgemm RMSNorm", ours)):
        with torch.no_grad():
            for _ in range(3): mod(x)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for _ in range(20): y = mod(x)
            ts = []
            for _ in range(30):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record(); g.replay(); b.record(); torch.cuda.synchronize(); ts.append(a.elapsed_time(b) * 1000 / 20)
            hs = []
            for _ in range(5):
                t = time.perf_counter()
                for _ in range(300): mod(x)
                hs.append((time.perf_counter() - t) / 300 * 1e6); torch.cuda.synchronize()
        print(f"H={h} {name}: graph {statistics.median(ts):.2f} us per call, eager host {min(hs):.1f} us per call", flush=True)
    with torch.no_grad():
        d = (ours(x).float() - hfn(x).float()).abs().max().item()
    print(f"  max |difference| {d:.3g}")
import sys
if len(sys.argv) < 2 or sys.argv[1] != 'model':
    sys.exit(0)
cfg = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                  num_hidden_layers=4, vocab_size=32000, max_position_embeddings=2048, torch_dtype="bfloat16")
torch.manual_seed(0)
model = LlamaForCausalLM(cfg).to(dev, torch.bfloat16)
quantize_model(model, bits=4, group_size=128)
model = model.eval()
fused = copy.deepcopy(model); replace_rms_norms(fused)
ids = torch.randint(0, 32000, (1, 8), device=dev)   # 8 tokens: the decode kernels, no sm90 GEMM to compile
for name, m in (("HF norms", model), ("mixgemm norms", fused), ("HF norms", model), ("mixgemm norms", fused)):
    with torch.no_grad():
        cache = DynamicCache(); out = m(ids, past_key_values=cache, use_cache=True)
        tok = out.logits[:, -1:].argmax(-1)
        for _ in range(5): out = m(tok, past_key_values=cache, use_cache=True); tok = out.logits[:, -1:].argmax(-1)
        torch.cuda.synchronize(); steps = []
        for _ in range(30):
            t = time.perf_counter(); out = m(tok, past_key_values=cache, use_cache=True); tok = out.logits[:, -1:].argmax(-1)
            torch.cuda.synchronize(); steps.append((time.perf_counter() - t) * 1e6)
    print(f"eager decode step, 4 llama3-8b layers + LM head, u4, {name}: {statistics.median(steps):.0f} us", flush=True)
