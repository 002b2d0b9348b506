"""The SM90 BF16 kernel on an H100/H200, through the backend interface, against FP64
(the checks are in gpu_kernel_checks.py)."""

import pytest

torch = pytest.importorskip("torch")

from gpu_kernel_checks import KernelChecks  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
        reason="needs an SM90 GPU",
    ),
]


class TestSm90(KernelChecks):
    ARCH = "sm_90a"
    # cooperative 128x256 and pingpong 128x128
    TILINGS = [((128, 256), (1, 1)), ((128, 128), (1, 1))]


class TestSm90Tile192(KernelChecks):
    """The pingpong 128x192 tile (192 accumulators per consumer thread) on both pairs: 2x1
    (unit 256x192) and 1x2 (unit 128x384)."""
    ARCH = "sm_90a"
    TILINGS = [((128, 192), (2, 1)), ((128, 192), (1, 2))]


class TestSm90Tile192x128(KernelChecks):
    """The pingpong 192x128 tile (three m64 WGMMA atoms per consumer group, 192 accumulators
    per thread) on both pairs: 2x1 (unit 384x128: with 256 or fewer rows the second CTA's part
    starts past the output) and 1x2 (unit 192x256, A multicast: 96 rows a CTA when K-major,
    half of each 64-row block's K columns when M-major)."""
    ARCH = "sm_90a"
    TILINGS = [((192, 128), (2, 1)), ((192, 128), (1, 2))]


class TestSm90TwoLaunches(KernelChecks):
    """The prep kernel, then the GEMM (spec.launches=2: what JAX's custom call compiles); the
    default above is one launch, the GEMM's CTAs doing the prep work before a hand-off."""
    ARCH = "sm_90a"
    TILINGS = [((128, 256), (1, 1), 2), ((128, 128), (1, 1), 2)]


class TestSm90PairSharingA(KernelChecks):
    """1x2 clusters: the CTA pair multicasts A (unit tile 128 x 2n; with an odd number of
    n-tiles the second CTA's half lies past the output: loaded as zeros, stored nowhere)."""
    ARCH = "sm_90a"
    TILINGS = [((128, 256), (1, 2)), ((128, 128), (1, 2))]


class TestSm90PairSharingB(KernelChecks):
    """2x1 clusters: the CTA pair multicasts B."""
    ARCH = "sm_90a"
    TILINGS = [((128, 256), (2, 1)), ((128, 128), (2, 1))]


# A set of epilogue staging buffers per pingpong consumer group (spec.epi_buffer_sets=2): the
# groups' epilogues overlap instead of taking one set in turn. Many short experts, so each CTA
# runs many units and both groups cycle through their buffers many times.
SPLIT_CASES = [
    (("m", "n"), "tensor2d", "dense", torch.bfloat16, False),
    (("k", "n"), "tensor_ragged", "dense", torch.float32, True),
    (("m", "k"), "tensor2d", "discrete", torch.float16, False),
    (("k", "k"), "tensor_ragged", "discrete", torch.float32, True),
]


@pytest.mark.parametrize("tile", [(128, 192), (192, 128), (128, 128), (64, 128)],
                         ids=lambda t: f"{t[0]}x{t[1]}")
@pytest.mark.parametrize("case", range(len(SPLIT_CASES)))
def test_pingpong_epilogue_buffer_set_per_group(seed, tile, case):
    from gpu_kernel_checks import make_spec, run_and_check

    majors, order, mode, out_dtype, acc = SPLIT_CASES[case]
    spec = make_spec("sm_90a", 256, 384, 40, *majors, order, mode, out_dtype, acc,
                     (tile, (1, 1))).with_tuning(epi_buffer_sets=2)
    gen = torch.Generator().manual_seed(seed)
    counts = (torch.randint(0, 40, (40,), generator=gen) * 8).tolist()  # K-major: % 8
    counts[3] = 0
    run_and_check(spec, counts, out_dtype)


# The cooperative tile with a set of epilogue buffers per consumer group (epi_buffer_sets=2):
# each group stores its own 64 rows, the groups taking turns. 320 rows: the last 128-row tile's
# second group has no row inside the output (its TMA stores are wholly out of bounds).
COOP_SPLIT_TILINGS = [((128, 256), (1, 1)), ((128, 256), (2, 1)), ((128, 256), (1, 2))]


