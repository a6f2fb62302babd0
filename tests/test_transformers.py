"""fa3 as a transformers attention implementation ("fa3", fa3.integrations.transformers).

CPU (CI): with fa3's kernels swapped for the float reference, small Llama / Mistral / Gemma-2
models from configs (random weights, no download) give the logits of transformers' own "eager"
attention, unpadded and right- or left-padded: this checks the mapping itself (layouts, GQA,
scaling, causal, sliding window, softcap, gpt-oss's attention sinks, unpadding into varlen). The
module imports without
transformers. GPU: the same models on fa3's kernels against "sdpa"/"eager" in bf16 (logits,
gradients, greedy generation through transformers' cache)."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from fa3.integrations import transformers as fa3_hf  # noqa: E402
from fa3.reference import attention_reference  # noqa: E402
from conftest import rel_err  # noqa: E402


def _configs():
    common = dict(vocab_size=256, hidden_size=512, intermediate_size=512, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=128, attention_dropout=0.0,
                  max_position_embeddings=256)
    return {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(common)),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, dict(common, sliding_window=16)),
        "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM,
                   dict(common, sliding_window=16, attn_logit_softcapping=20.0, final_logit_softcapping=None,
                        query_pre_attn_scalar=128)),
        # attention sinks (s_aux), alternating sliding and full layers
        "gpt_oss": (transformers.GptOssConfig, transformers.GptOssForCausalLM,
                    dict(common, sliding_window=16, num_local_experts=4, num_experts_per_tok=2)),
    }


def make_model(kind, device, dtype):
    config_cls, model_cls, kwargs = _configs()[kind]
    torch.manual_seed(0)
    model = model_cls(config_cls(**kwargs)).to(device=device, dtype=dtype).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            if hasattr(layer.self_attn, "sinks"):
                layer.self_attn.sinks.normal_(0.0, 2.0)  # sinks that matter
    return model


def batch(device, padding):
    """(input_ids, attention_mask): 3 sequences of 40, 23 and 31 tokens padded to 40."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 256, (3, 40), generator=g)
    mask = torch.ones(3, 40, dtype=torch.long)
    if padding != "none":
        for row, length in ((1, 23), (2, 31)):
            if padding == "right":
                mask[row, length:] = 0
            else:
                mask[row, :40 - length] = 0
    return ids.to(device), mask.to(device)


def logits_of(model, impl, ids, mask, padding):
    model.set_attn_implementation(impl)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=None if padding == "none" else mask).logits
    return out.float() * mask[..., None]  # padded positions do not count


def greedy_runs(model, ids, mask, impls, max_new_tokens, **generate_kwargs):
    """{impl: model.generate(...)} for each attention implementation, greedy, with its logits."""
    runs = {}
    for impl in impls:
        model.set_attn_implementation(impl)
        runs[impl] = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                                    do_sample=False, output_logits=True, return_dict_in_generate=True,
                                    pad_token_id=0, **generate_kwargs)
    return runs


def assert_same_generation(runs, tol):
    assert torch.equal(runs["fa3"].sequences, runs["eager"].sequences)
    assert rel_err(torch.stack(runs["fa3"].logits), torch.stack(runs["eager"].logits)) < tol

# ----------------------------------------------------------------------------- CPU: the mapping
def _reference_attention(q, k, v, causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
                         sinks=None):
    assert sinks is None or sinks.dtype == torch.float32  # fa3's sinks are float32
    return attention_reference(q, k, v, causal, softmax_scale, torch.float32, window_size, softcap,
                               sinks)[0].to(q.dtype)


def _reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal, softmax_scale, window_size, softcap,
                      kernel, check_values=True, sinks=None):
    outs = []
    for i in range(len(cu_q) - 1):
        sq, sk = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
        outs.append(_reference_attention(q[None, sq], k[None, sk], v[None, sk], causal, softmax_scale,
                                         window_size, softcap, sinks)[0])
    return torch.cat(outs), None


