"""The SM90 BF16 kernel compiles for sm_90a without a GPU, in every mode, and its PTX holds
the Hopper instructions it is built on, and the device-side offsets check: the prep kernel's
sticky status record (GPU-scope CAS + system-scope fence) and the GEMM's verdict read before any work."""

from __future__ import annotations

import itertools

import pytest

pytest.importorskip("cutlass")

from kernel_compile import check_offsets_check_ptx, compile_ptx, spec  # noqa: E402

MAJORS = [("m", "n"), ("k", "n"), ("m", "k"), ("k", "k")]
MODES = list(itertools.product(MAJORS, ["tensor2d", "tensor_ragged"], ["dense", "discrete"],
                               ["bfloat16", "float16", "float32"], [False, True]))


def check_hopper_ptx(ptx: str, accumulate: bool) -> None:
    check_offsets_check_ptx(ptx)
    assert "wgmma.mma_async.sync.aligned" in ptx
    assert "cp.async.bulk.tensor" in ptx and ".shared::cta.global" in ptx  # TMA loads
    assert "setmaxnreg" in ptx  # producer / consumer register split
    assert "atom.global.add" in ptx  # dynamic unit counter
    assert "fence.proxy.tensormap::generic.acquire" in ptx  # per-expert descriptors
    if accumulate:
        assert "cp.reduce.async.bulk.tensor" in ptx and ".add." in ptx
    else:
        assert "cp.reduce.async.bulk" not in ptx
        assert "cp.async.bulk.tensor" in ptx and ".global.shared::cta" in ptx  # TMA store


@pytest.mark.parametrize("majors,order,mode,out,acc", MODES,
                         ids=lambda v: v if isinstance(v, str) else str(v))
def test_every_mode_compiles(majors, order, mode, out, acc):
    ptx = compile_ptx(spec("sm_90a", a_major=majors[0], b_major=majors[1], order=order,
                           mode=mode, out=out, acc=acc))
    check_hopper_ptx(ptx, acc)


@pytest.mark.parametrize("tile", [(128, 256), (256, 128), (128, 192), (128, 128), (64, 256),
                                  (64, 128)], ids=lambda t: f"{t[0]}x{t[1]}")
def test_every_tile_compiles(tile):
    ptx = compile_ptx(spec("sm_90a", tile=tile, cluster=(1, 1)))
    check_hopper_ptx(ptx, False)
    if tile in ((128, 128), (64, 256), (64, 128)):  # pingpong: ordered warp-group handoff
        assert "bar.arrive" in ptx


@pytest.mark.parametrize("tile,cluster,match", [
    ((128, 96), (1, 1), "mma_tiler_mn"),
    ((256, 256), (1, 1), "mma_tiler_mn"),  # 256 accumulator registers per thread
    ((128, 256), (2, 1), "cluster_shape_mn"),
])
def test_unsupported_tiling_is_a_value_error(tile, cluster, match):
    from gwgrad.backends import finalize_spec

    with pytest.raises(ValueError, match=match):
        finalize_spec(spec("sm_90a", tile=tile, cluster=cluster))
