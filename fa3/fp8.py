"""The FP8 forward: fa3.attention on torch.float8_e4m3fn q, k, v with descales (rung family
"attention_fp8", kernels/k5_fp8.py).

    out = fa3.attention(q8, k8, v8, q_descale=sq, k_descale=sk, v_descale=sv, causal=True)

computes attention of the dequantized inputs, q8 * q_descale etc. (flash-attn's FA3 interface):
descales are float32 shaped (batch, heads_kv), or one element for the whole tensor, or None (1);
q_descale is per KV head (one scale for the query heads of a group). The output is bf16 (or out='s
dtype, bf16 or fp16); causal, GQA, the LSE, sliding windows and softcap are as in bf16. Forward
only: q, k or v that require grad are refused. fa3.quantize_fp8 makes the inputs and scales.
Packed batches (fa3.attention_varlen, flash_attn_varlen_func) take the same arguments, descales
(sequences, heads_kv); an FP8 KV cache is fa3.attention_with_kvcache's (fa3.kvcache).

The kernel's V is V^T, (batch, heads_kv, d, keys padded to 16) with the keys permuted inside each
16 (transpose_v: the order in which each thread packs P into the FP8 A operand, kernels/k5_fp8.py):
one pass over V per call (kernels/fp8_transpose.py, 1 byte an element), which FA3's C++ kernel does
in SMEM.
"""

from __future__ import annotations

import math

import torch

from . import _checks, _dispatch, _launch, index_checks, masking, registry
from .compile import builders as _compile

# transpose_v: key 16b + 8a + 2t + c goes to position 16b + 4t + 2a + c (mma.fp8_a_order)
KEY_BLOCK = 16


