"""FP8 (e4m3) quantization on the host: scales per tensor, per head or per block of rows, and the
incoherent processing of FlashAttention-3 (random signs times a Hadamard transform).

    x_fp8, descale = fa3.quantize_fp8(x, granularity="tensor" | "head" | "block")
    x ~= fa3.dequantize_fp8(x_fp8, descale)            (x_fp8.float() * descale, broadcast)
    q_rot = fa3.hadamard_rotate(q); k_rot = fa3.hadamard_rotate(k)    q_rot k_rot^T == q k^T

Scales: `descale` is what the FP8 values are multiplied by to give x back (amax / 448, 448 being
e4m3's largest finite value), float32, with these shapes for x of shape (batch, seqlen, heads, d):

    granularity="tensor"  ()                                   one scale
    granularity="head"    (batch, heads)                       per (batch, head); with
                          (batch, num_heads_kv)                num_heads_kv: one per group of
                                                               heads_q // num_heads_kv query heads
                                                               (what fa3.attention's q_descale
                                                               takes under GQA)
    granularity="block"   (batch, heads, ceil(seqlen / block_size))   per block of block_size rows
                                                               of one head

fa3.attention takes the "tensor" and "head" scales (flash-attn's FA3 interface: q/k/v_descale
shaped (batch, heads_kv)); block scales serve FP8 GEMMs and finer-grained references.

Incoherent processing (FlashAttention-3, section 3.3): outliers in a few channels of q and k
inflate amax, so the scale wastes e4m3's few bits on them. Multiplying q and k by the same random
orthogonal matrix M = D H / sqrt(d) (D: random signs, H: the d x d Hadamard matrix) spreads every
outlier over all channels and leaves q k^T unchanged: (q M)(k M)^T = q M M^T k^T = q k^T. H is
applied by the fast Walsh-Hadamard transform, O(d log d) per row. The same `seed` must rotate q and
k (the signs follow from it); v is not rotated (its product with P is not invariant).
"""

from __future__ import annotations

import math

import torch

FP8_DTYPE = torch.float8_e4m3fn
E4M3_MAX = 448.0  # largest finite e4m3fn value
GRANULARITIES = ("tensor", "head", "block")
_FLOAT_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)

_SIGNS: dict[tuple, torch.Tensor] = {}


def random_signs(d: int, seed: int = 0, device=None, dtype=torch.float32) -> torch.Tensor:
    """The (d,) vector of +-1 that `hadamard_rotate` multiplies by, drawn from `seed` (the same on
    every device: drawn on the CPU)."""
    key = (d, int(seed), str(device), dtype)
    signs = _SIGNS.get(key)
    if signs is None:
        gen = torch.Generator().manual_seed(int(seed))
        bits = torch.randint(0, 2, (d,), generator=gen)
        signs = _SIGNS[key] = (bits * 2 - 1).to(device=device, dtype=dtype)
    return signs


def _check_float(x, name: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{name} has dtype {x.dtype}; quantize from torch.float32, float64, bfloat16 "
                        "or float16")


