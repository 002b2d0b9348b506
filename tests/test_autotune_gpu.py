"""The autotuner on an SM90 GPU (gwgrad/autotune.py): a small BF16 problem tuned among a few
candidates, the winner's result against FP64; an accumulated output untouched by the tuning;
a second process using the persisted winner without timing, compiling or importing the CuTe
DSL; invalid offsets raising the wrapper's error. Few candidates each (``max_candidates``),
so that the file's compiles stay within a minute on the H200 host."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import gwgrad  # noqa: E402
from gwgrad import plan as plans  # noqa: E402

at = sys.modules["gwgrad.autotune"]  # gwgrad.autotune is the function
ROOT = Path(__file__).resolve().parents[1]

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available()
                       or torch.cuda.get_device_capability() != (9, 0),
                       reason="needs torch with an SM90 GPU"),
]

HIDDEN, INTER = 256, 512
#: An empty expert, counts that end inside a tile (both operands M/N-major: any count runs).
COUNTS = [0, 300, 37, 700, 1024, 5]


def operands(counts=COUNTS):
    """x (tokens, hidden) and dy (tokens, intermediate) bfloat16, offsets int32, on the GPU:
    the call's A is x.T (M-major), B is dy (N-major)."""
    tokens = sum(counts)
    x = torch.randn(tokens, HIDDEN, device="cuda").to(torch.bfloat16)
    dy = torch.randn(tokens, INTER, device="cuda").to(torch.bfloat16)
    offsets = torch.tensor(counts, device="cuda").cumsum(0).to(torch.int32)
    return x, dy, offsets


def reference(x, dy, counts=COUNTS):
    """Each expert's x_e.T @ dy_e in float64."""
    ends = torch.tensor(counts).cumsum(0).tolist()
    starts = [0] + ends[:-1]
    return [x[s:e].double().T @ dy[s:e].double() for s, e in zip(starts, ends)]


def check(outs, refs, base=None):
    for e, (got, want) in enumerate(zip(outs, refs)):
        if base is not None:
            want = want + base[e].double()
        got = got.double()
        assert not torch.isnan(got).any(), f"expert {e}: output not fully written"
        err = float((got - want).norm() / want.norm().clamp_min(1e-30))
        assert err < 1e-2 or (want.norm() == 0 and got.norm() == 0), f"expert {e}: {err:.2e}"


def only_plan():
    """The wrapper's plan of the one signature called since the test began."""
    (plan,) = plans.call_plans._entries.values()
    return plan


def test_a_tuned_signature_computes_with_its_winner():
    x, dy, offsets = operands()
    out = torch.full((len(COUNTS), HIDDEN, INTER), float("nan"), device="cuda",
                     dtype=torch.bfloat16)
    result = gwgrad.autotune(x.T, dy, offsets_tensor=offsets, wgrad_tensor=out,
                             max_candidates=3)
    assert result.source == "timed", result
    assert [t.tuning for t in result.timings][0] == result.default and len(result.timings) == 3
    assert all(t.ms and t.ms > 0 for t in result.timings), result.timings
    assert torch.isnan(out).all()  # the caller's output is never the tuning's
    saved = json.loads(Path(result.path).read_text())
    assert saved["winner"]["mma_tiler_mn"] == list(result.tuning.mma_tiler_mn)
    assert saved["device"] == torch.cuda.get_device_name()
    gwgrad.grouped_gemm_wgrad(x.T, dy, offsets_tensor=offsets, wgrad_tensor=out)
    torch.cuda.synchronize()
    assert only_plan().spec == result.spec
    check(out.unbind(0), reference(x, dy))
    # Invalid offsets: the wrapper's host-check error, before anything is timed.
    bad = torch.tensor([0, 300, 200, 1100, 2066, 2066], dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match=r"^offsets_tensor: expected non-decreasing offsets"):
        gwgrad.autotune(x.T, dy, offsets_tensor=bad, wgrad_tensor=out, retune=True)


def test_tuning_an_accumulating_call_leaves_its_outputs_untouched():
    """FP32 main gradients, one buffer per expert (discrete, accumulating): the tuning times
    into scratch buffers; the outputs keep every bit until the call itself adds into them."""
    x, dy, offsets = operands()
    outs = [torch.randn(HIDDEN, INTER, device="cuda") for _ in COUNTS]
    before = [o.clone() for o in outs]
    ptrs = torch.tensor([o.data_ptr() for o in outs], dtype=torch.int64, device="cuda")
    kwargs = dict(offsets_tensor=offsets, output_mode="discrete", wgrad_ptrs=ptrs,
                  wgrad_dtype=torch.float32, accumulate_on_output=True)
    result = gwgrad.autotune(x.T, dy, max_candidates=2, **kwargs)
    torch.cuda.synchronize()
    assert result.source == "timed" and all(t.ms for t in result.timings), result
    for got, want in zip(outs, before):
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    gwgrad.grouped_gemm_wgrad(x.T, dy, **kwargs)
    torch.cuda.synchronize()
    assert only_plan().spec == result.spec
    check(outs, reference(x, dy), base=before)


CHILD = """
import json, sys, torch
import gwgrad
from gwgrad import kernel_cache, plan as plans
at = sys.modules["gwgrad.autotune"]
counts = {counts}
x = torch.randn(sum(counts), {hidden}, device="cuda").to(torch.bfloat16)
dy = torch.randn(sum(counts), {inter}, device="cuda").to(torch.bfloat16)
offsets = torch.tensor(counts, device="cuda").cumsum(0).to(torch.int32)
(w,) = gwgrad.grouped_gemm_wgrad(x.T, dy, offsets_tensor=offsets)
ends = torch.tensor(counts).cumsum(0).tolist()
err = max(float((w[e].double() - x[s:t].double().T @ dy[s:t].double()).norm()
                / (x[s:t].double().T @ dy[s:t].double()).norm())
          for e, (s, t) in enumerate(zip([0] + ends[:-1], ends)) if t > s)
(plan,) = plans.call_plans._entries.values()
print(json.dumps({{"stats": at.stats(), "compiles": kernel_cache.stats()["compiles"],
                  "tiling": [list(plan.spec.mma_tiler_mn), list(plan.spec.cluster_shape_mn)],
                  "tuning": repr(plan.spec.tuning), "err": err,
                  "cutlass": "cutlass" in sys.modules}}))
"""


def test_a_second_process_uses_the_persisted_winner_without_timing():
    counts = [128, 64, 0, 960]  # a signature of its own (its tokens_sum)
    x, dy, offsets = operands(counts)
    result = gwgrad.autotune(x.T, dy, offsets_tensor=offsets, max_candidates=3)
    assert result.source == "timed" and result.path, result
    env = dict(os.environ, GWGRAD_AUTOTUNE="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    env.pop("CUTE_DSL_ARCH", None)
    code = CHILD.format(counts=counts, hidden=HIDDEN, inter=INTER)
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    child = json.loads(proc.stdout.strip().splitlines()[-1])
    assert child["stats"]["timed"] == 0 and child["stats"]["loaded"] == 1, child
    assert child["tuning"] == repr(result.tuning), (child, result.tuning)
    assert child["compiles"] == 0 and child["cutlass"] is False, child
    assert child["err"] < 1e-2, child
