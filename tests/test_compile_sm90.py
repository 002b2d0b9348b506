"""The SM90 BF16 kernel compiles for sm_90a without a GPU, in every mode, and its PTX holds
the Hopper instructions it is built on, and the device-side offsets check: the prep kernel's
sticky status record (GPU-scope CAS + system-scope fence) and the GEMM's verdict read before any work."""

from __future__ import annotations

import itertools
import re

import pytest

pytest.importorskip("cutlass")

from kernel_compile import check_offsets_check_ptx, compile_ptx, spec  # noqa: E402

MAJORS = [("m", "n"), ("k", "n"), ("m", "k"), ("k", "k")]
MODES = list(itertools.product(MAJORS, ["tensor2d", "tensor_ragged"], ["dense", "discrete"],
                               ["bfloat16", "float16", "float32"], [False, True]))


def check_hopper_ptx(ptx: str, accumulate: bool, cluster: bool = False) -> None:
    check_offsets_check_ptx(ptx)
    assert "wgmma.mma_async.sync.aligned" in ptx
    assert "setmaxnreg" in ptx  # producer / consumer register split
    assert "atom.global.add" in ptx  # dynamic unit counter
    if cluster:  # multicast TMA loads into the cluster, cluster barriers
        assert ".multicast::cluster" in ptx and "barrier.cluster.arrive" in ptx
        assert "mapa" in ptx or "shared::cluster" in ptx  # releases reach the peer's barriers
        # The leader hands its peers each unit id: st.async completing their barrier, and
        # their acknowledgements arrive on the leader's.
        assert "st.async" in ptx and "mbarrier::complete_tx" in ptx
    else:
        assert "cp.async.bulk.tensor" in ptx and ".shared::cta.global" in ptx  # TMA loads
        assert ".multicast::cluster" not in ptx and "st.async" not in ptx
    assert "fence.proxy.tensormap::generic.acquire" in ptx  # per-expert descriptors
    # Empty experts: zeroed by warps 1-3 (nothing to add when accumulating); their units are
    # never handed out (the producer reads the live count: with the balanced schedule, in one
    # vector load with the spread and tokens words).
    assert re.search(r"ld\.global\.b32\s+%r\d+, \[%rd\d+\+16\];"
                     r"|ld\.global\.v4\.b32\s+\{[^}]*\}, \[%rd\d+\+16\];"
                     r"|add\.s64\s+(%rd\d+), %rd\d+, 16;[\s\S]*?ld\.global\.v4\.b32\s+\{[^}]*\}, \[\1\];",
                     ptx)
    # ... by TMA bulk copies of a line of zeros in shared memory.
    assert ("cp.async.bulk.global.shared::cta.bulk_group" in ptx) != accumulate
    assert "st.global.cs.v4.b32" not in ptx
    if accumulate:
        assert "cp.reduce.async.bulk.tensor" in ptx and ".add." in ptx
    else:
        assert "cp.reduce.async.bulk" not in ptx
        assert "cp.async.bulk.tensor" in ptx and ".global.shared::cta" in ptx  # TMA store


@pytest.mark.compile
@pytest.mark.parametrize("majors,order,mode,out,acc", MODES,
                         ids=lambda v: v if isinstance(v, str) else str(v))
def test_every_mode_compiles(majors, order, mode, out, acc):
    """Every mode in its default tiling (a 1x2 pair for 16-bit outputs of this size)."""
    from gwgrad.backends import finalize_spec

    s = spec("sm_90a", a_major=majors[0], b_major=majors[1], order=order, mode=mode, out=out,
             acc=acc)
    ptx = compile_ptx(s)
    check_hopper_ptx(ptx, acc, cluster=finalize_spec(s)[0].cluster_shape_mn != (1, 1))


@pytest.mark.compile
@pytest.mark.parametrize("tile", [(128, 256), (256, 128), (128, 192), (192, 128), (128, 128),
                                  (64, 256), (64, 128)], ids=lambda t: f"{t[0]}x{t[1]}")
