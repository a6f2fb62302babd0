"""Train a Llama-shaped model for a few steps with fa3 attention and with SDPA: losses side by side,
and the time per training step (forward + backward + AdamW).

    python benchmarks/train_step.py [--layers 4] [--seqlen 4096] [--batch 2] [--steps 8]
                                    [--width 2048] [--heads 16] [--kv-heads 4] [--no-hf]
                                    [--backward-kernels b7,b7g --variant b7g=b7:dkv_bulk_add=1]

Two models, each trained twice from the same initial weights on the same random tokens, once with
`fa3.attention` (causal, GQA) and once with torch's SDPA (its default backend):
- `llama`: this file's own Llama-shaped decoder (RMSNorm, rotary embeddings, GQA attention,
  SwiGLU MLP; projections on torch.matmul, bf16 weights);
- `hf-llama`: transformers' LlamaForCausalLM from a config with random weights (no download), with
  fa3 registered through `transformers.AttentionInterface` as "fa3"; skipped when transformers is
  not installed.
Prints each step's loss for both (they must agree within bf16 noise), then the median step time.
`--backward-kernels` trains the own model once more per named backward rung (experiment rows from
`--variant` included, benchmarks/variants.py), each against the same SDPA run.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

try:
    import fa3
except ImportError:  # a source checkout, not installed
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import fa3

import torch
import torch.nn.functional as F
import variants

from fa3.timing import event_times_ms

LOSS_TOLERANCE = 0.02  # |loss_fa3 - loss_sdpa| / loss_sdpa per step: bf16 noise, not a bug


def sdpa(q, k, v, causal=True):
    """SDPA in fa3's (batch, seqlen, heads, head_dim) layout, GQA by expanding k and v."""
    group = q.shape[2] // k.shape[2]
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=group > 1)
    return out.transpose(1, 2)


def fa3_attention(q, k, v, causal=True, backward_kernel=None):
    return fa3.attention(q, k, v, causal=causal, backward_kernel=backward_kernel)


class RMSNorm(torch.nn.Module):
    def __init__(self, width, **kw):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(width, **kw))

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + 1e-5)).to(x.dtype) * self.weight


