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


class TestSm90Quad(KernelChecks):
    """2x2 clusters: each CTA multicasts A to its row peer and B to its column peer (unit
    tile 256 x 256 for 128x128 CTAs, or 128 x 256 for 64x128 ones)."""
    ARCH = "sm_90a"
    TILINGS = [((128, 128), (2, 2)), ((64, 128), (2, 2))]


# A set of epilogue staging buffers per pingpong consumer group (spec.epi_buffer_sets=2): the
# groups' epilogues overlap instead of taking one set in turn. Many short experts, so each CTA
# runs many units and both groups cycle through their buffers many times.
SPLIT_CASES = [
    (("m", "n"), "tensor2d", "dense", torch.bfloat16, False),
    (("k", "n"), "tensor_ragged", "dense", torch.float32, True),
    (("m", "k"), "tensor2d", "discrete", torch.float16, False),
    (("k", "k"), "tensor_ragged", "discrete", torch.float32, True),
]


@pytest.mark.parametrize("tile", [(128, 128), (64, 128)], ids=lambda t: f"{t[0]}x{t[1]}")
@pytest.mark.parametrize("case", range(len(SPLIT_CASES)))
def test_pingpong_epilogue_buffer_set_per_group(seed, tile, case):
    import dataclasses

    from gpu_kernel_checks import make_spec, run_and_check

    majors, order, mode, out_dtype, acc = SPLIT_CASES[case]
    spec = dataclasses.replace(
        make_spec("sm_90a", 256, 384, 40, *majors, order, mode, out_dtype, acc,
                  (tile, (1, 1))), epi_buffer_sets=2)
    gen = torch.Generator().manual_seed(seed)
    counts = (torch.randint(0, 40, (40,), generator=gen) * 8).tolist()  # K-major: % 8
    counts[3] = 0
    run_and_check(spec, counts, out_dtype)


# The cooperative tile with a set of epilogue buffers per consumer group (epi_buffer_sets=2):
# each group stores its own 64 rows, the groups taking turns. 320 rows: the last 128-row tile's
# second group has no row inside the output (its TMA stores are wholly out of bounds).
COOP_SPLIT_TILINGS = [((128, 256), (1, 1)), ((128, 256), (2, 1)), ((128, 192), (1, 1)),
                      ((128, 256), (1, 2))]


@pytest.mark.parametrize("tiling", range(len(COOP_SPLIT_TILINGS)))
@pytest.mark.parametrize("case", range(len(SPLIT_CASES)))
def test_cooperative_epilogue_buffer_set_per_group(seed, tiling, case):
    import dataclasses

    from gpu_kernel_checks import make_spec, run_and_check

    majors, order, mode, out_dtype, acc = SPLIT_CASES[case]
    spec = dataclasses.replace(
        make_spec("sm_90a", 320, 512, 40, *majors, order, mode, out_dtype, acc,
                  COOP_SPLIT_TILINGS[tiling]), epi_buffer_sets=2)
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
    import dataclasses

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


STATIC_CASES = [  # (tile, cluster), majors, order, mode, out, accumulate
    (((128, 128), (1, 1)), ("m", "n"), "tensor2d", "dense", torch.bfloat16, False),
    (((128, 128), (1, 2)), ("k", "n"), "tensor_ragged", "discrete", torch.float32, True),
    (((128, 256), (2, 1)), ("m", "k"), "tensor2d", "dense", torch.float16, False),
    (((64, 128), (1, 1)), ("k", "k"), "tensor_ragged", "dense", torch.float32, True),
    (((128, 128), (2, 2)), ("m", "n"), "tensor_ragged", "discrete", torch.bfloat16, False),
]


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
    """(spec, its finalized spec, backend, compiled kernel, output dtype) of a STATIC_CASES /
    BALANCED_CASES entry with ``unit_schedule=schedule`` on ``dims`` (hidden, intermediate,
    experts)."""
    import dataclasses

    from gpu_kernel_checks import compiled_for, make_spec

    tiling, majors, order, mode, out_dtype, acc = case
    spec = dataclasses.replace(
        make_spec("sm_90a", *dims, *majors, order, mode, out_dtype, acc, tiling),
        unit_schedule=schedule)
    final, backend, compiled = compiled_for(spec)
    assert final.unit_schedule == schedule
    return spec, final, backend, compiled, out_dtype


