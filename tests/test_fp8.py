"""The FP8 forward (fa3.attention on float8_e4m3fn q, k, v; rung family "attention_fp8").

CPU: argument checks and their messages, the op's fake shapes, and that the host's V^T key order
(fa3.fp8.transpose_v) is the order in which the kernel packs P into the FP8 A operand, read off the
DSL's own WGMMA thread layouts. GPU (Hopper): accuracy against a float64 reference computed from the
dequantized inputs, for every head dim, causal and not, GQA, ragged seqlens, the descale shapes,
window, softcap, LSE, out=; and the Hadamard option on outlier data.
"""

import math

import pytest
import torch

import fa3
from fa3 import _checks, fp8, registry
from fa3.reference import attention_reference
from conftest import raises_with, rel_err

FP8 = torch.float8_e4m3fn
RUNG = registry.available_kernels(registry.ATTENTION_FP8)[0]
FP8_RUNGS = registry.available_kernels(registry.ATTENTION_FP8)  # f1 (V^T by a kernel), f2 (in SMEM)


def fp8_qkv(batch=2, seqlen_q=16, seqlen_k=24, heads_q=4, heads_kv=2, head_dim=128, device="cpu"):
    gen = torch.Generator().manual_seed(batch * 1000 + seqlen_q * 10 + seqlen_k)
    q, k, v = (torch.randn(batch, s, h, head_dim, generator=gen) for s, h in
               ((seqlen_q, heads_q), (seqlen_k, heads_kv), (seqlen_k, heads_kv)))
    return tuple(t.to(device=device, dtype=FP8) for t in (q, k, v))


def raises(exc, *words, **call):
    return raises_with(fa3.attention, exc, *words, **call)


# ----------------------------------------------------------------------------- argument checks
@pytest.mark.parametrize("name", ["k", "v"])
def test_fp8_q_with_bf16_operand(name):
    args = dict(zip("qkv", fp8_qkv()))
    args[name] = args[name].to(torch.bfloat16)
    raises(TypeError, name, "torch.bfloat16", "float8_e4m3fn", "fa3.quantize_fp8", **args)


def test_e5m2_refused():
    q, k, v = (t.to(torch.float8_e5m2) for t in fp8_qkv())
    raises(TypeError, "q", "float8_e5m2", "e5m2 is not supported", q=q, k=k, v=v)


def test_descales_with_bf16_inputs():
    q, k, v = (t.to(torch.bfloat16) for t in fp8_qkv())
    raises(ValueError, "q_descale", "FP8 inputs", "bfloat16", q=q, k=k, v=v,
           k_descale=torch.ones(2, 2))


def test_requires_grad_refused():
    q, k, v = fp8_qkv()
    raises(ValueError, "forward-only", "requires grad", "detach", q=q.requires_grad_(), k=k, v=v)


def test_cpu_tensors():
    q, k, v = fp8_qkv()
    raises(ValueError, "q", "cpu", "q.cuda()", q=q, k=k, v=v)


def test_bf16_rung_is_not_an_fp8_kernel():
    q, k, v = fp8_qkv()
    raises(ValueError, "kernel='k5.5'", "attention_fp8", RUNG, q=q, k=k, v=v, kernel="k5.5")


def test_sinks_refused():
    """Sinks are a 16-bit feature: FP8 inputs with sinks are refused by name, before the device."""
    q, k, v = fp8_qkv()
    raises(ValueError, "sinks", "FP8", "fa3.dequantize_fp8", q=q, k=k, v=v, sinks=torch.zeros(4))


def test_value_head_dim_refused():
    """v's head dim must be q's on the FP8 rungs (the (192, 128)-style pairs are 16-bit only)."""
    q, k, _ = fp8_qkv(head_dim=128)
    v = fp8_qkv(head_dim=64)[2]
    raises(ValueError, "v has head_dim 64", "128", f"kernel={RUNG!r}", q=q, k=k, v=v)