@pytest.mark.parametrize("padding", ["none", "right", "left"])
@pytest.mark.parametrize("kind", ["llama", "mistral", "gemma2", "gpt_oss"])
def test_mapping_matches_eager_on_cpu(kind, padding, monkeypatch):
    monkeypatch.setattr(fa3_hf, "attention", _reference_attention)
    monkeypatch.setattr(fa3_hf, "packed_attention", _reference_varlen)
    model = make_model(kind, "cpu", torch.float32)
    ids, mask = batch("cpu", padding)
    got, want = logits_of(model, "fa3", ids, mask, padding), logits_of(model, "eager", ids, mask, padding)
    assert rel_err(got, want) < 1e-4


def parameter_grads(model, impl, ids, mask, padding):
    """The flattened parameter gradients of the loss on the real tokens: labels -100 where padded,
    and where the position before is padded (its logits predict them: padded rows' outputs are
    undefined, fa3 gives 0, eager an average)."""
    model.set_attn_implementation(impl)
    model.zero_grad()
    labels = ids.masked_fill((mask == 0) | (mask.roll(1, dims=1) == 0), -100)
    model(input_ids=ids, attention_mask=None if padding == "none" else mask, labels=labels).loss.backward()
    return torch.cat([p.grad.float().flatten() for p in model.parameters() if p.grad is not None])


@pytest.mark.parametrize("padding", ["right", "left"])
@pytest.mark.parametrize("kind", ["mistral", "gpt_oss"])
def test_padded_training_mapping_on_cpu(kind, padding, monkeypatch):
    """Gradients flow through the unpad gather and the scatter back (padded rows get none), and
    into gpt-oss's sinks."""
    monkeypatch.setattr(fa3_hf, "packed_attention", _reference_varlen)
    model = make_model(kind, "cpu", torch.float32).train()
    ids, mask = batch("cpu", padding)
    got, want = (parameter_grads(model, impl, ids, mask, padding) for impl in ("fa3", "eager"))
    assert rel_err(got, want) < 1e-4


def _reference_kvcache(q, k_cache, v_cache, cache_seqlens, cache_leftpad, causal, softmax_scale, window_size,
                       softcap, sinks):
    """attention_with_kvcache over a left-padded dense cache: row b's keys [leftpad, seqlens)."""
    rows = []
    for b, (start, end) in enumerate(zip(cache_leftpad.tolist(), cache_seqlens.tolist())):
        rows.append(_reference_attention(q[b:b + 1], k_cache[b:b + 1, start:end], v_cache[b:b + 1, start:end],
                                         causal, softmax_scale, window_size, softcap, sinks))
    return torch.cat(rows)


def _reference_kvcache_call(q, k_cache, v_cache, *, cache_seqlens, cache_leftpad=None, causal, softmax_scale,
                            window_size, softcap, sinks, cu_seqlens_q=None, max_seqlen_q=None):
    """attention_with_kvcache's keyword call, on the float reference (packed queries: as many a row)."""
    if cache_leftpad is None:
        cache_leftpad = torch.zeros_like(cache_seqlens)
    if cu_seqlens_q is not None:
        assert cu_seqlens_q.tolist() == list(range(0, q.shape[0] + 1, max_seqlen_q))
        out = _reference_kvcache(q.view(-1, max_seqlen_q, *q.shape[1:]), k_cache, v_cache, cache_seqlens,
                                 cache_leftpad, causal, softmax_scale, window_size, softcap, sinks)
        return out.flatten(0, 1)
    return _reference_kvcache(q, k_cache, v_cache, cache_seqlens, cache_leftpad, causal, softmax_scale,
                              window_size, softcap, sinks)

@pytest.mark.parametrize("kind", ["llama", "gpt_oss"])
def test_generation_mapping_on_cpu(kind, monkeypatch):
    """Decode steps over a left-padded cache (every new query real) read it in place through
    attention_with_kvcache's cache_leftpad, and give eager's tokens and logits (gpt-oss: sinks, and
    sliding layers, whose window cache transformers passes without a mask); the padded prompt goes
    through the variable-length path."""
    calls = []

    def kvcache(q, k_cache, v_cache, *, cache_seqlens, cache_leftpad, causal, softmax_scale, window_size,
                softcap, sinks):
        calls.append(q.shape[1])
        return _reference_kvcache(q, k_cache, v_cache, cache_seqlens, cache_leftpad, causal, softmax_scale,
                                  window_size, softcap, sinks)

    monkeypatch.setattr(fa3_hf, "attention", _reference_attention)
    monkeypatch.setattr(fa3_hf, "packed_attention", _reference_varlen)
    monkeypatch.setattr(fa3_hf, "attention_with_kvcache", kvcache)
    model = make_model(kind, "cpu", torch.float32)
    ids, mask = batch("cpu", "left")
    assert_same_generation(greedy_runs(model, ids, mask, ("fa3", "eager"), 4), 1e-4)
    assert calls and set(calls) == {1}  # the decode steps, one new query each, read the cache in place