def test_every_tile_compiles(tile):
    from gwgrad.kernels.tiling import SM90_TILES

    ptx = compile_ptx(spec("sm_90a", tile=tile, cluster=(1, 1)))
    check_hopper_ptx(ptx, False)
    if SM90_TILES[tile] == "pingpong":  # ordered hand-off
        assert "bar.arrive" in ptx
    # One WGMMA per m64 atom of a consumer group's rows, per K step of 16 (a K-block of 64).
    group_rows = tile[0] if SM90_TILES[tile] == "pingpong" else tile[0] // 2
    assert ptx.count("wgmma.mma_async") == group_rows // 64 * 4


@pytest.mark.compile
@pytest.mark.parametrize("tile,cluster,out,acc,kw", [
    ((128, 192), (1, 2), "bfloat16", False, {}),
    ((128, 192), (2, 1), "float16", False, {}),
    ((128, 192), (1, 1), "float32", True, {}),
    ((192, 128), (1, 1), "bfloat16", False, {}),
    ((192, 128), (1, 2), "bfloat16", False, {}),
    ((192, 128), (2, 1), "float16", False, {}),
    ((192, 128), (1, 1), "float32", True, {}),
    ((192, 128), (1, 2), "float32", True, dict(a_major="k", mode="discrete")),
    ((192, 128), (2, 1), "float32", True, dict(b_major="k")),
], ids=["1x2-bf16", "2x1-f16", "f32-acc", "192x128-bf16", "192x128-1x2-bf16",
        "192x128-2x1-f16", "192x128-f32-acc", "192x128-1x2-f32-acc-ak-discrete",
        "192x128-2x1-f32-acc-bk"])
def test_192_accumulator_tile_spills_nothing(tile, cluster, out, acc, kw):
    """The pingpong 128x192 and 192x128 tiles, whose consumer threads hold 192 FP32
    accumulators (of their 232 registers): ptxas keeps every value in registers (no
    local-memory stack frame), in the 16-bit store path and in the FP32 reduce-add one, on
    one CTA and on both pairs. (A 128x256 pingpong tile, 256 accumulators, spills about 2 KB
    a thread.)"""
    from kernel_compile import compile_cubin, cubin_resources

    res = cubin_resources(compile_cubin(spec("sm_90a", hidden=2880, intermediate=5760,
                                             experts=32, tile=tile, cluster=cluster, out=out,
                                             acc=acc, **kw)))
    assert res["regs"] and res["frame"], res
    assert max(res["frame"]) == 0, f"ptxas spilled to a local-memory frame: {res}"


@pytest.mark.parametrize("tile,cluster,match", [
    ((128, 96), (1, 1), "mma_tiler_mn"),
    ((256, 256), (1, 1), "mma_tiler_mn"),  # 256 accumulator registers per thread
    ((192, 192), (1, 1), "mma_tiler_mn"),  # 288 accumulator registers per thread
    ((192, 64), (1, 1), "mma_tiler_mn"),
    ((256, 192), (1, 1), "mma_tiler_mn"),
    ((128, 256), (2, 4), "cluster_shape_mn"),
    ((128, 128), (4, 1), "cluster_shape_mn"),
    ((128, 128), (2, 2), "cluster_shape_mn"),  # SM90 clusters are CTA pairs
    ((64, 128), (2, 2), "cluster_shape_mn"),
])
def test_unsupported_tiling_is_a_value_error(tile, cluster, match):
    from gwgrad.backends import finalize_spec

    with pytest.raises(ValueError, match=match):
        finalize_spec(spec("sm_90a", tile=tile, cluster=cluster))


def _epilogue_sync_counts(ptx: str):
    """(256-thread named-barrier waits, TMA-store drains) in the PTX."""
    import re

    return (len(re.findall(r"bar\.sync\s+%r\d+, 256;", ptx)),
            ptx.count("cp.async.bulk.wait_group.read"))


def _last_batch_segments(ptx: str):
    """Per `wgmma.wait_group 0`: the code since the WGMMA batch committed before it."""
    waits = [m.start() for m in re.finditer(r"wgmma\.wait_group\.sync\.aligned\s+0;", ptx)]
    return [ptx[ptx.rfind("wgmma.commit_group", 0, w):w] for w in waits]