def test_unsupported_head_dim():
    q, k, v = fp8_qkv(head_dim=96)
    msg = raises(ValueError, "head_dim=96", q=q, k=k, v=v)
    for d in registry.get(RUNG).head_dims:
        assert str(d) in msg


@pytest.mark.parametrize("name", ["q_descale", "k_descale", "v_descale"])
@pytest.mark.parametrize("bad, exc, words", [
    (torch.ones(2, 2, dtype=torch.float16), TypeError, ("torch.float16", "float32")),
    (torch.ones(2, 4), ValueError, ("(2, 4)", "(batch, heads_kv) = (2, 2)")),
    (torch.ones(2), ValueError, ("(2,)", "one element")),
    (torch.ones(2, 2, device="meta"), ValueError, ("meta", "q's device")),
    (1.0, TypeError, ("torch.Tensor", "float")),
])
def test_bad_descale(no_device_check, name, bad, exc, words):
    q, k, v = fp8_qkv()
    raises(exc, name, *words, q=q, k=k, v=v, **{name: bad})


@pytest.mark.parametrize("given", [None, torch.tensor(0.5), torch.tensor([0.5]), torch.full((1, 1), 0.5),
                                   torch.full((3, 2), 0.5).t()])
def test_descale_forms(given):
    """None (1), 0-d, one element and (batch, heads_kv) in any strides all become a float32 (batch,
    heads_kv) view with the right values, never a copy (the kernels take any strides): one element
    broadcast with strides 0."""
    got = _checks.check_descale(given, "q_descale", 2, 3, torch.device("cpu"))
    assert got.shape == (2, 3) and got.dtype == torch.float32
    assert torch.equal(got, torch.full((2, 3), 1.0 if given is None else 0.5))
    if given is not None:
        assert got.data_ptr() == given.data_ptr()
    if given is None or given.numel() == 1:
        assert got.stride() == (0, 0)


@pytest.mark.parametrize("bad, exc", [(torch.float32, TypeError), (FP8, TypeError), ("shape", ValueError)])
def test_bad_out(no_device_check, bad, exc):
    q, k, v = fp8_qkv()
    out = torch.empty(2, 17, 4, 128, dtype=torch.bfloat16) if bad == "shape" else \
        torch.empty(q.shape, dtype=bad)
    raises(exc, "out", q=q, k=k, v=v, out=out)


def test_fake_shapes(no_device_check):
    """The op on meta tensors: O in out_dtype shaped like q, LSE (batch, heads_q, seqlen_q)."""
    q, k, v = (t.to("meta") for t in fp8_qkv(batch=3, seqlen_q=33, seqlen_k=70, heads_q=8, heads_kv=2))
    d = torch.ones(3, 2, device="meta")
    for out_dtype in (torch.bfloat16, torch.float16):
        out, lse = torch.ops.fa3.attention_fp8(q, k, v, d, d, d, True, 0.1, RUNG, -1, -1, 0.0, out_dtype)
        assert out.shape == q.shape and out.dtype == out_dtype and out.device.type == "meta"
        assert lse.shape == (3, 8, 33) and lse.dtype == torch.float32


def test_traced_call_reaches_the_op(no_device_check):
    """Under torch.compile (eager backend on meta tensors) fa3.attention's FP8 branch is one call
    of the custom op, with out='s dtype."""
    q, k, v = (t.to("meta") for t in fp8_qkv())

    @torch.compile(backend="eager", fullgraph=True)
    def f(q, k, v, s):
        return fa3.attention(q, k, v, q_descale=s, k_descale=s, v_descale=s, causal=True, return_lse=True)

    out, lse = f(q, k, v, torch.ones(2, 2, device="meta"))
    assert out.shape == q.shape and out.dtype == torch.bfloat16 and lse.shape == (2, 4, 16)


def packed_fp8(lengths_q, lengths_k, heads_q=4, heads_kv=2, head_dim=128, device="cpu"):
    """Packed FP8 q (total_q, heads_q, d), k, v (total_k, heads_kv, d) and int32 offsets."""
    gen = torch.Generator().manual_seed(sum(lengths_q) + 7 * sum(lengths_k))
    q = torch.randn(sum(lengths_q), heads_q, head_dim, generator=gen)
    k, v = (torch.randn(sum(lengths_k), heads_kv, head_dim, generator=gen) for _ in range(2))
    cu = [torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32, device=device)
          for n in (lengths_q, lengths_k)]
    return (*(t.to(device=device, dtype=FP8) for t in (q, k, v)), *cu)


