"""Independent reference packers of each checkpoint format, written from the formats'
documentation and sources (AutoAWQ ``WQLinear_GEMM.from_linear`` / ``dequantize_gemm``, AutoGPTQ
``QuantLinear.pack`` and GPTQModel's v1 <-> v2 zero conversion, compressed-tensors
``pack_to_int32`` / ``_dequantize``, HQQ ``BitPack`` / ``Quantizer.dequantize`` /
``encode_safetensor_type``), with each format's own dequantization formula. None of those packages
is imported. Used by the importers' tests (tests/formats/test_formats.py) and by every test that
needs a checkpoint layer in a source format (tests/hf_checkpoints.py, ...).
"""
import zlib

import numpy as np
import torch


FP16, BF16 = torch.float16, torch.bfloat16
N = 48  # three 16-row atoms: odd but legal
#: K per group size: odd multiples of 64 where the group size allows it (small for speed).
K_FOR = {32: 192, 64: 192, 128: 384, 256: 512, "K": 320}


def shape_for(group):
    k = K_FOR[group]
    return k, (k if group == "K" else group)


def gen_for(*key):
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def rand_codes(shape, bits, gen, lo=0):
    return torch.randint(lo, 1 << bits, shape, generator=gen, dtype=torch.int64)


def rand_scales(shape, dtype, gen):
    """Positive, normal in fp16 and bf16: 2^[-10, -3)."""
    return (2.0 ** torch.empty(shape).uniform_(-10, -3, generator=gen)).to(dtype)


def u32_to_i32(a):
    return torch.from_numpy((np.asarray(a, dtype=np.uint64) & 0xFFFFFFFF)
                            .astype(np.uint32).view(np.int32).copy())


def i32_to_u64(t):
    return t.numpy().view(np.uint32).astype(np.uint64)


# ===================================================================================== AWQ
# AutoAWQ WQLinear_GEMM.from_linear: qweight[:, c] |= intweight[:, 8c + order_map[i]] << 4i,
# order_map = [0, 2, 4, 6, 1, 3, 5, 7]; qzeros the same over zeros[K/g, N]; scales fp16.
AWQ_ORDER_MAP = [0, 2, 4, 6, 1, 3, 5, 7]