@pytest.mark.parametrize("kind", ["llama", "gpt_oss"])
@pytest.mark.parametrize("padding", ["none", "left"])
def test_static_cache_generation_on_cpu(kind, padding, monkeypatch):
    """transformers' static cache (cache_implementation="static", what compiled generation uses) holds
    rows past the tokens: with padding the mask is shorter than the cache and its rows are sliced off;
    without, transformers passes no mask, and each row's keys come from its position ids. Eager's
    tokens and logits (before: the empty rows were attended to)."""
    monkeypatch.setattr(fa3_hf, "attention", _reference_attention)
    monkeypatch.setattr(fa3_hf, "packed_attention", _reference_varlen)
    monkeypatch.setattr(fa3_hf, "attention_with_kvcache", _reference_kvcache_call)
    model = make_model(kind, "cpu", torch.float32)
    ids, mask = batch("cpu", padding)
    assert_same_generation(greedy_runs(model, ids, mask, ("fa3", "eager"), 4, cache_implementation="static"), 1e-4)


def test_static_cache_rows_that_differ_read_in_place(monkeypatch):
    """Position ids whose rows end at different places (no mask) give each row its own key count,
    read in place by the cache call; every row at the same place slices the cache instead."""
    calls = []

    def kvcache(q, k, v, *, cache_seqlens, **kw):
        calls.append(cache_seqlens.tolist())
        return _reference_kvcache_call(q, k, v, cache_seqlens=cache_seqlens,
                                       cache_leftpad=torch.zeros_like(cache_seqlens), **kw)

    monkeypatch.setattr(fa3_hf, "attention", _reference_attention)
    monkeypatch.setattr(fa3_hf, "attention_with_kvcache", kvcache)
    module = torch.nn.Module()
    module.is_causal = True
    q, k = torch.randn(3, 8, 1, 128), torch.randn(3, 4, 20, 128)
    out, _ = fa3_hf.fa3_attention_forward(module, q, k, k, None, position_ids=torch.tensor([[6], [11], [3]]))
    assert calls == [[7, 12, 4]]
    for row, keys in enumerate((7, 12, 4)):
        want = _reference_attention(q[row:row + 1].transpose(1, 2), k[row:row + 1, :, :keys].transpose(1, 2),
                                    k[row:row + 1, :, :keys].transpose(1, 2), causal=True)
        assert rel_err(out[row:row + 1], want) < 1e-5
    out, _ = fa3_hf.fa3_attention_forward(module, q, k, k, None, position_ids=torch.tensor([[9]]))
    want = _reference_attention(q.transpose(1, 2), k[:, :, :10].transpose(1, 2), k[:, :, :10].transpose(1, 2),
                                causal=True)
    assert len(calls) == 1 and rel_err(out, want) < 1e-5
    q3 = torch.randn(3, 8, 3, 128)  # three queries a row: packed (long ones would run on the prompt kernel)
    out, _ = fa3_hf.fa3_attention_forward(module, q3, k, k, None, position_ids=torch.tensor([[4, 5, 6], [9, 10, 11],
                                                                                            [1, 2, 3]]))
    assert calls[-1] == [7, 12, 4]
    for row, keys in enumerate((7, 12, 4)):
        want = _reference_attention(q3[row:row + 1].transpose(1, 2), k[row:row + 1, :, :keys].transpose(1, 2),
                                    k[row:row + 1, :, :keys].transpose(1, 2), causal=True)
        assert rel_err(out[row:row + 1], want) < 1e-5
    calls.clear()
    module.is_causal = False  # cross-attention (an encoder's keys, all real): position ids say nothing of them
    out, _ = fa3_hf.fa3_attention_forward(module, q, k, k, None, position_ids=torch.tensor([[9]]))
    want = _reference_attention(q.transpose(1, 2), k.transpose(1, 2), k.transpose(1, 2))
    assert not calls and rel_err(out, want) < 1e-5


