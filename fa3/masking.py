"""Host side of masking and score modifiers: what `causal`, `window_size` and `softcap` mean to
the kernels, decided once for every attention entry point (fa3.attention, attention_varlen,
attention_with_kvcache).

flash-attn's conventions: window_size=(left, right) lets query i see keys j with
i + shift - left <= j <= i + shift + right (shift = seqlen_k - seqlen_q, bottom-right aligned), -1
meaning unbounded; causal=True with a window keeps the left edge and sets right = 0. softcap > 0
replaces each score s (already times softmax_scale) by softcap * tanh(s / softcap).

The kernels get static flags (causal; local = a window edge is bounded; softcap on or off: each
compiles once) and runtime values (the window edges, the scales): new window sizes or caps never
recompile.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from ._memo import BoundedMemo

LOG2E = math.log2(math.e)
UNBOUNDED = 1 << 30  # a window side of -1, as the kernels take it (kernels/common/mask.py)


class Masking(NamedTuple):
    causal: bool  # compiled in: the plain causal mask (a window with left unbounded, right 0)
    local: bool  # compiled in: the window predicates, with the edges below
    left: int
    right: int
    softcap: bool  # compiled in
    scale_log2: float  # exp2-domain scale of the (capped) scores
    softcap_scale: float  # softmax_scale / softcap (1.0 when unused)

    @property
    def plain(self) -> bool:
        """Neither a window nor a softcap: what every rung supports."""
        return not (self.local or self.softcap)


def masked(causal, window_size) -> bool:
    """Whether a call masks keys by position (causal, or a window): the backward's ordered dQ walk
    then runs K/V tiles in descending order, where other rungs are fastest (registry
    `deterministic_masked_only`)."""
    return bool(causal) or tuple(window_size) != (-1, -1)


_PLAIN = BoundedMemo(64)  # (causal, softmax_scale) -> the Masking of a call with neither window nor softcap


def check_window(window_size, softcap) -> tuple[int, int]:
    """Validated (left, right) and softcap, with messages that name the argument."""
    try:
        left, right = (int(x) for x in window_size)
    except (TypeError, ValueError):
        raise ValueError(f"window_size must be a pair of ints (left, right), -1 for unbounded; got "
                         f"{window_size!r}") from None
    if left < -1 or right < -1:
        raise ValueError(f"window_size={tuple(window_size)}: each side must be >= 0, or -1 for unbounded")
    if not isinstance(softcap, (int, float)) or not math.isfinite(softcap) or softcap < 0:
        raise ValueError(f"softcap={softcap!r} must be a finite float >= 0 (0 disables it)")
    return left, right


def check_scale(scale: float) -> None:
    """softmax_scale must be finite and positive: the online softmax subtracts each row's largest
    raw score (kernels/common/softmax.py), the row's maximum after scaling only for a scale > 0 (a
    negative one overflows the exp2, NaN or 0 turns masked scores' -inf into NaN)."""
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"softmax_scale={scale!r} must be a finite float > 0 (the default is "
                         f"1 / sqrt(head_dim)); to flip the scores' sign, negate q")


def masking(causal: bool, window_size, softcap: float, scale: float) -> Masking:
    """The kernels' view of (causal, window_size, softcap, softmax_scale); arguments checked."""
    if window_size == (-1, -1) and not softcap:  # most calls: no checks, one dict lookup
        mask = _PLAIN.get((causal, scale))
        if mask is None:
            check_scale(scale)  # once per scale: a NaN key is never found again, and checked each call
            mask = _PLAIN.remember((causal, scale), Masking(
                causal=bool(causal), local=False, left=UNBOUNDED, right=UNBOUNDED, softcap=False,
                scale_log2=scale * LOG2E, softcap_scale=1.0))
        return mask
    left, right = check_window(window_size, softcap)
    check_scale(scale)
    if causal:
        right = 0
    causal = right == 0 and left == -1  # a window that is the causal mask compiles as one
    local = not causal and (left, right) != (-1, -1)
    capped = softcap > 0
    return Masking(
        causal=causal, local=local,
        left=UNBOUNDED if left < 0 else left, right=UNBOUNDED if right < 0 else right,
        softcap=capped, scale_log2=(softcap if capped else scale) * LOG2E,
        softcap_scale=scale / softcap if capped else 1.0)


def for_score_mod(mask: Masking) -> Masking:
    """The scales of a kernel with a score mod (forward and backward): the mod sees softmax_scale *
    q k^T, so softmax_scale rides in softcap_scale's slot and scale_log2 is log2 e (a score mod
    excludes softcap)."""
    return mask._replace(scale_log2=LOG2E, softcap_scale=mask.scale_log2 / LOG2E)

