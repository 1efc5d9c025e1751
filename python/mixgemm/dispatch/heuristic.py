"""The heuristic: which kernel config runs a GEMM of M tokens on an N x K weight
(:func:`select_tile`, :func:`select_spec`), and the token-count buckets that the launch plans are
cached by (:func:`token_bucket`: every M of a bucket gets the same config on a given layer and GPU).

The bounds below were measured (docs/dispatch.md); above 512
tokens the choice also follows the GPU's SM count (:func:`xl_evens_waves`).
"""
from __future__ import annotations

import bisect
import functools
from typing import TYPE_CHECKING, Optional

import torch

from ..jit.catalog import FP8_TILE, FP8_TOKEN_TILES, TILE_CONFIGS
from ..jit.specs import Activation

if TYPE_CHECKING:  # codegen and specs are imported lazily: `import mixgemm` stays cheap
    from ..jit.catalog import DecodeConfig, TileConfig
    from ..jit.specs import DecodeSpec, GemmSpec
    from ..weights.types import PackedWeight

#: 16 < M <= 32 on a layer of at most this many weights (N x K) goes to the 32-token decode
#: kernel ("dec32") instead of "mid". Measured on H100 at M = 32 (sweep-decode-m32.json against
#: bench-m32.json, docs/dispatch.md): dec32 at its best split factor took 0.75-0.84x
#: the time of "mid" on 4096x4096 and 6144x4096 (u4, u2, s8), but 1.03-1.25x on every layer of
#: 58M weights or more (4096x14336 up), where the GEMM's wide tiles stream better.
_DEC32_MAX_WEIGHTS = 1 << 25
#: 32 < M <= 128 (and 16 < M <= 32 above the dec32 bound): the 256-row stream-K tiles ("tall",
#: 256x64, and "tall128", 256x128) on large layers, "mid" (128x64) on small ones. Measured on H200
#: (docs/dispatch.md, sweep-gemm256*.json, u4 and u2, 9 layers): a 256-row weight tile converts each weight
#: once per 64 (128) tokens for twice the tensor-core work of a 128-row one.
#:   M <= 64: "tall" 1.17-1.35x faster than "mid" on every layer above 2**26 weights (10240x8192,
#:            28672x4096, 8192x28672, 57344x8192); "mid" up to 1.2x faster at or below it
#:            (4096x4096, 6144x4096, 4096x14336, 8192x8192).
#:   M <= 128: "tall128" 1.35-1.8x faster than "mid" on 8192x8192 and above; "tall" on 4096x14336
#:            (58.7M weights: 52 us against 59 for "mid" and 64 for "tall128"); "mid" on 2**25
#:            weights or fewer.
_MID_M64_MAX_WEIGHTS = 1 << 26
_MID_M128_MAX_WEIGHTS = 1 << 25
_TALL_M128_MAX_WEIGHTS = 60_000_000   # between 4096x14336 (58.7M) and 8192x8192 (67.1M)
#: Above M = 128 the 128x256 stream-K tile ("xl"): measured on H100 (docs/dispatch.md)
#: 1.04-1.6x faster than the persistent 128x128 and 128x256 tiles at
#: M = 256 on layers that make few 128x256 tiles (stream-K spreads them over every SM), within 4.5%
#: of the best 128x256 variant (persistent or stream-K, any raster / swizzle) at every M from 128 to
#: 16384, and 8% slower than 128x128 only on 6144x4096 at M = 256. The 256-row tiles lose there
#: (docs/dispatch.md: up to 1.7x slower at M = 192-256).
#: Except up to M = 256 on small layers: the persistent 128x128 tile ("large") was 3-18% faster than
#: "xl" at M = 256 on the 6 preset layers of at most 36.7M weights (3584x3584 .. 7168x5120: e.g.
#: 4608x3584 33.9 against 40.8 us, 6144x4096 37.5 against 42.8; H100, docs/dispatch.md),
#: and slower from 4096x14336 (58.7M weights: 107.9 against 67.8) up.
_LARGE_M256_MAX_WEIGHTS = 48_000_000   # between 7168x5120 (36.7M) and 4096x14336 (58.7M)
#: Above M = 512 the same 128x256 tile, persistent, in 2x1 clusters that multicast the activation
#: tile ("xlp"): measured on H100 (docs/dispatch.md) 3-12% faster
#: than "xl" at every M from 640 to 2048 on 3584x3584, 4096x4096, 6144x4096 and 4096x14336, 2-5%
#: at M = 4096 (also 28672x4096, u4 and s8); at M = 384-512 it lost on 4096x4096 (+5%) and
#: 4096x14336 (+32-43%: 64 tiles of 224 k-tiles, half the SMs idle), where stream-K spreads the
#: k-tiles. Above M = 512 a layer of N >= 3584 rows has at least 84 tiles of 128x256.
#: Also from M = 257 on layers of at least 16384 rows (>= 256 tiles): 2-26% faster than "xl" at
#: M = 384 and 512 on 28672x4096, 37888x3584, 55296x5120 and 57344x8192 (docs/dispatch.md;
#: at M = 384 "xl" runs 2 token tiles, the second half empty, 21-26% slower on the first two);
#: on 10240x8192 (160 tiles) it lost 12-26%, on 8192x28672 it won 2%. At M = 192-256 the same
#: layers were mixed (28672x4096 -7%, 57344x8192 +5%), so "xl" stays there.
_XLP_M512_MIN_ROWS = 16384
#: Above M = 512, "xl" instead of "xlp" where stream-K evens out the waves that "xlp" leaves
#: ragged (:func:`xl_evens_waves`): "xl" wins when CUTLASS's stream-K decomposition spreads its
#: tiles' k-tiles over every SM and its waves (tiles / SMs) times this factor are fewer than the
#: whole waves of "xlp". Measured on H100 (docs/dispatch.md: 16
#: preset layers x M = 640 .. 4096, 100 points): with 1.05 the rule picks the faster of the two, or
#: one within 2% of it, at every point; e.g. 4608x3584 at M = 1024 83.5 -> 64.3 us, 5120x27648
#: at M = 1024 535.1 -> 366.8, 3584x18944 at M = 1536 372.3 -> 271.5.
_XL_STREAMK_OVERHEAD = 1.05
#: The SM count :func:`select_tile` assumes when the caller names no GPU (H100 SXM, H200).
DEFAULT_SM_COUNT = 132
#: Kernel config labels, first match wins: (upper bound of M, upper bound of N x K or None, label,
#: lower bound of N or None); see select_tile.
_HEURISTIC = ((8, None, "dec8", None), (16, None, "dec16", None), (32, _DEC32_MAX_WEIGHTS, "dec32", None),
              (64, _MID_M64_MAX_WEIGHTS, "mid", None), (64, None, "tall", None),
              (128, _MID_M128_MAX_WEIGHTS, "mid", None), (128, _TALL_M128_MAX_WEIGHTS, "tall", None),
              (128, None, "tall128", None),
              (256, _LARGE_M256_MAX_WEIGHTS, "large", None), (256, None, "xl", None),
              (512, None, "xlp", _XLP_M512_MIN_ROWS), (512, None, "xl", None), (None, None, "xlp", None))