@pytest.mark.compile
@pytest.mark.parametrize("tile, cluster, early", [
    ((128, 128), (1, 1), True), ((128, 128), (1, 2), True), ((64, 128), (1, 1), True),
    ((192, 128), (2, 1), True), ((128, 256), (1, 1), False),
], ids=["pingpong", "pingpong-1x2", "pingpong-64x128", "pingpong-192x128-2x1", "cooperative"])
def test_pingpong_hands_off_before_the_last_batch_completes(tile, cluster, early):
    """Pingpong: a group hands the tensor cores to its peer (bar.arrive on the peer's order
    barrier) once its unit's last WGMMA batch is committed, before it waits for that batch
    (wait_group 0), as CUTLASS's pingpong kernel does; the cooperative tile has no hand-off."""
    ptx = compile_ptx(spec("sm_90a", tile=tile, cluster=cluster))
    gemm = ptx.split(".entry ")[-1]
    handoffs = [seg for seg in _last_batch_segments(gemm) if "bar.arrive" in seg]
    assert bool(handoffs) == early, [seg[-300:] for seg in _last_batch_segments(gemm)]
    for seg in handoffs:
        assert "wgmma.mma_async" not in seg


@pytest.mark.compile
@pytest.mark.parametrize("case", [
    dict(tile=(128, 128)),
    dict(tile=(64, 128), out="float32", acc=True, mode="discrete"),
    dict(tile=(64, 256), out="float16", order="tensor_ragged", a_major="k"),
    dict(fp8="block_1x128", tile=(64, 128)),
    dict(tile=(192, 128), out="float16", a_major="k", b_major="k"),
], ids=["128x128", "64x128-f32-acc-discrete", "64x256-f16-ragged", "fp8-64x128",
        "192x128-f16-kk"])
def test_pingpong_epilogue_buffer_set_per_group(case):
    """spec.epi_buffer_sets=2: each pingpong consumer group stages its epilogue in its own
    buffers, so the EPI_ORDER hand-off (one 256-thread barrier wait) and the per-unit drain of
    the TMA stores before it are gone; everything else stays."""

    from kernel_compile import fp8_spec

    case = dict(case)
    recipe = case.pop("fp8", None)
    base = (fp8_spec("sm_90a", recipe, cluster=(1, 1), **case) if recipe
            else spec("sm_90a", cluster=(1, 1), **case))
    shared = compile_ptx(base)
    split = compile_ptx(base.with_tuning(epi_buffer_sets=2))
    check_hopper_ptx(split, base.accumulate)
    (bars, drains), (bars2, drains2) = _epilogue_sync_counts(shared), _epilogue_sync_counts(split)
    assert (bars2, drains2) == (bars - 1, drains - 1), ((bars, drains), (bars2, drains2))


@pytest.mark.compile
@pytest.mark.parametrize("case", [
    dict(tile=(128, 256)),
    dict(tile=(128, 256), cluster=(2, 1), out="float32", acc=True, mode="discrete"),
    dict(tile=(128, 256), cluster=(1, 2), order="tensor_ragged", a_major="k"),
    dict(tile=(128, 256), out="float16", b_major="k"),
], ids=["128x256", "128x256-2x1-f32-acc-discrete", "128x256-1x2-ragged", "128x256-f16-bk"])
def test_cooperative_epilogue_buffer_set_per_group(case):
    """spec.epi_buffer_sets=2 on a cooperative tile: each consumer group stores its own 64
    rows through its own staging buffers (a 128-thread barrier per group instead of the
    256-thread one of the shared epilogue), the groups taking turns on the EPI_ORDER
    barriers (one wait and one arrive on a 256-thread barrier per unit), with no store drain
    per unit; the MMA is untouched."""

    case = dict(case)
    # One set asked for: on these small outputs a 16-bit default would already be two.
    base = spec("sm_90a", cluster=case.pop("cluster", (1, 1)), **case).with_tuning(
        epi_buffer_sets=1)
    shared = compile_ptx(base)
    split = compile_ptx(base.with_tuning(epi_buffer_sets=2))
    check_hopper_ptx(split, base.accumulate, cluster=base.cluster_shape_mn != (1, 1))
    # The shared epilogue: two 256-thread barrier waits per sub-tile; split: none.
    assert re.findall(r"bar\.sync\s+\d+, 256;", shared) and not re.findall(
        r"bar\.sync\s+\d+, 256;", split)
    assert len(re.findall(r"bar\.sync\s+%r\d+, 128;", split)) == len(
        re.findall(r"bar\.sync\s+\d+, 256;", shared))
    assert len(re.findall(r"bar\.sync\s+%r\d+, 256;", split)) == 1  # its turn
    assert len(re.findall(r"bar\.arrive\s+%r\d+, 256;", split)) == 2  # the start, the pass
    assert (shared.count("cp.async.bulk.wait_group.read")
            == split.count("cp.async.bulk.wait_group.read"))
    assert shared.count("wgmma.mma_async") == split.count("wgmma.mma_async")