def _packed_batch(device):
    """One row of three sequences (20, 13 and 17 tokens), position ids counting from 0 in each, as
    transformers' DataCollatorWithFlattening packs a padding-free batch; and each sequence's ids."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 256, (1, 50), generator=g).to(device)
    position_ids = torch.cat([torch.arange(n) for n in (20, 13, 17)])[None].to(device)
    return ids, position_ids, [ids[:, a:b] for a, b in ((0, 20), (20, 33), (33, 50))]


def _logits_alone(model, pieces):
    model.set_attn_implementation("eager")
    with torch.no_grad():
        return torch.cat([model(input_ids=piece, use_cache=False).logits for piece in pieces], 1)


@pytest.mark.parametrize("kind", ["llama", "gpt_oss"])
@pytest.mark.parametrize("given", ["position_ids", "flash_kwargs"])
def test_packed_sequences_on_cpu(kind, given, monkeypatch):
    """Padding-free training's flattened batch (one row, no mask) attends within each sequence: the
    logits of each sequence run alone (before: attention crossed the sequences, relative error 0.98
    on llama). The sequences come from the position ids (once a forward) or from transformers'
    cu_seq_lens_q/k kwargs where the collator made them (then the position ids are not read)."""
    monkeypatch.setattr(fa3_hf, "attention", _reference_attention)
    monkeypatch.setattr(fa3_hf, "packed_attention", _reference_varlen)
    builds = []
    monkeypatch.setattr(fa3_hf, "_PACKED", fa3_hf._PerTensor(lambda p: builds.append(1) or fa3_hf._packed_spans(p)))
    model = make_model(kind, "cpu", torch.float32)
    ids, position_ids, pieces = _packed_batch("cpu")
    kw = {}
    if given == "flash_kwargs":
        cu = torch.tensor([0, 20, 33, 50], dtype=torch.int32)
        kw = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=20, max_length_k=20)
    model.set_attn_implementation("fa3")
    with torch.no_grad():
        got = model(input_ids=ids, position_ids=position_ids, use_cache=False, **kw).logits
    assert rel_err(got, _logits_alone(model, pieces)) < 1e-5
    assert len(builds) == (1 if given == "position_ids" else 0)  # once a forward, not once a layer
    assert fa3_hf._packed_spans(torch.arange(7)[None]) is None  # one sequence
    cu, longest = fa3_hf._packed_spans(torch.tensor([[3, 4, 0, 1, 2, 0]]))  # the first token starts one anyway
    assert cu.tolist() == [0, 2, 5, 6] and cu.dtype == torch.int32 and longest == 3


def _more_configs():
    """Other families' attention as transformers wires it (sliding layers in Qwen3 / Gemma 3 /
    Cohere2 / StarCoder2, QK norms, Phi-3's fused projections)."""
    common = dict(vocab_size=256, hidden_size=512, intermediate_size=512, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, attention_dropout=0.0, max_position_embeddings=256)
    return {
        "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(common, head_dim=128, use_sliding_window=True,
                                                          sliding_window=16, max_window_layers=1)),
        "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(common, head_dim=128, sliding_window=16,
                                                                 query_pre_attn_scalar=128)),
        "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(common, pad_token_id=0)),
        "cohere2": ("Cohere2Config", "Cohere2ForCausalLM", dict(common, head_dim=128, sliding_window=16)),
    }


