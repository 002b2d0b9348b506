"""The two-pass MXFP8 path on an H100/H200 (Tuning.mainloop=2: kernels/sm90_mxfp8_bf16.py,
the operands dequantized to BF16 in the workspace, then the BF16 kernel), through the public
API with the plan's tuner hook rewriting every blocked-recipe request to mainloop=2 (the
public API does not take the tuning field), against float64 products: the checks of
tests/test_fp8_sm90_gpu.py (run_case: NaN-poisoned outputs in guard memory) for every mode,
tiling, CTA pair and E5M2, and the special scale codes against gwgrad.formats.mx_to_bf16
(the path's documented semantics: one rounding of x * 2^(s-127) to BF16)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import gwgrad  # noqa: E402
from gwgrad import formats  # noqa: E402

import test_fp8_sm90_gpu as fp8_gpu  # noqa: E402  (its tests are called, not collected here)
from test_fp8_sm90_gpu import COUNTS, MODES, run_case  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
        reason="needs an SM90 GPU",
    ),
]


@pytest.fixture(autouse=True)
def two_pass(monkeypatch):
    """Every blocked-recipe call planned in the test runs mainloop=2; afterwards the test
    checks that the two-pass backend compiled the call's operator."""
    from gwgrad import plan as gwplan
    from gwgrad.backends.fp8_sm90 import Mxfp8Bf16Sm90Backend

    def tuner(request, tokens_sum, device_id, tensors):
        if request.scale_recipe == "blocked":
            return request.with_tuning(mainloop=2)
        return request

    gwplan.clear_cache()
    monkeypatch.setattr(gwplan, "tuner", tuner)
    yield
    used = {type(op.backend) for op in gwplan._compiled.values()}
    gwplan.clear_cache()
    assert Mxfp8Bf16Sm90Backend in used, used


@pytest.mark.parametrize("case", range(len(MODES)))
def test_modes(seed, case):
    kw = dict(MODES[case])
    if kw.get("order") == "tensor_ragged":  # mainloop=2 takes tensor2d operands only
        kw["order"] = "tensor2d"
    kw.pop("global_scales", None)  # and no global scales (tests/test_mxfp8_bf16.py: refused)
    run_case(seed, "blocked", COUNTS["blocked"], **kw)


@pytest.mark.parametrize("tiling", [(64, 128), (128, 128), (128, 192), (128, 256)])
def test_tilings(seed, tiling):
    # Partial tiles (hidden 208, intermediate 400), scale tensors with spare columns.
    run_case(seed, "blocked", COUNTS["blocked"], hidden=208, inter=400, tiling=tiling, extra=1)


@pytest.mark.parametrize("cluster", [(1, 2), (2, 1)], ids=["1x2", "2x1"])
@pytest.mark.parametrize("case", [0, 2, 3])
def test_modes_on_pairs(seed, case, cluster):
    kw = dict(MODES[case])
    kw.pop("order", None)
    run_case(seed, "blocked", COUNTS["blocked"], tiling=(128, 128), cluster=cluster, **kw)


def test_e5m2(seed):
    # MXFP8 takes one FP8 type for A and B (the API refuses a mix).
    run_case(seed, "blocked", COUNTS["blocked"], a_fmt="e5m2", b_fmt="e5m2")
    run_case(seed, "blocked", COUNTS["blocked"], a_fmt="e5m2", b_fmt="e5m2",
             out_dtype=torch.float32)


def test_long_experts(seed):
    # Several K blocks and 32-token groups per dequantize CTA row (256 groups: 8192 tokens).
    run_case(seed, "blocked", [4096, 0, 4128, 160], hidden=256, inter=128)


@pytest.mark.parametrize("mode", ["dense", "discrete"])
def test_every_expert_empty(seed, mode):
    # 0 tokens: the dequantize grids still launch one CTA each (a grid of 0 is a launch error).
    run_case(seed, "blocked", [0, 0, 0], hidden=128, inter=64, mode=mode)


def test_special_scale_codes(seed):
    """E8M0 0x00 (2^-127) on A's first column of expert 0 against 0xFE (2^127) on B's: A's
    values become BF16 denormals (rounded below 2^-133), B's of magnitude >= 2 overflow to
    +-Inf (so those outputs are +-Inf or NaN); 0xFF in row 5 of expert 1's A scales makes that
    output row NaN. The reference: float64 products of gwgrad.formats.mx_to_bf16's operands."""
    counts, a, b, _, (raws_a, raws_b), out = fp8_gpu.special_scale_codes_call(
        seed, workspace=False)
    codes_a = a.view(torch.uint8).cpu().numpy()
    codes_b = b.t().contiguous().view(torch.uint8).cpu().numpy()
    start = 0
    for x, c in enumerate(counts):
        k = np.arange(c) // 32
        va = formats.mx_to_bf16(codes_a[:, start:start + c], "e4m3", raws_a[x][:, k])
        vb = formats.mx_to_bf16(codes_b[:, start:start + c], "e4m3", raws_b[x][:, k])
        start += c
        with np.errstate(invalid="ignore", over="ignore"):
            ref = torch.from_numpy(va @ vb.T)
        got = out[x].double().cpu()
        assert torch.equal(torch.isnan(got), torch.isnan(ref)), f"expert {x}: NaN pattern"
        assert torch.equal(torch.isinf(got), torch.isinf(ref)), f"expert {x}: Inf pattern"
        assert torch.equal(got[torch.isinf(ref)], ref[torch.isinf(ref)])
        if x == 0:
            assert torch.isinf(ref).any()  # the documented overflow happened
        if x == 1:
            assert int(torch.isnan(ref).all(dim=1).sum()) == 1
        keep = torch.isfinite(ref)
        err, norm = (got[keep] - ref[keep]).norm().item(), ref[keep].norm().item()
        # Expert 0's finite outputs may all be zero (A's values rounded away): then exactly.
        assert err <= 2e-3 * norm if norm else err == 0, f"expert {x}: error {err:.2e} / {norm:.2e}"


def test_scales_too_small_and_invalid_offsets_write_nothing(seed):
    fp8_gpu.test_scales_too_small_write_nothing(seed)
    fp8_gpu.test_invalid_offsets_write_nothing(seed, "blocked")