@pytest.mark.parametrize("arch,tile,cluster,sets,extra", [
    ("sm_90a", (256, 128), (2, 1), 2, {}),  # 256-row cooperative CTA tile: rows interleave
    ("sm_90a", (128, 128), (1, 1), 3, {}),
    ("sm_100a", (128, 128), (1, 1), 2, {}),
])
def test_epilogue_buffer_sets_rejected(arch, tile, cluster, sets, extra):
    from gwgrad.backends import finalize_spec

    with pytest.raises(ValueError, match=rf"^epi_buffer_sets: expected 1.*got {sets}$"):
        finalize_spec(spec(arch, tile=tile, cluster=cluster).with_tuning(epi_buffer_sets=sets,
                                                                         **extra))


@pytest.mark.compile
@pytest.mark.parametrize("tile,cluster,kw", [
    ((128, 128), (1, 2), {}),
    ((128, 128), (2, 1), dict(out="float32", acc=True)),
    ((128, 256), (1, 2), dict(mode="discrete", order="tensor_ragged", a_major="k")),
    ((64, 128), (2, 1), dict(out="float16", b_major="k", mode="discrete", acc=True)),
    ((192, 128), (1, 2), dict(a_major="k", order="tensor_ragged")),
    ((192, 128), (2, 1), dict(mode="discrete", out="float32")),
], ids=["pp-1x2", "pp-2x1-f32-acc", "coop-1x2-discrete-ragged", "pp64-2x1-f16-discrete-acc",
        "pp192-1x2-ragged", "pp192-2x1-discrete-f32"])
def test_cluster_pairs_compile(tile, cluster, kw):
    """A 1x2 (2x1) CTA pair multicasts A (B): the unit tile is the cluster's, each CTA
    computes its part (tests/test_sm90_kernel_gpu.py has the GPU tests)."""
    from gwgrad.backends import finalize_spec

    s = spec("sm_90a", tile=tile, cluster=cluster, **kw)
    final, backend = finalize_spec(s)
    cfg = backend.config(final)
    assert (cfg.tile_m, cfg.tile_n) == (tile[0] * cluster[0], tile[1] * cluster[1])
    ptx = compile_ptx(s)
    check_hopper_ptx(ptx, final.accumulate, cluster=True)


@pytest.mark.compile
@pytest.mark.parametrize("launches", [1, 2])
@pytest.mark.parametrize("mode,cluster", [("dense", (1, 1)), ("discrete", (1, 2))])
def test_launches_per_call_compile(launches, mode, cluster):
    """One launch: a single entry whose CTAs do the prep work, pass the prep hand-off, then
    read the verdict (kernel_compile.check_prep_handoff_ptx); two: the prep kernel and the
    GEMM. The offsets check is the same code in both."""
    from kernel_compile import replace

    ptx = compile_ptx(replace(spec("sm_90a", mode=mode, cluster=cluster), launches=launches))
    assert ptx.count(".entry ") == launches
    check_hopper_ptx(ptx, False, cluster=cluster != (1, 1))
    if launches == 2:
        assert "ld.acquire.gpu" not in ptx and "fence.proxy.tensormap::generic.release" in ptx