@pytest.mark.parametrize("kind", ["qwen3", "gemma3", "phi3", "cohere2"])
def test_more_architectures_on_cpu(kind, monkeypatch):
    """Left-padded logits and greedy generation with a static cache give eager's, for families the
    other tests do not build."""
    monkeypatch.setattr(fa3_hf, "attention", _reference_attention)
    monkeypatch.setattr(fa3_hf, "packed_attention", _reference_varlen)
    monkeypatch.setattr(fa3_hf, "attention_with_kvcache", _reference_kvcache_call)
    config, model_cls, kwargs = _more_configs()[kind]
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(getattr(transformers, config)(**kwargs)).eval()
    ids, mask = batch("cpu", "left")
    assert rel_err(logits_of(model, "fa3", ids, mask, "left"), logits_of(model, "eager", ids, mask, "left")) < 1e-5
    assert_same_generation(greedy_runs(model, ids, mask, ("fa3", "eager"), 3, cache_implementation="static"), 1e-5)

def test_decode_plan_reads_left_padding_in_place():
    """Which decode masks read the cache in place (_LeftPadded: each row's padding, then its keys,
    the new queries among them) and which are unpadded through gathers."""
    build = fa3_hf._unpad_plan
    mask = torch.ones(3, 10, dtype=torch.long)
    mask[1, :4] = 0
    mask[2, :9] = 0
    plan = build(mask, 1, True)
    assert isinstance(plan, fa3_hf._LeftPadded)
    assert plan.leftpad.tolist() == [0, 4, 9] and plan.lengths.tolist() == [10, 10, 10]
    assert plan.leftpad.dtype == plan.lengths.dtype == torch.int32
    assert not isinstance(build(mask, 2, True), fa3_hf._LeftPadded)  # row 2's second query is padding
    assert not isinstance(build(mask, 1, False), fa3_hf._LeftPadded)  # gradients wanted, or traced
    holes = mask.clone()
    holes[0, 5] = 0  # not left padding
    assert not isinstance(build(holes, 1, True), fa3_hf._LeftPadded)
    assert not isinstance(build(mask, 10, True), fa3_hf._LeftPadded)  # a prompt, not a decode step

    # the layer's side: in place only for a cache attention_with_kvcache reads as it is, few queries
    calls = []

    def kvcache(q, k, v, **kw):
        calls.append(q.shape)
        return q

    monkeyplan = fa3_hf._PerTensor(fa3_hf._unpad_plan)
    q, k = torch.randn(3, 1, 8, 128), torch.randn(3, 10, 2, 128)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fa3_hf, "attention_with_kvcache", kvcache)
        mp.setattr(fa3_hf, "packed_attention", _reference_varlen)
        mp.setattr(fa3_hf, "_PLAN", monkeyplan)
        with torch.no_grad():
            fa3_hf._unpadded(q, k, k, mask, True, None, (-1, -1), 0.0)
            assert len(calls) == 1
            fa3_hf._unpadded(q, k, k[..., :64], mask, True, None, (-1, -1), 0.0)  # v's head dim differs
            wide = torch.randn(3, 10, 2, 130)[..., :128]  # heads 520 bytes apart: not TMA-aligned
            fa3_hf._unpadded(q, wide, wide, mask, True, None, (-1, -1), 0.0)
            fa3_hf._unpadded(torch.randn(3, 17, 8, 128), torch.randn(3, 30, 2, 128), torch.randn(3, 30, 2, 128),
                             torch.ones(3, 30, dtype=torch.long), True, None, (-1, -1), 0.0)  # 17 x 4 rows
        assert len(calls) == 1


def test_plans_kept_per_mask_for_alternating_layer_kinds(monkeypatch):
    """A forward of a model with full and sliding layers passes two masks (transformers slices one per
    layer kind), its layers alternating: each mask's plan is built once a forward (each build is a host
    sync), not once a layer; a new forward's masks (new objects, or the same one written in place)
    build again."""
    builds = []
    plans = fa3_hf._PerTensor(lambda mask, seqlen_q, in_place: builds.append(1) or fa3_hf._unpad_plan(mask, seqlen_q,
                                                                                                     in_place))
    full = torch.ones(3, 12, dtype=torch.long)
    full[1, :5] = 0
    sliding = full[:, -8:]
    for layer in range(24):
        mask = sliding if layer % 2 == 0 else full
        plan = plans.get(mask, 1, True)
        assert isinstance(plan, fa3_hf._LeftPadded) and plan.lengths.tolist() == [mask.shape[1]] * 3
    assert len(builds) == 2
    plans.get(full, 2, True)  # another query count: another plan
    full[0, 0] = 0  # written in place: its version moved
    plans.get(full, 1, True)
    plans.get(full.clone(), 1, True)  # another object
    assert len(builds) == 5

