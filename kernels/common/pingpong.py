"""Ping-pong: consumer warpgroups taking turns to issue their GEMMs (FlashAttention-3's inter-
warpgroup overlap), so that one warpgroup's softmax runs under another's GEMMs.

The turn goes round the consumer warpgroups 1 -> 2 (-> 3) -> 1 on named barriers: warpgroup w
waits on barrier `turn_barrier - 1 + w`, which its predecessor arrives on (128 waiting + 128
arriving threads). Warpgroup 1 starts with a credit on its own barrier. A kernel uses
`consumer_wgs` named barriers from `turn_barrier` on; every pass_turn must follow the same
warpgroup's wait_turn, so that each barrier's waits and arrivals strictly alternate.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Int32


class PingPong:
    """Mixin for a warp-specialized kernel. The kernel sets `turn_barrier` (the first of its turn
    barriers), `pingpong` (static: off, every call compiles to nothing) and `consumer_wgs`;
    `wg` is the calling consumer warpgroup, 1..consumer_wgs."""

    turn_barrier: int

    @cute.jit
    def mma_init(self, wg: Int32):
        """Warpgroup 1 starts with the turn: a credit on its own barrier."""
        if cutlass.const_expr(self.pingpong):
            if wg == 1:
                cute.arch.barrier_arrive(barrier_id=self.turn_barrier, number_of_threads=256)

    @cute.jit
    def wait_turn(self, wg: Int32):
        if cutlass.const_expr(self.pingpong):
            cute.arch.barrier(barrier_id=self.turn_barrier - 1 + wg, number_of_threads=256)

    @cute.jit
    def pass_turn(self, wg: Int32):
        if cutlass.const_expr(self.pingpong):
            cute.arch.barrier_arrive(barrier_id=self.turn_barrier + wg % self.consumer_wgs,
                                     number_of_threads=256)
