"""End to end in transformers: a Llama-shaped model (random weights from a config, no download) with
attn_implementation="sdpa" and "fa3", timed and compared side by side.

    python benchmarks/e2e_transformers.py [--layers 4] [--seqlen 8192] [--only train,...]
                                          [--profile] [--json FILE]

Workloads, bf16 on one GPU:
  prefill       a padded batch (4 prompts of seqlen, 3/4, 1/2 and 1/4 of it, left-padded):
                forward only; logits compared on the real tokens.
  train         one training step (forward + backward) on batch 2 x seqlen, unpadded; losses compared.
  train-padded  one training step on the prefill's lengths, right-padded (labels -100 on padding):
                fa3 runs the packed (varlen) forward and backward; losses compared.
  generate      4 left-padded prompts of 512..2048 tokens, 64 new tokens, greedy, transformers'
                cache; tokens compared (a first difference must be a near tie of sdpa's top two).
  generate-b1   the same for one unpadded prompt of 4096 tokens (no mask: a host-bound loop).
  generate-static  the 4 prompts with cache_implementation="static" (rows past the tokens).
Times are medians of --repeats runs after a warm-up run (CUDA-synchronized wall time).
--profile prints each implementation's 12 most expensive GPU kernels per workload (one run).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from timing import format_table, progress

import torch

import fa3.integrations.transformers  # noqa: F401  (registers "fa3")


def make_model(args):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=32000, hidden_size=args.width, intermediate_size=args.mlp,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.kv_heads, max_position_embeddings=args.seqlen + 128,
                         attention_dropout=0.0)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(device="cuda", dtype=torch.bfloat16)


def timed(fn, repeats, profile=False, label=""):
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    if profile:
        from torch.profiler import ProfilerActivity, profile as torch_profile

        with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        print(f"--- {label}: GPU kernels of one run")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=70))
    return statistics.median(times) * 1e3, result


def padded(lengths, total, gen, side="left"):
    ids = torch.randint(3, 32000, (len(lengths), total), generator=gen)
    mask = torch.zeros(len(lengths), total, dtype=torch.long)
    for row, length in enumerate(lengths):
        real = slice(total - length, total) if side == "left" else slice(0, length)
        mask[row, real] = 1
        ids[row] = ids[row].masked_fill(mask[row] == 0, 0)
    return ids.cuda(), mask.cuda()


def rel_diff(a, b):
    return float((a - b).norm() / b.norm())


def prefill(model, args, gen):
    s = args.seqlen
    ids, mask = padded([s, 3 * s // 4, s // 2, s // 4], s, gen)
    model.eval()
    times, logits = {}, {}
    for impl in IMPLS:
        model.set_attn_implementation(impl)
        with torch.no_grad():
            times[impl], out = timed(lambda: model(input_ids=ids, attention_mask=mask).logits, args.repeats,
                                     args.profile, f"prefill {impl}")
        logits[impl] = out.float() * mask[..., None]
        del out
        progress(f"prefill      {impl:5s} {times[impl]:8.2f} ms")
    return ["prefill (4 padded prompts)", times, f"logits rel. diff {rel_diff(logits['fa3'], logits['sdpa']):.1e}"], True


def train(model, args, gen, pad):
    """One optimizer-free training step: forward, loss, backward."""
    s = args.seqlen
    if pad:
        ids, mask = padded([s, 3 * s // 4, s // 2, s // 4], s, gen, side="right")
        labels = ids.masked_fill(mask == 0, -100)
        name = "train step (4 padded, right)"
    else:
        ids, mask = torch.randint(3, 32000, (2, s), generator=gen).cuda(), None
        labels = ids
        name = f"train step (2 x {s})"
    model.train()
    times, losses = {}, {}
    for impl in IMPLS:
        model.set_attn_implementation(impl)

        def step():
            model.zero_grad(set_to_none=True)
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
            loss.backward()
            return loss.detach()
        times[impl], loss = timed(step, args.repeats, args.profile, f"{name} {impl}")
        losses[impl] = float(loss)
        progress(f"{'train-padded' if pad else 'train':12s} {impl:5s} {times[impl]:8.2f} ms  loss {losses[impl]:.5f}")
    model.zero_grad(set_to_none=True)
    diff = abs(losses["fa3"] - losses["sdpa"]) / abs(losses["sdpa"])
    return [name, times, f"loss rel. diff {diff:.1e}"], True


def generate(model, args, gen, lengths=(2048, 1536, 1024, 512), cache=None, label="generate 64 tokens (4 prompts)"):
    """Greedy generation through transformers' cache (`cache`: its cache_implementation, None: the
    default dynamic one); tokens compared."""
    model.eval()
    longest = max(lengths)
    ids, mask = padded(list(lengths), longest, gen)
    extra = {} if cache is None else {"cache_implementation": cache}
    times, runs = {}, {}
    for impl in IMPLS:
        model.set_attn_implementation(impl)
        times[impl], runs[impl] = timed(
            lambda: model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=64, do_sample=False,
                                   output_logits=True, return_dict_in_generate=True, pad_token_id=0, **extra),
            args.repeats, args.profile, f"{label} {impl}")
        progress(f"{label}  {impl:5s} {times[impl]:8.2f} ms")
    same, ties, bad = 0, 0, 0
    for row in range(ids.shape[0]):
        x, y = runs["fa3"].sequences[row, longest:], runs["sdpa"].sequences[row, longest:]
        differ = (x != y).nonzero()
        if not len(differ):
            same += 1
            continue
        step = int(differ[0])
        top2 = runs["sdpa"].logits[step][row].float().topk(2).values
        if float(top2[0] - top2[1]) < 0.05:
            ties += 1
        else:
            bad += 1
    return ([label, times, f"{same}/{len(lengths)} identical, {ties} near-tie divergences, {bad} unexplained"],
            bad == 0)


IMPLS = ("sdpa", "fa3")
WORKLOADS = {"prefill": prefill, "train": lambda m, a, g: train(m, a, g, pad=False),
             "train-padded": lambda m, a, g: train(m, a, g, pad=True), "generate": generate,
             "generate-b1": lambda m, a, g: generate(m, a, g, (4096,), label="generate 64 tokens (1 prompt, 4096)"),
             "generate-static": lambda m, a, g: generate(m, a, g, cache="static",
                                                         label="generate 64 tokens (4 prompts, static cache)")}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seqlen", type=int, default=8192)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--mlp", type=int, default=5632)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--only", default=",".join(WORKLOADS), help=f"comma-separated, of {list(WORKLOADS)}")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args(argv)
    unknown = set(args.only.split(",")) - set(WORKLOADS)
    if unknown:
        p.error(f"--only: unknown workloads {sorted(unknown)}; choose from {list(WORKLOADS)}")
    if not torch.cuda.is_available():
        print("e2e_transformers needs a CUDA GPU (Hopper for fa3); none was found.")
        return 2
    model = make_model(args)
    gen = torch.Generator().manual_seed(0)
    rows, ok = [], True
    for name in args.only.split(","):
        row, agreed = WORKLOADS[name](model, args, gen)
        rows.append(row)
        ok = ok and agreed
    table = [[name, t["sdpa"], t["fa3"], f"{t['sdpa'] / t['fa3']:.2f}x", note] for name, t, note in rows]
    print()
    print(f"{torch.cuda.get_device_name()}; Llama-shaped, {args.layers} layers, width {args.width}, "
          f"{args.heads}/{args.kv_heads} heads, d{args.width // args.heads}, bf16")
    print(format_table(["workload", "sdpa ms", "fa3 ms", "speedup", "agreement"], table))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": table}, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
