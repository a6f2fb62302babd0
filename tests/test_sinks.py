"""Attention sinks (gpt-oss): one float32 logit per query head in every row's softmax denominator,
with no value. CPU: the reference's math, the d sinks formula the backward uses (float64 autograd),
argument checks, the fake shapes. GPU: forward and backward of fa3.attention, attention_varlen and
attention_with_kvcache against the float64 reference, and a tiny gpt-oss generating the same greedy
tokens with "fa3" as with "eager".
"""

import pytest
import torch

import fa3
from fa3 import backward, registry
from fa3.reference import attention_reference

from conftest import HAS_HOPPER, raises_with, rel_err

gpu = pytest.mark.gpu
BF16 = torch.bfloat16


def _sinks(heads, seed=0, device="cpu", scale=2.0):
    g = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(heads, device=device, generator=g, dtype=torch.float32) * scale


def _explicit(q, k, v, sinks, causal):
    """gpt-oss's eager formulation: the sink as one more column of logits, dropped after softmax."""
    b, sq, hq, d = q.shape
    group = hq // k.shape[2]
    qf, kf, vf = (t.double().transpose(1, 2) for t in (q, k, v))
    kf, vf = kf.repeat_interleave(group, 1), vf.repeat_interleave(group, 1)
    s = qf @ kf.transpose(-1, -2) / d ** 0.5
    if causal:
        i = torch.arange(sq)[:, None] + k.shape[1] - sq
        s = s.masked_fill(torch.arange(k.shape[1])[None] > i, float("-inf"))
    logits = torch.cat([s, sinks.double()[None, :, None, None].expand(b, hq, sq, 1)], dim=-1)
    p = torch.softmax(logits, dim=-1)[..., :-1]
    return (p @ vf).transpose(1, 2), torch.logsumexp(logits, dim=-1)


# ----------------------------------------------------------------------------- CPU: the math
@pytest.mark.parametrize("causal", [False, True])
def test_reference_sinks_are_gpt_oss_semantics(causal):
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 37, 6, 32, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 21, 2, 32, generator=g, dtype=torch.float64) for _ in range(2))
    sinks = _sinks(6)
    out, lse = attention_reference(q, k, v, causal=causal, dtype=torch.float64, sinks=sinks)
    ref_out, ref_lse = _explicit(q, k, v, sinks, causal)
    assert rel_err(out, ref_out) < 1e-9 and rel_err(lse, ref_lse) < 1e-9, (rel_err(out, ref_out), rel_err(lse, ref_lse))
    plain, _ = attention_reference(q, k, v, causal=causal, dtype=torch.float64)
    assert rel_err(out, plain) > 1e-3  # the sinks change the result
    if causal:  # 37 queries, 21 keys: the first 16 rows see no key -> O = 0, LSE = the sink
        assert torch.equal(out[:, :16], torch.zeros_like(out[:, :16]))
        assert torch.equal(lse[:, :, :16], sinks.double()[None, :, None].expand(2, 6, 16))


def test_sink_gradient_formula_matches_autograd():
    """d sinks_h = -sum_{batch, rows} exp(sinks_h - LSE) * D, D = rowsum(dO * O) (what
    fa3.backward.sink_grad computes from the preprocess's D), against float64 autograd; and the
    kernels' dq/dk/dv formula (P = exp(S - LSE) with the sink in LSE, dS = P (dP - D)) too."""
    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, 45, 4, 16, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 30, 2, 16, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 30, 2, 16, generator=g, dtype=torch.float64, requires_grad=True)
    sinks = _sinks(4).double().requires_grad_()
    dout = torch.randn(2, 45, 4, 16, generator=g, dtype=torch.float64)
    out, lse = attention_reference(q, k, v, causal=True, dtype=torch.float64, sinks=sinks)
    out.backward(dout)
    dsum = (dout * out.detach()).sum(-1).transpose(1, 2)  # D: (batch, heads, rows)
    pad = torch.full((2, 4, 3), float("nan"), dtype=torch.float64)  # the preprocess's padded rows
    got = backward.sink_grad(sinks, lse.detach(), torch.cat([dsum, pad], dim=2), 45)
    assert rel_err(got, sinks.grad) < 1e-12
    # dS = P (dP - D) with P = exp(S - LSE): the sink needs nothing else of the kernels
    scale = 16 ** -0.5
    qf, kf, vf = (t.detach().transpose(1, 2) for t in (q, k, v))
    kf, vf = kf.repeat_interleave(2, 1), vf.repeat_interleave(2, 1)
    s = (qf @ kf.transpose(-1, -2)) * scale
    i = torch.arange(45)[:, None] + 30 - 45
    s = s.masked_fill(torch.arange(30)[None] > i, float("-inf"))
    p = torch.exp(s - lse.detach()[..., None])
    dp = dout.transpose(1, 2) @ vf.transpose(-1, -2)
    ds = p * (dp - dsum[..., None])
    dq = (ds @ kf * scale).transpose(1, 2)
    assert rel_err(dq, q.grad) < 1e-12