@pytest.mark.parametrize("tiling", range(len(COOP_SPLIT_TILINGS)))
@pytest.mark.parametrize("case", range(len(SPLIT_CASES)))
def test_cooperative_epilogue_buffer_set_per_group(seed, tiling, case):
    from gpu_kernel_checks import make_spec, run_and_check

    majors, order, mode, out_dtype, acc = SPLIT_CASES[case]
    spec = make_spec("sm_90a", 320, 512, 40, *majors, order, mode, out_dtype, acc,
                     COOP_SPLIT_TILINGS[tiling]).with_tuning(epi_buffer_sets=2)
    gen = torch.Generator().manual_seed(seed)
    counts = (torch.randint(0, 40, (40,), generator=gen) * 8).tolist()  # K-major: % 8
    counts[3] = 0
    run_and_check(spec, counts, out_dtype)


def test_single_launch_leaves_its_workspace_ready_for_any_grid():
    """One launch per call: the prep hand-off's words (workspace bytes 8 and 12: the expert
    counter and the prepared / passed count) are 0 again after every launch, so one workspace
    serves launches of different grid sizes in any order (here 132-CTA and 1-CTA grids,
    alternating), each correct against FP64; a two-launch kernel on the same workspace leaves
    both alone."""

    from gpu_kernel_checks import compiled_for, desc, make_operands, make_spec
    from gwgrad import grid as launch_grid
    from gwgrad.backends.base import LaunchArgs

    cases = []
    for hidden, inter, counts, launches in ((1024, 1536, [512, 0, 256, 1024], 1),
                                            (128, 128, [64], 1), (256, 256, [128, 64], 2)):
        spec = make_spec("sm_90a", hidden, inter, len(counts), tiling=(None, None, launches))
        final, backend, compiled = compiled_for(spec)
        assert final.launches == launches
        cases.append((final, backend, compiled, counts))
    grids = {launch_grid.grid_size(c[2], 0) for c in cases[:2]}
    assert 1 in grids and max(grids) > 100, grids
    nbytes = max(c[1].workspace_bytes(c[0]) for c in cases)
    ws = torch.zeros(nbytes, dtype=torch.uint8, device="cuda")
    words = ws[:16].view(torch.int32)
    for step in range(7):
        spec, backend, compiled, counts = cases[(0, 1, 0, 2, 1, 1, 0)[step]]
        a, b, offs, t, a_parts, b_parts = make_operands(spec, counts)
        out = torch.full((len(counts), spec.hidden, spec.intermediate), float("nan"),
                         device="cuda", dtype=torch.bfloat16)
        backend.launch(compiled, spec, LaunchArgs(
            a=desc(a), b=desc(b), offsets=desc(offs), tokens_sum=t, wgrad=desc(out),
            stream=torch.cuda.current_stream().cuda_stream, workspace=ws.data_ptr()))
        torch.cuda.synchronize()
        assert words[2].item() == 0 and words[3].item() == 0, (step, words.tolist())
        for e in range(len(counts)):
            ref = a_parts[e].double() @ b_parts[e].double()
            err = (out[e].double() - ref).norm() / max(ref.norm(), 1e-30)
            assert err < 1e-2 if counts[e] else out[e].eq(0).all(), (step, e, float(err))


@pytest.mark.parametrize("factor,tiling", [(2, ((128, 128), (1, 1))), (3, ((128, 128), (1, 1))),
                                           (2, ((128, 256), (1, 1))), (2, ((128, 128), (1, 2)))],
                         ids=["2x_sms", "3x_sms", "2x_sms_128x256", "2x_sms_pairs"])