def select_tile(m: int, n: int, k: int, sm_count: int = DEFAULT_SM_COUNT) -> "TileConfig | DecodeConfig":
    """The heuristic: which kernel config runs a problem of ``m`` tokens, ``n`` output features
    and ``k`` input features.

    * ``m <= 8, 16``     -> "dec8" / "dec16": the decode kernel with that token tile (one warp
      per 16-row weight band, weights streamed by bulk copies, split-K from the measured table
      of :mod:`mixgemm.dispatch.tuning` or the kernel's planner, so that every SM streams weights);
    * ``m <= 32`` and ``n * k <= 2**25`` -> "dec32": the decode kernel with a 32-token tile (on
      small layers; measured slower than "mid" on larger ones);
    * ``m <= 64``        -> "mid": sm90 GEMM, 128x64x64 tiles, stream-K, on layers of at most
      2**26 weights; "tall" (256x64x64, stream-K) on larger ones;
    * ``m <= 128``       -> "mid" on layers of at most 2**25 weights, "tall" below 60M weights,
      "tall128" (256x128x64, stream-K) above;
    * ``m <= 256``       -> "large" (128x128x64, persistent) on layers of at most 48M weights,
      else "xl": sm90 GEMM, 128x256x64 tiles, stream-K, walked along the weight rows with
      swizzle 2;
    * ``m <= 512``       -> "xlp" on layers of at least 16384 rows: the same tile, persistent,
      in clusters of two weight tiles that share (multicast) each activation tile; else "xl";
    * else               -> "xlp", or "xl" where its stream-K decomposition evens out the waves
      that "xlp" leaves ragged on a GPU of ``sm_count`` SMs (:func:`xl_evens_waves`).

    ``k`` matters through the layer's size ``n * k`` (and above 512 tokens through its k-tiles),
    ``n`` also through its own bound.
    """
    label = next(lab for m_max, size_max, lab, rows_min in _HEURISTIC
                 if (m_max is None or m <= m_max) and (size_max is None or n * k <= size_max)
                 and (rows_min is None or n >= rows_min))
    if m > _LARGE_M:
        label = _LARGE_M_LABELS[xl_evens_waves(m, n, k, sm_count)]
    return next(tc for tc in TILE_CONFIGS if tc.label == label)