def rotary(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Layer(torch.nn.Module):
    def __init__(self, width, heads, kv_heads, mlp, **kw):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, width // heads
        self.norm1, self.norm2 = RMSNorm(width, **kw), RMSNorm(width, **kw)
        self.qkv = torch.nn.Linear(width, (heads + 2 * kv_heads) * self.head_dim, bias=False, **kw)
        self.proj = torch.nn.Linear(width, width, bias=False, **kw)
        self.gate_up = torch.nn.Linear(width, 2 * mlp, bias=False, **kw)
        self.down = torch.nn.Linear(mlp, width, bias=False, **kw)

    def forward(self, x, cos, sin, attention):
        b, s, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(
            [self.heads * self.head_dim, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim], -1)
        q = rotary(q.view(b, s, self.heads, self.head_dim), cos, sin)
        k = rotary(k.view(b, s, self.kv_heads, self.head_dim), cos, sin)
        o = attention(q, k, v.view(b, s, self.kv_heads, self.head_dim))
        x = x + self.proj(o.reshape(b, s, -1))
        gate, up = self.gate_up(self.norm2(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class Llama(torch.nn.Module):
    def __init__(self, vocab, width, layers, heads, kv_heads, mlp, **kw):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width, **kw)
        self.layers = torch.nn.ModuleList(Layer(width, heads, kv_heads, mlp, **kw) for _ in range(layers))
        self.norm = RMSNorm(width, **kw)
        self.head = torch.nn.Linear(width, vocab, bias=False, **kw)
        self.head_dim = width // heads

    def forward(self, tokens, attention, positions=None):
        """positions: each token's place in the sequence (default 0, 1, ...): a shard of a longer
        sequence (context parallelism) passes its tokens' global positions for the rotary angles."""
        if positions is None:
            positions = torch.arange(tokens.shape[1], device=tokens.device)
        inv = 10000.0 ** (-torch.arange(0, self.head_dim, 2, device=tokens.device).float() / self.head_dim)
        angles = positions.float()[:, None] * inv[None, :]
        cos, sin = (f(angles)[None, :, None, :].to(self.embed.weight.dtype) for f in (torch.cos, torch.sin))
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x, cos, sin, attention)
        return self.head(self.norm(x))


def train(model, tokens, steps, step_fn):
    """Per-step losses and CUDA-event milliseconds of `steps` AdamW steps (the first compiles)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    losses, times = [], []

    def step():
        opt.zero_grad(set_to_none=True)
        loss = step_fn(model, tokens)
        loss.backward()
        opt.step()
        losses.append(loss.detach())

    for _ in range(steps):
        times.append(event_times_ms(step, 1)[0])
    return [loss.item() for loss in losses], times


def median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2]


def compare(name, make_model, tokens, steps, step_fns) -> bool:
    """Train copies of one model with each attention; print losses and times; True if they agree."""
    base = make_model()
    results = {}
    for label, fn in step_fns.items():
        model = copy.deepcopy(base)
        torch.cuda.synchronize()
        results[label] = train(model, tokens, steps, fn)
        del model
        torch.cuda.empty_cache()
        losses = " ".join(f"{loss:.4f}" for loss in results[label][0])
        print(f"  {name} {label:<5} losses {losses}", flush=True)
    sdpa_losses, sdpa_ms = results["sdpa"]
    t_sdpa = median(sdpa_ms[1:])  # the first step compiles (fa3) or autotunes: the median of the rest
    worst = 0.0
    for label, (fa3_losses, fa3_ms) in results.items():
        if label == "sdpa":
            continue
        diff = max(abs(a - b) / abs(b) for a, b in zip(fa3_losses, sdpa_losses))
        worst = max(worst, diff)
        t_fa3 = median(fa3_ms[1:])
        print(f"{name}: step {t_fa3:.1f} ms with {label}, {t_sdpa:.1f} ms with SDPA ({t_sdpa / t_fa3:.3f}x); "
              f"largest relative loss difference {diff:.2e} (tolerance {LOSS_TOLERANCE})", flush=True)
    return worst <= LOSS_TOLERANCE


def hf_llama(args):
    """transformers' LlamaForCausalLM with fa3 registered as an attention implementation, or None."""
    try:
        from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM
    except ImportError:
        return None

    def fa3_hf_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):
        # transformers passes (batch, heads, seqlen, head_dim); causal training without padding
        if dropout:
            raise ValueError("fa3 attention has no dropout; set attention_dropout=0")
        out = fa3.attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                            causal=True, softmax_scale=scaling)
        return out, None

    AttentionInterface.register("fa3", fa3_hf_attention)
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.width, intermediate_size=args.mlp,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.kv_heads, max_position_embeddings=args.seqlen,
                         attention_dropout=0.0)

    def make():
        torch.manual_seed(0)
        return LlamaForCausalLM(config).to(device="cuda", dtype=torch.bfloat16)

    def step_fn(impl):
        def fn(model, tokens):
            model.config._attn_implementation = impl
            return model(input_ids=tokens, labels=tokens).loss
        return fn

    return make, {"fa3": step_fn("fa3"), "sdpa": step_fn("sdpa")}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    variants.register_from_argv(argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seqlen", type=int, default=4096)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--mlp", type=int, default=5632)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--no-hf", action="store_true", help="skip the transformers model")
    p.add_argument("--backward-kernels", default="",
                   help="also train the own model with these backward rungs, comma-separated")
    p.add_argument("--variant", action="append", default=[], metavar="NAME=BASE:key=value,...",
                   help="an experiment row for --backward-kernels (benchmarks/variants.py)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("train_step needs a Hopper GPU; none was found.")
        return 2
    print(f"{torch.cuda.get_device_name()}: {args.layers} layers, width {args.width}, {args.heads} heads "
          f"({args.kv_heads} kv), batch {args.batch} x seqlen {args.seqlen}, bf16, AdamW", flush=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seqlen), device="cuda", generator=gen)

    def make_llama():
        torch.manual_seed(0)
        return Llama(args.vocab, args.width, args.layers, args.heads, args.kv_heads, args.mlp,
                     device="cuda", dtype=torch.bfloat16)

    def llama_step(attention):
        def fn(model, tokens):
            logits = model(tokens[:, :-1], attention)
            return F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        return fn

    step_fns = {"fa3": llama_step(fa3_attention), "sdpa": llama_step(sdpa)}
    for rung in filter(None, args.backward_kernels.split(",")):
        step_fns[f"fa3 {rung}"] = llama_step(lambda q, k, v, rung=rung: fa3_attention(q, k, v, backward_kernel=rung))
    ok = compare("llama", make_llama, tokens, args.steps, step_fns)
    hf = None if args.no_hf else hf_llama(args)
    if hf is None and not args.no_hf:
        print("hf-llama skipped: transformers is not installed", flush=True)
    elif hf is not None:
        ok &= compare("hf-llama", hf[0], tokens, args.steps, hf[1])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
