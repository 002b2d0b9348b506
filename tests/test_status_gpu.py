"""The device-side offsets check on a GPU: invalid offsets make a launch write nothing (an FP32
main grad that is accumulated into stays bit-for-bit unchanged, and so does the memory around
the output), and the ValueError naming ``offsets_tensor`` comes at the documented points:
``gwgrad.check_errors()``, the next gwgrad launch once the failed one completed, or at once
with ``validate_offsets=True``. Eager, ``validate_offsets=False`` and CUDA-graph replays."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import gwgrad  # noqa: E402
import gwgrad.adapters.torch as gwt  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs torch with a CUDA GPU"),
]

E, HIDDEN, INTER = 5, 256, 384
COUNTS = [512, 0, 997, 3, 256]
T = sum(COUNTS)
GUARD = 4096  # float32 elements on each side of the output

# name -> (offsets, what the message says); misaligned counts need a K-major operand.
BAD = {
    "decreasing": ([512, 400, 1509, 1512, T], r"non-decreasing offsets, got offsets_tensor\[1\] = 400"),
    "negative": ([-16, 512, 1509, 1512, T], r"offsets >= 0, got offsets_tensor\[0\] = -16"),
    "past_the_end": ([512, 512, 1509, 1512, T + 64], rf"last offset to equal tokens_sum = {T}"),
    "short": ([512, 512, 1509, 1512, T - 8], rf"last offset to equal tokens_sum = {T}"),
}


def good_offsets():
    return torch.cumsum(torch.tensor(COUNTS), 0).to(torch.int32).cuda()


def operands():
    x = torch.randn(T, HIDDEN, dtype=torch.bfloat16, device="cuda")
    dy = torch.randn(T, INTER, dtype=torch.bfloat16, device="cuda")
    return x, dy


def guarded_output(dtype=torch.float32):
    """(output view, the whole buffer, a copy of it): random values, guards on both sides."""
    n = E * HIDDEN * INTER
    whole = torch.randn(GUARD + n + GUARD, device="cuda").to(dtype)
    out = whole[GUARD:GUARD + n].view(E, HIDDEN, INTER)
    return out, whole, whole.clone()


def unchanged(whole, before) -> bool:
    torch.cuda.synchronize()
    return torch.equal(whole.view(torch.int32 if whole.element_size() == 4 else torch.int16),
                       before.view(torch.int32 if before.element_size() == 4 else torch.int16))


def reference(x, dy, offsets):
    bounds = [0] + offsets.tolist()
    return torch.stack([x[s:e].double().T @ dy[s:e].double() for s, e in zip(bounds, bounds[1:])])


@pytest.fixture(autouse=True)
def nothing_pending():
    gwgrad.check_errors()
    yield
    gwgrad.check_errors()


@pytest.mark.parametrize("case", sorted(BAD))
@pytest.mark.parametrize("entry", ["wrapper", "adapter_accumulate", "class"])
def test_invalid_offsets_write_nothing_and_raise_at_check_errors(case, entry):
    x, dy = operands()
    values, message = BAD[case]
    bad = torch.tensor(values, dtype=torch.int32, device="cuda")
    out, whole, before = guarded_output()
    if entry == "wrapper":  # the contract's wrapper, default arguments: no host check
        gwgrad.grouped_gemm_wgrad_wrapper_sm100(a_tensor=x.T, b_tensor=dy, sfa_tensor=None,
                                                sfb_tensor=None, offsets_tensor=bad,
                                                wgrad_tensor=out)
    elif entry == "adapter_accumulate":  # an FP32 main grad: no partial or clamped sum
        gwt.wgrad(x, dy, bad, out=out, accumulate=True)
    else:
        op = gwgrad.GroupedGemmWgrad(x.T, dy, None, None, good_offsets(), out,
                                     accumulate_on_output=True)
        op.compile()
        op.execute(x.T, dy, None, None, bad, out)
    with pytest.raises(ValueError, match=r"^offsets_tensor: expected .*" + message):
        gwgrad.check_errors()
    assert unchanged(whole, before)


def test_the_next_launch_raises_and_is_not_enqueued():
    x, dy = operands()
    out, whole, before = guarded_output()
    bad = torch.tensor(BAD["decreasing"][0], dtype=torch.int32, device="cuda")
    gwt.wgrad(x, dy, bad, out=out)  # returns at once: nothing synchronizes
    torch.cuda.synchronize()  # the failed launch completed: its record is visible
    with pytest.raises(ValueError, match=r"^offsets: expected non-decreasing"):
        gwt.wgrad(x, dy, good_offsets(), out=out)
    assert unchanged(whole, before)
    gwt.wgrad(x, dy, good_offsets(), out=out)  # reported once; now it runs
    torch.cuda.synchronize()
    want = reference(x, dy, good_offsets())
    assert float((out.double() - want).norm() / want.norm()) < 1e-5


def test_validate_offsets_raises_before_launching():
    x, dy = operands()
    out, whole, before = guarded_output()
    bad = torch.tensor(BAD["past_the_end"][0], dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match=r"^offsets_tensor: expected the last offset"):
        gwgrad.grouped_gemm_wgrad(x.T, dy, offsets_tensor=bad, wgrad_tensor=out,
                                  validate_offsets=True)
    with pytest.raises(ValueError, match=r"^offsets: expected the last offset"):
        gwt.wgrad(x, dy, bad, out=out, validate_offsets=True)
    gwgrad.check_errors()  # nothing reached the device
    assert unchanged(whole, before)


def test_misaligned_counts_with_a_k_major_operand():
    x, dy = operands()
    a_k = x.T.contiguous()  # K-major A: every count must be a multiple of 8
    out, whole, before = guarded_output(torch.bfloat16)
    counts = [512, 0, 997, 3, 256]  # sums to a multiple of 8, two counts are not
    offs = torch.cumsum(torch.tensor(counts), 0).to(torch.int32).cuda()
    gwgrad.grouped_gemm_wgrad(a_k, dy, offsets_tensor=offs, wgrad_tensor=out)
    with pytest.raises(ValueError, match=r"^offsets_tensor: expected every expert's token count "
                                         r"to be a multiple of 8 .*got 997 tokens for expert 2"):
        gwgrad.check_errors()
    assert unchanged(whole, before)


def test_graph_replays_with_invalid_offsets_write_nothing():
    x, dy = operands()
    out, whole, _ = guarded_output()
    offsets = good_offsets()
    gwt.wgrad(x, dy, offsets, out=out, accumulate=True)  # compile and plan before capturing
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    # Capture on a stream of the tensors' device: torch.cuda.graph's default capture
    # stream is made once per process, on the device current at its first use.
    with torch.cuda.graph(graph, stream=torch.cuda.Stream(out.device)):
        gwt.wgrad(x, dy, offsets, out=out, accumulate=True)
    before = whole.clone()
    for case in sorted(BAD):
        offsets.copy_(torch.tensor(BAD[case][0], dtype=torch.int32))
        graph.replay()
        with pytest.raises(ValueError, match=r"^offsets_tensor: expected .*" + BAD[case][1]):
            gwgrad.check_errors()
        assert unchanged(whole, before), case
    offsets.copy_(good_offsets())
    graph.replay()
    torch.cuda.synchronize()
    want = before[GUARD:GUARD + out.numel()].view_as(out).double() + reference(x, dy, offsets)
    assert float((out.double() - want).norm() / want.norm()) < 1e-5
