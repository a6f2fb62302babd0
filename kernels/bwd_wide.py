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

Measured (H200, d64, TFLOP/s; worklog/backward.md has the runs): non-causal 2k / 8k / 16k, b2 /
b8 / cuDNN / flash-attn-4: 446.6 / 472.0 / 414.1 / 495.3, 470.5 / 477.5 / 439.6 / 513.1, 476.8 /
496.2 / 443.3 / 523.0 (1.02-1.06x b2, 0.93-0.95x flash-attn-4); GQA 4: 1.00-1.04x b2. Causal, in
another run: 0.94-0.99x b2, so B2 keeps masked calls (registry `masked_head_dims`). Per Q tile B8
issues more instructions than B2 (ncu, causal 8k: 6.6x the IMADs, 131x the SMEM loads):
each column's LSE and D read from SMEM (32 `LDS.64` a thread) and the widening of the rounded P^T
(64 `IMAD.U32 ..., 0x10000` a thread).

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