def test_single_launch_needs_no_resident_grid(monkeypatch, factor, tiling):
    """The single launch's prep hand-off waits for no CTA to start: with a grid of 2-3x the
    CTAs that fit on the GPU at once, the later CTAs start only as earlier ones exit (a grid
    barrier would wait for them forever), yet every expert comes out right against FP64 and
    the hand-off's words are 0 again. This is also the case of a GEMM overlapped with
    another stream's kernel that holds some SMs: the CTAs that start work at once."""
    from gpu_kernel_checks import compiled_for, desc, make_operands, make_spec
    from gwgrad import grid as launch_grid
    from gwgrad.backends.base import LaunchArgs

    spec = make_spec("sm_90a", 1024, 1536, 16, tiling=(*tiling, 1))
    spec, backend, compiled = compiled_for(spec)
    assert spec.launches == 1
    resident = launch_grid.grid_size(compiled, 0)
    grid = resident * factor
    assert compiled.num_units * launch_grid.cluster_size(compiled) >= grid  # work for every CTA
    monkeypatch.setattr(launch_grid, "grid_size", lambda cfg, device: grid)
    gen = torch.Generator().manual_seed(factor)
    counts = (torch.randint(0, 96, (16,), generator=gen) * 8).tolist()
    counts[5] = 0
    a, b, offs, t, a_parts, b_parts = make_operands(spec, counts)
    out = torch.full((16, spec.hidden, spec.intermediate), float("nan"), device="cuda",
                     dtype=torch.bfloat16)
    ws = torch.zeros(backend.workspace_bytes(spec), dtype=torch.uint8, device="cuda")
    for _ in range(2):  # the second launch reuses the workspace the first left
        backend.launch(compiled, spec, LaunchArgs(
            a=desc(a), b=desc(b), offsets=desc(offs), tokens_sum=t, wgrad=desc(out),
            stream=torch.cuda.current_stream().cuda_stream, workspace=ws.data_ptr()))
        torch.cuda.synchronize()
        assert ws[8:16].view(torch.int32).tolist() == [0, 0]
        for e in range(16):
            ref = a_parts[e].double() @ b_parts[e].double()
            err = (out[e].double() - ref).norm() / max(ref.norm(), 1e-30)
            assert err < 1e-2 if counts[e] else out[e].eq(0).all(), (e, counts[e], float(err))
        out.fill_(float("nan"))


def _grid_for(monkeypatch, compiled, grid):
    """Set the launch grid: the resident one, one CTA (cluster), or 3x the resident one (the
    later CTAs start as earlier ones exit); returns its size in CTAs."""
    from gwgrad import grid as launch_grid

    count = launch_grid.grid_size(compiled, 0)
    if grid != "resident":
        count = launch_grid.cluster_size(compiled) if grid == "one_cluster" else 3 * count
        monkeypatch.setattr(launch_grid, "grid_size", lambda cfg, device: count)
    return count


def _scheduled(case, schedule, dims=(256, 384, 24)):
    """(spec, its finalized spec, backend, compiled kernel, output dtype) of a BALANCED_CASES /
    ZERO_FILL_CASES entry with ``unit_schedule=schedule`` on ``dims`` (hidden, intermediate,
    experts)."""

    from gpu_kernel_checks import compiled_for, make_spec

    tiling, majors, order, mode, out_dtype, acc = case
    spec = make_spec("sm_90a", *dims, *majors, order, mode, out_dtype, acc,
                     tiling).with_tuning(unit_schedule=schedule)
    final, backend, compiled = compiled_for(spec)
    assert final.unit_schedule == schedule
    return spec, final, backend, compiled, out_dtype


ZERO_FILL_CASES = [  # (tile, cluster), majors, order, mode, out, accumulate (no zeros)
    (((128, 256), (1, 1)), ("m", "n"), "tensor2d", "dense", torch.bfloat16, False),
    (((128, 128), (1, 1)), ("k", "n"), "tensor_ragged", "discrete", torch.float16, False),
    (((128, 128), (1, 2)), ("m", "k"), "tensor2d", "dense", torch.float32, False),
    (((128, 128), (1, 2), 2), ("m", "n"), "tensor2d", "discrete", torch.bfloat16, False),
]


@pytest.mark.parametrize("case", range(len(ZERO_FILL_CASES)))
@pytest.mark.parametrize("counts", ["most_empty", "one_live", "all_empty"])
@pytest.mark.parametrize("grid", ["resident", "one_cluster", "oversubscribed"])
def test_zero_fill_of_empty_experts(monkeypatch, seed, case, counts, grid):
    """The empty experts' outputs are zeroed by the producer warp group's three zero warps
    (zero_empty_experts), spread over the grid, while the live experts' units run: with
    most experts empty, a single live expert (most CTAs take no unit), every expert empty (no
    unit at all), on the resident grid, one CTA (cluster) taking every unit, and 3x the
    resident grid, every output comes out right against FP64 (NaN-poisoned: every empty
    expert's zeros written, dense or discrete, 16- or 32-bit) and the launch returns."""
    from gpu_kernel_checks import run_and_check

    spec, _, _, compiled, out_dtype = _scheduled(ZERO_FILL_CASES[case], 1, dims=(256, 384, 40))
    _grid_for(monkeypatch, compiled, grid)
    gen = torch.Generator().manual_seed(seed)
    values = (torch.randint(1, 60, (40,), generator=gen) * 8).tolist()
    if counts == "most_empty":
        values = [v if e % 5 == 0 else 0 for e, v in enumerate(values)]
    elif counts == "one_live":
        values = [0] * 39 + [values[0]]
    else:
        values = [0] * 40
    run_and_check(spec, values, out_dtype)


