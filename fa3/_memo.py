"""A bounded memo: the one store behind the host path's remembered plans and launches.

Keys are what is static in a call (shapes, strides, dtypes, devices, flags); a workload whose
shapes change every call (a serving step's batch) must not grow a memo without bound, so a full
memo is emptied and refilled by the calls that follow.
"""

from __future__ import annotations


class BoundedMemo(dict):
    """A dict that forgets everything once it holds `limit` keys and another is stored."""

    def __init__(self, limit: int = 256):
        super().__init__()
        self.limit = limit

    def remember(self, key, value):
        """Store value under key (emptying a full memo first) and return it."""
        if len(self) >= self.limit and key not in self:
            self.clear()
        self[key] = value
        return value


def layout(t):
    """What a remembered call's key holds of a tensor argument: (shape, stride, dtype, device);
    None stays None."""
    return None if t is None else (t.shape, t.stride(), t.dtype, t.device)