@pytest.mark.compile
@pytest.mark.parametrize("cluster", [(1, 1), (1, 2)], ids=lambda c: f"{c[0]}x{c[1]}")
def test_unit_schedule_compile(cluster):
    """spec.unit_schedule: balanced (3) keeps the dynamic path (1: the counter's atomic and,
    on a cluster, the leader's hand-off by st.async into the peers' mailboxes, the operand
    loads multicast) beside its static order, and its prep work reduces the counts' max, min
    and sum (three more warp reductions than the dynamic kernel's)."""
    from kernel_compile import replace

    base = spec("sm_90a", tile=(128, 128), cluster=cluster)
    dynamic = compile_ptx(replace(base, unit_schedule=1))
    balanced = compile_ptx(replace(base, unit_schedule=3))
    add = "redux.sync.add.s32"
    assert balanced.count(add) == dynamic.count(add) + 1
    check_offsets_check_ptx(balanced)
    assert "wgmma.mma_async.sync.aligned" in balanced
    assert balanced.count("atom.global.add") == dynamic.count("atom.global.add")
    for kind in ("max", "min"):
        op = f"redux.sync.{kind}.s32"
        assert balanced.count(op) > dynamic.count(op), (kind, balanced.count(op))
    if cluster != (1, 1):
        assert "st.async" in dynamic and "st.async" in balanced
        assert ".multicast::cluster" in balanced


@pytest.mark.compile
def test_default_unit_schedule_is_resolved():
    """finalize_spec resolves unit_schedule 0 (the backend's default) to a schedule the kernel
    runs: the PTX of a spec left at 0 is that of the resolved one."""
    from gwgrad.backends import finalize_spec

    from kernel_compile import replace

    base = spec("sm_90a", tile=(128, 128), cluster=(1, 1))
    final = finalize_spec(replace(base, unit_schedule=0))[0]
    assert final.unit_schedule in (1, 3)
    assert compile_ptx(replace(base, unit_schedule=0)) == compile_ptx(
        replace(base, unit_schedule=final.unit_schedule))


@pytest.mark.compile
@pytest.mark.parametrize("tile, cluster, mode", [
    ((128, 256), (1, 1), "dense"), ((128, 128), (1, 2), "discrete"),
], ids=["cooperative-dense", "pair-discrete"])
def test_zero_fill_copies_a_shared_zero_line(tile, cluster, mode):
    """The zero warps write one line of zeros to shared memory (32 threads, 16 bytes each),
    fence it for the async proxy, meet at a 96-thread barrier, then one lane per warp copies
    the line over the empty experts' outputs with bulk copies, waiting until at most
    ZERO_IN_FLIGHT are unread and, before it exits, until all are read."""
    from gwgrad.kernels.sm90_bf16 import ZERO_IN_FLIGHT, ZERO_LINE

    gemm = compile_ptx(spec("sm_90a", tile=tile, cluster=cluster, mode=mode)).split(".entry ")[-1]
    zero = gemm.index("st.shared.v4.b32")
    fence = gemm.index("fence.proxy.async.shared::cta", zero)
    start = re.search(r"bar\.sync\s+7, 96;", gemm[fence:])
    copy = gemm.index("cp.async.bulk.global.shared::cta.bulk_group", fence)
    assert start and fence + start.start() < copy
    # The line's byte offset in 64 bits (an expert's output may pass 2 GiB).
    assert re.search(rf"mul\.wide\.s32\s+%rd\d+, %r\d+, {ZERO_LINE};", gemm[fence:copy])
    tail = gemm[copy:copy + 400]
    assert re.search(rf"cp\.async\.bulk\.wait_group\.read\s+{ZERO_IN_FLIGHT};", tail)
    assert re.search(r"cp\.async\.bulk\.wait_group\.read\s+0;", gemm[copy:])


