"""End to end in transformers: a Llama-shaped model (random weights from a config, no download) with
attn_implementation="sdpa" and "fa3", timed and compared side by side.

    python benchmarks/e2e_transformers.py [--layers 4] [--seqlen 8192] [--json FILE]

Three workloads, bf16 on one GPU:
  prefill   a padded batch (4 prompts of seqlen, 3/4, 1/2 and 1/4 of it, left-padded): forward
            only; logits compared on the real tokens.
  train     one training step (forward + backward) on batch 2 x seqlen, unpadded; losses compared.
  generate  4 left-padded prompts of 512..2048 tokens, 64 new tokens, greedy, transformers' cache;
            tokens compared (a first difference must be a near tie of sdpa's top-two logits).
Times are medians of --repeats runs after a warm-up run (CUDA-synchronized wall time).
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


def timed(fn, repeats):
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3, result


def left_padded(lengths, total, gen):
    ids = torch.randint(3, 32000, (len(lengths), total), generator=gen)
    mask = torch.zeros(len(lengths), total, dtype=torch.long)
    for row, length in enumerate(lengths):
        mask[row, total - length:] = 1
        ids[row, :total - length] = 0
    return ids.cuda(), mask.cuda()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seqlen", type=int, default=8192)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--mlp", type=int, default=5632)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("e2e_transformers needs a CUDA GPU (Hopper for fa3); none was found.")
        return 2
    model = make_model(args)
    gen = torch.Generator().manual_seed(0)
    s = args.seqlen
    rows, results, ok = [], {}, True

    # prefill of a padded batch
    ids, mask = left_padded([s, 3 * s // 4, s // 2, s // 4], s, gen)
    model.eval()
    for impl in ("sdpa", "fa3"):
        model.set_attn_implementation(impl)
        with torch.no_grad():
            ms, logits = timed(lambda: model(input_ids=ids, attention_mask=mask).logits, args.repeats)
        results[("prefill", impl)] = (ms, (logits.float() * mask[..., None]))
        progress(f"prefill  {impl:5s} {ms:8.2f} ms")
    a, b = results[("prefill", "fa3")][1], results[("prefill", "sdpa")][1]
    prefill_err = float((a - b).norm() / b.norm())
    rows.append(["prefill (4 padded prompts)", results[("prefill", "sdpa")][0], results[("prefill", "fa3")][0],
                 f"logits rel. diff {prefill_err:.1e}"])
    del a, b, results[("prefill", "fa3")], results[("prefill", "sdpa")]

    # one training step, unpadded
    tokens = torch.randint(3, 32000, (2, s), generator=gen).cuda()
    model.train()
    losses = {}
    for impl in ("sdpa", "fa3"):
        model.set_attn_implementation(impl)

        def step():
            model.zero_grad(set_to_none=True)
            loss = model(input_ids=tokens, labels=tokens).loss
            loss.backward()
            return loss.detach()
        ms, loss = timed(step, args.repeats)
        losses[impl] = (ms, float(loss))
        progress(f"train    {impl:5s} {ms:8.2f} ms  loss {float(loss):.5f}")
    loss_diff = abs(losses["fa3"][1] - losses["sdpa"][1]) / abs(losses["sdpa"][1])
    rows.append([f"train step (2 x {s})", losses["sdpa"][0], losses["fa3"][0], f"loss rel. diff {loss_diff:.1e}"])
    model.zero_grad(set_to_none=True)

    # greedy generation through transformers' cache
    model.eval()
    ids, mask = left_padded([2048, 1536, 1024, 512], 2048, gen)
    runs = {}
    for impl in ("sdpa", "fa3"):
        model.set_attn_implementation(impl)
        ms, run = timed(lambda: model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=64,
                                               do_sample=False, output_logits=True,
                                               return_dict_in_generate=True, pad_token_id=0), args.repeats)
        runs[impl] = (ms, run)
        progress(f"generate {impl:5s} {ms:8.2f} ms")
    same, ties, bad = 0, 0, 0
    for row in range(ids.shape[0]):
        x, y = runs["fa3"][1].sequences[row, 2048:], runs["sdpa"][1].sequences[row, 2048:]
        differ = (x != y).nonzero()
        if not len(differ):
            same += 1
            continue
        step = int(differ[0])
        top2 = runs["sdpa"][1].logits[step][row].float().topk(2).values
        if float(top2[0] - top2[1]) < 0.05:
            ties += 1
        else:
            bad += 1
    ok = bad == 0
    rows.append(["generate 64 tokens (4 prompts)", runs["sdpa"][0], runs["fa3"][0],
                 f"{same}/4 identical, {ties} near-tie divergences, {bad} unexplained"])

    table = [[name, sdpa, fa3_ms, f"{sdpa / fa3_ms:.2f}x", note] for name, sdpa, fa3_ms, note in rows]
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
