"""The backward of fa3.attention: the fa3::attention_backward op's checks and body.

    preprocess (D = rowsum(dO * O), LSE * log2 e)  ->  main kernel (dK, dV; dQ summed in FP32)
    ->  postprocess (dQ * softmax_scale -> dtype; GQA: dK and dV summed over each group)

The autograd registration that calls it is in fa3.ops; the rung choice in fa3.interface.
"""

from __future__ import annotations

import torch

from . import _compile, interface, masking


def _check_backward(dout, q, k, v, out, lse, kernel):
    """The backward op's arguments: the forward's (checked again: the op can be called directly)
    plus dout and out shaped like q and lse (batch, heads_q, seqlen_q) FP32."""
    interface._check_attention(q, k, v, None)
    spec = interface._memo_rung(interface._backward_rung, kernel, q.shape[3])
    for name, t in (("dout", dout), ("out", out)):
        interface.check_tensor(t, name, 4, q.dtype, unit_stride_last=False)  # any strides: copied if needed
        if t.shape != q.shape or t.device != q.device:
            raise ValueError(f"{name} must be shaped like q {tuple(q.shape)} on {q.device}, got "
                             f"{tuple(t.shape)} on {t.device}")
    batch, seqlen_q, heads_q, _ = q.shape
    if not isinstance(lse, torch.Tensor) or lse.shape != (batch, heads_q, seqlen_q) \
            or lse.dtype != torch.float32 or lse.device != q.device:
        raise ValueError(f"lse must be the forward's (batch, heads_q, seqlen_q) = "
                         f"{(batch, heads_q, seqlen_q)} float32 log-sum-exp on {q.device}")
    return spec


_NO_LOCK: dict[torch.device, torch.Tensor] = {}  # a stand-in for the counters when not deterministic


def launch_attention_backward(spec, dout, q, k, v, out, lse, causal: bool, scale: float,
                              deterministic: bool, window=(-1, -1), softcap: float = 0.0):
    """(dq, dk, dv) for rung `spec`: preprocess (D, LSE * log2 e), the main kernel (dK, dV per
    query head; dQ summed in FP32), postprocess (dQ * scale -> dtype; GQA sums over each group).
    The body of the fa3::attention_backward op: arguments are validated already."""
    batch, seqlen_q, heads_q, head_dim = q.shape
    seqlen_k, heads_kv = k.shape[1], k.shape[2]
    device, dtype = q.device, q.dtype
    dq = torch.empty_like(q, memory_format=torch.contiguous_format)
    dk = torch.empty_like(k, memory_format=torch.contiguous_format)
    dv = torch.empty_like(v, memory_format=torch.contiguous_format)
    if dq.numel() == 0 or seqlen_k == 0:  # nothing to differentiate, or no key: all gradients 0
        return dq.zero_(), dk.zero_(), dv.zero_()
    if q.requires_grad or k.requires_grad or v.requires_grad or out.requires_grad or dout.requires_grad:
        q, k, v, out, dout = interface._detached(q, k, v, out, dout)
    q, k, v, dout = (interface.tma_ready(t) for t in (q, k, v, dout))
    if out.stride(-1) != 1:
        out = out.contiguous()
    tile_m = spec.config_for(head_dim)["tile_m"]
    q_tiles = -(-seqlen_q // tile_m)
    lse2 = torch.empty(batch, heads_q, q_tiles * tile_m, dtype=torch.float32, device=device)
    dsum = torch.empty_like(lse2)
    _compile.get_backward_preprocess(dtype, head_dim)(out, dout, lse, lse2, dsum)
    dq_acc = torch.zeros(batch, q_tiles * tile_m, heads_q, head_dim, dtype=torch.float32, device=device)
    gqa = heads_q != heads_kv
    if gqa:  # one slice per query head in FP32, summed over each group below
        dk_h = torch.empty(batch, seqlen_k, heads_q, head_dim, dtype=torch.float32, device=device)
        dv_h = torch.empty_like(dk_h)
    else:
        dk_h, dv_h = dk, dv
    if deterministic:
        lock = torch.zeros(batch, heads_q, q_tiles, dtype=torch.int32, device=device)
    else:
        lock = _NO_LOCK.get(device)
        if lock is None:
            lock = _NO_LOCK[device] = torch.zeros(1, 1, 1, dtype=torch.int32, device=device)
    mask = masking.masking(causal, window, softcap, scale)  # as the forward saw the scores
    fn = _compile.get_backward(spec, dtype, head_dim, mask.causal, bool(deterministic), gqa, mask.local,
                               mask.softcap)
    fn(q, k, v, dout, lse2, dsum, dq_acc, dk_h, dv_h, lock, mask.scale_log2, scale, mask.left,
       mask.right, mask.softcap_scale)
    torch.mul(dq_acc[:, :seqlen_q], scale, out=dq)
    if gqa:
        group = heads_q // heads_kv
        torch.sum(dk_h.view(batch, seqlen_k, heads_kv, group, head_dim), dim=3, out=dk)
        torch.sum(dv_h.view(batch, seqlen_k, heads_kv, group, head_dim), dim=3, out=dv)
    return dq, dk, dv
