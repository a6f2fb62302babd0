"""fa3 as a Hugging Face transformers attention implementation.

    import fa3.integrations.transformers          # registers "fa3" (a no-op without transformers)
    model = AutoModelForCausalLM.from_pretrained(..., attn_implementation="fa3")
    model.set_attn_implementation("fa3")          # or switch an existing model

What a layer passes is mapped onto fa3's entry points: (batch, heads, seqlen, head_dim) tensors as
(batch, seqlen, heads, head_dim) views (no copies), GQA as it is, `scaling` as softmax_scale,
causal from the module (`is_causal`), `sliding_window` W as flash-attn's window (W - 1, W - 1) (with
causal: the W most recent keys, as transformers' own masks), `softcap` as Gemma 2's cap, `s_aux`
(gpt-oss's per-head attention sinks, a parameter in the model's dtype) as fa3's float32 `sinks`
(differentiable: training updates them). The mask
is flash-attention's (transformers' `flash_attention_mask`): None when nothing is padded, else the
2-D (batch, keys) padding mask, and then the batch is unpadded into fa3.attention_varlen (right- or
left-padded prompts, padded training batches); decode steps over a left-padded cache (every new
query real, each row's padding before its keys) read transformers' cache in place through
fa3.attention_with_kvcache's cache_leftpad, with no gather. Generation uses transformers' own
cache: each step attends to the whole cache, bottom-right aligned. A static cache holds rows past
its tokens: with a mask, the rows it covers are read (as transformers' flash-attention path slices
them); without one (transformers drops an all-ones mask for implementations not named "flash..."),
each row holds its last query's position + 1 keys (from position_ids: one sync a forward, or read
in place by the cache call where rows differ or the call is traced). A flattened batch (padding-free
training: one row, no mask, each sequence's position ids from 0, or transformers' cu_seq_lens_q/k
kwargs) runs as the variable-length batch it is, never attending across sequences; under
torch.compile only the kwargs are read (finding the sequences in the position ids would break the
graph at every layer: DataCollatorWithFlattening(return_flash_attn_kwargs=True) provides them).
Training runs fa3's backward, padded batches included (the varlen backward; gradients of padded rows are 0).

Refused with a clear error, never approximated: dropout > 0 while training (fa3 has no attention
dropout), output_attentions and an arbitrary additive mask.
"""

from __future__ import annotations

import weakref
from typing import NamedTuple

import torch

from .._launch import tma_aligned
from ..interface import attention
from ..kvcache import attention_with_kvcache, decode_rows_fit
from ..varlen import packed_attention

NAME = "fa3"


def _window(sliding_window, key_length):
    """transformers' sliding window W (the W most recent keys) as flash-attn's (left, right)."""
    if sliding_window is None or key_length <= sliding_window:
        return (-1, -1)
    return (sliding_window - 1, sliding_window - 1)