def test_zero_fill_past_2_gib(seed):
    """An empty expert whose FP32 output passes 2 GiB (16384 x 32776 x 4 bytes): the zero
    fill's byte offsets pass 2^31 (64-bit in zero_empty_experts). Its whole output comes out
    zero, the live expert's right against FP64, and a NaN guard after the output untouched."""
    from gpu_kernel_checks import LaunchArgs, compiled_for, desc, make_operands, make_spec

    m, n, counts = 16384, 32776, [0, 8]
    assert m * n * 4 > 2 ** 31
    spec = make_spec("sm_90a", m, n, 2, "m", "n", "tensor2d", "dense", torch.float32, False,
                     ((128, 128), (1, 1)))
    final, backend, compiled = compiled_for(spec)
    a, b, offs, t, a_parts, b_parts = make_operands(final, counts)
    guard = 1 << 20
    flat = torch.full((2 * m * n + guard,), float("nan"), device="cuda")
    out = flat[:2 * m * n].view(2, m, n)
    ws = torch.zeros(max(backend.workspace_bytes(final), 1), dtype=torch.uint8, device="cuda")
    backend.launch(compiled, final, LaunchArgs(
        a=desc(a), b=desc(b), offsets=desc(offs), tokens_sum=t,
        stream=torch.cuda.current_stream().cuda_stream, workspace=ws.data_ptr(),
        wgrad=desc(out)))
    torch.cuda.synchronize()
    assert torch.count_nonzero(out[0]).item() == 0, f"seed {seed}: the empty expert is not zero"
    assert torch.isnan(flat[2 * m * n:]).all(), f"seed {seed}: the guard after the output written"
    ref = a_parts[1].double() @ b_parts[1].double()
    err = ((out[1].double() - ref).norm() / ref.norm()).item()
    assert err <= 1e-2, f"seed {seed}: live expert rel err {err:.3e}"


BALANCED_CASES = [  # (tile, cluster), majors, order, mode, out, accumulate
    (((128, 128), (1, 1)), ("m", "n"), "tensor2d", "dense", torch.bfloat16, False),
    (((128, 128), (1, 2)), ("k", "n"), "tensor_ragged", "discrete", torch.bfloat16, False),
    (((128, 128), (1, 2)), ("m", "k"), "tensor2d", "dense", torch.float32, True),
    (((128, 128), (1, 2), 2), ("m", "n"), "tensor2d", "dense", torch.bfloat16, False),  # + prep
    (((128, 256), (2, 1)), ("m", "k"), "tensor2d", "dense", torch.float16, False),
]


@pytest.mark.parametrize("case", range(len(BALANCED_CASES)))
@pytest.mark.parametrize("counts", ["equal", "spread", "skewed"])
@pytest.mark.parametrize("grid", ["resident", "one_cluster", "oversubscribed"])
def test_balanced_schedule(monkeypatch, seed, case, counts, grid):
    """unit_schedule=3 (balanced): the kernel runs a launch statically when the largest count
    minus the smallest nonzero one is at most 1/BALANCED_SPREAD of a CTA's (cluster's) share
    of the work, else dynamically. Which one ran is read back from the workspace (the dynamic
    counter stays 0 on a static launch), against the rule computed here from the counts and
    the grid; both must be right against FP64. Equal counts (and an empty expert) run static
    on any grid, a spread of 8 tokens only on one CTA (cluster), a skewed launch never."""
    from gpu_kernel_checks import run_and_check
    from gwgrad import grid as launch_grid
    from gwgrad.kernels.tiling import BALANCED_SPREAD

    spec, final, backend, compiled, out_dtype = _scheduled(BALANCED_CASES[case], 3)
    clusters = _grid_for(monkeypatch, compiled, grid) // launch_grid.cluster_size(compiled)
    values = {"equal": [200] * 24, "spread": [200, 208] * 12,
              "skewed": [1000] + [8] * 23}[counts]
    values[5] = 0
    spread = max(values) - min(c for c in values if c)
    units_per_expert = compiled.num_units // final.num_experts
    static = spread * BALANCED_SPREAD * clusters <= sum(values) * units_per_expert
    assert static == {"equal": True, "spread": grid == "one_cluster", "skewed": False}[counts]
    ws = torch.zeros(max(backend.workspace_bytes(final), 1), dtype=torch.uint8, device="cuda")
    run_and_check(spec, values, out_dtype, workspace=ws)
    words = ws[:32].view(torch.int32).tolist()
    assert words[6:8] == [spread, sum(values)], words
    assert (words[0] == 0) == static, (words[0], static, clusters)
