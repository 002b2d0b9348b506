"""The prep work: each expert's token range, rank and TMA descriptors in the workspace, and the
offsets check, before any unit of the GEMM starts.

Per-expert K ranges. The *prep work* (one warp per expert) writes the workspace (layout:
kernels/config.py) before any unit starts. Either a small prep kernel (grid = E) runs before
the GEMM on the same stream (``cfg.launches == 2``: PrepWork.prep_kernel), or the GEMM's own
warps do it (``cfg.launches == 1``: the first warps of each CTA take experts from a counter;
PrepWork.prep_in_kernel) and each CTA goes on once every expert is prepared (prep_handoff).
No CTA waits for another to start: the launch is an ordinary one, correct for any grid (one
CTA resident at a time included), and a CTA that starts late (its SMs held by another
stream's kernel) holds nobody up. One launch saves the host one cudaLaunchKernelEx per call
(docs/PERFORMANCE.md, host overhead).

Ranges and order (write_ranges_and_order). The rank of expert e is the number of experts with
more tokens, or as many and a lower index: a stable longest-first sort without any
inter-block communication; ``order[rank]`` is the unit order of kernels/scheduler.py.

Offsets check (expert 0's warp of the prep work, check_offsets). With prev(e) = offsets[e-1]
(0 for e = 0) and count(e) = offsets[e] - prev(e), the offsets are valid iff every
count(e) >= 0, offsets[E-1] == tokens_sum and every count(e) is a multiple of
cfg.count_multiple (so every offset lies in [0, tokens_sum]). The warp reads the offsets
lane-strided and combines with warp reductions. Invalid offsets: the verdict is 0, so the GEMM
kernel of the same launch does no work and writes no output byte (dense or discrete,
accumulating or not), and the first problem is recorded in the caller's *status record*
(kernels/config.py, gwgrad/status.py), the same problem a host check reports
(gwgrad/offsets.find_problem: the first negative count, else the last offset, else the first
count that is not a multiple). The record is sticky: a GPU-scope compare-and-swap of [0] from
0 to the code elects one writer across a device's launches (system-scope atomics on mapped
host memory need host-native atomics, which PCIe hosts lack: compute-sanitizer rejects them);
only it writes [1..4], [6..7], then, after a system-scope fence, [5] (>= 1, so a non-zero [5]
tells the host the fields are complete), and fences again. The host clears [0] after
reporting.

Sanitizing (defense in depth, whatever the verdict): begin/end are clamped to [0, tokens_sum]
and end >= begin, so no descriptor ever reaches outside A or B whatever `offsets` holds. For
``tensor2d`` the A/B descriptors keep the global base and strides but end the token axis at
``end``; loads start at token ``begin`` (token_origin), so the TMA unit zero-fills the last K
tile past the expert's end: any token count works, no masking in the mainloop. For
``tensor_ragged`` an operand whose unit stride is along K gets its expert's own block (base +
begin * rows, rows x count with row stride count). Whenever an operand's unit stride is along
K, TMA needs 16-byte aligned rows, so an expert whose count is not a multiple of 8 is treated
as empty (such offsets also fail the check above). Discrete outputs get one descriptor per
expert from ``wgrad_ptrs``; a null or unaligned address skips that expert's store instead of
faulting (output_ptr_ok).

Descriptors. Every 128-byte slot is written in full, the fields then zeros (write_descriptor);
a reader acquires each before its first use (acquire_descriptor) and hands it to a copy as
tma_desc_ptr_for_copy(slot).

Verified on an H200: tests/test_status_gpu.py (invalid offsets write nothing, the status
record), tests/test_sm90_kernel_gpu.py (test_single_launch_*: the hand-off on any grid and
the workspace left ready), tests/test_cudnn_api_gpu.py (test_workspace_garbage_gives_the_same_bits,
test_descriptor_workspace_is_used_and_left_zero), tests/test_fp8_sm90_gpu.py (scale-column
prefix sums, too-small scales). PTX (no GPU): tests/test_compile_smoke.py
(test_descriptor_slots_written_in_full), kernel_compile.check_prep_handoff_ptx and
check_offsets_check_ptx, run by the compile tests of every kernel.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64
from cutlass.cute.nvgpu import cpasync
from cutlass._mlir.dialects import cute as _cute_ir
from cutlass._mlir.dialects import cute_nvgpu as _cute_nvgpu_ir
from cutlass._mlir.dialects import llvm
from cutlass.cute.typing import AddressSpace
from cutlass.cutlass_dsl import dsl_user_op

from ..offsets import (COUNT_NOT_MULTIPLE, LAST_NOT_TOKENS_SUM, NEGATIVE_COUNT,
                       OUTPUT_PTR_INVALID, SCALES_TOO_SMALL)
from .config import (DESC_A, DESC_B, DESC_BYTES, DESC_C, STATUS_CODE, STATUS_EXPERT,
                     STATUS_INT32, STATUS_MULTIPLE, STATUS_PREV, STATUS_TOKENS_SUM,
                     STATUS_VALUE, Workspace, expert_output_view)


# ----------------------------------------------------------------------------------------
# The prep work of a GEMM kernel
# ----------------------------------------------------------------------------------------


class PrepWork:
    """The prep kernel and the single-launch prep work, as methods of the GEMM kernel whose
    hooks they call (a base of kernels/entry.GroupedWgradKernel).

    The kernel sets `cfg`, `c_dtype` and `epi_tile` and implements `c_store_op()`,
    `expert_output_tensor(c_e)` and `expert_load_atoms(a_e, b_e, tiled_mma, a_smem_layout,
    b_smem_layout) -> (atom_a, atom_b)`: the TMA load atoms of one expert's operand views
    (their descriptors are what the prep work stores).
    """

    def launch_prep(self, mA, mB, offsets, tokens_sum, wgrad_ptrs, workspace_ptr, status_ptr,
                    tiled_mma, a_smem_layout, b_smem_layout, epi_smem_layout, stream,
                    sf_capacity=None, scale_views=None):
        """`sf_capacity`: the scale tensors' columns (blocked) or rows (block_1x128), which the
        offsets check compares with what the offsets need (None: no such scales).
        `scale_views`: what a kernel with per-expert scale descriptors needs to build them
        (its `prep_kernel_scaled` arguments after the common ones; None: no such
        descriptors)."""
        status = cute.make_tensor(
            cute.recast_ptr(status_ptr, dtype=Int32), cute.make_layout(STATUS_INT32)
        )
        args = (
            mA, mB, offsets, tokens_sum, wgrad_ptrs, workspace_ptr, status, tiled_mma,
            a_smem_layout, b_smem_layout, epi_smem_layout, self.epi_tile,
            Int32(0) if sf_capacity is None else sf_capacity,
        )
        if cutlass.const_expr(scale_views is None):
            prep = self.prep_kernel(*args)
        else:
            prep = self.prep_kernel_scaled(*args, *scale_views)
        prep.launch(grid=(self.cfg.num_experts, 1, 1), block=(32, 1, 1), stream=stream)

    @cute.kernel
    def prep_kernel(
        self,
        mA: cute.Tensor,
        mB: cute.Tensor,
        offsets: cute.Tensor,
        tokens_sum: Int32,
        wgrad_ptrs: cute.Tensor,
        workspace_ptr: cute.Pointer,
        status: cute.Tensor,
        tiled_mma: cute.TiledMma,
        a_smem_layout: cute.ComposedLayout,
        b_smem_layout: cute.ComposedLayout,
        epi_smem_layout: cute.ComposedLayout,
        epi_tile: cute.Tile,
        sf_capacity: Int32,
    ):
        """One warp per expert: range, rank, scale base and the expert's TMA descriptors;
        block 0 also checks the offsets (verdict and status record)."""
        self.prep_body(
            mA, mB, offsets, tokens_sum, wgrad_ptrs, workspace_ptr, status, tiled_mma,
            a_smem_layout, b_smem_layout, epi_smem_layout, epi_tile, sf_capacity,
            cute.arch.block_idx()[0],
        )
        # Order the descriptor writes before the GEMM kernel's tensormap-proxy reads.
        cpasync.fence_tma_desc_release()

    @cute.jit
    def prep_body(
        self, mA, mB, offsets, tokens_sum, wgrad_ptrs, workspace_ptr, status, tiled_mma,
        a_smem_layout, b_smem_layout, epi_smem_layout, epi_tile, sf_capacity, expert,
    ):
        """The prep work for one expert, by one warp (the prep kernel's block, or a warp of a
        single-launch GEMM: prep_in_kernel); returns (workspace, expert, begin, end, scale
        columns before the expert) for kernels that add descriptors of their own."""
        cfg = self.cfg
        ws = Workspace(cfg, workspace_ptr)
        if expert == 0:
            check_offsets(cfg, offsets, tokens_sum, ws, status, sf_capacity, wgrad_ptrs)
        begin, end, columns_before = write_ranges_and_order(cfg, offsets, tokens_sum, ws, expert)
        a_e = expert_operand_view(mA, cfg.hidden, cfg.a_ragged_block, begin, end)
        b_e = expert_operand_view(mB, cfg.intermediate, cfg.b_ragged_block, begin, end)
        atom_a, atom_b = self.expert_load_atoms(a_e, b_e, tiled_mma, a_smem_layout, b_smem_layout)
        write_descriptor(atom_a, ws.desc_ptr(expert, DESC_A))
        write_descriptor(atom_b, ws.desc_ptr(expert, DESC_B))
        if cutlass.const_expr(cfg.output_mode == "discrete"):
            if output_ptr_ok(wgrad_ptrs, expert):
                c_e = expert_output_view(
                    cfg,
                    cute.make_ptr(
                        self.c_dtype, wgrad_ptrs[expert], cute.AddressSpace.gmem, assumed_align=16
                    ),
                )
                atom_c, _ = cpasync.make_tiled_tma_atom(
                    self.c_store_op(), self.expert_output_tensor(c_e), epi_smem_layout, epi_tile
                )
                write_descriptor(atom_c, ws.desc_ptr(expert, DESC_C))
        return ws, expert, begin, end, columns_before

    # -- single launch: the prep work inside the GEMM kernel ---------------------------------
    @cute.jit
    def prep_in_kernel(
        self, mA, mB, offsets, tokens_sum, wgrad_ptrs, workspace_ptr, status, tiled_mma,
        a_smem_layout, b_smem_layout, epi_smem_layout, epi_tile, sf_capacity,
        num_warps: cutlass.Constexpr,
    ):
        """The prep kernel's work done by the GEMM's own CTAs (``cfg.launches == 1``). The
        first ceil(E / grid) warps of each CTA (at most ``num_warps``) take experts from the
        workspace's counter (byte 8) until it passes E; each prepared expert is counted (byte
        12, a release after the expert's descriptors are released to the tensormap proxy).
        Work-conserving: whichever CTAs run first prepare every expert, so none waits for
        another to start. Then prep_handoff: the workspace is complete, as the prep kernel
        leaves it, for every thread after it."""
        cfg = self.cfg
        ws = Workspace(cfg, workspace_ptr)
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()
        grid = cute.arch.grid_dim()[0]
        takers = (cfg.num_experts + grid - 1) // grid  # one round when the whole grid runs
        if warp < takers and warp < num_warps:
            expert = take_expert(ws, lane)
            while expert < cfg.num_experts:
                self.prep_body(
                    mA, mB, offsets, tokens_sum, wgrad_ptrs, workspace_ptr, status, tiled_mma,
                    a_smem_layout, b_smem_layout, epi_smem_layout, epi_tile, sf_capacity,
                    expert,
                )
                # This thread's descriptor writes, released to the tensormap proxy (readers
                # acquire each descriptor before its first use: acquire_descriptor), then
                # the whole warp's, before lane 0 counts the expert as prepared.
                cpasync.fence_tma_desc_release()
                cute.arch.sync_warp()
                if lane == 0:
                    cute.arch.atomic_add(ws.prep_done, Int32(1), sem="release", scope="gpu")
                expert = take_expert(ws, lane)
        prep_handoff(ws, cfg.num_experts)


@cute.jit
def take_expert(ws: Workspace, lane: Int32) -> Int32:
    """The next expert for a prep warp: lane 0 takes it from the counter (a relaxed atomic:
    what the expert needs comes from the offsets, not from other warps) and the warp shares it."""
    taken = Int32(0)
    if lane == 0:
        taken = cute.arch.atomic_add(ws.prep_next, Int32(1), sem="relaxed", scope="gpu")
    return cute.arch.shuffle_sync(taken, 0)


@cute.jit
def prep_handoff(ws: Workspace, num_experts: cutlass.Constexpr):
    """Each CTA goes on once all ``num_experts`` are prepared; what their warps wrote is then
    visible to every thread after this.

    Between two CTA barriers (the first: this CTA's prep warps are done), thread 0 spins with
    acquire loads until the prepared count (workspace byte 12) reaches E, then passes: an
    acq_rel add on the same word. The last CTA to pass (it reads E + grid - 1) sets both the
    expert counter and that word back to 0, so they are 0 whenever no launch runs: a workspace
    must start with bytes 8..15 zero (gwgrad's workspaces are zero-filled when allocated) and
    then serves any grid size. Every CTA takes part, so no word is reset while another CTA
    can still read it."""
    cute.arch.barrier()
    if cute.arch.thread_idx()[0] == 0:
        grid = cute.arch.grid_dim()[0]
        done = cute.arch.load(ws.prep_done, Int32, sem="acquire", scope="gpu")
        while done < num_experts:
            done = cute.arch.load(ws.prep_done, Int32, sem="acquire", scope="gpu")
        passed = cute.arch.atomic_add(ws.prep_done, Int32(1), sem="acq_rel", scope="gpu")
        if passed == num_experts + grid - 1:
            cute.arch.atomic_exch(ws.prep_next, Int32(0), sem="relaxed", scope="gpu")
            cute.arch.atomic_exch(ws.prep_done, Int32(0), sem="relaxed", scope="gpu")
        cute.arch.fence_acq_rel_gpu()
    cute.arch.barrier()


# ----------------------------------------------------------------------------------------
# Ranges, order and the offsets check
# ----------------------------------------------------------------------------------------


@cute.jit
def sanitized_range(
    offsets: cute.Tensor, expert: Int32, tokens_sum: Int32, count_multiple: cutlass.Constexpr
):
    """(begin, end) of one expert, clamped so that 0 <= begin <= end <= tokens_sum."""
    end = cutlass.min(cutlass.max(offsets[expert], 0), tokens_sum)
    begin = Int32(0)
    if expert > 0:
        begin = cutlass.min(cutlass.max(offsets[expert - 1], 0), tokens_sum)
    end = cutlass.max(end, begin)
    if cutlass.const_expr(count_multiple > 1):
        if (end - begin) % count_multiple != 0:
            end = begin
    return begin, end


@cute.jit
def write_ranges_and_order(
    cfg: cutlass.Constexpr, offsets: cute.Tensor, tokens_sum: Int32, ws: Workspace,
    expert: Int32,
):
    """Body of the prep work's bookkeeping for one expert, by one warp.

    The rank of expert e is the number of experts with more tokens, or as many and a lower
    index: a stable longest-first sort without any inter-block communication.
    """
    lane = cute.arch.lane_idx()
    begin, end = sanitized_range(offsets, expert, tokens_sum, cfg.count_multiple)
    count = end - begin
    ahead = Int32(0)
    nonempty = Int32(0)
    columns_before = Int32(0)
    most, least, total = Int32(0), Int32(0x7FFFFFFF), Int32(0)  # balanced only
    for j in range(lane, cfg.num_experts, 32):
        bj, ej = sanitized_range(offsets, j, tokens_sum, cfg.count_multiple)
        cj = ej - bj
        nonempty += Int32(cj > 0)
        if cutlass.const_expr(cfg.counts_words):
            most = cutlass.max(most, cj)
            if cj > 0:
                least = cutlass.min(least, cj)
            total += cj
        is_ahead = Int32(cj > count) | (Int32(cj == count) & Int32(j < expert))
        ahead += is_ahead
        if cutlass.const_expr(cfg.sf_rule is not None):
            columns_before += Int32(j < expert) * scale_columns(cfg, cj)
    rank = cute.arch.warp_redux_sync(ahead, "add")
    live = cute.arch.warp_redux_sync(nonempty, "add")
    ranges, order, counter = ws.ranges, ws.order, ws.counter
    if cutlass.const_expr(cfg.sf_rule is not None):
        columns_before = cute.arch.warp_redux_sync(columns_before, "add")
        if lane == 0:
            ws.sf_base[expert] = columns_before
    if lane == 0:
        ranges[2 * expert] = begin
        ranges[2 * expert + 1] = end
        order[rank] = expert
        if expert == 0:
            counter[0] = Int32(0)
            ws.live[0] = live
    if cutlass.const_expr(cfg.counts_words):
        # The balanced schedule's inputs (scheduler.counts_balanced); no live expert:
        # spread 0 (there are no units).
        most = cute.arch.warp_redux_sync(most, "max")
        least = cute.arch.warp_redux_sync(least, "min")
        total = cute.arch.warp_redux_sync(total, "add")
        if lane == 0 and expert == 0:
            ws.spread[0] = cutlass.max(most - least, Int32(0))
            ws.tokens[0] = total
    return begin, end, columns_before


@cute.jit
def scale_columns(cfg: cutlass.Constexpr, count: Int32) -> Int32:
    """C_e of an expert with `count` (>= 0) tokens: its scale columns (gwgrad/scales.py)."""
    tokens, pad = cfg.sf_rule
    columns = (count + (tokens - 1)) // tokens
    if cutlass.const_expr(pad > 1):
        columns = (columns + (pad - 1)) // pad * pad
    return columns


@cute.jit
def check_offsets(
    cfg: cutlass.Constexpr, offsets: cute.Tensor, tokens_sum: Int32, ws: Workspace,
    status: cute.Tensor, sf_capacity: Int32, wgrad_ptrs: cute.Tensor,
):
    """The offsets check of block 0 of the prep kernel (one warp): writes the verdict and, when
    the offsets (or, in discrete mode, the per-expert output addresses) are invalid, claims
    and fills the status record (see module doc)."""
    lane = cute.arch.lane_idx()
    e = cfg.num_experts
    # First expert (E: none) with a negative count, and with a count not a multiple.
    first_negative = Int32(e)
    first_not_multiple = Int32(e)
    for j in range(lane, e, 32):
        value = offsets[j]
        prev = Int32(0)
        if j > 0:
            prev = offsets[j - 1]
        # Compared, not subtracted: the difference of two int32 offsets can overflow.
        if value < prev:
            first_negative = cutlass.min(first_negative, j)
        if cutlass.const_expr(cfg.count_multiple > 1):
            # Only consulted when every count is >= 0 and the last offset is tokens_sum, so
            # the difference is then exact.
            if (value - prev) % cfg.count_multiple != 0:
                first_not_multiple = cutlass.min(first_not_multiple, j)
    first_negative = cute.arch.warp_redux_sync(first_negative, "min")
    first_not_multiple = cute.arch.warp_redux_sync(first_not_multiple, "min")
    # The host check's order (gwgrad/offsets.find_problem), so both report the same problem.
    # Branch-free (0/1 flags): an scf.if that yields constants fails the DSL's pass pipeline
    # for the SM100 prep kernel traced through a tensor entry (nvidia-cutlass-dsl 4.8.1).
    negative = Int32(first_negative < e)
    last_wrong = Int32(offsets[e - 1] != tokens_sum) * (1 - negative)
    not_multiple = Int32(first_not_multiple < e) * (1 - negative) * (1 - last_wrong)
    code = (negative * NEGATIVE_COUNT + last_wrong * LAST_NOT_TOKENS_SUM
            + not_multiple * COUNT_NOT_MULTIPLE)
    expert = (negative * first_negative + last_wrong * (e - 1)
              + not_multiple * first_not_multiple)
    value = offsets[expert]
    prev = offsets[cutlass.max(expert - 1, 0)] * Int32(expert > 0)
    if cutlass.const_expr(cfg.sf_rule is not None):
        # Valid counts so far: do the experts' scale columns fit the scale tensors? The
        # first expert whose chunk ends past `sf_capacity` (a sequential walk: E is small).
        cumulative = Int32(0)
        first_over = Int32(e)
        cumulative_at = Int32(0)
        for j in range(e):
            before = offsets[cutlass.max(j - 1, 0)] * Int32(j > 0)
            cumulative += scale_columns(cfg, cutlass.max(offsets[j] - before, 0))
            over = Int32(cumulative > sf_capacity) * Int32(first_over == e)
            first_over += over * (j - first_over)
            cumulative_at += over * (cumulative - cumulative_at)
        too_small = Int32(first_over < e) * Int32(code == 0)
        code += too_small * SCALES_TOO_SMALL
        expert += too_small * first_over
        value += too_small * (cumulative_at - value)
        prev += too_small * (sf_capacity - prev)
    if cutlass.const_expr(cfg.output_mode == "discrete"):
        # Valid offsets so far: the first expert whose output address is null or not 16-byte
        # aligned (TMA stores need 16); the record holds its low and high 32 bits.
        first_bad = Int32(e)
        for j in range(lane, e, 32):
            first_bad = cutlass.min(first_bad, j + Int32(output_ptr_ok(wgrad_ptrs, j)) * (e - j))
        first_bad = cute.arch.warp_redux_sync(first_bad, "min")
        bad_ptr = Int32(first_bad < e) * Int32(code == 0)
        address = wgrad_ptrs[cutlass.min(first_bad, e - 1)]
        code += bad_ptr * OUTPUT_PTR_INVALID
        expert += bad_ptr * first_bad
        value += bad_ptr * (Int32(address & 0xFFFFFFFF) - value)
        prev += bad_ptr * (Int32(address >> 32) - prev)
    if lane == 0:
        ws.verdict[0] = Int32(code == 0)
        if code != 0:
            # Sticky: only the first problem since the host last cleared [0] is recorded. The
            # claim is atomic at GPU scope: the record is mapped host memory, where
            # system-scope atomics need host-native atomics (hostNativeAtomicSupported; not
            # over PCIe: compute-sanitizer rejects them there). Launches on one device claim
            # it one at a time; two devices failing at the same moment could both write it,
            # and the record may then mix their fields (the error is still reported).
            old = cute.arch.atomic_cas(
                status.iterator + STATUS_CODE, cmp=Int32(0), val=code, scope="gpu"
            )
            if old == 0:
                status[STATUS_EXPERT] = expert
                status[STATUS_VALUE] = value
                status[STATUS_PREV] = prev
                status[STATUS_TOKENS_SUM] = tokens_sum
                status[6] = Int32(0)
                status[7] = Int32(0)
                # The fields before [5]: a non-zero [5] tells the host the record is complete.
                cute.arch.fence_acq_rel_sys()
                status[STATUS_MULTIPLE] = Int32(cfg.count_multiple)
                cute.arch.fence_acq_rel_sys()


# ----------------------------------------------------------------------------------------
# Descriptors
# ----------------------------------------------------------------------------------------


@cute.jit
def expert_operand_view(
    mX: cute.Tensor, rows: cutlass.Constexpr, ragged_block: cutlass.Constexpr, begin: Int32, end: Int32
) -> cute.Tensor:
    """The (rows, tokens) tensor one expert's descriptor is built from.

    tensor2d (and ragged operands whose unit stride is not K): the global tensor with its token
    axis ended at `end`; loads use global token coordinates from `begin`.
    ragged K-contiguous block: (rows, count) at base + begin*rows with row stride count; loads
    use block-local token coordinates from 0.
    """
    res = mX
    if cutlass.const_expr(ragged_block):
        count = end - begin
        base = mX.iterator + Int64(begin) * rows
        res = cute.make_tensor(
            base, cute.make_layout((rows, cutlass.max(count, 1)), stride=(Int64(count), 1))
        )
    else:
        res = cute.make_tensor(
            mX.iterator, cute.make_layout((rows, cutlass.max(end, 1)), stride=mX.stride)
        )
    return res


def token_origin(begin, ragged_block: bool):
    """First token coordinate of an expert's loads: global (`begin`) for tensor2d views, 0 for
    a ragged K-contiguous block, whose descriptor starts at the expert's own base."""
    if ragged_block:
        return Int32(0)
    return begin


@cute.jit
def output_ptr_ok(ptrs: cute.Tensor, expert: Int32) -> cutlass.Boolean:
    """Discrete mode: a null or unaligned expert address skips that expert's store."""
    p = ptrs[expert]
    return p != 0 and (p & 15) == 0


#: Bytes of a TMA descriptor that copy_tensormap writes (the CUtensorMap's fields); the rest of
#: its 128-byte slot is written with zeros (write_descriptor).
DESC_FIELD_BYTES = 64


def zero_descriptor_tail(gaddr: Int64, *, loc=None, ip=None) -> None:
    """Zeros over bytes DESC_FIELD_BYTES..DESC_BYTES-1 of the descriptor slot at ``gaddr``
    (128-byte aligned), four 16-byte stores."""
    stores = " ".join(f"st.global.v4.b32 [$0+{off}], {{0, 0, 0, 0}};"
                      for off in range(DESC_FIELD_BYTES, DESC_BYTES, 16))
    llvm.inline_asm(None, [Int64(gaddr).ir_value(loc=loc, ip=ip)], stores, "l",
                    has_side_effects=True, is_align_stack=False,
                    asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)


@cute.jit
def write_descriptor(atom, slot: cute.Pointer) -> None:
    """A TMA descriptor into its 128-byte workspace slot, every byte of it: the fields by
    copy_tensormap, zeros after them. A caller's workspace only has its first 16 bytes
    zeroed, so nothing of a slot may be left to what the memory held (cuDNN also writes all
    128 bytes)."""
    cpasync.copy_tensormap(atom, slot)
    zero_descriptor_tail(slot.toint())


@dsl_user_op
def tma_desc_ptr_for_copy(raw_ptr: cute.Pointer, *, loc=None, ip=None) -> cute.Pointer:
    """A workspace descriptor address in the form `cute.copy(..., tma_desc_ptr=...)` takes:
    a generic-space pointer typed as a tiled TMA descriptor."""
    llvm_ptr = raw_ptr.to_llvm_ptr(loc=loc, ip=ip)
    generic = llvm.addrspacecast(llvm.PointerType.get(AddressSpace.generic), llvm_ptr, loc=loc, ip=ip)
    gptr = cute.make_ptr(
        raw_ptr.dtype, generic, AddressSpace.generic, assumed_align=DESC_BYTES, loc=loc, ip=ip
    )
    desc_ty = _cute_ir.PtrType.get(
        _cute_nvgpu_ir.TmaDescriptorTiledType.get(), gptr.memspace, gptr.alignment
    )
    return _cute_ir.recast_iter(desc_ty, gptr.value)


@dsl_user_op
def prefetch_tma_descriptor(raw_ptr: cute.Pointer, *, loc=None, ip=None) -> None:
    """Bring a workspace descriptor into the TMA descriptor cache ahead of its first use."""
    llvm_ptr = raw_ptr.to_llvm_ptr(loc=loc, ip=ip)
    generic = llvm.addrspacecast(llvm.PointerType.get(AddressSpace.generic), llvm_ptr, loc=loc, ip=ip)
    cute.arch.prefetch(generic, tensormap=True, loc=loc, ip=ip)


@cute.jit
def acquire_descriptor(ws, expert: Int32, slot: int) -> None:
    """An expert's workspace descriptor before its first use by this warp: the prep kernel
    rewrote it in place since any earlier launch that used this workspace, so drop stale
    cached copies (acquire fence), then warm the descriptor cache (prefetch)."""
    cpasync.fence_tma_desc_acquire(ws.desc_ptr(expert, slot))
    prefetch_tma_descriptor(ws.desc_ptr(expert, slot))
