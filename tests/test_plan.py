"""The adapters' per-call path (gwgrad.api.operator_for, gwgrad.prepared) without a GPU: a
stand-in CUDA backend records what reaches it; CPU descriptors run on the reference."""

from __future__ import annotations

import numpy as np
import pytest

import gwgrad
from gwgrad import DType, LaunchArgs, from_pointer
from gwgrad import backends as backends_mod
from gwgrad.api import operator_for
from gwgrad.prepared import prepare_call
from wgrad_cases import bf16, bf16_problem, layout_a, layout_b


class PointerRecorder(gwgrad.Backend):
    name = "pointer_recorder"

    def __init__(self, with_pointer_launch=True):
        self.compiled, self.calls, self.pointer_calls = [], [], []
        if with_pointer_launch:
            self.launch_pointers = self._launch_pointers

    def check_support(self, spec):
        pass

    def workspace_bytes(self, spec):
        return 4096

    def compile(self, spec):
        self.compiled.append(spec)
        return ("compiled", spec)

    def launch(self, compiled, spec, args):
        self.calls.append(args)

    def _launch_pointers(self, compiled, spec, device_id, *values):
        self.pointer_calls.append((compiled, device_id) + values)


@pytest.fixture(params=[True, False], ids=["launch_pointers", "launch"])
def backend(request, monkeypatch):
    rec = PointerRecorder(with_pointer_launch=request.param)
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_100a")
    monkeypatch.setitem(backends_mod._instances,
                        ("gwgrad.backends.bf16_sm100", "Bf16Sm100Backend"), rec)
    return rec


def cuda(shape, strides, dtype, ptr):
    return from_pointer(ptr, shape, strides, dtype, 0)


H, N, E, T = 64, 128, 4, 512


def descs(a_ptr=1 << 32, b_ptr=2 << 32, off_ptr=3 << 32, out_ptr=4 << 32, tokens=T):
    return (cuda((H, tokens), (1, H), DType.BFLOAT16, a_ptr),
            cuda((tokens, N), (N, 1), DType.BFLOAT16, b_ptr),
            cuda((E,), None, DType.INT32, off_ptr),
            cuda((E, H, N), None, DType.FLOAT32, out_ptr))


def test_operator_for_checks_once_per_signature(backend):
    a, b, off, out = descs()
    op = operator_for(a, b, off, wgrad=out)
    assert op is operator_for(*descs(a_ptr=5 << 32)[:3], wgrad=out)  # new storage: same op
    assert len(backend.compiled) == 1
    with pytest.raises(ValueError, match="^b_tensor:"):
        operator_for(a, descs(tokens=T // 2)[1], off, wgrad=out)
    other = operator_for(*descs(tokens=T // 2)[:3], wgrad=out)  # a new signature
    assert other is op  # tokens_sum is dynamic: the same compiled operator
    assert operator_for(a, b, off, wgrad=out, accumulate_on_output=True) is not op
    gwgrad.clear_cache()
    assert operator_for(a, b, off, wgrad=out) is not op


def test_prepared_call_launches_from_addresses(backend):
    a, b, off, out = descs()
    call = prepare_call(a, b, off, wgrad=out)
    assert (call.is_cuda, call.device_id, call.workspace_bytes, call.tokens_sum) == (
        True, 0, 4096, T)
    call.launch(16 << 32, 17 << 32, 18 << 32 | 4, 19 << 32, stream=0x77, workspace=0x1000)
    if backend.pointer_calls:
        (compiled, device, *values), = backend.pointer_calls
        assert compiled == ("compiled", call.operator.spec) and device == 0
        assert values == [16 << 32, 17 << 32, 18 << 32 | 4, 19 << 32, 0x1000, T, 0x77]
    else:
        (args,) = backend.calls
        assert isinstance(args, LaunchArgs)
        assert (args.a.ptr, args.b.ptr, args.offsets.ptr, args.wgrad.ptr) == (
            16 << 32, 17 << 32, 18 << 32 | 4, 19 << 32)
        assert (args.stream, args.workspace, args.tokens_sum) == (0x77, 0x1000, T)
        assert args.a.owner is None  # the prepared call holds no user memory
    for bad, name in (((1 << 32) + 8, "a_tensor"), ((3 << 32) + 2, "offsets_tensor")):
        values = [1 << 32, 2 << 32, 3 << 32, 4 << 32]
        values[0 if name == "a_tensor" else 2] = bad
        with pytest.raises(ValueError, match=f"^{name}: expected a .*-byte aligned"):
            call.launch(*values)


def test_prepared_discrete_call(backend):
    a, b, off, _ = descs()
    ptrs = cuda((E,), None, DType.INT64, 6 << 32)
    call = prepare_call(a, b, off, wgrad_ptrs=ptrs, output_mode="discrete",
                        wgrad_dtype=DType.BFLOAT16)
    assert call.discrete and call.operator.spec.output_mode == "discrete"
    call.launch(1 << 32, 2 << 32, 3 << 32, 7 << 32, stream=5, workspace=64)
    if backend.calls:
        assert backend.calls[0].wgrad_ptrs.ptr == 7 << 32 and backend.calls[0].wgrad is None
    with pytest.raises(ValueError, match="^wgrad_ptrs: expected a 16-byte"):
        call.launch(1 << 32, 2 << 32, 3 << 32, (7 << 32) + 8)


def test_prepared_call_on_the_cpu(rng):
    p = bf16_problem(rng)
    a = layout_a(bf16(p.a), p.counts, "m", "tensor2d")
    b = layout_b(bf16(p.b), p.counts, "n", "tensor2d")
    offsets = gwgrad.as_tensor_desc(p.offsets, "offsets")
    out = np.full((p.experts, p.a.shape[0], p.b.shape[1]), np.nan, np.float32)
    call = prepare_call(a.desc, b.desc, offsets, wgrad=gwgrad.as_tensor_desc(out, "out"))
    assert not call.is_cuda and call.workspace_bytes == 0
    call.launch(a.desc.ptr, b.desc.ptr, offsets.ptr, out.ctypes.data)
    np.testing.assert_allclose(out, p.expected(), rtol=1e-6, atol=1e-6)
