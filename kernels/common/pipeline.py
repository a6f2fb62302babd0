"""The staged SMEM ring between a TMA producer and its consumers (PipelineTmaAsync).

Each stage has a *full* barrier (the producer arms it with the stage's byte count; TMA completes
it as bytes land) and an *empty* barrier (each consumer warp arrives once it is done reading).

    producer: acquire(state)    wait until the stage is empty, arm full with tx_count bytes
              copy(s) into stage state.index from GMEM tile `tile`, all on that full barrier
              advance()         next stage; the phase flips each time the ring wraps
    consumer: wait(state)       until the stage's bytes have landed
              ...read it...
              release(state)    lane 0 of each warp arrives on the empty barrier
              advance()
    producer: tail(state)       before exit, wait for the consumers to free every stage

Bytes, not arrivals, complete a full barrier: the issuing thread cannot know when the copy engine
is done; it only announces how many bytes to expect. Producer states start at phase 1 so the
first `stages` acquires pass at once; consumer states start at phase 0.
Pitfall: the consumer count is in *warps* (one arrival per warp), never threads.
Helpers that advance a state return it: rebind it in the loop (`state = produce(...)`) so the DSL
carries the new count/phase across dynamic control flow.
"""

import cutlass.cute as cute
from cutlass import pipeline
from cutlass.pipeline import PipelineState, PipelineUserType, make_pipeline_state  # noqa: F401  (re-export)


def create(barrier_ptr, stages: int, consumer_warps: int, tx_bytes: int, cluster_m: int = 1):
    """A TMA ring of `stages` whose full barriers expect `tx_bytes` per stage (defer_sync: call
    `init_done()` once after creating every pipeline of the kernel). cluster_m > 1: the CTAs of a
    cluster along M multicast into each other's stages, so each consumer warp's release arrives on
    the empty barrier of every CTA in the cluster (the DSL picks one lane per peer)."""
    return pipeline.PipelineTmaAsync.create(
        barrier_storage=barrier_ptr,
        num_stages=stages,
        producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
        consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, consumer_warps * cluster_m),
        tx_count=tx_bytes,
        defer_sync=True,
        # the DSL's "mode n" peers: same n, other m (the CTAs that share B); its "mode m" would
        # signal only this CTA, and the peer's producer would wait forever
        **({"cta_layout_vmnk": cute.make_layout((1, cluster_m, 1, 1)), "mcast_mode_mn": (0, 1)}
           if cluster_m > 1 else {}),
    )


def create_gather(barrier_ptr, stages: int, threads: int, consumer_threads: int = 0):
    """A ring that `threads` threads fill with cp.async copies and then read (PipelineCpAsync): the
    full barrier expects one arrival per thread, made by the copy engine once that thread's copies
    have landed (`commit_copies`); the empty barrier one per thread after it read the stage. The
    same threads produce and consume (a producer acquire waits for all of them to release), or
    (consumer_threads > 0) those `threads` produce and `consumer_threads` read and release (M1:
    warpgroup 1 copies, both warpgroups read)."""
    return pipeline.PipelineCpAsync.create(
        barrier_storage=barrier_ptr,
        num_stages=stages,
        producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, threads),
        consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, consumer_threads or threads),
        defer_sync=True,
    )


HANDOFF_BARRIERS = 2  # Int64 mbarriers (full, empty) a one-stage hand-off (create_handoff) needs


def create_handoff(barrier_ptr, producer_threads: int, consumer_threads: int):
    """A one-stage hand-off of an SMEM buffer written by some threads and read by others
    (PipelineAsync, deferred like create): *full* expects one arrival per producer thread, each
    after its own writes (producer_commit); *empty* one per consumer thread, each after its own
    reads (consumer_release). The arrive/wait pairs order the buffer's accesses at CTA scope, which
    compute-sanitizer's racecheck follows (it does not follow named barriers' bar.arrive). With one
    stage a side's state after `count` hand-offs is state_at(1, count[, producer=True])."""
    return pipeline.PipelineAsync.create(
        barrier_storage=barrier_ptr,
        num_stages=1,
        producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, producer_threads),
        consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, consumer_threads),
        defer_sync=True,
    )


def init_done(cluster_m: int = 1):
    """Make barrier initialisation visible before anyone uses a barrier: to the CTA, or with
    cluster_m > 1 to the whole cluster (its peers' copies will complete on these barriers)."""
    cluster = cute.make_layout((cluster_m, 1)) if cluster_m > 1 else None
    pipeline.pipeline_init_arrive(cluster_shape_mn=cluster, is_relaxed=True)
    pipeline.pipeline_init_wait(cluster_shape_mn=cluster)


def producer_state(stages: int):
    return make_pipeline_state(PipelineUserType.Producer, stages)


def consumer_state(stages: int):
    return make_pipeline_state(PipelineUserType.Consumer, stages)


def state_at(stages: int, count, producer: bool = False):
    """The state of a ring of `stages` after `count` advances from its start (producer or
    consumer): for a ring driven in step with another whose state carries the count (B2's
    one-stage dO ring follows the Q ring), without a state of its own carried through the loop."""
    phase = (count // stages) % 2
    return PipelineState(stages, count, count % stages, 1 - phase if producer else phase)


def produce(pipe, state, tile, copies):
    """Fill stage `state.index` with GMEM tile `tile` of every (atom, tXgX, tXsX[, multicast mask])
    in `copies`, all completing on the stage's one full barrier, then advance. Call from one whole
    warp: the copy elects its own issuing lane (wrapping it in elect_one can deadlock). Returns the
    advanced state."""
    pipe.producer_acquire(state)
    for atom, tXgX, tXsX, *mask in copies:  # (atom, tXgX, tXsX[, multicast mask])
        multicast = {"mcast_mask": mask[0]} if mask else {}
        cute.copy(atom, tXgX[(None, tile)], tXsX[(None, state.index)],
                  tma_bar_ptr=pipe.producer_get_barrier(state), **multicast)
    pipe.producer_commit(state)  # a no-op for TMA: the bytes complete the barrier
    state.advance()
    return state


def produce_copies(pipe, state, load, *args):
    """Fill stage `state.index` of a gather ring (create_gather): wait until it is free, issue
    `load(state.index, *args)` (this thread's cp.async copies), arrive on the full barrier when
    they land, advance. Every producer thread calls it. Returns the advanced state."""
    pipe.producer_acquire(state)
    load(state.index, *args)
    pipe.producer_commit(state)  # cp.async.mbarrier.arrive.noinc: once this thread's copies land
    state.advance()
    return state


def consume_wait(pipe, state):
    pipe.consumer_wait(state, pipe.consumer_try_wait(state))


def release(pipe, state):
    pipe.consumer_release(state)
    state.advance()
    return state


def tail(pipe, state):
    """Producer epilogue: wait until consumers have released every stage before the CTA exits."""
    pipe.producer_tail(state)
