"""Float reference attention: the definition every kernel is checked against.

Same conventions as fa3.attention: (batch, seqlen, heads, head_dim) layout, GQA by head groups,
causal and sliding windows aligned to the bottom right, softcap as Gemma 2, attention sinks as
gpt-oss (one logit per query head in every row's denominator, with no value), rows with no visible
key give O = 0 and LSE = -inf (with sinks: the head's sink).
"""

import math

import torch


def causal_mask(seqlen_q: int, seqlen_k: int, device=None) -> torch.Tensor:
    """True where query i may see key j: j <= i + seqlen_k - seqlen_q (bottom-right aligned)."""
    i = torch.arange(seqlen_q, device=device)[:, None]
    j = torch.arange(seqlen_k, device=device)[None, :]
    return j <= i + (seqlen_k - seqlen_q)


def window_mask(seqlen_q: int, seqlen_k: int, left: int, right: int, device=None) -> torch.Tensor:
    """True where query i may see key j: i + shift - left <= j <= i + shift + right, shift =
    seqlen_k - seqlen_q; -1 leaves that side unbounded (flash-attn's window_size)."""
    i = torch.arange(seqlen_q, device=device)[:, None] + (seqlen_k - seqlen_q)
    j = torch.arange(seqlen_k, device=device)[None, :]
    visible = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if left >= 0:
        visible &= j >= i - left
    if right >= 0:
        visible &= j <= i + right
    return visible


def attention_reference(q, k, v, causal=False, softmax_scale=None, dtype=torch.float32,
                        window_size=(-1, -1), softcap=0.0, sinks=None):
    """Returns (out, lse) computed in `dtype` (float32 or float64); out is cast back to q.dtype's
    shape but kept in `dtype`. lse is (batch, heads_q, seqlen_q). `sinks` (heads_q,): differentiable
    here (autograd of this function is the reference for the kernels' d sinks)."""
    batch, seqlen_q, heads_q, head_dim = q.shape
    seqlen_k, heads_kv = k.shape[1], k.shape[2]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
    group = heads_q // heads_kv
    qf = q.to(dtype).transpose(1, 2)  # b h s d
    kf = k.to(dtype).transpose(1, 2).repeat_interleave(group, dim=1)
    vf = v.to(dtype).transpose(1, 2).repeat_interleave(group, dim=1)
    scores = torch.matmul(qf, kf.transpose(-1, -2)) * scale
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    left, right = window_size
    if causal:
        right = 0
    if (left, right) != (-1, -1):
        scores = scores.masked_fill(~window_mask(seqlen_q, seqlen_k, left, right, q.device), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    if sinks is not None:  # the sink joins each row's denominator: log(sum_j e^s_j + e^sink)
        lse = torch.logaddexp(lse, sinks.to(dtype)[None, :, None].expand_as(lse))
    probs = torch.exp(scores - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    out = torch.matmul(probs, vf).transpose(1, 2)
    return out, lse


def attention_backward_reference(dout, q, k, v, out, lse, causal=False, softmax_scale=None,
                                 dtype=torch.float64):
    """(dq, dk, dv) in `dtype` given the forward's `out` and `lse` (fa3.attention_backward's
    definition): P = exp(S - lse), D = rowsum(dO * O), dS = P (dO V^T - D), dQ = scale dS K,
    dK = scale dS^T Q, dV = P^T dO; GQA: dK and dV summed over each group. With the out and lse of
    a larger key set this is one key block's share of the gradient (ring attention's backward)."""
    batch, seqlen_q, heads_q, head_dim = q.shape
    seqlen_k, heads_kv = k.shape[1], k.shape[2]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
    group = heads_q // heads_kv
    qf, of, dof = (t.to(dtype).transpose(1, 2) for t in (q, out, dout))  # b h s d
    kf = k.to(dtype).transpose(1, 2).repeat_interleave(group, dim=1)
    vf = v.to(dtype).transpose(1, 2).repeat_interleave(group, dim=1)
    scores = torch.matmul(qf, kf.transpose(-1, -2)) * scale
    if causal:
        scores = scores.masked_fill(~causal_mask(seqlen_q, seqlen_k, q.device), float("-inf"))
    lse = lse.to(dtype)
    probs = torch.exp(scores - torch.where(torch.isinf(lse), float("inf"), lse)[..., None])
    dv = torch.matmul(probs.transpose(-1, -2), dof)
    dscores = probs * (torch.matmul(dof, vf.transpose(-1, -2)) - (dof * of).sum(-1, keepdim=True))
    dq = torch.matmul(dscores, kf) * scale
    dk = torch.matmul(dscores.transpose(-1, -2), qf) * scale

    def per_kv_head(t):  # b h_q s d -> b s h_kv d, summed over each group
        return t.view(batch, heads_kv, group, seqlen_k, head_dim).sum(2).transpose(1, 2)

    return dq.transpose(1, 2), per_kv_head(dk), per_kv_head(dv)