def test_all_masked_rows_with_a_sink_of_minus_inf_have_no_nan_gradient():
    lse = torch.tensor([[[float("-inf"), 0.5]]])
    dsum = torch.tensor([[[0.0, 2.0]]])
    got = backward.sink_grad(torch.tensor([float("-inf")]), lse, dsum, 2)
    assert torch.equal(got, torch.zeros(1))


# ----------------------------------------------------------------------------- CPU: checks
def _meta(*shape, dtype=BF16):
    return torch.empty(*shape, device="meta", dtype=dtype)


@pytest.mark.parametrize("sinks, exc, words", [
    ([0.0] * 8, TypeError, ("sinks must be a torch.Tensor", "list")),
    (torch.empty(8, device="meta", dtype=BF16), TypeError, ("sinks", "torch.bfloat16", "float32")),
    (torch.empty(4, device="meta"), ValueError, ("sinks", "(heads_q=8,)", "(4,)")),
    (torch.empty(1, 8, device="meta"), ValueError, ("sinks", "(1, 8)")),
    (torch.empty(8), ValueError, ("sinks is on cpu", "meta")),
])
def test_bad_sinks(no_device_check, sinks, exc, words):
    q, k = _meta(2, 16, 8, 64), _meta(2, 16, 2, 64)
    raises_with(fa3.attention, exc, *words, q=q, k=k, v=k, sinks=sinks)
    cu = torch.zeros(3, dtype=torch.int32, device="meta")
    raises_with(fa3.attention_varlen, exc, *words, q=q[0], k=k[0], v=k[0], cu_seqlens_q=cu,
                cu_seqlens_k=cu, sinks=sinks)


def test_rungs_without_sinks_are_refused_by_name(no_device_check):
    q, k = _meta(2, 16, 4, 64), _meta(2, 16, 4, 64)
    no_sinks = [n for n in registry.available_kernels(registry.ATTENTION)
                if registry.SINKS not in registry.get(n).variants]
    assert no_sinks and registry.SINKS in registry.fastest(registry.ATTENTION, 64).variants
    raises_with(fa3.attention, ValueError, f"kernel={no_sinks[0]!r}", "does not support sinks", "k5.5",
                q=q, k=k, v=k, kernel=no_sinks[0], sinks=torch.zeros(4, device="meta"))


def test_sinks_gradient_shapes_on_meta(no_device_check):
    """The op path (autograd) returns d sinks shaped like sinks; varlen too; lse stays (batch, heads,
    seqlen)."""
    q = _meta(2, 33, 8, 64).requires_grad_()
    k = _meta(2, 17, 2, 64).requires_grad_()
    sinks = torch.zeros(8, device="meta").requires_grad_()
    out, lse = fa3.attention(q, k, k, causal=True, sinks=sinks, return_lse=True)
    assert lse.shape == (2, 8, 33)
    out.sum().backward()
    assert sinks.grad.shape == (8,) and sinks.grad.dtype == torch.float32
    sinks.grad = None
    cu = torch.tensor([0, 20, 33], dtype=torch.int32, device="meta")
    out = fa3.attention_varlen(q[0], k[0], k[0], cu, cu, sinks=sinks)
    out.sum().backward()
    assert sinks.grad.shape == (8,)


def test_attention_backward_function_with_sinks_traced(no_device_check):
    """fa3.attention_backward (traced: the op's fake on meta tensors): (dq, dk, dv) without sinks,
    and d sinks fourth with them (the op's fourth output, shaped like sinks)."""
    q, k = _meta(2, 33, 8, 64), _meta(2, 17, 2, 64)
    out, lse = _meta(2, 33, 8, 64), torch.empty(2, 8, 33, device="meta")

    @torch.compile(backend="eager", fullgraph=True)
    def grads(sinks):
        return fa3.attention_backward(q, q, k, k, out, lse, causal=True, sinks=sinks)

    assert [tuple(g.shape) for g in grads(None)] == [(2, 33, 8, 64), (2, 17, 2, 64), (2, 17, 2, 64)]
    with_sinks = grads(torch.zeros(8, device="meta"))
    assert len(with_sinks) == 4 and with_sinks[3].shape == (8,) and with_sinks[3].dtype == torch.float32
    raises_with(fa3.attention_backward, ValueError, "sinks", "(heads_q=8,)", dout=q, q=q, k=k, v=k,
                out=out, lse=lse, sinks=torch.zeros(4, device="meta"))