def xl_evens_waves(m: int, n: int, k: int, sm_count: int) -> bool:
    """Whether "xl" (128x256x64, stream-K) beats "xlp" (the same tile, persistent, in 2x1
    clusters) at ``m`` > 512 tokens on an ``n`` x ``k`` layer and ``sm_count`` SMs.

    "xlp" runs whole waves of tiles; "xl" is ~5% slower per tile (no activation multicast, the
    stream-K code) but, where CUTLASS's stream-K heuristic splits the last waves' k-tiles over
    every SM (its tail wave less than half full: ``tile_scheduler_params.h``
    ``get_num_sk_tiles``), runs ``tiles / sm_count`` waves. Both round the weight-row tiles up to
    pairs (the cluster; the swizzle of 2), and "xl" also the token tiles (its swizzle), so at an
    odd count of token tiles it computes an empty one."""
    rows = -(-n // 128)
    rows += rows & 1
    cols = -(-m // 256)
    tiles_xl = rows * (cols + (cols & 1))
    tail = tiles_xl % sm_count
    if tail == 0 or 2 * tail >= sm_count or -(-k // 64) <= 8:    # CUTLASS runs "xl" data-parallel
        return False
    xlp_waves = -(-(rows * cols) // sm_count)
    return tiles_xl * _XL_STREAMK_OVERHEAD < xlp_waves * sm_count


def tile_labels(m: int) -> set:
    """Every config label :func:`select_tile` may choose for ``m`` tokens on some layer: the
    choice depends on the layer through its size ``n * k`` and its rows ``n``, so the layers at
    and just past each bound of the table (as 1-column and as square-ish layers) cover every case;
    above 512 tokens both 128x256 configs (:func:`xl_evens_waves`)."""
    if m > _LARGE_M:
        return set(_LARGE_M_LABELS)
    sizes = {1} | {b + d for _, b, _, _ in _HEURISTIC if b is not None for d in (0, 1)}
    rows = {r + d for _, _, _, r in _HEURISTIC if r is not None for d in (-1, 0)}
    layers = {(s, 1) for s in sizes} | {(r, max(1, s // r)) for r in rows for s in sizes}
    return {select_tile(m, n, k).label for n, k in layers}


def _token_buckets() -> tuple[int, ...]:
    """M -> the index of the heuristic's token-count bucket, for M up to the table's largest
    bound, 512 (larger M: :func:`token_bucket`). Every M of a bucket gets the same kernel config
    from :func:`select_tile` on any layer: the table's rows match on ``m <= bound``."""
    bounds = sorted({m_max for m_max, _, _, _ in _HEURISTIC if m_max is not None})
    return tuple(bisect.bisect_left(bounds, m) for m in range(bounds[-1] + 1))


#: see _token_buckets (the launch plans are cached per bucket)
TOKEN_BUCKETS = _token_buckets()
#: the largest M of the table's buckets; above it :func:`token_bucket` picks one of two buckets
_LARGE_M = len(TOKEN_BUCKETS) - 1
#: the configs above 512 tokens, and their buckets: "xlp", and "xl" where :func:`xl_evens_waves`
_LARGE_M_LABELS = ("xlp", "xl")
LARGE_M_BUCKETS = (TOKEN_BUCKETS[-1] + 1, TOKEN_BUCKETS[-1] + 2)


def token_bucket(m: int, n: int = 0, k: int = 0, sm_count: int = DEFAULT_SM_COUNT) -> int:
    """The heuristic's token-count bucket of ``m`` (0 for M <= 8, 1 for M <= 16, ...): the plan
    cache's M key (:mod:`mixgemm.dispatch.plans`). Above 512 tokens the bucket is one of
    :data:`LARGE_M_BUCKETS`, by :func:`xl_evens_waves` for an ``n`` x ``k`` layer on ``sm_count`` SMs
    (the first without a layer)."""
    if m < len(TOKEN_BUCKETS):
        return TOKEN_BUCKETS[m]
    return LARGE_M_BUCKETS[n > 0 and xl_evens_waves(m, n, k, sm_count)]


def large_bucket(m: int, n: int, k: int, device_index: int) -> int:
    """:func:`token_bucket` of ``m`` > 512 tokens on CUDA device ``device_index``."""
    return token_bucket(m, n, k, sm_count(device_index))


@functools.lru_cache(maxsize=None)
def gpu_name(device_index: int) -> str:
    """CUDA device ``device_index``'s name (the tuning tables' key; fixed for the process)."""
    return torch.cuda.get_device_name(device_index)


@functools.lru_cache(maxsize=None)
def sm_count(device_index: int) -> int:
    """CUDA device ``device_index``'s SM count (:data:`DEFAULT_SM_COUNT` for a negative index: a
    CPU tensor's :meth:`~torch.Tensor.get_device`, which no launch plan is made for)."""
    if device_index < 0:
        return DEFAULT_SM_COUNT

    return torch.cuda.get_device_properties(device_index).multi_processor_count


#: The e4m3 GEMM's time per k-tile for each token tile, relative to the widest's (the conversion
#: of the weight's codes, the same for every token tile, is most of it), and what a split launch
#: adds, in k-tiles of the 128-token tile's time, for a 128-token tile (a narrower one in
#: proportion to its width): per wave, the partial sums that every split stores or adds in the
#: workspace, and the stream-K kernel's own cost over the persistent one's
#: (``_FP8_SPLIT_WAVE_COST``), and per split beyond the first a link of the chain in which the
#: splits of a tile add their sums one after another, in k order (``_FP8_SPLIT_LINK_COST``:
#: CUTLASS's deterministic reduction). Fitted on an H200 to 70 points (4 LLaMA-3-8B layers and
#: the gated gate/up, u4 and u2, M = 16 to 4096, every token tile x 1 to 8 splits; docs/fp8.md,
#: "Token tiles and split-K"), where the rule's pick ran within 6.2% of the fastest everywhere.
_FP8_TILE_TIME = {128: 1.0, 64: 0.83, 32: 0.65}
_FP8_SPLIT_WAVE_COST = 12.0
_FP8_SPLIT_LINK_COST = 4.0
#: The most splits of an output tile's k-tiles, and the fewest k-tiles a split may hold.
FP8_MAX_SPLITS = 8
_FP8_MIN_SPLIT_KTILES = 2


@functools.lru_cache(maxsize=4096)   # (a pure function of its arguments, asked on every e4m3 call)
def fp8_launch(m: int, n: int, k: int, sm_count: int = DEFAULT_SM_COUNT,
               token_tiles: tuple = FP8_TOKEN_TILES) -> tuple[int, int]:
    """The token tile (``tile_n``, one of :data:`mixgemm.jit.catalog.FP8_TOKEN_TILES`) and the
    split-K factor of the e4m3 GEMM for ``m`` tokens on an ``n`` x ``k`` weight, on a GPU of
    ``sm_count`` SMs.

    Each output tile's k-loop runs at about the same time per k-tile whatever the token tile
    (``_FP8_TILE_TIME``), so the launch that runs fewest k-tiles one after another on an SM wins:
    its waves (output tiles x splits over the SMs, rounded up) times the k-tiles of a split,
    plus what the splits' reduction adds (``_FP8_SPLIT_WAVE_COST`` per wave and
    ``_FP8_SPLIT_LINK_COST`` per link of the chain). Few tokens on few weight rows leave most SMs
    idle without splits, and a long K gives the splits k-tiles enough to pay for their reduction;
    many tokens fill the SMs with whole tiles. The least estimate wins; of equals, fewer splits,
    then the wider tile.
    ``token_tiles``: the tiles to choose from (one: the best split for that tile)."""
    row_tiles = -(-n // FP8_TILE[0])
    k_tiles = -(-k // FP8_TILE[2])
    sms = max(sm_count, 1)
    best, best_cost = (token_tiles[0], 1), None
    for tile_n in token_tiles:
        tiles = row_tiles * -(-max(m, 1) // tile_n)
        for splits in range(1, FP8_MAX_SPLITS + 1):
            if splits > 1 and k_tiles < splits * _FP8_MIN_SPLIT_KTILES:
                break
            waves = -(-(tiles * splits) // sms)
            cost = _FP8_TILE_TIME[tile_n] * waves * -(-k_tiles // splits)
            if splits > 1:
                cost += (waves * _FP8_SPLIT_WAVE_COST + (splits - 1) * _FP8_SPLIT_LINK_COST) * tile_n / FP8_TOKEN_TILES[0]
            if best_cost is None or cost < best_cost - 1e-9:
                best, best_cost = (tile_n, splits), cost
    return best


def select_spec(m: int, w: "PackedWeight", activation: Optional[str] = None,
                sm_count: int = DEFAULT_SM_COUNT) -> "GemmSpec | DecodeSpec":
    """The kernel :func:`mixgemm.gemm` runs (on a GPU of ``sm_count`` SMs). The decode kernels fix
    their activation at compile time (so the spec names it); the sm90 GEMM kernels take none /
    silu / gelu per call, and swiglu has GEMM kernels of its own (the gated epilogue)."""
    tc = select_tile(m, w.n, w.k, sm_count)
    return tc.spec(w.act_type, w.weight_type, Activation(activation or "none"))


def configs_any_gpu(m: int, n: int, k: int) -> list:
    """Every kernel config :func:`select_tile` may pick for ``m`` tokens on an ``n`` x ``k``
    layer, on any GPU: the one config up to 512 tokens; above, "xlp" and "xl"
    (:func:`xl_evens_waves` picks between them by M and the SM count)."""
    if m < len(TOKEN_BUCKETS):
        return [select_tile(m, n, k)]
    return [tc for tc in TILE_CONFIGS if tc.label in _LARGE_M_LABELS]


def select_specs_any_gpu(m: int, w: "PackedWeight", activation: Optional[str] = None) -> list:
    """Every kernel :func:`select_spec` may return for ``m`` tokens on ``w``, on any GPU
    (:func:`configs_any_gpu`). What :func:`mixgemm.aot.prebuild.specs_for` builds."""
    return [tc.spec(w.act_type, w.weight_type, Activation(activation or "none"))
            for tc in configs_any_gpu(m, w.n, w.k)]