def _epilogue_run_mismatches(kernel, threads):
    """(thread, sub-tile, value, its accumulator coordinate, its sub-tile coordinate) of every
    value of ``threads`` whose accumulator element (the tiled MMA's C partition of the CTA
    tile, retiled by the kernel's epilogue copy) is not where the epilogue stages it: value v
    of run i of a thread's retiled accumulator (RegisterAccumulator.load) goes to sub-tile i
    (row-major over the epi_tile sub-tiles of the rows its epilogue stores:
    RegisterAccumulator.target) at the copy's v-th position (partition_S of a sub-tile).
    Called while tracing (the layouts are static); plain Python, not a @cute.jit body."""
    import cutlass.cute as cute

    tiled_mma = kernel.tiled_mma
    copy = kernel.epilogue_copy(tiled_mma)
    (epi_m, epi_n), cta = kernel.epi_tile, (kernel.cta_m, kernel.cta_n)
    rows = 64 if kernel.coop_split else kernel.cta_m  # what one epilogue stores
    n_sub = kernel.cta_n // epi_n
    subtiles = rows // epi_m * n_sub
    bad = []
    for t in threads:
        epi_t = t % 128 if kernel.pingpong or kernel.coop_split else t
        row0 = 64 * (t // 128) if kernel.coop_split else 0
        acc = copy.retile(tiled_mma.get_slice(t).partition_C(cute.make_identity_tensor(cta)))
        sub = copy.get_slice(epi_t).partition_S(cute.make_identity_tensor((epi_m, epi_n)))
        size = cute.size(sub)
        assert size * subtiles == cute.size(acc), (size, subtiles, cute.size(acc))
        (ai, aj), (si, sj) = acc.iterator, sub.iterator
        for i in range(subtiles):
            r0, c0 = row0 + i // n_sub * epi_m, i % n_sub * epi_n
            for v in range(size):
                (a, b), (s, u) = acc.layout(i * size + v), sub.layout(v)
                got, want = (ai + a, aj + b), (r0 + si + s, c0 + sj + u)
                assert all(isinstance(x, int) for x in got + want), (got, want)
                if got != want:
                    bad.append((t, i, v, got, want))
    return bad


@pytest.mark.compile
@pytest.mark.parametrize("tile,out,sets", [
    ((192, 128), "bfloat16", 1), ((192, 128), "bfloat16", 2), ((192, 128), "float32", 1),
    ((128, 192), "bfloat16", 1), ((128, 128), "float32", 1), ((64, 256), "bfloat16", 1),
    ((64, 128), "bfloat16", 1), ((128, 256), "bfloat16", 1), ((128, 256), "bfloat16", 2),
    ((256, 128), "float32", 1),
], ids=lambda v: f"{v[0]}x{v[1]}" if isinstance(v, tuple) else str(v))
def test_epilogue_sub_tiles_are_the_accumulator_runs(tile, out, sets):
    """The epilogue reads a thread's accumulator in runs, run i staged as sub-tile i: for the
    tile's MMA and epilogue copy (traced, no kernel), every value of sampled threads of each
    warp is staged at its own output coordinate, for one to three m64 WGMMA atoms a pingpong
    group (64, 128, 192 rows), the cooperative tiles and their per-group epilogues
    (coop_split), 16-bit and FP32 sub-tiles."""
    from gwgrad.backends import finalize_spec
    from gwgrad.kernels import compiler

    final, backend = finalize_spec(spec("sm_90a", tile=tile, cluster=(1, 1), out=out)
                                   .with_tuning(epi_buffer_sets=sets))
    kernel = backend.make_kernel(final)
    threads = [w * 32 + lane for w in range(8 if kernel.cfg.schedule == "cooperative" else 4)
               for lane in (0, 5, 30)]
    found = {}

    import cutlass.cute as cute

    @cute.jit
    def trace():
        kernel._setup()
        found["bad"] = _epilogue_run_mismatches(kernel, threads)

    compiler.compile_entry(trace, lambda: [], compiler.compile_options("sm_90a"))
    assert found["bad"] == [], found["bad"][:5]