# ----------------------------------------------------------------------------- GPU
def _gpu_inputs(batch, sq, sk, hq, hkv, d, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    mk = lambda *s: torch.randn(*s, device="cuda", dtype=BF16, generator=g)
    return mk(batch, sq, hq, d), mk(batch, sk, hkv, d), mk(batch, sk, hkv, d), mk(batch, sq, hq, d)


def _poison():
    torch.empty(1 << 26, dtype=torch.float32, device="cuda").fill_(float("nan"))


def _check_grads(got, ref, low, names):
    """Each against float64 within 2x the same math's error run by PyTorch in bf16 (+ a floor), as
    test_backward."""
    for name, g, r, b in zip(names, got, ref, low):
        assert torch.isfinite(g).all(), f"{name} has NaN/inf"
        err, base = rel_err(g, r), rel_err(b.to(r.dtype), r)
        assert err <= 2 * base + 2e-3, f"{name}: rel err {err:.2e} vs PyTorch bf16 {base:.2e}"


def _reference_with_grads(q, k, v, dout, sinks, dtype, **kw):
    q, k, v = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
    s = sinks.detach().to(dtype).requires_grad_()
    out, lse = attention_reference(q, k, v, dtype=dtype, sinks=s, **kw)
    out.backward(dout.to(dtype))
    return (out, q.grad, k.grad, v.grad, s.grad), lse


SHAPES = [(2, 257, 131, 4, 2), (1, 100, 333, 6, 1), (2, 333, 100, 2, 2), (1, 1, 3, 2, 2)]
# (head_dim, causal, window): every head dim, each mask kind at two of them (the sink is head-dim
# independent: it lives in the epilogue; each case compiles a forward and two backward kernels)
MASK_CASES = [(64, False, (-1, -1)), (96, True, (-1, -1)), (128, True, (-1, -1)), (128, False, (50, 20)),
              (192, False, (-1, -1)), (192, True, (100, 0)), (256, False, (50, 20))]


@gpu
@pytest.mark.parametrize("head_dim, causal, window", MASK_CASES,
                         ids=[f"d{d}-{'causal' if c else 'full'}-w{w[0]}" for d, c, w in MASK_CASES])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_sinks_forward_backward_match_reference(head_dim, causal, window, shape):
    batch, sq, sk, hq, hkv = shape
    q, k, v, dout = _gpu_inputs(batch, sq, sk, hq, hkv, head_dim, seed=sq + head_dim)
    sinks = _sinks(hq, seed=head_dim, device="cuda")
    kw = dict(causal=causal, window_size=window)
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    sg = sinks.clone().requires_grad_()
    out, lse = fa3.attention(qg, kg, vg, sinks=sg, return_lse=True, **kw)
    _poison()
    out.backward(dout)
    exact, ref_lse = _reference_with_grads(q, k, v, dout, sinks, torch.float64, **kw)
    low, _ = _reference_with_grads(q, k, v, dout, sinks, BF16, **kw)  # PyTorch's own bf16 error
    _check_grads((out, qg.grad, kg.grad, vg.grad, sg.grad), exact, low, ("out", "dq", "dk", "dv", "dsinks"))
    assert torch.allclose(lse.double(), ref_lse, atol=1e-2, rtol=1e-3)  # finite everywhere: sinks
    # eager (no grad) takes the direct path: the same kernel, the same numbers
    assert torch.equal(fa3.attention(q, k, v, sinks=sinks, **kw), out.detach())


@gpu
def test_attention_backward_function_with_sinks_matches_autograd():
    """fa3.attention_backward(..., sinks=) on the forward's (out, lse): autograd's dq, dk, dv and
    d sinks, bitwise (deterministic)."""
    q, k, v, dout = _gpu_inputs(2, 300, 200, 8, 2, 128, seed=5)
    sinks = _sinks(8, device="cuda")
    qg, kg, vg, sg = (t.clone().requires_grad_() for t in (q, k, v, sinks))
    fa3.attention(qg, kg, vg, causal=True, sinks=sg, deterministic=True).backward(dout)
    out, lse = fa3.attention(q, k, v, causal=True, sinks=sinks, return_lse=True)
    _poison()
    got = fa3.attention_backward(dout, q, k, v, out, lse, causal=True, sinks=sinks, deterministic=True)
    for name, a, b in zip(("dq", "dk", "dv", "dsinks"), got, (qg.grad, kg.grad, vg.grad, sg.grad)):
        assert torch.equal(a, b), name


@gpu
@pytest.mark.parametrize("head_dim", [96, 128, 192], ids=lambda d: f"d{d}")
def test_sinks_deterministic_backward_is_repeatable(head_dim):
    q, k, v, dout = _gpu_inputs(2, 1000, 1000, 8, 2, head_dim, seed=3)
    sinks = _sinks(8, device="cuda")
    grads = []
    for _ in range(2):
        sg = sinks.clone().requires_grad_()
        qg = q.clone().requires_grad_()
        fa3.attention(qg, k, v, causal=True, sinks=sg, deterministic=True).backward(dout)
        grads.append((qg.grad, sg.grad))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])


