"""The plan tier (gwgrad.plan) without a GPU: a stand-in CUDA backend records what reaches it
through its raw-address launcher or, without one, through ``launch``; CPU descriptors run on
the reference. The device status record is a host buffer here."""

from __future__ import annotations

import contextlib
import ctypes

import numpy as np
import pytest

import gwgrad
from gwgrad import DType, LaunchArgs, from_pointer, status
from gwgrad import backends as backends_mod
from gwgrad.plan import plan_for
from wgrad_cases import bf16, bf16_problem, layout_a, layout_b


class PointerRecorder(gwgrad.Backend):
    name = "pointer_recorder"

    def __init__(self, with_launcher=True):
        self.compiled, self.calls, self.pointer_calls = [], [], []
        self.with_launcher = with_launcher

    def check_support(self, spec):
        pass

    def workspace_bytes(self, spec):
        return 4096

    def compile(self, spec):
        self.compiled.append(spec)
        return ("compiled", spec)

    def launch(self, compiled, spec, args):
        self.calls.append(args)

    def launcher(self, compiled, spec, device_id):
        if not self.with_launcher:
            return None
        return lambda *values: self.pointer_calls.append((compiled, device_id) + values)


_record = (ctypes.c_int32 * 32)()


@pytest.fixture(params=[True, False], ids=["launcher", "launch"])
def backend(request, monkeypatch):
    rec = PointerRecorder(with_launcher=request.param)
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_100a")
    monkeypatch.setitem(backends_mod._instances,
                        ("gwgrad.backends.bf16_sm100", "Bf16Sm100Backend"), rec)
    # The status record in host memory (no CUDA here); clean before and after.
    ctypes.memset(_record, 0, ctypes.sizeof(_record))
    monkeypatch.setattr(status, "_address", ctypes.addressof(_record))
    monkeypatch.setattr(status, "_code", ctypes.c_int32.from_address(ctypes.addressof(_record)))
    # Per-stream workspaces without a GPU: any non-zero address will do for a recorder.
    monkeypatch.setattr(gwgrad.interop, "workspace", lambda device, stream, nbytes: 0xABC000)
    monkeypatch.setattr(gwgrad.cuda, "stream_is_capturing", lambda stream: stream == 0xCA9)
    monkeypatch.setattr(gwgrad.cuda, "on_device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(gwgrad.cuda, "malloc_async", lambda nbytes, stream: 0xDEF000)
    zeroed = []
    monkeypatch.setattr(gwgrad.cuda, "memset_async",
                        lambda ptr, nbytes, stream: zeroed.append((ptr, nbytes, stream)))
    rec.zeroed = zeroed
    freed = []
    monkeypatch.setattr(gwgrad.cuda, "free_async", lambda ptr, stream: freed.append((ptr, stream)))
    rec.freed = freed
    return rec


def cuda(shape, strides, dtype, ptr):
    return from_pointer(ptr, shape, strides, dtype, 0)


H, N, E, T = 64, 128, 4, 512


def descs(a_ptr=1 << 32, b_ptr=2 << 32, off_ptr=3 << 32, out_ptr=4 << 32, tokens=T):
    return (cuda((H, tokens), (1, H), DType.BFLOAT16, a_ptr),
            cuda((tokens, N), (N, 1), DType.BFLOAT16, b_ptr),
            cuda((E,), None, DType.INT32, off_ptr),
            cuda((E, H, N), None, DType.FLOAT32, out_ptr))


def test_plan_checks_once_per_signature(backend):
    a, b, off, out = descs()
    plan = plan_for(a, b, off, wgrad=out)
    assert plan is plan_for(*descs(a_ptr=5 << 32)[:3], wgrad=out)  # new storage: same plan
    assert gwgrad.cache_info()["plans"] >= 1
    with pytest.raises(ValueError, match="^b_tensor:"):
        plan_for(a, descs(tokens=T // 2)[1], off, wgrad=out)
    other = plan_for(*descs(tokens=T // 2)[:3], wgrad=out)  # a new signature, same operator
    assert other is not plan and other.operator is plan.operator and other.tokens_sum == T // 2
    assert plan_for(a, b, off, wgrad=out, accumulate_on_output=True).operator is not plan.operator
    assert len(backend.compiled) == 2


def test_launch_passes_addresses_stream_workspace_and_status(backend):
    a, b, off, out = descs()
    plan = plan_for(a, b, off, wgrad=out)
    plan.launch(16 << 32, 17 << 32, 18 << 32 | 4, 19 << 32, stream=0x77, workspace=0x1000)
    plan.launch(16 << 32, 17 << 32, 18 << 32, 19 << 32, stream=0x78)  # gwgrad's workspace
    if backend.with_launcher:
        (c, dev, *values), (_, _, *values2) = backend.pointer_calls
        assert c == ("compiled", plan.spec) and dev == 0
        assert values == [0x77, 16 << 32, 17 << 32, 18 << 32 | 4, 19 << 32, 0x1000,
                          ctypes.addressof(_record), T]
        assert values2[5] == 0xABC000
        # While the stream is captured: a stream-ordered workspace, its grid-barrier words
        # zeroed on the stream, freed after the launch.
        plan.launch(16 << 32, 17 << 32, 18 << 32, 19 << 32, stream=0xCA9)
        assert backend.pointer_calls[-1][7] == 0xDEF000 and backend.freed == [(0xDEF000, 0xCA9)]
        assert backend.zeroed == [(0xDEF000, 16, 0xCA9)]
    else:
        args, args2 = backend.calls
        assert isinstance(args, LaunchArgs) and args.a.ptr == 16 << 32
        assert (args.stream, args.workspace, args.tokens_sum) == (0x77, 0x1000, T)
        assert args.wgrad.ptr == 19 << 32 and args.wgrad.shape == (E, H, N)
        assert args2.workspace == 0xABC000
    for values in ((16 << 32 | 8, 1, 2, 3), (0, 17 << 32 | 2, 0, 0), (0, 0, 2, 0), (0, 0, 0, 8)):
        with pytest.raises(ValueError, match="16-byte aligned|4-byte aligned"):
            plan.launch(*values)


def test_a_recorded_device_error_is_raised_by_the_next_launch(backend):
    a, b, off, out = descs()
    plan = plan_for(a, b, off, wgrad=out)
    _record[:6] = [2, 3, 500, 400, T, 1]  # what the prep kernel writes: last offset != T
    with pytest.raises(ValueError, match=r"^offsets_tensor: expected the last offset to equal "
                                         r"tokens_sum = 512, got offsets_tensor\[3\] = 500 "
                                         r"\(found by the device-side check"):
        plan.launch(1 << 32, 2 << 32, 3 << 32, 4 << 32)
    assert list(_record[:6]) == [0] * 6  # reported once, cleared
    calls = len(backend.pointer_calls) + len(backend.calls)
    plan.launch(1 << 32, 2 << 32, 3 << 32, 4 << 32)
    assert len(backend.pointer_calls) + len(backend.calls) == calls + 1
    _record[:6] = [1, 2, 10, 90, T, 1]
    with pytest.raises(ValueError, match=r"non-decreasing offsets, got offsets_tensor\[2\] = 10 "
                                         r"after offsets_tensor\[1\] = 90"):
        gwgrad.check_errors(synchronize=False)
    gwgrad.check_errors(synchronize=False)  # nothing left


def test_discrete_plan_takes_the_pointer_array(backend):
    a, b, off, _ = descs()
    ptrs = cuda((E,), None, DType.INT64, 6 << 32)
    plan = plan_for(a, b, off, wgrad_ptrs=ptrs, output_mode="discrete", wgrad_dtype="bfloat16")
    assert plan.discrete and plan.workspace_bytes == 4096
    plan.launch(1 << 32, 2 << 32, 3 << 32, 7 << 32, stream=5, workspace=64)
    if backend.with_launcher:
        assert backend.pointer_calls[-1][2:7] == (5, 1 << 32, 2 << 32, 3 << 32, 7 << 32)
    else:
        args = backend.calls[-1]
        assert args.wgrad is None and args.wgrad_ptrs.ptr == 7 << 32
    with pytest.raises(ValueError, match="^wgrad_ptrs: expected a 16-byte aligned"):
        plan.launch(1 << 32, 2 << 32, 3 << 32, (7 << 32) + 8)


def test_cpu_plan_runs_the_reference(rng):
    p = bf16_problem(rng)
    a = layout_a(bf16(p.a), p.counts, "m", "tensor2d")
    b = layout_b(bf16(p.b), p.counts, "n", "tensor2d")
    offsets = gwgrad.as_tensor_desc(p.offsets, "offsets")
    out = np.full((p.experts, p.a.shape[0], p.b.shape[1]), np.nan, np.float32)
    plan = plan_for(a.desc, b.desc, offsets, wgrad=gwgrad.as_tensor_desc(out, "out"))
    assert not plan.is_cuda and plan.workspace_bytes == 0
    plan.launch(a.desc.ptr, b.desc.ptr, offsets.ptr, out.ctypes.data)
    np.testing.assert_allclose(out, p.expected(), rtol=1e-6, atol=1e-6)
    bad = p.offsets.copy()
    bad[-1] += 1  # the reference checks on the host, always
    with pytest.raises(ValueError, match=r"^offsets_tensor: expected the last offset"):
        plan.launch(a.desc.ptr, b.desc.ptr, bad.ctypes.data, out.ctypes.data)


def test_plan_caches_are_bounded_oldest_out():
    """A token total that changes every call (dropless MoE) makes a new plan each time: the
    caches keep at most maxsize plans, dropping the oldest first (a hit does no bookkeeping)."""
    from gwgrad.plan import PlanCache

    cache = PlanCache(maxsize=3)
    for k in "abc":
        cache[k] = k.upper()
    assert cache.get("a") == "A"
    cache["d"] = "D"
    assert len(cache) == 3 and "a" not in cache and cache.get("b") == "B"
    cache["a"] = "A2"  # rebuilt: now the newest
    assert [cache.get(k) for k in "abcd"] == ["A2", None, "C", "D"]
    assert cache.get("missing") is None
    with pytest.raises(TypeError):
        cache.get([1])  # unhashable: the callers' full check names the argument
    cache.clear()
    assert len(cache) == 0 and cache.get("c") is None
    cache["e"] = "E"
    assert cache.get("e") == "E"  # get still reads the cleared dict


def test_changing_token_totals_keep_the_adapter_caches_bounded(monkeypatch):
    torch = pytest.importorskip("torch")
    import gwgrad.adapters.torch as gwt
    from gwgrad import plan as plans

    monkeypatch.setattr(gwt._plans, "maxsize", 4)
    monkeypatch.setattr(plans._plans, "maxsize", 4)
    gen = torch.Generator().manual_seed(0)
    for tokens in range(8, 8 * 12, 8):
        x = torch.randn(tokens, 16, generator=gen).bfloat16()
        dy = torch.randn(tokens, 24, generator=gen).bfloat16()
        offsets = torch.tensor([tokens // 2, tokens], dtype=torch.int32)
        w = gwt.wgrad(x, dy, offsets, out_dtype=torch.float32)
        want = torch.stack([x[:tokens // 2].double().T @ dy[:tokens // 2].double(),
                            x[tokens // 2:].double().T @ dy[tokens // 2:].double()])
        torch.testing.assert_close(w.double(), want, rtol=1e-5, atol=1e-5)
        assert len(gwt._plans) <= 4 and len(plans._plans) <= 4


def test_a_quantizer_is_one_operator_per_config_and_arch_planned_per_tokens(monkeypatch):
    """gwgrad.quantize's GPU path through the plan: one compiled operator per (config, arch),
    its workspace rule read from the cached kernel's info (no DSL), a plan per token count and
    device that launches the kernel with the tile bound and tokens appended."""
    from gwgrad import kernel_cache, plan, quantizers

    loads, launches = [], []

    class Kernel:  # a KernelFunction from the disk cache
        info = {"tile_tokens": 128, "per_tile": 32, "base": 96}

        def bound(self, device):
            return lambda *values: launches.append((device,) + values)

    def load_or_compile(key_parts, arch, options, signature, build):
        loads.append((key_parts, arch, options, signature))
        return Kernel()

    monkeypatch.setattr(kernel_cache, "load_or_compile", load_or_compile)
    plan.clear_cache()
    request = quantizers.request("mxfp8", "e4m3", 256, 3, "sm_90a")
    assert (request.recipe, request.sf_vec, request.count_multiple) == ("blocked", 32, 32)
    call = plan.quantize_plan(request, 1000, 0)
    assert plan.quantize_plan(request, 1000, 0) is call
    other = plan.quantize_plan(request, 64, 1)
    assert len(loads) == 1 and plan.cache_info()["constructed"] >= 1
    (key_parts, arch, options, signature), = loads
    assert arch == "sm_90a" and options == "--gpu-arch sm_90a"
    assert signature == ("ptr",) * 6 + ("i32",) * 3 + ("stream",)
    assert key_parts == request.key_parts() and "'channels', 256" in repr(key_parts)
    assert call.tile_bound == 8 + 3 and call.workspace_bytes == 96 + 32 * 11
    assert other.tile_bound == 1 + 3
    call.launch(7, 1, 2, 3, 4, 0, 5, 1032)
    assert launches == [(0, 7, 1, 2, 3, 4, 0, 5, 1000, 1032, 11)]
    plan.clear_cache()