def _wants_grad(*tensors) -> bool:
    """Whether autograd records this call: then the cache call (no gradient) cannot serve it."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _cu_seqlens(lengths: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.pad(torch.cumsum(lengths, 0, dtype=torch.int32), (1, 0))


class _LeftPadded(NamedTuple):
    """A decode step's mask, each row's padding before its keys and its new queries real: the cache
    is read in place (attention_with_kvcache, cache_leftpad)."""
    lengths: torch.Tensor  # int32 (batch,): every row holds all the keys
    leftpad: torch.Tensor  # int32 (batch,): where each row's keys start


class _PerTensor:
    """What is derived from a tensor every layer of a forward is passed (the padding mask, the
    position ids), computed once: reading it synchronizes with the host. Kept for the last `slots`
    tensors (models that mix full and sliding layers, gpt-oss and Gemma 2/3, get two masks a
    forward, one per layer kind, their layers alternating), each reused only for that very tensor
    object (a weak reference) at the same version and with the same further arguments."""

    slots = 4

    def __init__(self, build):
        self._build, self._entries = build, []  # [(weak reference, state, value)], the most recent first

    def get(self, tensor: torch.Tensor, *args):
        if torch.compiler.is_compiling():  # traced: built into the graph, nothing kept
            return self._build(tensor, *args)
        state = (tensor._version, *args)
        for ref, seen, value in self._entries:
            if ref() is tensor and seen == state:
                return value
        value = self._build(tensor, *args)
        self._entries = [(weakref.ref(tensor), state, value)] + self._entries[:self.slots - 1]
        return value


def _unpad_plan(mask, seqlen_q, in_place):
    """How a padding mask is applied: a _LeftPadded plan where in_place allows and the mask is left
    padding with every query real (one host sync), else the gather indices and offsets of the real
    tokens."""
    mask = mask.bool()
    if in_place and seqlen_q < mask.shape[1]:
        lengths = mask.sum(1, dtype=torch.int32)
        leftpad = mask.shape[1] - lengths
        starts = torch.arange(mask.shape[1], device=mask.device)[None, :] >= leftpad[:, None]
        if bool(((starts == mask).all() & (lengths >= seqlen_q).all()).item()):  # the one sync
            return _LeftPadded(torch.full_like(lengths, mask.shape[1]), leftpad)
    q_mask = mask[:, -seqlen_q:]  # the queries are the last seqlen_q positions (decode: the new ones)
    return (q_mask.flatten().nonzero().squeeze(1), mask.flatten().nonzero().squeeze(1),
            _cu_seqlens(q_mask.sum(1, dtype=torch.int32)), _cu_seqlens(mask.sum(1, dtype=torch.int32)))


def _filled_keys(position_ids, key_length):
    """The keys each row of a step over a cache holds: its last query's position + 1, at most
    key_length (transformers' static cache has rows past them that hold no token yet, and passes
    no mask when nothing is padded). Eager: the count as an int where every row agrees (one host
    sync), else int32 (rows,) counts; traced: the counts."""
    lengths = (position_ids[:, -1] + 1).clamp(0, key_length).to(torch.int32)
    if torch.compiler.is_compiling():
        return lengths
    low, high = (int(x) for x in torch.stack(lengths.aminmax()).tolist())  # the one sync
    return high if low == high else lengths


def _packed_spans(position_ids):
    """Where the sequences of a flattened batch start (transformers' padding-free training, as
    DataCollatorWithFlattening builds it: one row, each sequence's positions counting from 0):
    (cu_seqlens int32, longest) or None when the row is one sequence. Host syncs: the starts'
    count and the longest."""
    positions = position_ids.reshape(-1)
    starts = (positions == 0).nonzero().reshape(-1)
    if starts.numel() == 0 or starts[0] != 0:  # the row's first token starts a sequence whatever its position
        starts = torch.cat([starts.new_zeros(1), starts])
    if starts.numel() == 1:
        return None
    cu_seqlens = torch.cat([starts, starts.new_full((1,), positions.numel())]).to(torch.int32)
    return cu_seqlens, int(cu_seqlens.diff().max())


_PLAN = _PerTensor(_unpad_plan)  # padding masks
_FILLED = _PerTensor(_filled_keys)  # position ids over a cache
_PACKED = _PerTensor(_packed_spans)  # position ids of a flattened batch


def _unpadded(q, k, v, mask, causal, scaling, window, softcap, sinks=None):
    """Padded (batch, seqlen, heads, d) q/k/v and a (batch, keys) padding mask -> fa3.attention_varlen
    on the real tokens -> the padded layout again (padded query rows are 0); or, for a decode step
    over a left-padded cache (no gradient wanted), attention_with_kvcache over it in place."""
    batch, seqlen_q = q.shape[:2]
    grad = _wants_grad(q, k, v, sinks)
    # in place: the cache as attention_with_kvcache reads it (TMA-aligned, k and v alike), few queries
    in_place = not grad and not torch.compiler.is_compiling() and mask.shape[1] == k.shape[1] \
        and k.shape == v.shape and tma_aligned(k) and tma_aligned(v) and decode_rows_fit(q, k)
    plan = _PLAN.get(mask, seqlen_q, in_place)
    if isinstance(plan, _LeftPadded):
        return attention_with_kvcache(q, k, v, cache_seqlens=plan.lengths, cache_leftpad=plan.leftpad,
                                      causal=causal, softmax_scale=scaling, window_size=window,
                                      softcap=softcap, sinks=sinks)
    q_index, k_index, cu_q, cu_k = plan
    # every query real (decode steps: the new tokens): no gather, no scatter back
    all_queries = q_index.shape[0] == batch * seqlen_q
    q_packed = q.flatten(0, 1) if all_queries else q.flatten(0, 1)[q_index]
    # the offsets come from the mask: no host copy to check them (the op still runs the kernel);
    # the padded length bounds every sequence (it picks the tiles of short query sequences)
    out, _ = packed_attention(q_packed, k.flatten(0, 1)[k_index], v.flatten(0, 1)[k_index], cu_q, cu_k,
                              seqlen_q, None, causal, scaling, window, softcap, None, check_values=False,
                              sinks=sinks)
    shape = (batch, seqlen_q, q.shape[2], v.shape[3])  # v's head dim (DeepSeek-style: not q's)
    if all_queries:
        return out.view(shape)
    padded = q.new_zeros(batch * seqlen_q, *shape[2:])
    padded[q_index] = out
    return padded.view(shape)


def fa3_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                          sliding_window=None, softcap=None, is_causal=None, **kwargs):
    """transformers' attention-interface signature; returns (attn_output (batch, seqlen, heads, d),
    None): fa3 never forms the attention weights."""
    if dropout and module.training:
        raise ValueError(f"attention dropout {dropout} while training: fa3 has no attention dropout; "
                         "set config.attention_dropout = 0.0, or use attn_implementation='sdpa'")
    if kwargs.get("output_attentions"):
        raise ValueError("output_attentions=True needs the attention weights, which fa3 never forms; "
                         "use attn_implementation='eager' to get them")
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # (batch, seqlen, heads, d) views
    position_ids = kwargs.get("position_ids")
    filled = None  # keys each row holds, where a static cache holds rows past them (no mask given)
    if attention_mask is not None and attention_mask.dim() == 2 and k.shape[1] > attention_mask.shape[1]:
        # a static cache: its rows past the mask hold no token yet (transformers' flash-attention
        # path slices them off the same way)
        k, v = k[:, :attention_mask.shape[1]], v[:, :attention_mask.shape[1]]
    elif attention_mask is None and causal and isinstance(position_ids, torch.Tensor) and position_ids.dim() == 2 \
            and q.shape[1] < k.shape[1]:  # (causal: a decoder's own cache; cross-attention keys are all real)
        filled = _FILLED.get(position_ids, k.shape[1])
        if isinstance(filled, int):  # every row alike: the rows past them sliced off (a dynamic cache has none)
            if filled < k.shape[1]:
                k, v = k[:, :filled], v[:, :filled]
            filled = None
    window = _window(sliding_window, k.shape[1])
    softcap = float(softcap or 0.0)
    sinks = kwargs.get("s_aux")
    if sinks is not None:  # (a differentiable cast: the model keeps its sinks in its own dtype)
        sinks = sinks.float()
    if attention_mask is None and q.shape[0] == 1 and q.shape[1] == k.shape[1] > 1:
        # one row, no cache: maybe several sequences packed (padding-free training); transformers' flash
        # kwargs when the collator made them (no sync), else the position ids
        spans = None
        if kwargs.get("cu_seq_lens_q") is not None and kwargs.get("cu_seq_lens_k") is not None:
            spans = (kwargs["cu_seq_lens_q"].to(torch.int32), kwargs["cu_seq_lens_k"].to(torch.int32),
                     int(kwargs.get("max_length_q") or q.shape[1]), int(kwargs.get("max_length_k") or k.shape[1]))
        elif isinstance(position_ids, torch.Tensor) and position_ids.numel() == q.shape[1] \
                and not torch.compiler.is_compiling():  # (traced: finding them would break every layer's graph)
            found = _PACKED.get(position_ids)
            spans = None if found is None else (found[0], found[0], found[1], found[1])
        if spans is not None:
            cu_q, cu_k, max_q, max_k = spans
            out, _ = packed_attention(q[0], k[0], v[0], cu_q, cu_k, max_q, max_k, causal, scaling, window, softcap,
                                      None, check_values=False, sinks=sinks)
            return out[None], None
    if filled is not None:  # rows that differ, or traced: each row's count, the cache read in place
        grad = _wants_grad(q, k, v, sinks)
        # (traced: fake tensors have no address; the op checks the alignment when it runs)
        aligned = torch.compiler.is_compiling() or (tma_aligned(k) and tma_aligned(v))
        if grad or k.shape != v.shape or not aligned:
            raise ValueError(f"fa3 reads a static cache in place by each row's token count (rows that differ, or "
                             f"under torch.compile), which takes no gradient and needs k and v alike and "
                             f"TMA-aligned; here k {tuple(k.shape)}, v {tuple(v.shape)}, gradients wanted: {grad}: "
                             "pass the attention_mask, or use a dynamic cache")
        batch, seqlen_q = q.shape[:2]
        lengths = filled.expand(batch).contiguous() if filled.shape[0] != batch else filled
        kw = dict(cache_seqlens=lengths, causal=causal, softmax_scale=scaling, window_size=window, softcap=softcap,
                  sinks=sinks)
        if seqlen_q == 1:
            return attention_with_kvcache(q, k, v, **kw), None
        # several queries a row (a prompt): packed, so that long ones run on the prompt kernel
        cu_seqlens_q = torch.arange(0, (batch + 1) * seqlen_q, seqlen_q, dtype=torch.int32, device=q.device)
        out = attention_with_kvcache(q.reshape(batch * seqlen_q, *q.shape[2:]), k, v, cu_seqlens_q=cu_seqlens_q,
                                     max_seqlen_q=seqlen_q, **kw)
        return out.view(batch, seqlen_q, *out.shape[1:]), None
    if attention_mask is None:
        out = attention(q, k, v, causal=causal, softmax_scale=scaling, window_size=window, softcap=softcap,
                        sinks=sinks)
        return out, None
    if attention_mask.dim() != 2 or attention_mask.dtype.is_floating_point:
        raise ValueError(f"fa3 takes transformers' 2-D padding mask (flash-attention's format), got "
                         f"{attention_mask.dtype} of shape {tuple(attention_mask.shape)}: an arbitrary "
                         "additive mask cannot be expressed; use attn_implementation='sdpa'")
    return _unpadded(q, k, v, attention_mask, causal, scaling, window, softcap, sinks), None


def register() -> bool:
    """Register "fa3" with transformers' AttentionInterface (and flash-attention's mask format).
    Returns False, registering nothing, when transformers is not installed."""
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask
    except ImportError:
        return False
    AttentionInterface.register(NAME, fa3_attention_forward)
    AttentionMaskInterface.register(NAME, flash_attention_mask)
    return True


REGISTERED = register()