@gpu
@pytest.mark.parametrize("head_dim", [96, 128, 192], ids=lambda d: f"d{d}")
@pytest.mark.parametrize("causal", [False, True])
def test_sinks_varlen_forward_backward(head_dim, causal):
    lens_q, lens_k = [1, 77, 500, 2, 0], [600, 77, 130, 0, 5]
    g = torch.Generator(device="cuda").manual_seed(head_dim)
    mk = lambda n, h: torch.randn(n, h, head_dim, device="cuda", dtype=BF16, generator=g)
    q, k, v, dout = mk(sum(lens_q), 6), mk(sum(lens_k), 2), mk(sum(lens_k), 2), mk(sum(lens_q), 6)
    cu = lambda lens: torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    sinks = _sinks(6, seed=1, device="cuda")
    qg, kg, vg, sg = (t.clone().requires_grad_() for t in (q, k, v, sinks))
    out, lse = fa3.attention_varlen(qg, kg, vg, cu(lens_q), cu(lens_k), causal=causal, sinks=sg,
                                    return_lse=True)
    _poison()
    out.backward(dout)
    # the reference: each sequence alone, d sinks summed over them
    cq, ck = cu(lens_q).tolist(), cu(lens_k).tolist()
    outs, grads, ds = [], [[], [], []], torch.zeros(6, dtype=torch.float64, device="cuda")
    for b in range(len(lens_q)):
        sl_q, sl_k = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        (o, dq, dk, dv, dsk), lse_b = _reference_with_grads(
            q[None, sl_q], k[None, sl_k], v[None, sl_k], dout[None, sl_q], sinks, torch.float64, causal=causal)
        assert torch.allclose(lse[:, sl_q].double(), lse_b[0], atol=1e-2, rtol=1e-3)
        outs.append(o[0])
        for acc, t in zip(grads, (dq, dk, dv)):
            acc.append(t[0])
        ds += dsk
    assert rel_err(out, torch.cat(outs)) < 1.5e-2
    for name, got, parts in zip(("dq", "dk", "dv"), (qg.grad, kg.grad, vg.grad), grads):
        assert rel_err(got, torch.cat(parts)) < 2e-2, name
    assert rel_err(sg.grad, ds) < 1e-2


@gpu
@pytest.mark.parametrize("head_dim", [96, 128, 192], ids=lambda d: f"d{d}")
@pytest.mark.parametrize("page_size", [None, 64])
def test_sinks_kvcache(head_dim, page_size):
    """Dense and paged caches, one split and several (the combine adds the sink), rows with no key."""
    batch, sq, hq, hkv, capacity = 4, 3, 8, 2, 512
    lens = [0, 1, 200, 509]
    g = torch.Generator(device="cuda").manual_seed(head_dim)
    k = torch.randn(batch, capacity, hkv, head_dim, device="cuda", dtype=BF16, generator=g)
    v = torch.randn_like(k)
    q = torch.randn(batch, sq, hq, head_dim, device="cuda", dtype=BF16, generator=g)
    sinks = _sinks(hq, device="cuda")
    table, kc, vc = None, k, v
    if page_size:
        per_seq = capacity // page_size
        perm = torch.randperm(batch * per_seq, device="cuda", generator=g)
        table = perm.view(batch, per_seq).to(torch.int32)
        kc, vc = torch.empty_like(k.view(-1, page_size, hkv, head_dim)), torch.empty_like(v.view(-1, page_size, hkv, head_dim))
        kc[perm], vc[perm] = k.view(-1, page_size, hkv, head_dim), v.view(-1, page_size, hkv, head_dim)
    seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    for causal in (False, True):
        for splits in (1, 4):
            out, lse = fa3.attention_with_kvcache(q, kc, vc, cache_seqlens=seqlens, block_table=table,
                                                  causal=causal, num_splits=splits, sinks=sinks,
                                                  return_lse=True)
            for b, n in enumerate(lens):
                ro, rl = attention_reference(q[b:b + 1], k[b:b + 1, :n], v[b:b + 1, :n], causal=causal,
                                             dtype=torch.float64, sinks=sinks)
                assert rel_err(out[b:b + 1], ro) < 1.5e-2 or (n == 0 and not out[b].any())
                assert torch.allclose(lse[b:b + 1].double(), rl, atol=1e-2, rtol=1e-3), (b, splits)