def hadamard_rotate(x: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """x (..., d) times D H / sqrt(d): random signs (from `seed`), then the normalized Hadamard
    transform over the last dimension (fast Walsh-Hadamard, O(d log d) per row). d must be a power
    of two. Orthogonal: rotating q and k with the same seed keeps q k^T (up to rounding). Computed
    in float32 (float64 for float64 input); returned in x's dtype."""
    _check_float(x, "x")
    d = x.shape[-1] if x.dim() else 0
    if d < 1 or d & (d - 1):
        raise ValueError(f"hadamard_rotate needs a last dimension that is a power of two, got "
                         f"shape {tuple(x.shape)}: pad the head dim to the next power of two")
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    y = x.to(work) * random_signs(d, seed, x.device, work)
    rows = y.reshape(-1, d)
    h = 1
    while h < d:  # butterflies on pairs h apart: (a, b) -> (a + b, a - b)
        pairs = rows.reshape(-1, d // (2 * h), 2, h)
        a, b = pairs[:, :, 0], pairs[:, :, 1]
        rows = torch.stack((a + b, a - b), dim=2).reshape(-1, d)
        h *= 2
    return (rows * (1.0 / math.sqrt(d))).reshape(x.shape).to(x.dtype)


def quantize_fp8(x: torch.Tensor, granularity: str = "tensor", *, num_heads_kv: int | None = None,
                 block_size: int = 128, hadamard: bool = False, seed: int = 0):
    """(x_fp8, descale): x in torch.float8_e4m3fn and the float32 scale that gives it back,
    x ~= x_fp8 * descale. Shapes of descale: the module docstring (x is (batch, seqlen, heads, d)
    for "head" and "block"; any shape for "tensor").

    num_heads_kv ("head" only): one scale per group of heads // num_heads_kv consecutive heads, for
        q under GQA (fa3.attention's q_descale is (batch, heads_kv)).
    block_size ("block" only): rows per block.
    hadamard: rotate the last dimension first (hadamard_rotate with `seed`): pass the same seed
        for q and k, and not for v.
    All-zero groups get descale 1 (their values quantize to 0)."""
    _check_float(x, "x")
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity={granularity!r}; choose one of {', '.join(map(repr, GRANULARITIES))}")
    if granularity != "tensor" and x.dim() != 4:
        raise ValueError(f"granularity={granularity!r} needs x shaped (batch, seqlen, heads, head_dim), "
                         f"got shape {tuple(x.shape)}")
    if num_heads_kv is not None and granularity != "head":
        raise ValueError("num_heads_kv applies to granularity='head' only")
    if hadamard:
        x = hadamard_rotate(x, seed)
    xf = x.float() if x.dtype != torch.float64 else x
    if granularity == "tensor":
        amax = xf.abs().amax() if x.numel() else xf.new_zeros(())
        descale = _descale(amax)
        return _cast(xf / descale), descale.float()
    batch, seqlen, heads, d = x.shape
    if granularity == "head":
        groups = heads if num_heads_kv is None else num_heads_kv
        if groups < 1 or heads % groups:
            raise ValueError(f"num_heads_kv={num_heads_kv} must divide the {heads} heads of x")
        grouped = xf.reshape(batch, seqlen, groups, heads // groups, d)
        amax = grouped.abs().amax(dim=(1, 3, 4)) if seqlen else grouped.new_zeros(batch, groups)
        descale = _descale(amax)  # (batch, groups)
        x_fp8 = _cast(grouped / descale[:, None, :, None, None]).reshape(x.shape)
        return x_fp8, descale.float()
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size={block_size!r} must be a positive int")
    blocks = -(-seqlen // block_size)
    padded = torch.nn.functional.pad(xf, (0, 0, 0, 0, 0, blocks * block_size - seqlen))
    tiles = padded.reshape(batch, blocks, block_size, heads, d)
    amax = tiles.abs().amax(dim=(2, 4)).transpose(1, 2)  # (batch, heads, blocks)
    descale = _descale(amax)
    scaled = tiles / descale.transpose(1, 2)[:, :, None, :, None]
    x_fp8 = _cast(scaled.reshape(batch, blocks * block_size, heads, d)[:, :seqlen])
    return x_fp8, descale.float()


def dequantize_fp8(x_fp8: torch.Tensor, descale: torch.Tensor, block_size: int = 128,
                   dtype=torch.float32) -> torch.Tensor:
    """x_fp8 * descale in `dtype`, the granularity read off descale's shape (0-d or one element:
    per tensor; (batch, groups): per head or group of heads; (batch, heads, blocks): per block of
    `block_size` rows)."""
    x = x_fp8.to(dtype)
    s = descale.to(device=x.device, dtype=dtype)
    if s.numel() == 1:
        return x * s.reshape(())
    batch, seqlen, heads, d = x.shape
    if s.dim() == 2:
        groups = s.shape[1]
        return (x.reshape(batch, seqlen, groups, heads // groups, d)
                * s[:, None, :, None, None]).reshape(x.shape)
    per_row = s.repeat_interleave(block_size, dim=2)[:, :, :seqlen]  # (batch, heads, seqlen)
    return x * per_row.transpose(1, 2)[..., None]


def _descale(amax: torch.Tensor) -> torch.Tensor:
    return torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))


def _cast(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(FP8_DTYPE)