def padded_keys(seqlen: int) -> int:
    """V^T's key count: seqlen_k rounded up to whole 16-key blocks."""
    return -(-seqlen // KEY_BLOCK) * KEY_BLOCK


def transpose_v(v: torch.Tensor) -> torch.Tensor:
    """V (batch, seqlen_k, heads_kv, d) e4m3 -> the kernel's V^T: a (batch, d, heads_kv, keys) view
    of a contiguous (batch, heads_kv, d, keys) tensor, keys = seqlen_k rounded up to 16 (zeros past
    seqlen_k), each 16 keys in the order the FP8 P operand packs them. On the GPU: one pass of
    kernels/fp8_transpose.py (32-bit words: V viewed as int32); `transpose_v_reference` is the same
    map in torch ops."""
    if v.device.type != "cuda":
        return transpose_v_reference(v)
    batch, seqlen, heads, d = v.shape
    keys = padded_keys(seqlen)
    vt = torch.empty(batch, heads, d, keys, dtype=v.dtype, device=v.device)
    if vt.numel():
        _compile.get_value_transpose(d)(_launch.tma_ready(v).view(torch.int32), vt.view(torch.int32),
                                        _launch.stand_in(v.device))
    return vt.permute(0, 2, 1, 3)


def transpose_v_packed(v: torch.Tensor, cu_seqlens_k: torch.Tensor) -> torch.Tensor:
    """A packed batch's V (total_k, heads_kv, d) -> V^T as transpose_v's for one batch entry,
    (1, d, heads_kv, columns), each sequence's keys in their own run of 16-aligned columns: entry b
    starts at column 16 * ceil(cu_seqlens_k[b] / 16) + 16 b (kernels/k5_fp8.py reads it there),
    so that the 16-key permutation counts from its first key; zeros between runs. One pass of
    kernels/fp8_transpose.py (its packed variant); offsets are not read on the host (values no
    check saw place keys wrongly, never outside the tensors)."""
    total_k, heads, d = v.shape
    batch = cu_seqlens_k.shape[0] - 1
    columns = padded_keys(total_k) + KEY_BLOCK * batch
    if v.device.type != "cuda":
        return _transpose_v_packed_reference(v, cu_seqlens_k, columns)
    vt = torch.empty(1, heads, d, columns, dtype=v.dtype, device=v.device)
    if vt.numel():
        _compile.get_value_transpose(d, packed=True)(_launch.tma_ready(v.unsqueeze(0)).view(torch.int32),
                                                     vt.view(torch.int32), cu_seqlens_k)
    return vt.permute(0, 2, 1, 3)


def _transpose_v_packed_reference(v, cu_seqlens_k, columns):
    """transpose_v_packed in torch ops: each sequence spread to its run, then transpose_v."""
    total_k, heads, d = v.shape
    batch = cu_seqlens_k.shape[0] - 1
    keys = torch.arange(total_k, dtype=cu_seqlens_k.dtype, device=v.device)
    entry = (torch.searchsorted(cu_seqlens_k, keys, right=True) - 1).clamp_(0, max(batch - 1, 0))
    starts = cu_seqlens_k.long()
    shift = (starts + KEY_BLOCK - 1) // KEY_BLOCK * KEY_BLOCK - starts + \
        KEY_BLOCK * torch.arange(batch + 1, device=v.device)
    column = (keys + shift[entry]).clamp_(0, columns - 1)
    spread = v.view(torch.uint8).new_zeros(columns, heads, d)
    spread.index_copy_(0, column, v.view(torch.uint8))
    return transpose_v_reference(spread.view(v.dtype).unsqueeze(0))


def transpose_v_reference(v: torch.Tensor) -> torch.Tensor:
    """transpose_v in torch ops (a byte gather: the test reference; the kernel is what calls run)."""
    batch, seqlen, heads, d = v.shape
    keys = padded_keys(seqlen)
    u = v.view(torch.uint8)  # FP8 has few torch kernels; bytes copy the same (0x00 is +0.0)
    if keys != seqlen:
        padded = u.new_zeros(batch, keys, heads, d)
        padded[:, :seqlen] = u
        u = padded
    # (b, blocks, a, t, c, h, d) -> (b, h, d, blocks, t, a, c): key 16b + 8a + 2t + c at 16b + 4t + 2a + c
    blocks = u.reshape(batch, keys // KEY_BLOCK, 2, 4, 2, heads, d)
    vt = blocks.permute(0, 5, 6, 1, 3, 2, 4).reshape(batch, heads, d, keys)
    return vt.view(v.dtype).permute(0, 2, 1, 3)


def is_fp8_call(q, q_descale, k_descale, v_descale) -> bool:
    """Whether fa3.attention's call belongs to the FP8 forward: FP8 q, or any descale given."""
    return (isinstance(q, torch.Tensor) and q.dtype in _checks.FP8_LIKE) or \
        q_descale is not None or k_descale is not None or v_descale is not None


def check_attention_fp8(q, k, v, q_descale, k_descale, v_descale, kernel, out=None, sinks=None,
                        cu_seqlens=None, max_seqlens=(None, None), check_values=True):
    """fa3.attention's FP8 arguments (and attention_varlen's: `cu_seqlens` = (cu_seqlens_q,
    cu_seqlens_k) for a packed batch, with `max_seqlens` and `check_values` as there); returns
    (spec, (q_descale, k_descale, v_descale)) with the descales as the kernel takes them (float32,
    (batch, heads_kv), contiguous; a packed batch's entries are its batch)."""
    if isinstance(q, torch.Tensor) and q.dtype not in _checks.FP8_LIKE:
        raise ValueError(f"q_descale, k_descale and v_descale apply to FP8 inputs; q has dtype "
                         f"{q.dtype}: quantize q, k and v with fa3.quantize_fp8, or drop the descales")
    if sinks is not None:
        raise ValueError("sinks are not supported with FP8 inputs (the FP8 rungs do not compile "
                         "them): pass bfloat16 or float16 q, k, v (fa3.dequantize_fp8) to use "
                         "sinks, or drop sinks")
    packed = cu_seqlens is not None
    q_shape, k_shape = _checks.check_qkv(q, k, v, _checks.PACKED_KV_LAYOUT if packed else _checks.KV_LAYOUT,
                                         dtypes=_checks.FP8_DTYPES)
    if packed:
        index_checks.check_packed_offsets(*cu_seqlens, q.device, q_shape[0], k_shape[0], *max_seqlens,
                                          check_values)
        batch = cu_seqlens[0].shape[0] - 1
    elif k_shape[0] != q_shape[0]:
        raise ValueError(f"q has batch {q_shape[0]} but k and v have batch {k_shape[0]}")
    else:
        batch = q_shape[0]
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        raise ValueError("FP8 attention is forward-only (as FlashAttention-3's): q, k or v requires "
                         "grad; pass tensors that do not (x.detach()), or train in bfloat16")
    head_dim = q_shape[-1]
    spec = _dispatch.memo_rung(fp8_rung, kernel, head_dim)
    if v.shape[-1] != head_dim:
        _dispatch.check_value_head_dim(spec, head_dim, v.shape[-1], "kernel")
    _checks.check_hopper(q.device, "q")
    heads_kv = k_shape[-2]
    descales = tuple(_checks.check_descale(t, name, batch, heads_kv, q.device) for t, name in
                     ((q_descale, "q_descale"), (k_descale, "k_descale"), (v_descale, "v_descale")))
    if out is not None:
        _checks.check_fp8_output(out, q, (("q", q), ("k", k), ("v", v)))
    return spec, descales


def fp8_rung(kernel, head_dim):
    """The FP8 forward rung `kernel` (None: the fastest for head_dim), checked to support it."""
    return _dispatch.family_rung(registry.ATTENTION_FP8, kernel, head_dim, "q, k and v")


def attention_fp8(q, k, v, q_descale, k_descale, v_descale, *, causal, softmax_scale, window,
                  softcap, return_lse, kernel, out, sinks=None, cu_seqlens=None, max_seqlens=(None, None)):
    """fa3.attention's FP8 branch, and attention_varlen's (`cu_seqlens`: (cu_seqlens_q,
    cu_seqlens_k)); the public docstrings are theirs."""
    spec, descales = check_attention_fp8(q, k, v, q_descale, k_descale, v_descale, kernel, out,
                                         sinks, cu_seqlens, max_seqlens)
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    causal, window = bool(causal), tuple(window)
    mask = masking.masking(causal, window, softcap, scale)
    _dispatch.check_variants(spec, mask, "kernel")
    out_dtype = torch.bfloat16 if out is None else out.dtype
    cu = cu_seqlens or (None, None)
    if _dispatch.direct_call_ok(q, k, v, *descales, *(t for t in cu if t is not None)):
        with _dispatch.op_range("fa3::attention_fp8"):
            result, lse = launch_attention_fp8(spec, q, k, v, descales, mask, out_dtype, out, cu_seqlens)
    else:
        result, lse = torch.ops.fa3.attention_fp8(q, k, v, *descales, causal, scale, spec.name,
                                                  window[0], window[1], float(softcap), out_dtype, *cu)
        result = result if out is None else out.copy_(result)
    return (result, lse) if return_lse else result


def launch_attention_fp8(spec, q, k, v, descales, mask: masking.Masking, out_dtype, out=None,
                         cu_seqlens=None):
    """Allocate (unless `out`) and launch: (out, lse). Arguments are validated already. A packed
    batch (`cu_seqlens`) runs as one batch entry holding every sequence, as attention_varlen's."""
    device = q.device
    if out is None:
        out = torch.empty(q.shape, dtype=out_dtype, device=device)
    heads_q, head_dim = q.shape[-2:]
    lse = torch.empty(*q.shape[:-3], heads_q, q.shape[-3], dtype=torch.float32, device=device)
    if out.numel() == 0 or k.shape[-3] == 0:  # nothing to compute, or no keys: O = 0, LSE = -inf
        out.zero_()
        lse.fill_(float("-inf"))
        return out, lse
    stand_in = _launch.stand_in(device)
    host_vt = spec.load_class().value_transposed_by_host  # F1; F2 transposes V in SMEM
    if cu_seqlens is None:
        q4, k4, o4, lse3, cu = q, k, out, lse, (stand_in, stand_in)
        v4 = transpose_v(v) if host_vt else _launch.tma_ready(v)
    else:
        q4, k4, o4, lse3 = q.unsqueeze(0), k.unsqueeze(0), out.unsqueeze(0), lse.unsqueeze(0)
        v4 = transpose_v_packed(v, cu_seqlens[1]) if host_vt else _launch.tma_ready(v.unsqueeze(0))
        cu = cu_seqlens
    fn = _compile.get_attention_fp8(spec, out_dtype, head_dim, mask.causal, cu_seqlens is not None,
                                    mask.local, mask.softcap)
    fn(_launch.tma_ready(q4), _launch.tma_ready(k4), v4, o4, lse3, mask.scale_log2,
       _checks.HOPPER_SMS[device], _launch.tile_counter(spec, mask.causal, device), *cu,
       mask.left, mask.right, mask.softcap_scale, *descales)
    return out, lse