@pytest.mark.parametrize("case", range(len(STATIC_CASES)))
@pytest.mark.parametrize("grid", ["resident", "one_cluster", "oversubscribed"])
def test_static_units(monkeypatch, seed, case, grid):
    """unit_schedule=2 (static): each CTA (cluster) takes every grid-th unit, with no counter
    and no leader hand-off. Every expert comes out right against FP64 (NaN-poisoned outputs,
    an empty expert) with the resident grid, a single CTA or cluster running every unit, and a
    grid of 3x the resident one."""
    from gpu_kernel_checks import run_and_check

    spec, _, _, compiled, out_dtype = _scheduled(STATIC_CASES[case], 2)
    _grid_for(monkeypatch, compiled, grid)
    gen = torch.Generator().manual_seed(seed)
    counts = (torch.randint(0, 60, (24,), generator=gen) * 8).tolist()  # K-major: % 8
    counts[4] = 0
    counts[7] = 1000
    run_and_check(spec, counts, out_dtype)


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


def hybrid_head(counts, units_per_expert, clusters):
    """The hybrid schedule's static head for these counts (Sm90GroupedWgrad.static_head),
    or None when the launch is balanced (static throughout)."""
    from gwgrad.kernels.tiling import BALANCED_SPREAD

    live = sorted((c for c in counts if c), reverse=True)
    spread = max(live) - min(live)
    if spread * BALANCED_SPREAD * clusters <= sum(live) * units_per_expert:
        return None
    tails = [sum(live[r:]) for r in range(len(live))]
    found = sum(t * units_per_expert >= max(live) * clusters for t in tails)
    return max(clusters, max(found - 1, 0) * units_per_expert // clusters * clusters)


@pytest.mark.parametrize("case", range(len(BALANCED_CASES)))
@pytest.mark.parametrize("counts", ["equal", "steps", "skewed"])
@pytest.mark.parametrize("grid", ["resident", "one_cluster", "oversubscribed"])
def test_hybrid_schedule(monkeypatch, seed, case, counts, grid):
    """unit_schedule=4 (hybrid): a balanced launch runs statically; an unbalanced one hands
    out a static head (a multiple of the grid) and the rest from the counter. The counter
    after the launch tells how many units went out dynamically (one call per dynamic unit,
    plus one per CTA (cluster) that finds no more): 0 on a static launch, else live units -
    head + clusters, with the head computed here from the counts (hybrid_head). Both must be
    right against FP64. 96 experts of 256 x 1024: on the resident grid the "steps" counts
    take a head of several rounds, a single cluster runs them statically (balanced)."""
    from gpu_kernel_checks import run_and_check
    from gwgrad import grid as launch_grid

    spec, final, backend, compiled, out_dtype = _scheduled(BALANCED_CASES[case], 4,
                                                           (256, 1024, 96))
    clusters = _grid_for(monkeypatch, compiled, grid) // launch_grid.cluster_size(compiled)
    values = {"equal": [200] * 96, "steps": [400, 320, 240, 160, 80, 8] * 16,
              "skewed": [1000] + [8] * 95}[counts]
    values[5] = 0
    units_per_expert = compiled.num_units // final.num_experts
    live_units = sum(1 for c in values if c) * units_per_expert
    head = hybrid_head(values, units_per_expert, clusters)
    if counts == "equal":
        assert head is None
    if counts == "steps" and grid == "resident":
        assert head > clusters, (head, clusters)  # a static head of several rounds
    if counts == "skewed":
        assert head is not None
    ws = torch.zeros(max(backend.workspace_bytes(final), 1), dtype=torch.uint8, device="cuda")
    run_and_check(spec, values, out_dtype, workspace=ws)
    words = ws[:36].view(torch.int32).tolist()
    assert words[8] == max(values), words
    want = 0 if head is None else live_units - head + clusters
    assert words[0] == want, (words[0], want, head, clusters)


K_SPLIT_CASES = [  # (tiling, major / order / mode / out / accumulate)
    (((128, 128), (1, 1)), dict()),
    (((128, 256), (1, 1)), dict()),
    (((128, 128), (1, 1)), dict(out=torch.float32, acc=True)),
    (((128, 128), (1, 1)), dict(a_major="k", b_major="k", order="tensor_ragged",
                                mode="discrete", out=torch.float16)),
    (((128, 128), (1, 1)), dict(a_major="k", b_major="n", out=torch.float32)),
]


@pytest.mark.parametrize("case", range(len(K_SPLIT_CASES)))
@pytest.mark.parametrize("grid", [0, 1], ids=["resident_grid", "one_cta"])
def test_k_split(monkeypatch, case, grid):
    """spec.split_tokens=512: experts of 520-4600 tokens run as 2-8 chunks (one expert needs
    more than 8 chunks of 512, so its chunks grow), others as one, one expert is empty. Every
    expert comes out right against FP64 in every mode, NaN-poisoned outputs are fully
    written (the empty expert: zeros, or untouched when accumulating), a second call gives the
    same bits (the chunks add in a fixed order), and one CTA running every unit in order
    finishes too (each chunk waits only for a lower unit)."""
    import dataclasses

    from gpu_kernel_checks import compiled_for, desc, make_operands, make_spec
    from gwgrad import grid as launch_grid
    from gwgrad.backends.base import LaunchArgs

    tiling, kw = K_SPLIT_CASES[case]
    seed = 1000 + case
    spec = dataclasses.replace(make_spec("sm_90a", 256, 384, 6, tiling=(*tiling, 1), **kw),
                               split_tokens=512)
    spec, backend, compiled = compiled_for(spec)
    if grid:
        monkeypatch.setattr(launch_grid, "grid_size", lambda cfg, device: grid)
    counts = [1040, 0, 4600, 520, 96, 8]
    torch.manual_seed(seed)
    a, b, offs, t, a_parts, b_parts = make_operands(spec, counts)
    dtype = kw.get("out", torch.bfloat16)
    acc = kw.get("acc", False)
    e, m, n = len(counts), spec.hidden, spec.intermediate
    init = (torch.randn(e, m, n, device="cuda").to(dtype) if acc
            else torch.full((e, m, n), float("nan"), device="cuda", dtype=dtype))
    ws = torch.zeros(backend.workspace_bytes(spec), dtype=torch.uint8, device="cuda")
    results = []
    for _ in range(2):
        if spec.output_mode == "dense":
            out = init.clone()
            outs, wgrad = list(out.unbind(0)), dict(wgrad=desc(out))
        else:
            outs = [init[x].clone() for x in range(e)]
            ptrs = torch.tensor([o.data_ptr() for o in outs], dtype=torch.int64, device="cuda")
            wgrad = dict(wgrad_ptrs=desc(ptrs))
        backend.launch(compiled, spec, LaunchArgs(
            a=desc(a), b=desc(b), offsets=desc(offs), tokens_sum=t,
            stream=torch.cuda.current_stream().cuda_stream, workspace=ws.data_ptr(), **wgrad))
        torch.cuda.synchronize()
        for x in range(e):
            ref = a_parts[x].double() @ b_parts[x].double()
            if acc:
                ref = ref + init[x].double()
            got = outs[x].double()
            assert not torch.isnan(got).any(), (f"seed {seed}", x, "not fully written")
            err = (got - ref).norm() / max(ref.norm(), 1e-30)
            assert err < 1e-2, (f"seed {seed}", x, counts[x], float(err))
        results.append([o.clone() for o in outs])
    assert all(torch.equal(p, q) for p, q in zip(*results)), f"seed {seed}: calls differ"