def test_varlen_fake_shapes(no_device_check):
    """The op with cu_seqlens on meta tensors: O shaped like q, LSE (heads_q, total_q)."""
    q, k, v, cu_q, cu_k = (t.to("meta") for t in packed_fp8([3, 5], [4, 9]))
    d = torch.ones(2, 2, device="meta")
    out, lse = torch.ops.fa3.attention_fp8(q, k, v, d, d, d, True, 0.1, RUNG, -1, -1, 0.0,
                                           torch.bfloat16, cu_q, cu_k)
    assert out.shape == q.shape and out.dtype == torch.bfloat16 and lse.shape == (4, 8)


def test_varlen_checks(no_device_check):
    """attention_varlen's FP8 branch: descales are (sequences, heads_kv); 16-bit k with FP8 q names
    k. (Over a cache: tests/test_fp8_cache.py.)"""
    q, k, v, cu_q, cu_k = packed_fp8([3, 5, 2], [4, 9, 1])
    call = dict(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    raises_with(fa3.attention_varlen, ValueError, "q_descale", "(3, 2)", **call,
                q_descale=torch.ones(2, 2))
    raises_with(fa3.attention_varlen, TypeError, "k", "torch.bfloat16", "float8_e4m3fn",
                **{**call, "k": k.to(torch.bfloat16)})


def test_flash_attn_names_route_fp8():
    """flash-attn's names hand FP8 inputs and their descales to the FP8 forward (here: its device
    check, on CPU tensors), read no descales with 16-bit inputs (flash-attn's rule; here: the
    16-bit device check)."""
    q, k, v = fp8_qkv()
    s = torch.ones(2, 2)
    raises_with(fa3.flash_attn_func, ValueError, "q", "cpu", q=q, k=k, v=v, q_descale=s)
    raises_with(fa3.flash_attn_func, ValueError, "q", "cpu", q=q.to(torch.bfloat16), k=k.to(torch.bfloat16),
                v=v.to(torch.bfloat16), q_descale=s)
    pq, pk, pv, cu_q, cu_k = packed_fp8([3, 5], [4, 9])
    raises_with(fa3.flash_attn_varlen_func, ValueError, "q", "cpu", q=pq, k=pk, v=pv, cu_seqlens_q=cu_q,
                cu_seqlens_k=cu_k, max_seqlen_q=5, max_seqlen_k=9, k_descale=s)


def test_transpose_v_packed_columns():
    """A packed V^T gives entry b its keys from column 16 ceil(cu_k[b] / 16) + 16 b on, in
    transpose_v's order of the entry alone (zeros between entries); empty entries included."""
    lengths = [5, 0, 37, 16, 1, 20]
    heads, d = 2, 64
    total = sum(lengths)
    v = (torch.arange(total).view(total, 1, 1) % 250 + 1).expand(total, heads, d).to(torch.uint8)
    v = v.contiguous().view(FP8)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    vt = fp8.transpose_v_packed(v, cu)
    columns = fp8.padded_keys(total) + 16 * len(lengths)
    assert vt.shape == (1, d, heads, columns)
    got = vt[0].view(torch.uint8)
    used = torch.zeros(columns, dtype=torch.bool)
    for b, n in enumerate(lengths):
        start = int(cu[b])
        first = -(-start // 16) * 16 + 16 * b
        alone = fp8.transpose_v_reference(v[start:start + n].unsqueeze(0))[0].view(torch.uint8)
        width = alone.shape[-1]
        assert torch.equal(got[..., first:first + width], alone), f"entry {b}"
        used[first:first + width] = True
    assert (got[..., ~used] == 0).all()


# ----------------------------------------------------------------------------- V^T's key order
def test_transpose_v_shape_padding_and_order():
    """V^T holds key 16b + 8a + 2t + c at position 16b + 4t + 2a + c of each head's row of keys;
    keys past seqlen_k (rounded up to 16) are zeros."""
    batch, seqlen, heads, d = 2, 37, 3, 64
    keys = torch.arange(seqlen).view(1, seqlen, 1, 1).expand(batch, seqlen, heads, d)
    v = (keys % 100 + 1).to(torch.uint8).contiguous().view(FP8)
    vt = fp8.transpose_v(v)
    assert vt.dtype == FP8 and vt.shape == (batch, d, heads, 48)
    rows = vt.permute(0, 2, 1, 3).contiguous().view(torch.uint8)  # (batch, heads, d, keys)
    for p in range(48):
        b, r = divmod(p, 16)
        t, j = divmod(r, 4)
        key = 16 * b + 8 * (j // 2) + 2 * t + j % 2
        expected = key % 100 + 1 if key < seqlen else 0
        assert (rows[..., p] == expected).all(), f"position {p}: expected key {key}"


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("seqlen", [1, 37, 64, 1000])
def test_transpose_v_kernel_matches_reference(d, seqlen):
    """The GPU transpose (kernels/fp8_transpose.py) writes the reference's bytes exactly, padding
    included, from random bytes, for a V sliced out of a packed kv tensor (strided rows)."""
    batch, heads = 3, 2
    kv = torch.randint(0, 256, (batch, seqlen, 2, heads, d), dtype=torch.uint8, device="cuda").view(FP8)
    v = kv[:, :, 1]
    vt = fp8.transpose_v(v)
    torch.cuda.synchronize()
    expected = fp8.transpose_v_reference(v.cpu())
    assert vt.shape == expected.shape
    assert torch.equal(vt.cpu().view(torch.uint8), expected.view(torch.uint8))


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("lengths", [[1000], [5, 0, 37, 16, 1, 20], [300, 0, 0, 1, 129, 64, 700]])
def test_transpose_v_packed_kernel_matches_reference(d, lengths):
    """The packed V^T kernel (a binary search per block over cu_seqlens_k) writes the torch
    reference's bytes exactly, gaps and empty sequences included, from a strided V."""
    total, heads = sum(lengths), 2
    kv = torch.randint(0, 256, (total, 2, heads, d), dtype=torch.uint8, device="cuda").view(FP8)
    v = kv[:, 1]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    vt = fp8.transpose_v_packed(v, cu)
    expected = fp8.transpose_v_packed(v.cpu(), cu.cpu())
    assert vt.shape == expected.shape
    assert torch.equal(vt.cpu().view(torch.uint8), expected.view(torch.uint8))


def test_p_operand_order_matches_transpose_v():
    """For every consumer thread and every byte of its FP8 A fragment (P of a 128 x 64 tile), the
    accumulator element mma.fp8_a_order reads sits in the same row as the A element, and its key
    (column) is the key transpose_v stores at that A element's k position: P V then sums each
    probability with its own key's V row. Coordinates come from the DSL's WGMMA thread-value
    layouts (C of the e4m3 QK^T, A of the register-sourced e4m3 P V)."""
    import fa3.__main__ as cli

    cli.prepare_dsl_env()
    import cutlass
    import cutlass.cute as cute
    from fa3.kernels.common import mma

    tile_n, found = 64, {}

    @cute.jit
    def layouts():
        qk = mma.tiled_mma(cutlass.Float8E4M3FN, 128, tile_n)
        pv = mma.tiled_mma(cutlass.Float8E4M3FN, 128, 128, a_in_regs=True)
        acc = cute.make_rmem_tensor(qk.get_slice(0).partition_shape_C((128, tile_n)), cutlass.Float32)
        order = mma.fp8_a_order(acc).layout
        found["order"] = [order(i) for i in range(cute.size(order))]
        found["a"] = [[pv.tv_layout_A((t, i)) for i in range(16)] for t in range(128)]
        found["c"] = [[qk.tv_layout_C((t, i)) for i in range(cute.size(acc))] for t in range(128)]

    cute.compile(layouts)
    # the key stored at each position of V^T's rows (one 64-key tile)
    v = torch.arange(tile_n, dtype=torch.uint8).view(1, tile_n, 1, 1).view(FP8)
    key_at = fp8.transpose_v(v).contiguous().view(torch.uint8).flatten().tolist()
    for t in range(128):
        for i, c_index in enumerate(found["order"]):
            k_block, value = divmod(i, 16)
            m_a, k = found["a"][t][value] % 64, 32 * k_block + found["a"][t][value] // 64
            m_c, n = found["c"][t][c_index] % 64, found["c"][t][c_index] // 64
            assert m_a == m_c, f"thread {t} byte {i}: A row {m_a}, accumulator row {m_c}"
            assert key_at[k] == n, f"thread {t} byte {i}: k {k} holds key {key_at[k]}, P is of key {n}"


# ----------------------------------------------------------------------------- GPU
MAX_REL_ERR = 0.07  # P rounded to e4m3 (3 mantissa bits): ~3.6% RMS per probability
MAX_LSE_ERR = 2e-3


def quantized(batch, seqlen_q, seqlen_k, heads_q, heads_kv, d, seed=0, scale=1.0):
    """q, k, v quantized per (batch, kv head) (fa3.quantize_fp8) on the GPU, and their dequantized
    float64 values."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(batch, s, h, d, generator=gen, device="cuda") * scale for s, h in
               ((seqlen_q, heads_q), (seqlen_k, heads_kv), (seqlen_k, heads_kv)))
    (q8, sq), (k8, sk), (v8, sv) = (fa3.quantize_fp8(q, "head", num_heads_kv=heads_kv),
                                    fa3.quantize_fp8(k, "head"), fa3.quantize_fp8(v, "head"))
    deq = [fa3.dequantize_fp8(x, s, dtype=torch.float64) for x, s in ((q8, sq), (k8, sk), (v8, sv))]
    return (q8, k8, v8), (sq, sk, sv), deq


def check(out, lse, ref_out, ref_lse, label):
    assert not out.isnan().any() and not lse.isnan().any(), f"{label}: NaN"
    err = rel_err(out, ref_out)
    visible = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), visible), f"{label}: -inf LSE rows differ"
    lse_err = rel_err(lse[visible], ref_lse[visible]) if visible.any() else 0.0
    print(f"\n  {label}: out rel err {err:.3e}, lse rel err {lse_err:.2e}", end="")
    assert err < MAX_REL_ERR, f"{label}: out rel err {err:.3e}"
    assert lse_err < MAX_LSE_ERR, f"{label}: lse rel err {lse_err:.3e}"


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", FP8_RUNGS)
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q, seqlen_k, heads_q, heads_kv", [
    (1000, 1000, 4, 4), (333, 777, 8, 2), (777, 333, 6, 1), (4096, 4096, 2, 2)])
def test_fp8_accuracy(kernel, d, causal, seqlen_q, seqlen_k, heads_q, heads_kv):
    (q8, k8, v8), (sq, sk, sv), (q, k, v) = quantized(2, seqlen_q, seqlen_k, heads_q, heads_kv, d,
                                                     seed=d + seqlen_q)
    ref_out, ref_lse = attention_reference(q, k, v, causal=causal, dtype=torch.float64)
    out, lse = fa3.attention(q8, k8, v8, q_descale=sq, k_descale=sk, v_descale=sv, causal=causal,
                             return_lse=True, kernel=kernel)
    assert out.dtype == torch.bfloat16 and out.shape == q8.shape
    check(out, lse, ref_out, ref_lse, f"{kernel} d{d} {'causal' if causal else 'full'} {seqlen_q}x{seqlen_k} "
          f"heads {heads_q}/{heads_kv}")


@pytest.mark.gpu
@pytest.mark.parametrize("form", ["none", "0-d", "1-element", "per-head"])
def test_fp8_descale_forms(form):
    """The inputs quantized per tensor, the descale passed as a 0-d tensor, a one-element tensor or
    (batch, heads_kv); or None: the values cast to e4m3 as they are (descale 1)."""
    gen = torch.Generator(device="cuda").manual_seed(5)
    q, k, v = (torch.randn(2, 300, 4, 128, generator=gen, device="cuda") * 3 for _ in range(3))
    if form == "none":
        quant = [(x.to(FP8), torch.tensor(1.0, device="cuda")) for x in (q, k, v)]
    else:
        quant = [fa3.quantize_fp8(x) for x in (q, k, v)]
    deq = [fa3.dequantize_fp8(x, s, dtype=torch.float64) for x, s in quant]
    shaped = {"none": lambda s: None, "0-d": lambda s: s, "1-element": lambda s: s.reshape(1),
              "per-head": lambda s: s.expand(2, 4).clone()}[form]
    out = fa3.attention(*(x for x, _ in quant), q_descale=shaped(quant[0][1]),
                        k_descale=shaped(quant[1][1]), v_descale=shaped(quant[2][1]))
    ref_out, ref_lse = attention_reference(*deq, dtype=torch.float64)
    err = rel_err(out, ref_out)
    print(f"\n  descale {form}: out rel err {err:.3e}", end="")
    assert err < MAX_REL_ERR


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", FP8_RUNGS)
@pytest.mark.parametrize("variant", ["window", "softcap", "out_fp16", "no_keys_for_first_rows"])
@pytest.mark.parametrize("d", [64, 128])  # d64: f2 is the default there
def test_fp8_variants(kernel, variant, d):
    (q8, k8, v8), scales, (q, k, v) = quantized(2, 700 if variant != "no_keys_for_first_rows" else 900,
                                                500, 4, 2, d, seed=9)
    kwargs, ref_kwargs = {}, {}
    if variant == "window":
        kwargs = ref_kwargs = dict(window_size=(100, 30))
    elif variant == "softcap":
        kwargs = ref_kwargs = dict(softcap=8.0)
    elif variant == "out_fp16":
        kwargs = dict(out=torch.full(q8.shape, float("nan"), dtype=torch.float16, device="cuda"))
    else:  # seqlen_q > seqlen_k, causal: the first 400 rows see no key: O = 0, LSE = -inf
        kwargs = ref_kwargs = dict(causal=True)
    out, lse = fa3.attention(q8, k8, v8, q_descale=scales[0], k_descale=scales[1], v_descale=scales[2],
                             return_lse=True, kernel=kernel, **kwargs)
    if variant == "out_fp16":
        assert out is kwargs["out"] and out.dtype == torch.float16
    ref_out, ref_lse = attention_reference(q, k, v, dtype=torch.float64, **ref_kwargs)
    check(out, lse, ref_out, ref_lse, f"{kernel} {variant} d{d}")


@pytest.mark.gpu
def test_hadamard_lowers_attention_error_on_outliers():
    """Incoherent processing end to end: q and k with outlier channels; FP8 attention of q, k
    quantized plainly vs after the same Hadamard rotation, both against float64 attention of the
    unquantized inputs: the rotated one is measurably closer."""
    gen = torch.Generator(device="cuda").manual_seed(7)
    d = 128
    q, k, v = (torch.randn(2, 2048, 4, d, generator=gen, device="cuda") for _ in range(3))
    channels = torch.randint(0, d, (4,), generator=gen, device="cuda")
    q[..., channels] *= 30
    k[..., channels] *= 30
    scale = 1.0 / math.sqrt(d) / 10  # keep the softmax from saturating on the outliers
    ref_out, _ = attention_reference(q.double(), k.double(), v.double(), softmax_scale=scale,
                                     dtype=torch.float64)
    v8, sv = fa3.quantize_fp8(v, "head")
    errs = {}
    for rotate in (False, True):
        (q8, sq), (k8, sk) = (fa3.quantize_fp8(x, "head", hadamard=rotate, seed=3) for x in (q, k))
        out = fa3.attention(q8, k8, v8, q_descale=sq, k_descale=sk, v_descale=sv, softmax_scale=scale)
        errs[rotate] = rel_err(out, ref_out)
    print(f"\n  outliers: plain {errs[False]:.3e}, Hadamard {errs[True]:.3e} "
          f"({errs[False] / errs[True]:.2f}x lower)", end="")
    assert errs[True] < errs[False] / 1.2


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", FP8_RUNGS)
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_fp8_varlen_accuracy(kernel, d, causal):
    """A packed batch (lengths 0, 1, ragged, longer than a tile; GQA 6/2) quantized per sequence
    and KV head, against the float64 reference of each sequence alone; out= poisoned with NaN."""
    lengths_q, lengths_k = [1, 300, 0, 129, 777, 64], [70, 300, 5, 1, 1000, 64]
    heads_q, heads_kv = 6, 2
    gen = torch.Generator(device="cuda").manual_seed(d + causal)
    parts, scales, deq = {"q": [], "k": [], "v": []}, {"q": [], "k": [], "v": []}, []
    for n_q, n_k in zip(lengths_q, lengths_k):
        entry = {}
        for name, n, h in (("q", n_q, heads_q), ("k", n_k, heads_kv), ("v", n_k, heads_kv)):
            x = torch.randn(1, n, h, d, generator=gen, device="cuda")
            if n:
                x8, sx = fa3.quantize_fp8(x, "head", num_heads_kv=heads_kv if name == "q" else None)
            else:
                x8, sx = x.to(FP8), torch.ones(1, heads_kv, device="cuda")
            parts[name].append(x8[0])
            scales[name].append(sx)
            entry[name] = fa3.dequantize_fp8(x8, sx, dtype=torch.float64)
        deq.append(entry)
    q8, k8, v8 = (torch.cat(parts[n]) for n in "qkv")
    sq, sk, sv = (torch.cat(scales[n]) for n in "qkv")
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
                  for n in (lengths_q, lengths_k))
    out = torch.full(q8.shape, float("nan"), dtype=torch.bfloat16, device="cuda")
    got, lse = fa3.attention_varlen(q8, k8, v8, cu_q, cu_k, max(lengths_q), max(lengths_k), causal=causal,
                                    q_descale=sq, k_descale=sk, v_descale=sv, out=out, return_lse=True,
                                    kernel=kernel)
    assert got is out and lse.shape == (heads_q, q8.shape[0])
    ref_out = torch.zeros(q8.shape, dtype=torch.float64, device="cuda")
    ref_lse = torch.full((heads_q, q8.shape[0]), float("-inf"), dtype=torch.float64, device="cuda")
    for b, entry in enumerate(deq):
        rows = slice(int(cu_q[b]), int(cu_q[b + 1]))
        if lengths_q[b] == 0 or lengths_k[b] == 0:  # no rows, or O = 0 and LSE = -inf as set
            continue
        o, o_lse = attention_reference(entry["q"], entry["k"], entry["v"], causal=causal, dtype=torch.float64)
        ref_out[rows], ref_lse[:, rows] = o[0], o_lse[0]
    check(out, lse, ref_out, ref_lse, f"{kernel} varlen d{d} {'causal' if causal else 'full'}")
    if kernel == fa3.fp8.fp8_rung(None, d).name:  # flash-attn's name runs the default rung: the same bits
        again = fa3.flash_attn_varlen_func(q8, k8, v8, cu_q, cu_k, max(lengths_q), max(lengths_k),
                                           causal=causal, q_descale=sq, k_descale=sk, v_descale=sv)
        assert torch.equal(again, out)


@pytest.mark.gpu
def test_flash_attn_func_fp8_matches_attention():
    (q8, k8, v8), (sq, sk, sv), _ = quantized(2, 300, 500, 4, 2, 128, seed=11)
    want = fa3.attention(q8, k8, v8, q_descale=sq, k_descale=sk, v_descale=sv, causal=True)
    got = fa3.flash_attn_func(q8, k8, v8, causal=True, q_descale=sq, k_descale=sk, v_descale=sv)
    assert torch.equal(got, want)