def test_refusals():
    model = make_model("llama", "cpu", torch.float32).train()  # dropout is refused while training
    module = model.model.layers[0].self_attn
    q = torch.zeros(1, 4, 8, 128)
    with pytest.raises(ValueError, match="dropout"):
        fa3_hf.fa3_attention_forward(module, q, q, q, None, dropout=0.1)
    with pytest.raises(ValueError, match="additive mask"):
        fa3_hf.fa3_attention_forward(module, q, q, q, torch.zeros(1, 1, 8, 8))


# ----------------------------------------------------------------------------- GPU: the kernels
@pytest.mark.gpu
@pytest.mark.parametrize("padding", ["none", "right", "left"])
@pytest.mark.parametrize("kind", ["llama", "mistral", "gemma2", "gpt_oss"])
def test_logits_match(kind, padding):
    model = make_model(kind, "cuda", torch.bfloat16)
    ids, mask = batch("cuda", padding)
    peer = "eager" if kind in ("gemma2", "gpt_oss") else "sdpa"  # sdpa knows no softcap nor sinks
    got, want = logits_of(model, "fa3", ids, mask, padding), logits_of(model, peer, ids, mask, padding)
    assert torch.isfinite(got).all() and rel_err(got, want) < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("padding", ["none", "right", "left"])
@pytest.mark.parametrize("kind", ["llama", "mistral", "gemma2", "gpt_oss"])
def test_gradients_match(kind, padding):
    """A training step, padded batches through the varlen backward (gpt-oss: its sinks' too)."""
    model = make_model(kind, "cuda", torch.bfloat16).train()
    ids, mask = batch("cuda", padding)
    got, want = (parameter_grads(model, impl, ids, mask, padding) for impl in ("fa3", "eager"))
    assert torch.isfinite(got).all() and rel_err(got, want) < 5e-2


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["llama", "gpt_oss"])
def test_packed_sequences_match_eager(kind):
    """A padding-free batch on the kernels: the logits of each sequence run alone (eager), and the
    training step's gradients finite."""
    model = make_model(kind, "cuda", torch.bfloat16)
    ids, position_ids, pieces = _packed_batch("cuda")
    model.set_attn_implementation("fa3")
    with torch.no_grad():
        got = model(input_ids=ids, position_ids=position_ids, use_cache=False).logits
    assert torch.isfinite(got).all() and rel_err(got, _logits_alone(model, pieces)) < 2e-2
    model.set_attn_implementation("fa3")
    model.train().zero_grad()
    model(input_ids=ids, position_ids=position_ids, use_cache=False, labels=ids).loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)

@pytest.mark.gpu
@pytest.mark.parametrize("kind,padding,cache", [("llama", "none", "dynamic"), ("llama", "left", "dynamic"),
                                                ("gpt_oss", "left", "dynamic"), ("llama", "none", "static"),
                                                ("gpt_oss", "left", "static")])
def test_generation_matches_sdpa(kind, padding, cache):
    """Greedy tokens through transformers' cache (left padding: decode steps read it in place with
    cache_leftpad; a static cache: only its rows that hold tokens) against sdpa's (eager's for
    gpt-oss, whose sinks sdpa does not take)."""
    model = make_model(kind, "cuda", torch.bfloat16)
    ids, mask = batch("cuda", padding)
    ref = "eager" if kind == "gpt_oss" else "sdpa"
    runs = greedy_runs(model, ids, mask, ("fa3", ref), 16, cache_implementation=cache)
    for row in range(ids.shape[0]):
        a, b = runs["fa3"].sequences[row, 40:], runs[ref].sequences[row, 40:]
        differ = (a != b).nonzero()
        if len(differ):  # the first difference must be a near tie of sdpa's top two logits
            step = int(differ[0])
            top2 = runs[ref].logits[step][row].float().topk(2).values
            assert float(top2[0] - top2[1]) < 0.05, f"row {row} differs at step {step}"
