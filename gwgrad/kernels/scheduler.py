"""Units, and the one unit scheduler of every GEMM kernel: which unit a CTA works on next.

Work decomposition. The output is E stacked (hidden x intermediate) matrices; a *unit* is one
(expert, m-tile, n-tile) output tile, so there are E * tiles_m * tiles_n units, all static.
Units are numbered expert-rank-major: rank r holds the r-th longest expert (ties by index;
the prep work writes the order, kernels/prep.py), so handing units out in increasing order
runs the longest tiles first, and tiles of one expert run side by side and share its A/B
K-panels through L2. Inside an expert, units go in bands of a few m-tiles, m fastest inside a
band (unit_tile_coords). decode_unit turns a unit into (expert, unit_m, unit_n, first token,
K tiles).

The scheduler (UnitScheduler; one warp of a CTA runs it): a CTA, or a cluster (whose CTAs walk
the same units), starts with the unit of its own index, so no CTA waits for another to start,
and asks next_unit for each following one. Variants:

  DynamicUnits   (SM90) a workspace counter: next = atomic add + the grid's clusters. On a
                 cluster the leader CTA takes each unit and hands it to its peers through the
                 ClusterMailbox, so every CTA of the cluster walks the same units.
  BalancedUnits  (SM90) per launch: a static order (next = unit + grid) when the launch's
                 counts are balanced (counts_balanced), else DynamicUnits'.
  ClcUnits       (SM100) cluster launch control: the grid has one cluster per unit, and next
                 is the unit of the not-yet-launched cluster this one cancels; the cluster's
                 first CTA issues the queries, every CTA's scheduler warp reads the responses.

Hand-off inside a CTA: the scheduling warp publishes each unit's words (the kernel's meaning)
into a ring of shared-memory slots (publish_words) from which the other roles take them
(take_words); a last unit of expert -1 tells them there is no more work.

Verified on an H200 (SM90 variants): tests/test_sm90_kernel_gpu.py (TestSm90PairSharingA / B:
the mailbox; test_balanced_schedule: both halves of the balanced schedule), every GPU test
through the dynamic schedule. PTX (no GPU): tests/test_compile_sm90.py
(test_unit_schedule_compile, test_cluster_pairs_compile), tests/test_compile_sm100.py
(check_schedule_counts: only the scheduler warps read CLC responses). ClcUnits has not run on
an SM100 GPU (tests/test_sm100_kernel_gpu.py is written for it).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Int32, Int64
from cutlass._mlir.dialects import nvvm

from .config import LoopInvariant, Workspace
from .tiling import BALANCED_SPREAD


@cute.jit
def decode_unit(cfg: cutlass.Constexpr, unit: Int32, ws: Workspace):
    """unit -> (expert, unit_m, unit_n, begin, k_tiles): the expert, the unit's tile
    coordinates in the expert's output (in unit tiles: a cluster's), its first token and its
    K tiles (0 for an empty expert)."""
    rank = unit // cfg.tiles_per_expert
    local = unit - rank * cfg.tiles_per_expert
    expert = ws.order[rank]
    begin = ws.ranges[2 * expert]
    end = ws.ranges[2 * expert + 1]
    k_tiles = (end - begin + (cfg.tile_k - 1)) // cfg.tile_k
    unit_m, unit_n = unit_tile_coords(cfg, local)
    return expert, unit_m, unit_n, begin, k_tiles


@cute.jit
def unit_tile_coords(cfg: cutlass.Constexpr, local: Int32):
    """(unit_m, unit_n) of the local-th unit of an expert.

    Bands of `raster_group` m-tiles, m fastest inside a band: the ~one-per-SM units running at
    once then cover a few rows and columns of the expert's output and share their A and B
    K-panels through L2 (n fastest over a wide output, e.g. 112 n-tiles, would stream every B
    panel for each row of A)."""
    g = cfg.raster_group
    band_size = g * cfg.tiles_n
    band = local // band_size
    in_band = local - band * band_size
    if cutlass.const_expr(cfg.tiles_m % g == 0):
        unit_n = in_band // g
        unit_m = band * g + in_band - unit_n * g
    else:
        rows = Int32(g)
        if band >= cfg.tiles_m // g:
            rows = Int32(cfg.tiles_m % g)
        unit_n = in_band // rows
        unit_m = band * g + in_band - unit_n * rows
    return unit_m, unit_n


# ----------------------------------------------------------------------------------------
# The scheduler interface and its variants
# ----------------------------------------------------------------------------------------


class UnitScheduler(LoopInvariant):
    """The units one CTA (one cluster) works on, in order; run by one warp.

    first_unit() -> (unit, walk)   the unit the CTA starts with (its cluster's index) and the
                                   schedule's state
    next_unit(unit, walk, lane) -> (unit, valid, walk)
                                   the unit after `unit`, the same on every lane; `valid` is
                                   False once the schedule has none left (CLC), and the
                                   counter schedules never run dry (Python True): their
                                   caller stops at the bound of units with work
    finish(walk, lane)             after the last unit

    `walk` is what the schedule carries from unit to unit; it is returned, since the DSL
    threads through a dynamic loop only the values rebound in the loop's own body.
    """

    def first_unit(self):
        raise NotImplementedError

    def next_unit(self, unit, walk, lane):
        raise NotImplementedError

    def finish(self, walk, lane):
        pass


class DynamicUnits(UnitScheduler):
    """Units from the workspace counter (byte 0, zeroed by the prep work): each CTA (cluster)
    starts with its index `first` among the `grid` CTAs (clusters) and then takes the
    counter's next value + grid. With a ClusterMailbox the cluster's leader takes them and
    hands them to its peers. `walk`: the mailbox's sequence number (units taken from it)."""

    def __init__(self, ws: Workspace, first: Int32, grid: Int32, mailbox=None):
        self.ws, self.first, self.grid, self.mailbox = ws, first, grid, mailbox

    def first_unit(self):
        return self.first, Int32(0)

    @cute.jit
    def next_unit(self, unit, walk, lane):
        nxt, walk = self.counter_unit(walk, lane)
        return cute.arch.shuffle_sync(nxt, 0), True, walk

    @cute.jit
    def counter_unit(self, walk, lane):
        """(the counter's next unit on lane 0 (the other lanes: 0), walk after it)."""
        nxt = Int32(0)
        if cutlass.const_expr(self.mailbox is None):
            if lane == 0:
                nxt = cute.arch.atomic_add(self.ws.counter.iterator, Int32(1)) + self.grid
        else:
            nxt = self.mailbox.next_unit(self.ws, walk, self.grid, lane)
            walk += 1
        return nxt, walk

    @cute.jit
    def finish(self, walk, lane):
        if cutlass.const_expr(self.mailbox is not None):
            self.mailbox.drain(walk, lane)


class BalancedUnits(DynamicUnits):
    """The balanced schedule: decided once per launch (counts_balanced), a static order, each
    CTA (cluster) taking every grid-th unit from its index (the same sequence in every CTA of
    a cluster: nothing to hand off), or else DynamicUnits'."""

    def __init__(self, cfg, ws: Workspace, first: Int32, grid: Int32, mailbox=None):
        super().__init__(ws, first, grid, mailbox)
        self.static = counts_balanced(cfg, ws, grid)

    @cute.jit
    def next_unit(self, unit, walk, lane):
        nxt = Int32(0)
        if self.static != 0:
            nxt = unit + self.grid
        else:
            nxt, walk = self.counter_unit(walk, lane)
        return cute.arch.shuffle_sync(nxt, 0), True, walk


@cute.jit
def counts_balanced(cfg: cutlass.Constexpr, ws: Workspace, grid: Int32) -> Int32:
    """1 when this launch's counts let a static order run (the largest count minus the
    smallest nonzero one, the most two CTAs' static shares can differ by when units go longest
    expert first, is at most 1/BALANCED_SPREAD of one CTA's (cluster's) share of the work),
    else 0. The prep work wrote both words."""
    spread = Int64(ws.spread[0])
    share = Int64(ws.tokens[0]) * cfg.tiles_per_expert
    return Int32(spread * BALANCED_SPREAD * Int64(grid) <= share)


def is_cluster_leader():
    """Whether this CTA (rank 0 of its cluster) takes the cluster's units."""
    return cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster()) == 0


