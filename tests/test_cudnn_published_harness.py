"""The float64 reference of tools/cudnn_published/conftest.py (the stand-in for torch's
block-scaled grouped GEMM below SM100 when cuDNN frontend's own tests run against gwgrad):
its scale unswizzling and FP4 decoding against gwgrad's scale and format rules, and a whole
call against a plain float64 loop."""

import importlib.util
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from gwgrad import formats, scales  # noqa: E402

HARNESS = Path(__file__).resolve().parents[1] / "tools" / "cudnn_published" / "conftest.py"


@pytest.fixture(scope="module")
def harness():
    spec = importlib.util.spec_from_file_location("cudnn_published_conftest", HARNESS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("rows,counts,vec", [(384, [256, 384], 32), (130, [0, 40, 33], 16),
                                             (640, [1, 2000], 32)])
def test_scales_unswizzle_per_expert(harness, rows, counts, vec):
    rng = np.random.default_rng(7)
    raws = [rng.integers(1, 255, (rows, -(-c // vec)), dtype=np.uint8) for c in counts]
    blocked = scales.assemble_blocked(raws, rows)
    got = harness._expert_scales(torch.from_numpy(blocked), rows, counts, vec)
    for raw, part in zip(raws, got):
        np.testing.assert_array_equal(part.numpy(), raw.astype(np.float64))


@pytest.mark.parametrize("axis", [0, 1])
def test_fp4_values_match_gwgrad_formats(harness, axis):
    rng = np.random.default_rng(3)
    codes = rng.integers(0, 16, (6, 8), dtype=np.uint8)
    packed = formats.pack_fp4(codes, axis)
    t = torch.from_numpy(packed).view(torch.float4_e2m1fn_x2)
    np.testing.assert_array_equal(harness._values(t, axis).numpy(),
                                  formats.unpack_fp4(packed, axis).astype(np.float64))


def test_reference_matches_a_float64_loop(harness):
    gen = torch.Generator().manual_seed(5)
    m, n, counts, vec = 130, 72, [64, 0, 96], 32
    tokens = sum(counts)
    a = torch.randint(-4, 5, (m, tokens), generator=gen).to(torch.float8_e4m3fn)
    b = torch.randint(-4, 5, (tokens, n), generator=gen).to(torch.float8_e4m3fn)
    sa = [torch.randint(120, 130, (m, -(-c // vec)), generator=gen, dtype=torch.uint8) for c in counts]
    sb = [torch.randint(120, 130, (n, -(-c // vec)), generator=gen, dtype=torch.uint8) for c in counts]
    sfa = torch.from_numpy(scales.assemble_blocked([s.numpy() for s in sa], m)).view(torch.float8_e8m0fnu)
    sfb = torch.from_numpy(scales.assemble_blocked([s.numpy() for s in sb], n)).view(torch.float8_e8m0fnu)
    offs = torch.tensor(np.cumsum(counts), dtype=torch.int32)
    out = harness._float64_scaled_grouped_mm(a, b, sfa, "BlockWise1x32", sfb, "BlockWise1x32",
                                             offs=offs, output_dtype=torch.float64)
    start = 0
    for e, c in enumerate(counts):
        want = torch.zeros(m, n, dtype=torch.float64)
        for k in range(c):
            col = a[:, start + k].double() * 2.0 ** (sa[e][:, k // vec].double() - 127)
            row = b[start + k, :].double() * 2.0 ** (sb[e][:, k // vec].double() - 127)
            want += torch.outer(col, row)
        torch.testing.assert_close(out[e], want, rtol=0, atol=0)
        start += c


def test_summary_counts_a_junit_report(tmp_path):
    spec = importlib.util.spec_from_file_location(
        "cudnn_published_summary", HARNESS.parent / "summary.py")
    summary = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(summary)
    junit = tmp_path / "junit.xml"
    junit.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="fe_api.t" name="a"/>'
        '<testcase classname="fe_api.t" name="b"><skipped message="Unsupported testcase: '
        'x: needs an SM100 GPU"/></testcase>'
        '<testcase classname="fe_api.t" name="c"><skipped message="Unsupported testcase: '
        'x: needs an SM100 GPU"/></testcase>'
        '<testcase classname="fe_api.t" name="d"><failure message="boom"/></testcase>'
        '</testsuite></testsuites>')
    got = summary.summarize(str(junit), "abc")
    assert (got["passed"], got["skipped"], got["failed"]) == (1, 2, 1)
    assert got["skip_reasons"] == {"x: needs an SM100 GPU": 2}
    assert got["failures"] == [{"test": "fe_api.t::d", "message": "boom"}]
