"""The SM100 BF16 kernel compiles for sm_100a without a GPU in every supported configuration
(tile x cluster, and every mode on the default tile), and for sm_103a (the same kernel) on the
default one; its PTX holds the Blackwell
instructions it is built on: tcgen05 MMA and TMEM allocation, TMA loads, the TMA store or
reduce-add, cluster launch control for the dynamic schedule with only the scheduler warps
reading its responses (mbarrier counts), multicast TMA loads exactly where the cluster shares B, descriptor prefetches and the TMEM-load wait before an accumulator
stage is released; and the device-side offsets
check: the prep kernel's sticky status record (GPU-scope CAS + system-scope fence) and the GEMM's verdict
read before any cluster barrier, TMEM allocation or CLC query.

The exhaustive compiles are marked ``compile`` (``python -m pytest -m compile``); the fast tier
compiles the default configuration once (test_compile_smoke.py)."""

from __future__ import annotations

import itertools
import re

import pytest

pytest.importorskip("cutlass")

from kernel_compile import check_offsets_check_ptx, compile_ptx, spec  # noqa: E402

MAJORS = [("m", "n"), ("k", "n"), ("m", "k"), ("k", "k")]
MODES = list(itertools.product(MAJORS, ["tensor2d", "tensor_ragged"], ["dense", "discrete"],
                               ["bfloat16", "float16", "float32"], [False, True]))
TILINGS = ([((128, n), (c, 1)) for n in range(64, 257, 32) for c in (1, 2, 4)]
           + [((256, n), (c, 1)) for n in range(64, 257, 32) for c in (2, 4)])



def multicast_loads(ptx: str) -> list:
    """The TMA loads that multicast to the cluster (CLC's try_cancel and tcgen05.commit also
    say multicast::cluster: only cp.async.bulk.tensor lines count)."""
    return [line for line in ptx.splitlines()
            if line.strip().startswith("cp.async.bulk.tensor") and "multicast::cluster" in line]


def mbarrier_init_counts(ptx: str) -> list:
    """The arrival counts of the GEMM kernel's mbarrier.init instructions (registers resolved
    to the constants they are moved from)."""
    body = [c for c in ptx.split(".entry ")[1:] if "tcgen05.mma" in c][0]
    consts = dict(re.findall(r"mov\.b32\s+(%r\d+),\s*(\d+);", body))
    counts = []
    for arg in re.findall(r"mbarrier\.init\.shared(?:::cta)?\.b64\s+\[[^\]]+\],\s*([^;]+);", body):
        arg = arg.strip()
        counts.append(int(consts.get(arg, arg)))
    return counts


def check_schedule_counts(ptx: str, cluster_size: int) -> None:
    """Only the scheduler warps (one per CTA) consume the CLC response; the TMA, MMA and four
    epilogue warps (6 x 32 threads) consume the scheduler's unit ring, which 32 threads fill."""
    counts = mbarrier_init_counts(ptx)
    assert 32 * cluster_size in counts, counts
    assert 32 * 6 in counts, counts
    assert 32 * (1 + cluster_size * 6) not in counts, counts  # the old all-warps CLC count


def check_blackwell_ptx(ptx: str, accumulate: bool, two_cta: bool) -> None:
    check_offsets_check_ptx(ptx, before_verdict=("barrier.cluster", "mbarrier.init", "tcgen05.alloc", "clusterlaunchcontrol"))
    assert "tcgen05.mma" in ptx
    assert "tcgen05.alloc" in ptx and "tcgen05.dealloc" in ptx
    assert "tcgen05.ld" in ptx  # TMEM -> registers in the epilogue
    # the TMEM loads are waited for before the accumulator stage goes back to the MMA warp
    assert "tcgen05.wait::ld" in ptx
    assert "prefetch.tensormap" in ptx  # per-expert descriptors warmed after the acquire
    assert "cp.async.bulk.tensor" in ptx and ".global.tile.mbarrier::complete_tx" in ptx  # TMA loads
    assert "clusterlaunchcontrol.try_cancel" in ptx  # dynamic persistent schedule
    assert "fence.proxy.tensormap::generic.acquire" in ptx  # per-expert descriptors
    assert ("tcgen05.mma.cta_group::2" in ptx) == two_cta
    if accumulate:
        assert "cp.reduce.async.bulk.tensor" in ptx and ".add." in ptx
    else:
        assert "cp.reduce.async.bulk" not in ptx


@pytest.mark.compile
@pytest.mark.parametrize("majors,order,mode,out,acc", MODES,
                         ids=lambda v: v if isinstance(v, str) else str(v))
def test_every_mode_compiles(majors, order, mode, out, acc):
    ptx = compile_ptx(spec("sm_100a", a_major=majors[0], b_major=majors[1], order=order,
                           mode=mode, out=out, acc=acc))
    check_blackwell_ptx(ptx, acc, two_cta=True)  # default: 256x256 on a (2, 1) cluster
    assert not multicast_loads(ptx)  # the CTA pair splits A and B: nothing shared
    check_schedule_counts(ptx, 2)


@pytest.mark.compile
@pytest.mark.parametrize("tile,cluster", TILINGS, ids=lambda v: "x".join(map(str, v)))
def test_every_tiling_compiles(tile, cluster):
    ptx = compile_ptx(spec("sm_100a", tile=tile, cluster=cluster, acc=tile[1] % 64 == 0))
    check_blackwell_ptx(ptx, tile[1] % 64 == 0, two_cta=tile[0] == 256)
    # B's K-blocks are multicast exactly when several MMAs of the cluster share them: more
    # CTAs along M than one MMA takes (a 256-row MMA takes a CTA pair).
    shares_b = cluster[0] // (2 if tile[0] == 256 else 1) > 1
    assert bool(multicast_loads(ptx)) == shares_b, (tile, cluster)
    check_schedule_counts(ptx, cluster[0] * cluster[1])


@pytest.mark.compile
def test_sm103a_compiles():
    """sm_103a (B300) builds the sm_100a kernel: the default configuration compiles for it with
    the same instructions (the modes and tilings are checked on sm_100a above)."""
    ptx = compile_ptx(spec("sm_103a"))
    assert re.search(r"^\.target\s+sm_103a\b", ptx, re.M)
    check_blackwell_ptx(ptx, False, two_cta=True)
    assert not multicast_loads(ptx)
    check_schedule_counts(ptx, 2)


@pytest.mark.parametrize("tile,cluster,match", [
    ((64, 128), (1, 1), "mma_tiler_mn"),
    ((128, 48), (1, 1), "mma_tiler_mn"),
    ((256, 128), (1, 1), "cluster_shape_mn"),  # a 2-CTA MMA needs a CTA pair
    ((128, 128), (1, 2), "cluster_shape_mn"),
    ((128, 128), (3, 1), "cluster_shape_mn"),
])
def test_unsupported_tiling_is_a_value_error(tile, cluster, match):
    from gwgrad.backends import finalize_spec

    with pytest.raises(ValueError, match=match):
        finalize_spec(spec("sm_100a", tile=tile, cluster=cluster))