def awq_pack(int_rc):
    """[R, 8C] ints in [0, 15] -> int32 [R, C], AutoAWQ's GEMM packing."""
    v = np.asarray(int_rc, dtype=np.uint64)
    out = np.zeros((v.shape[0], v.shape[1] // 8), dtype=np.uint64)
    for i, col in enumerate(AWQ_ORDER_MAP):
        out |= v[:, col::8] << np.uint64(4 * i)
    return u32_to_i32(out)


def awq_reference_dequant(qweight, qzeros, scales, group_size):
    """AutoAWQ's dequantize_gemm: shift out nibbles, undo the order, (iw - iz) * s; -> [N, K]."""
    def unpack_cols(t):
        nib = torch.stack([(t >> (4 * i)) & 15 for i in range(8)], dim=-1)  # storage order
        natural = torch.empty_like(nib)
        natural[..., AWQ_ORDER_MAP] = nib  # nibble i holds column order_map[i]
        return natural.reshape(t.shape[0], -1).to(torch.int8)
    iw, iz = unpack_cols(qweight), unpack_cols(qzeros)
    s = scales.repeat_interleave(group_size, dim=0)
    return ((iw - iz.repeat_interleave(group_size, dim=0)) * s).t()


def make_awq(k, gs, gen, zeros="random", dtype=FP16):
    g = k // gs
    q_kn = rand_codes((k, N), 4, gen)
    z_gn = torch.full((g, N), 8) if zeros == "mid" else rand_codes((g, N), 4, gen)
    return awq_pack(q_kn), awq_pack(z_gn), rand_scales((g, N), dtype, gen)


# ==================================================================================== GPTQ
# AutoGPTQ QuantLinear.pack: qweight[row] |= intweight[i + j] << bits*j (K packed along rows),
# qzeros[:, col] |= (zeros - 1)[:, i + j] << bits*j (v1: stored minus one), g_idx int32 [K].
# GPTQModel: v2 stores zeros as they are; v1 <-> v2 by adding/subtracting 0x11111111 (4-bit),
# 0x01010101 (8-bit), 0x55555555 (2-bit) to each int32 word.
GPTQ_ONES = {2: 0x55555555, 4: 0x11111111, 8: 0x01010101}


def gptq_pack(ints, bits, axis):
    """Pack ints in [0, 2^bits) into int32 words along ``axis`` (0: K rows, 1: N columns)."""
    v = np.asarray(ints, dtype=np.uint64)
    if axis == 1:
        v = v.T
    per = 32 // bits
    out = np.zeros((v.shape[0] // per, v.shape[1]), dtype=np.uint64)
    for j in range(per):
        out |= v[j::per] << np.uint64(bits * j)
    return u32_to_i32(out.T if axis == 1 else out)


def gptq_pack_zeros(z_gn, bits, fmt):
    """v2: the zeros; v1: AutoGPTQ's ``zeros - 1`` (needs zeros >= 1, else its packer ORs the
    sign-extended -1 over the other zero points)."""
    if fmt == "gptq_v2":
        return gptq_pack(z_gn, bits, 1)
    assert int(z_gn.min()) >= 1
    return gptq_pack(z_gn - 1, bits, 1)


def gptq_v2_to_v1(qzeros_v2, bits):
    """GPTQModel's v2 -> v1 export: subtract 1 per zero point as an int32 word subtraction."""
    return u32_to_i32(i32_to_u64(qzeros_v2) + 2 ** 32 - GPTQ_ONES[bits])


def gptq_unpack(t, bits, axis):
    per = 32 // bits
    v = torch.from_numpy(i32_to_u64(t).astype(np.int64))
    if axis == 1:
        v = v.t()
    parts = torch.stack([(v >> (bits * j)) & ((1 << bits) - 1) for j in range(per)], dim=1)
    out = parts.reshape(-1, v.shape[1])
    return out.t() if axis == 1 else out


def gptq_reference_dequant(qweight, qzeros, scales, g_idx, bits, fmt):
    """GPTQModel's dequantize_weight on v2 zeros (v1 converted as GPTQModel does): [N, K]."""
    if fmt == "gptq":
        qzeros = u32_to_i32(i32_to_u64(qzeros) + GPTQ_ONES[bits])
    weight = gptq_unpack(qweight, bits, 0).to(torch.int16)     # [K, N]
    zeros = gptq_unpack(qzeros, bits, 1).to(torch.int16)       # [G, N]
    g = g_idx.long()
    return (scales[g] * (weight - zeros[g])).t()


def make_gptq(k, gs, bits, sym, fmt, dtype, gen, g_idx=None):
    g = k // gs
    q_kn = rand_codes((k, N), bits, gen)
    if sym:
        z = torch.full((g, N), 1 << (bits - 1))
    else:  # v1 (AutoGPTQ's packer) cannot store a zero point of 0
        z = rand_codes((g, N), bits, gen, lo=1 if fmt == "gptq" else 0)
    if g_idx is None:
        g_idx = torch.arange(k, dtype=torch.int32) // gs
    return dict(qweight=gptq_pack(q_kn, bits, 0), qzeros=gptq_pack_zeros(z, bits, fmt),
                scales=rand_scales((g, N), dtype, gen), g_idx=g_idx)


def random_act_order_g_idx(k, gs, gen):
    """GPTQ desc_act: g_idx[perm[i]] = i // gs for an activation-order permutation perm."""
    perm = torch.randperm(k, generator=gen)
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[perm] = (torch.arange(k) // gs).to(torch.int32)
    return g_idx


# ====================================================================== compressed-tensors
# pack_to_int32(value, num_bits, packed_dim): value + 2^(b-1) (unsigned), element i of a row
# at bit i*b of the row's little-endian int32 bit stream (ceil(E*b/32) words); zero points
# packed along dim 0 (N). _dequantize: (x_q.to(s.dtype) - zp.to(s.dtype)) * s.


def ct_pack(values, bits, packed_dim=1):
    """Signed int codes -> int32, compressed-tensors' dense bit stream along packed_dim."""
    v = np.asarray(values, dtype=np.int64) + (1 << (bits - 1))
    if packed_dim == 0:
        v = v.T
    rows, cols = v.shape
    words = -(-cols * bits // 32)
    out = np.zeros((words + 1, rows), dtype=np.uint64)          # one spare word for carries
    start = np.arange(cols) * bits
    word, offset = start // 32, (start % 32).astype(np.uint64)
    u = v.T.astype(np.uint64)                                   # [cols, rows]
    np.add.at(out, word, (u << offset[:, None]) & 0xFFFFFFFF)
    spill = offset + bits > 32                                  # straddles two words
    np.add.at(out, word[spill] + 1, u[spill] >> (np.uint64(32) - offset[spill, None]))
    out = out[:words].T
    return u32_to_i32(out.T if packed_dim == 0 else out)


def ct_unpack(packed, bits, count, packed_dim=1):
    v = i32_to_u64(packed)
    if packed_dim == 0:
        v = v.T
    start = np.arange(count) * bits
    word, offset = start // 32, (start % 32).astype(np.uint64)
    codes = (v[:, word] >> offset) & np.uint64((1 << bits) - 1)
    out = torch.from_numpy(codes.astype(np.int64) - (1 << (bits - 1))).to(torch.int8)
    return out.t() if packed_dim == 0 else out


def ct_reference_dequant(weight_packed, weight_scale, weight_shape, bits, weight_zero_point=None,
                         weight_g_idx=None):
    n, k = [int(v) for v in weight_shape]
    x_q = ct_unpack(weight_packed, bits, k)
    gs = k // weight_scale.shape[1]
    g = torch.arange(k) // gs if weight_g_idx is None else weight_g_idx.long()
    deq = x_q.to(weight_scale.dtype)
    if weight_zero_point is not None:
        zp = weight_zero_point
        if zp.dtype == torch.int32 and zp.shape[0] != n:
            zp = ct_unpack(zp, bits, n, packed_dim=0)
        deq = deq - zp.to(weight_scale.dtype)[:, g]
    return deq * weight_scale[:, g]


def make_ct(k, gs, bits, sym, dtype, gen, zp_packed=True, g_idx=None):
    g = k // gs
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1))
    q = torch.randint(lo, hi, (N, k), generator=gen)
    t = dict(weight_packed=ct_pack(q, bits), weight_scale=rand_scales((N, g), dtype, gen),
             weight_shape=torch.tensor([N, k]))
    if not sym:
        z = torch.randint(lo, hi, (N, g), generator=gen)
        t["weight_zero_point"] = ct_pack(z, bits, 0) if zp_packed else z.to(torch.int8)
    if g_idx is not None:
        t["weight_g_idx"] = g_idx
    return t


# ===================================================================================== HQQ
# Quantizer.quantize (axis=1): W.reshape(-1, g), W_q = BitPack.pack_<b>bit_u8(W_q): the row
# blocks of the [N*K/g, g] codes go to bits 8-b*(i+1) of each byte; scale/zero [N*K/g, 1];
# HQQLinear.state_dict encodes meta with encode_safetensor_type. Dequantize:
# ((unpack(W_q).to(compute_dtype) - zero) * scale).reshape(shape).


def hqq_pack(codes, bits):
    if bits == 8:
        return codes.to(torch.uint8)
    per, step = 8 // bits, codes.shape[0] // (8 // bits)
    out = torch.zeros((step, codes.shape[1]), dtype=torch.uint8)
    for i in range(per):
        out |= codes[i * step:(i + 1) * step].to(torch.uint8) << (8 - bits * (i + 1))
    return out


def hqq_unpack(W_q, bits, dtype):
    if bits == 8:
        return W_q.to(dtype)
    per = 8 // bits
    mask = (1 << bits) - 1
    return torch.cat([(W_q >> (8 - bits * (i + 1))) & mask for i in range(per)]).to(dtype)


def hqq_encode(v):
    """HQQ's encode_safetensor_type."""
    if isinstance(v, torch.dtype):
        v = str(v)
    if isinstance(v, torch.Size):
        return torch.tensor(v)
    if isinstance(v, bool):
        return torch.tensor(int(v), dtype=torch.uint8)
    if isinstance(v, int):
        return torch.tensor(v, dtype=torch.int32)
    if isinstance(v, float):
        return torch.tensor(v, dtype=torch.float32)
    if isinstance(v, str):
        return torch.tensor([ord(c) for c in v], dtype=torch.uint8)
    return v


def make_hqq(n, k, gs, bits, dtype, gen, zeros="integer", encoded=True, axis=1):
    rows = n * k // gs
    codes = rand_codes((rows, gs), bits, gen)
    scale = rand_scales((rows, 1), dtype, gen)
    if zeros == "mid":
        zero = torch.full((rows, 1), float(1 << (bits - 1)), dtype=dtype)
    else:
        zero = rand_codes((rows, 1), bits, gen).to(dtype)
        if zeros == "fractional":
            zero = (zero.float() * 0.9 + 0.3).to(dtype)
    meta = {"nbits": bits, "group_size": gs, "shape": torch.Size([n, k]), "axis": axis,
            "packing": {8: "8bit_u8", 4: "4bit_u8", 2: "2bit_u8"}[bits],
            "unpack_view_dtype": torch.uint8, "view_as_float": False, "compute_dtype": dtype,
            "channel_wise": True, "optimize": False, "round_zero": True}
    if encoded:
        meta = {key: hqq_encode(v) for key, v in meta.items()}
        meta.update(offload_meta=hqq_encode(False), encoded_state_dict=hqq_encode(True),
                    stores_quant_config=hqq_encode(True))
    return dict(W_q=hqq_pack(codes, bits), scale=scale, zero=zero), meta


def hqq_reference_dequant(W_q, scale, zero, bits, shape, dtype):
    return ((hqq_unpack(W_q, bits, dtype) - zero) * scale).reshape(shape)


def assert_bitwise(a: torch.Tensor, b: torch.Tensor, what: str, source: str = "the library's") -> None:
    """``a`` (mixgemm's) equals ``b`` (``source``) bit for bit, as 16-bit floats; the message
    counts the elements that differ and gives the first one's [n, k]."""
    assert a.dtype == b.dtype and a.shape == b.shape, (what, a.dtype, b.dtype, a.shape, b.shape)
    differ = a.view(torch.int16) != b.view(torch.int16)
    n = int(differ.sum())
    assert n == 0, (f"{what}: {n} of {a.numel()} elements differ from {source}, "
                    f"the first at [n, k] = {differ.nonzero()[:1].tolist()}")


def in_source_order(w: torch.Tensor, perm) -> torch.Tensor:
    """An imported weight with its act-order permutation undone (columns in the source order)."""
    if perm is None:
        return w
    src = torch.empty_like(w)
    src[:, perm] = w
    return src
