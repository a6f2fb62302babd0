"""A Llama-shaped model (random weights) served two ways, token by token compared:

    python benchmarks/generate.py [--prompts 8] [--tokens 64] [--layers 4]

fa3: the prompts are prefilled as one packed varlen batch (fa3.attention_varlen), their K/V written
into a paged cache (pages of 64 tokens, handed out in a shuffled order), and each generated token
attends through fa3.attention_with_kvcache, which appends its K/V in place.
reference: the same weights on SDPA with a dense (batch, capacity) cache: a right-padded prefill
with a causal + padding mask, then one masked SDPA call per step.

Both decode greedily from their own tokens. Where a sequence's tokens first differ, the reference's
top-two logits at that step must be a near tie (within a few times the logit noise measured at the
steps before: bf16 rounding in a different order); any other difference is a bug and the script
exits with status 1.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from timing import format_table  # noqa: F401  (puts the source tree on sys.path)

import fa3

PAGE = 64


class Config:
    vocab, hidden, heads_q, heads_kv, head_dim, mlp, theta = 8192, 2048, 16, 4, 128, 5632, 10000.0

    def __init__(self, layers):
        self.layers = layers


def make_weights(cfg, gen):
    w = lambda *shape, std=0.02: (torch.randn(*shape, device="cuda", generator=gen) * std).to(torch.bfloat16)
    h, d = cfg.hidden, cfg.head_dim
    layers = [dict(wq=w(h, cfg.heads_q * d), wk=w(h, cfg.heads_kv * d), wv=w(h, cfg.heads_kv * d),
                   wo=w(cfg.heads_q * d, h), w_gate=w(h, cfg.mlp), w_up=w(h, cfg.mlp), w_down=w(cfg.mlp, h),
                   norm1=torch.ones(h, device="cuda", dtype=torch.bfloat16),
                   norm2=torch.ones(h, device="cuda", dtype=torch.bfloat16)) for _ in range(cfg.layers)]
    return dict(embed=w(cfg.vocab, h, std=1.0), layers=layers, norm=torch.ones(h, device="cuda", dtype=torch.bfloat16),
                head=w(h, cfg.vocab))


def rms_norm(x, weight):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(x.dtype) * weight


def rope(x, positions, theta):
    """Rotary embedding of x (..., tokens, heads, d) at integer `positions` (..., tokens)."""
    d = x.shape[-1]
    freqs = theta ** (-torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d)
    angles = positions[..., None].float() * freqs  # (..., tokens, d/2)
    cos, sin = (torch.cat([f, f], -1)[..., None, :] for f in (angles.cos(), angles.sin()))
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return (x.float() * cos + torch.cat([-x2, x1], -1).float() * sin).to(x.dtype)


def forward(cfg, weights, tokens, positions, attend):
    """Logits of `tokens` (any leading shape), `attend(layer, q, k, v)` doing the attention on
    (..., tokens, heads, d) projections and returning (..., tokens, heads_q, d)."""
    x = weights["embed"][tokens]
    for i, lw in enumerate(weights["layers"]):
        h = rms_norm(x, lw["norm1"])
        shape = h.shape[:-1]
        q = rope((h @ lw["wq"]).view(*shape, cfg.heads_q, cfg.head_dim), positions, cfg.theta)
        k = rope((h @ lw["wk"]).view(*shape, cfg.heads_kv, cfg.head_dim), positions, cfg.theta)
        v = (h @ lw["wv"]).view(*shape, cfg.heads_kv, cfg.head_dim)
        x = x + attend(i, q, k, v).reshape(*shape, -1) @ lw["wo"]
        h = rms_norm(x, lw["norm2"])
        x = x + (F.silu(h @ lw["w_gate"]) * (h @ lw["w_up"])) @ lw["w_down"]
    return rms_norm(x, weights["norm"]).float() @ weights["head"].float()


# ----------------------------------------------------------------------------- fa3: varlen + paged
def generate_fa3(cfg, weights, prompts, steps, gen):
    batch, lengths = len(prompts), [len(p) for p in prompts]
    capacity = -(-(max(lengths) + steps) // PAGE) * PAGE
    pages_per_seq = capacity // PAGE
    table = torch.randperm(batch * pages_per_seq, device="cuda", generator=gen).view(batch, -1).to(torch.int32)
    caches = [[torch.empty(batch * pages_per_seq, PAGE, cfg.heads_kv, cfg.head_dim, device="cuda",
                           dtype=torch.bfloat16) for _ in range(2)] for _ in range(cfg.layers)]
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()), dtype=torch.int32, device="cuda")
    tokens = torch.cat(prompts)
    positions = torch.cat([torch.arange(n, device="cuda") for n in lengths])
    seq_of = torch.repeat_interleave(torch.arange(batch, device="cuda"), torch.tensor(lengths, device="cuda"))
    slots = table[seq_of, positions // PAGE].long()

    def prefill_attend(i, q, k, v):
        caches[i][0][slots, positions % PAGE] = k
        caches[i][1][slots, positions % PAGE] = v
        return fa3.attention_varlen(q, k, v, cu, cu, max(lengths), max(lengths), causal=True)

    seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")

    def decode_attend(i, q, k, v):
        return fa3.attention_with_kvcache(q, caches[i][0], caches[i][1], k, v, cache_seqlens=seqlens,
                                          block_table=table, causal=True)

    return _generate(cfg, weights, tokens, positions, cu[1:] - 1, prefill_attend, decode_attend, seqlens, steps)


# ----------------------------------------------------------------------------- reference: SDPA, dense
def generate_sdpa(cfg, weights, prompts, steps):
    batch, lengths = len(prompts), [len(p) for p in prompts]
    longest, capacity = max(lengths), max(lengths) + steps
    caches = [[torch.zeros(batch, capacity, cfg.heads_kv, cfg.head_dim, device="cuda", dtype=torch.bfloat16)
               for _ in range(2)] for _ in range(cfg.layers)]
    tokens = torch.zeros(batch, longest, dtype=torch.long, device="cuda")
    for b, p in enumerate(prompts):
        tokens[b, :len(p)] = p
    positions = torch.arange(longest, device="cuda").expand(batch, -1)
    seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    j = torch.arange(capacity, device="cuda")

    def sdpa(q, k, v, mask):
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           attn_mask=mask[:, None], enable_gqa=True)
        return o.transpose(1, 2)

    def prefill_attend(i, q, k, v):
        caches[i][0][:, :longest], caches[i][1][:, :longest] = k, v
        i_pos = torch.arange(longest, device="cuda")
        mask = (j[None, None, :longest] <= i_pos[None, :, None]) & (j[None, None, :longest] < seqlens[:, None, None])
        return sdpa(q, k, v, mask)

    def decode_attend(i, q, k, v):
        rows = torch.arange(batch, device="cuda")
        caches[i][0][rows, seqlens.long()] = k[:, 0]
        caches[i][1][rows, seqlens.long()] = v[:, 0]
        mask = (j[None, :] <= seqlens[:, None])[:, None, :]  # keys 0 .. seqlen (the new one included)
        return sdpa(q, caches[i][0], caches[i][1], mask)

    last = seqlens.long() - 1 + torch.arange(batch, device="cuda") * longest  # in the flattened logits
    return _generate(cfg, weights, tokens, positions, last, prefill_attend, decode_attend, seqlens, steps,
                     flat=True)


def _generate(cfg, weights, tokens, positions, last, prefill_attend, decode_attend, seqlens, steps, flat=False):
    """Greedy decoding: returns (tokens (batch, steps), logits (batch, steps, vocab), prefill ms,
    decode ms per step)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    logits = forward(cfg, weights, tokens, positions, prefill_attend)
    logits = (logits.flatten(0, 1) if flat else logits)[last]
    torch.cuda.synchronize()
    prefill_ms = (time.perf_counter() - t0) * 1e3
    out_tokens, out_logits = [], []
    t0 = time.perf_counter()
    for _ in range(steps):
        out_logits.append(logits)
        nxt = logits.argmax(-1)
        out_tokens.append(nxt)
        logits = forward(cfg, weights, nxt[:, None], seqlens.long()[:, None], decode_attend)[:, 0]
        seqlens += 1
    torch.cuda.synchronize()
    return torch.stack(out_tokens, 1), torch.stack(out_logits, 1), prefill_ms, (time.perf_counter() - t0) * 1e3 / steps


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--layers", type=int, default=4)
    args = ap.parse_args(argv)
    cfg = Config(args.layers)
    gen = torch.Generator(device="cuda").manual_seed(0)
    weights = make_weights(cfg, gen)
    lengths = torch.randint(20, 700, (args.prompts,), generator=torch.Generator().manual_seed(1)).tolist()
    prompts = [torch.randint(0, cfg.vocab, (n,), device="cuda", generator=gen) for n in lengths]
    print(f"{args.prompts} prompts of {min(lengths)}-{max(lengths)} tokens, {args.layers} layers, "
          f"GQA {cfg.heads_q}/{cfg.heads_kv}, d{cfg.head_dim}, {args.tokens} new tokens each", flush=True)
    with torch.no_grad():
        generate_fa3(cfg, weights, prompts, 2, gen)  # compile and warm up
        tok_f, log_f, pre_f, dec_f = generate_fa3(cfg, weights, prompts, args.tokens, gen)
        generate_sdpa(cfg, weights, prompts, 2)
        tok_s, log_s, pre_s, dec_s = generate_sdpa(cfg, weights, prompts, args.tokens)
    print(f"prefill: fa3 (varlen) {pre_f:.1f} ms, SDPA (padded) {pre_s:.1f} ms; decode step: fa3 (paged) "
          f"{dec_f:.2f} ms, SDPA (dense) {dec_s:.2f} ms (wall, eager, whole model)")
    # the logit noise: |fa3 - SDPA| at steps where both sequences still agree
    same = (tok_f == tok_s).long().cumprod(1).bool()  # before (and at) the first difference
    agree_steps = torch.cat([same[:, :1], same[:, :-1] & same[:, 1:]], 1)  # inputs identical so far
    noise = (log_f - log_s).abs().amax(-1)[agree_steps].max().item() if agree_steps.any() else 0.0
    tol = max(4 * noise, 1e-2)
    bugs, matched = 0, 0
    for b in range(args.prompts):
        diff = (tok_f[b] != tok_s[b]).nonzero()
        if diff.numel() == 0:
            matched += 1
            print(f"  prompt {b} ({lengths[b]} tokens): all {args.tokens} tokens identical")
            continue
        step = diff[0].item()
        top2 = log_s[b, step].topk(2).values
        gap = (top2[0] - top2[1]).item()
        verdict = "near tie (ok)" if gap <= tol else "BUG: not a tie"
        bugs += gap > tol
        print(f"  prompt {b} ({lengths[b]} tokens): first difference at step {step}, reference top-2 gap "
              f"{gap:.4f} vs tolerance {tol:.4f}: {verdict}")
    print(f"{matched}/{args.prompts} sequences identical for all {args.tokens} tokens; logit noise "
          f"{noise:.4f}; {bugs} unexplained differences")
    return 1 if bugs else 0


if __name__ == "__main__":
    raise SystemExit(main())
