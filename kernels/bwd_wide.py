"""B8: B4 on 128 x 128 S^T tiles at head_dim 64, made to fit by rounding P^T before dS^T.

At d64 B2 runs 128-row Q tiles (its S and dP live in two warpgroups' 64-row halves) and B3/B4's
64-row Q tiles lose to it: each Q tile's loads, barriers and hand-offs are amortized over half the
work. B4 with 128-row Q tiles held five 64 x 128 FP32 accumulators a thread at the worst point
(S^T, dP^T, plus P^T rounded for dV, dV and dK): ptxas spilled 88 B and serialized the WGMMAs.
One idea makes it fit:

    P^T_bf16 = round(exp2(S^T * scale_log2 - LSE * log2 e))   into the A operand's 32-bit pairs
    dS^T     = P^T_bf16 (dP^T - D)                            (one widening shift an element)

S^T's FP32 registers die at the rounding, before dP^T lands, so S^T and dP^T never live together
with the P^T fragment. dS^T then sees P rounded to bf16 (relative 2^-8, the size of dS^T's own
rounding); the gradient tests hold at B4's tolerances. dV = P^T dO is issued from the rounded
fragment while dP^T is still in flight (`dv_under_dp`, measured ahead of issuing it after dS^T).

The dQ hand-off keeps B4's per-warpgroup halves but with one buffer a warpgroup (two do not fit
beside 128-row Q/dO stages): the writer returns it as soon as its bulk reduce-add has read it.

Each column's LSE is read where it is used, not ahead (B4's `prefetch_stats`): 32 columns a thread
held across the wait for S^T cost more at 128 rows than the wait they hide (H200, one run,
2k / 8k / 16k: with the prefetch 0.97-0.98x B2 causal, without it 1.01-1.04x).

Measured (H200, d64, TFLOP/s, one run; worklog/backward.md), b2 / b8 / cuDNN / flash-attn-4, 2k /
8k / 16k: non-causal 442.4 / 455.6 / 416.7 / 488.1, 467.5 / 474.5 / 436.2 / 516.2, 478.2 / 500.2 /
443.8 / 520.8; causal 372.1 / 380.6 / 327.7 / 421.1, 456.4 / 458.4 / 402.2 / 490.8, 467.3 / 472.1 /
427.1 / 516.8; GQA 4 (2k / 8k): 1.02-1.05x b2. So 1.00-1.05x b2 and 0.90-0.96x flash-attn-4. Per Q
tile B8 issues more instructions than B2 (ncu, causal 8k, with the prefetch: 6.6x the IMADs, 131x
the SMEM loads): each column's LSE and D from SMEM (32 `LDS.64` a thread) and the widening of the
rounded P^T (64 `IMAD.U32 ..., 0x10000` a thread).

SMEM (bf16, d = 64): Q/dO 2 x 2 x 16 KB, K/V 32 KB, dS^T 2 x 32 KB, dQ 2 x 16 KB, the statistics
and barriers: 200.7 KB (ncu). Constraints: head_dim 64 (128-row tiles), two Q stages. kernel=None
sends deterministic calls to B2, as for every S^T rung; named, B8 runs them (124 B of spills with
GQA and a causal mask).
"""

from .bwd_split_dq import SplitDqBackward


class WideSplitDqBackward(SplitDqBackward):
    ds_from_rounded_p = True  # S^T's FP32 registers die at P^T's rounding
    dv_under_dp = True
    dq_buffers = 1  # one half-buffer a warpgroup: two do not fit beside 128-row stages
    # each column's LSE read where used: 32 columns a thread held ahead cost more than the wait
    prefetch_stats = False