@gpu
def test_sinks_cost_nothing_when_zero_probability():
    """A sink of -inf is no sink: the same output as no sinks (and LSE)."""
    q, k, v, _ = _gpu_inputs(2, 300, 300, 4, 4, 128, seed=5)
    sinks = torch.full((4,), float("-inf"), device="cuda")
    a, la = fa3.attention(q, k, v, causal=True, sinks=sinks, return_lse=True)
    b, lb = fa3.attention(q, k, v, causal=True, return_lse=True)
    assert rel_err(a, b) < 1e-6 and torch.allclose(la, lb)


# ----------------------------------------------------------------------------- gpt-oss
def _tiny_gpt_oss():
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "GptOssConfig"):
        pytest.skip("this transformers has no gpt-oss")
    import fa3.integrations.transformers  # noqa: F401  (registers "fa3")

    config = transformers.GptOssConfig(
        vocab_size=512, hidden_size=256, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, head_dim=64, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=32, max_position_embeddings=512,
        layer_types=["sliding_attention", "full_attention"])
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(config).to("cuda", BF16).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0.0, 2.0)  # sinks that matter
    return model


@gpu
@pytest.mark.skipif(not HAS_HOPPER, reason="needs a Hopper (sm_90) GPU")
def test_tiny_gpt_oss_greedy_tokens_match_eager():
    """Greedy generation through transformers' cache (sliding and full layers, sinks in both): the
    same tokens as "eager"; a token may differ only where eager's top two logits nearly tie (bf16
    noise decides), and then the test says where."""
    model = _tiny_gpt_oss()
    g = torch.Generator(device="cuda").manual_seed(0)
    prompt = torch.randint(0, 512, (2, 40), device="cuda", generator=g)
    runs = {}
    for impl in ("eager", "fa3"):
        model.set_attn_implementation(impl)
        with torch.no_grad():
            runs[impl] = model.generate(prompt, max_new_tokens=24, do_sample=False, pad_token_id=0,
                                        output_logits=True, return_dict_in_generate=True)
    got, want = runs["fa3"].sequences, runs["eager"].sequences
    if not torch.equal(got, want):
        differs = (got != want).int().argmax(dim=1)  # each row's first differing position
        for row, pos in enumerate(differs.tolist()):
            if got[row, pos] == want[row, pos]:
                continue
            top2 = runs["eager"].logits[pos - prompt.shape[1]][row].float().topk(2).values
            assert (top2[0] - top2[1]).item() < 0.05, f"row {row} differs at {pos} without a near tie"
    # one forward's logits agree (the sinks reach the kernels: without them this is far off)
    with torch.no_grad():
        model.set_attn_implementation("eager")
        ref = model(prompt).logits.float()
        model.set_attn_implementation("fa3")
        out = model(prompt).logits.float()
    assert rel_err(out, ref) < 2e-2


def test_sinks_trace_under_torch_compile(no_device_check):
    """torch.compile(fullgraph=True) traces a training step with sinks: one forward and one
    backward op, d sinks shaped like sinks."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    def loss_fn(q, k, sinks):
        return fa3.attention(q, k, k, causal=True, sinks=sinks).float().square().sum()

    q, k = _meta(2, 64, 4, 64).requires_grad_(), _meta(2, 64, 2, 64).requires_grad_()
    sinks = torch.zeros(4, device="meta").requires_grad_()
    torch._dynamo.reset()
    compiled = torch.compile(loss_fn, fullgraph=True, backend=aot_autograd(fw_compiler=backend,
                                                                           bw_compiler=backend))
    compiled(q, k, sinks).backward()
    targets = [n.target for g in graphs for n in g.graph.nodes if n.op == "call_function"]
    assert torch.ops.fa3.attention.default in targets and torch.ops.fa3.attention_backward.default in targets
    assert sinks.grad.shape == (4,) and q.grad.shape == q.shape