class ClusterMailbox(LoopInvariant):
    """How a cluster's leader CTA hands the units it takes to its peers: per stage, a 4-byte
    slot in each peer's shared memory, the peer's full barrier (one local arrive: its
    expect-tx, + the leader's st.async) and the leader's empty barrier (one arrive per peer).
    `full`, `empty`: the stages' barriers, `slots`: STAGES 16-byte slots."""

    STAGES = 4  # unit ids the leader hands its peers ahead of use

    def __init__(self, full, empty, slots, cluster_size: int):
        self.full, self.empty, self.slots = full, empty, slots
        self.cluster_size = cluster_size

    @cute.jit
    def init_barriers(self, thread0):
        """Thread 0 (`thread0`) initializes the barriers; every thread fences. Published to
        the cluster by the caller's cluster barrier."""
        if thread0:
            for i in cutlass.range_constexpr(self.STAGES):
                cute.arch.mbarrier_init(self.full + i, 1)
                cute.arch.mbarrier_init(self.empty + i, self.cluster_size - 1)
        cute.arch.mbarrier_init_fence()

    @cute.jit
    def next_unit(self, ws, seq, base, lane):
        """The cluster's next unit (lane 0; the other lanes get 0), its `seq`-th from the
        counter. The leader takes it (atomic add, + base: the clusters that started with their
        index) and stores it into each peer's mailbox slot with st.async, which completes the
        peer's full barrier; a peer waits for it and acknowledges on the leader's empty
        barrier, which the leader waits on before reusing the slot."""
        slot = seq % self.STAGES
        phase = (seq // self.STAGES) % 2
        nxt = Int32(0)
        if lane == 0:
            if is_cluster_leader():
                cute.arch.mbarrier_wait(self.empty + slot, phase ^ 1)
                nxt = cute.arch.atomic_add(ws.counter.iterator, Int32(1)) + base
                for peer in cutlass.range_constexpr(1, self.cluster_size):
                    cute.arch.store_async_dsmem(self.slots + 4 * slot, nxt, self.full + slot, peer)
            else:
                cute.arch.mbarrier_arrive_and_expect_tx(self.full + slot, 4)
                cute.arch.mbarrier_wait(self.full + slot, phase)
                nxt = (self.slots + 4 * slot).load()
                # Cluster scope: the slot's read is ordered before the leader reuses it.
                cute.arch.mbarrier_arrive(self.empty + slot, peer_cta_rank_in_cluster=0,
                                          scope=nvvm.MemScopeKind.CLUSTER)
        return nxt

    @cute.jit
    def drain(self, seq, lane):
        """The leader stays until every peer has taken every unit id it sent (their arrives
        land in its shared memory); after `seq` = 0 ids (a static launch) the waits pass."""
        if is_cluster_leader() and lane == 0:
            for i in cutlass.range_constexpr(self.STAGES):
                cute.arch.mbarrier_wait(self.empty + (seq + i) % self.STAGES,
                                        ((seq + i) // self.STAGES + 1) % 2)


class ClcUnits(UnitScheduler):
    """SM100 cluster launch control: the grid has one cluster per unit (grid x = unit *
    cluster_size), and a running cluster's next unit is that of the not-yet-launched cluster
    it cancels. The cluster's first CTA issues the queries (first_query / query /
    finish_queries); every CTA's scheduling warp reads each response (next_unit) and hands its
    slot back. `walk`: the response pipeline's consumer state."""

    def __init__(self, clc_pipeline, response_ptr, cluster_size: int, first: Int32):
        self.clc_pipeline, self.response_ptr = clc_pipeline, response_ptr
        self.cluster_size, self.first = cluster_size, first

    def first_unit(self):
        return self.first, pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)

    def first_query(self):
        """The query side's state (the cluster's first CTA)."""
        return pipeline.make_pipeline_state(pipeline.PipelineUserType.ProducerConsumer, 1)

    @cute.jit
    def query(self, query):
        """Ask for the next cluster to cancel (one elected thread); the caller advances
        `query`."""
        self.clc_pipeline.producer_acquire(query)
        with cute.arch.elect_one():
            cute.arch.issue_clc_query(self.clc_pipeline.producer_get_barrier(query),
                                      self.response_ptr)

    def finish_queries(self, query):
        self.clc_pipeline.producer_tail(query)

    @cute.jit
    def next_unit(self, unit, walk, lane):
        """Wait for the response, read it, hand the slot back."""
        self.clc_pipeline.consumer_wait(walk)
        m_idx, _, _, vld = cute.arch.clc_response(self.response_ptr)
        # The response is read through the generic proxy; the next query writes it through
        # the async proxy.
        cute.arch.fence_proxy("async.shared", space="cta")
        unit, valid = m_idx // self.cluster_size, vld != 0
        self.clc_pipeline.consumer_release(walk)
        walk.advance()
        return unit, valid, walk


# ----------------------------------------------------------------------------------------
# Hand-off inside a CTA: the scheduling warp publishes each unit's words to the other roles
# ----------------------------------------------------------------------------------------


@cute.jit
def publish_words(unit_pipeline, unit_state, unit_slots, words, lane):
    """Write ``words`` (a unit's description; its meaning is the kernel's) into the next slot
    of the unit ring (a PipelineAsync of 32 producer threads; slots a (words, stages) Int32
    tensor in shared memory) and commit it."""
    unit_pipeline.producer_acquire(unit_state)
    if lane == 0:
        for i in cutlass.range_constexpr(len(words)):
            unit_slots[(i, unit_state.index)] = words[i]
    unit_pipeline.producer_commit(unit_state)


@cute.jit
def take_words(unit_pipeline, unit_state, unit_slots, count: cutlass.Constexpr):
    """The next published unit's ``count`` words, and the advanced state (returned so that
    callers inside a dynamic ``if`` rebind it there)."""
    unit_pipeline.consumer_wait(unit_state)
    words = [unit_slots[(i, unit_state.index)] for i in range(count)]
    unit_pipeline.consumer_release(unit_state)
    unit_state.advance()
    return words, unit_state
