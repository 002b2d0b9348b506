"""The autotuner (gwgrad/autotune.py) without a GPU: the candidates it walks (the real backends'
``check_support``), the persisted winners (written, read back by a fresh loader, corrupt and
foreign files ignored, the key's parts), the switches (``GWGRAD_AUTOTUNE`` through
``plan_for``, the explicit call, the class) with a stand-in CUDA backend and the device
timing replaced by a deterministic one, and the round-robin timing loop on a fake clock.
The timing on an H200: tests/test_autotune_gpu.py."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

import gwgrad
from gwgrad import DType, from_pointer, plan as plans
from gwgrad import backends as backends_mod
from gwgrad.backends.tuning_rules import SM100
from gwgrad.spec import Tuning

at = sys.modules["gwgrad.autotune"]  # gwgrad.autotune is the function


# --- candidates, on the real backends -----------------------------------------------------------

def _requests():
    from kernel_compile import fp8_spec, spec

    return [
        (spec("sm_90a", hidden=2048, intermediate=1408, experts=64), 64 * 512),
        (spec("sm_90a", hidden=4096, intermediate=4096, experts=8, out="float32", acc=True), 8 * 4096),
        (spec("sm_90a", hidden=200, intermediate=136, experts=3), 500),
        (spec("sm_90a", hidden=256, intermediate=512, experts=4, mode="discrete"), 4 * 200),
        (fp8_spec("sm_90a", "block_1x128", hidden=2048, intermediate=1024), 4096),
        (fp8_spec("sm_90a", "per_expert_channel", hidden=1024, intermediate=768), 4096),
        (spec("sm_100a", hidden=2048, intermediate=768), 4096),
        (fp8_spec("sm_100a", "blocked", a_major="m", b_major="n"), 4096),
    ]


def test_every_candidate_passes_check_support_and_the_default_comes_first():
    pytest.importorskip("cutlass")
    for request, tokens in _requests():
        found = at.candidates(request, tokens)
        default, _ = backends_mod.finalize_spec(request, tokens)
        assert found[0] == default, request
        assert 1 < len(found) <= at.MAX_CANDIDATES
        assert len({s.tuning for s in found}) == len(found)  # no candidate twice
        tiles, clusters = at.TABLES[(at._kind(request), request.arch)]
        for spec in found:
            backends_mod.get_backend(spec).check_support(spec)  # raises for one it cannot run
            assert spec == backends_mod.finalize_spec(spec)[0]  # final: every field set
            if spec is not default:
                assert spec.mma_tiler_mn in tiles and spec.cluster_shape_mn in clusters
            # The tuning besides the tiling is the rules' for that tiling.
            fixed = request.with_tuning(mma_tiler_mn=spec.mma_tiler_mn,
                                        cluster_shape_mn=spec.cluster_shape_mn)
            assert spec == backends_mod.finalize_spec(fixed, tokens)[0]


def test_the_caller_fixed_tiling_is_not_tuned():
    pytest.importorskip("cutlass")
    from kernel_compile import spec

    tile = spec("sm_90a", hidden=4096, intermediate=4096, tile=(128, 128))
    found = at.candidates(tile, 8 * 4096)
    assert {s.mma_tiler_mn for s in found} == {(128, 128)}
    assert {s.cluster_shape_mn for s in found} == {(1, 1), (1, 2), (2, 1)}
    cluster = spec("sm_90a", hidden=4096, intermediate=4096, cluster=(1, 1))
    found = at.candidates(cluster, 8 * 4096)
    assert {s.cluster_shape_mn for s in found} == {(1, 1)} and len(found) > 3
    both = spec("sm_90a", hidden=4096, intermediate=4096, tile=(128, 128), cluster=(2, 1))
    (only,) = at.candidates(both, 8 * 4096)
    assert (only.mma_tiler_mn, only.cluster_shape_mn) == ((128, 128), (2, 1))


def test_the_cap_keeps_the_default_and_drops_the_padded_and_the_small():
    pytest.importorskip("cutlass")
    from kernel_compile import spec

    request = spec("sm_90a", hidden=4096, intermediate=4096, experts=8)
    found = at.candidates(request, 8 * 4096)
    every = at.candidates(request, 8 * 4096, limit=100)  # the SM90 BF16 table: 7 tiles x 3
    assert len(found) == at.MAX_CANDIDATES < len(every)
    area = lambda s: at._unit(s)[0] * at._unit(s)[1]  # noqa: E731
    dropped = [s for s in every if s not in found]
    assert max(map(area, dropped)) <= min(map(area, found[1:]))  # the smallest units go
    assert ((64, 128), (1, 1)) in {(s.mma_tiler_mn, s.cluster_shape_mn) for s in dropped}
    three = at.candidates(request, 8 * 4096, limit=3)
    assert three == found[:3]
    assert at.candidates(request, 8 * 4096, limit=1) == found[:1]
    # 136 columns: a 256-wide tile computes almost half padding; the default stays anyway.
    narrow = spec("sm_90a", hidden=200, intermediate=136, experts=3)
    found = at.candidates(narrow, 500)
    least = min(at._padding(s) for s in found)
    assert all(at._padding(s) <= least + at.PADDING_SLACK for s in found[1:])
    assert all(s.mma_tiler_mn[1] != 256 for s in found[1:])


# --- a stand-in CUDA backend and a deterministic timing -----------------------------------------

class Recorder(gwgrad.Backend):
    name = "recorder"
    tuning_rules = SM100  # the SM100 rules' default: 256x256 on a (2, 1) cluster

    def __init__(self):
        self.calls, self.compiled, self.refused = [], [], set()

    def check_support(self, spec):
        if (spec.mma_tiler_mn, spec.cluster_shape_mn) in self.refused:
            raise gwgrad.ArgumentError("mma_tiler_mn", f"not {spec.mma_tiler_mn} here")

    def compile(self, spec):
        self.compiled.append(spec)
        return ("compiled", spec)

    def launch(self, compiled, spec, args):
        self.calls.append((spec, args))


#: The fake timing's answer: the winner, by tiling (ms; anything else 1.0).
FAST = {((128, 128), (1, 1)): 0.25, ((256, 256), (2, 1)): 0.5}


class FakeTiming:
    """``autotune.measure`` without a device: a time per tiling, the calls it received."""

    def __init__(self, fast=FAST, fail=()):
        self.fast, self.fail, self.calls = fast, set(fail), []

    def __call__(self, specs, ops):
        self.calls.append((list(specs), ops))
        return [at.Timing(s.tuning, None, "launch: RuntimeError: no")
                if (s.mma_tiler_mn, s.cluster_shape_mn) in self.fail else
                at.Timing(s.tuning, self.fast.get((s.mma_tiler_mn, s.cluster_shape_mn), 1.0))
                for s in specs]


def never(specs, ops):
    raise AssertionError("timed, where the persisted winner should have been used")


@pytest.fixture
def recorder(monkeypatch, tmp_path):
    import contextlib

    rec = Recorder()
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_100a")
    monkeypatch.setenv("GWGRAD_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv(at.ENV, raising=False)
    monkeypatch.setitem(backends_mod._instances,
                        ("gwgrad.backends.bf16_sm100", "Bf16Sm100Backend"), rec)
    monkeypatch.setattr(at, "device_name", lambda device_id: "Fake GPU")
    monkeypatch.setattr(gwgrad.cuda, "on_device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(gwgrad.cuda, "stream_is_capturing", lambda stream: stream == 0xCA9)
    rec.timing = FakeTiming()
    monkeypatch.setattr(at, "measure", rec.timing)
    rec.cache = tmp_path / "cache"
    return rec


H, N, E, T = 512, 768, 4, 1024


def call_descs(tokens=T, hidden=H):
    a = from_pointer(1 << 32, (hidden, tokens), (1, hidden), DType.BFLOAT16, 0)
    b = from_pointer(2 << 32, (tokens, N), (N, 1), DType.BFLOAT16, 0)
    offsets = from_pointer(3 << 32, (E,), None, DType.INT32, 0)
    out = from_pointer(4 << 32, (E, hidden, N), None, DType.FLOAT32, 0)
    return a, b, offsets, out


def wrapper_call(rec, tokens=T, **kw):
    a, b, offsets, out = call_descs(tokens)
    gwgrad.grouped_gemm_wgrad(a, b, offsets_tensor=offsets, wgrad_tensor=out, current_stream=5,
                              **kw)
    spec, args = rec.calls[-1]
    return spec


def tiling(spec):
    return spec.mma_tiler_mn, spec.cluster_shape_mn


def files(rec):
    return sorted(rec.cache.glob("autotune-*.json")) if rec.cache.exists() else []


# --- the environment switch through plan_for ----------------------------------------------------

def test_the_env_switch_tunes_the_first_call_and_the_plan_uses_the_winner(recorder, monkeypatch):
    assert tiling(wrapper_call(recorder)) == ((256, 256), (2, 1))  # off: the rules' default
    assert recorder.timing.calls == [] and files(recorder) == []
    gwgrad.clear_cache()
    monkeypatch.setenv(at.ENV, "1")
    assert tiling(wrapper_call(recorder)) == ((128, 128), (1, 1))  # the fake's fastest
    (specs, ops), = recorder.timing.calls
    assert tiling(specs[0]) == ((256, 256), (2, 1))  # the default first, timed with the rest
    assert (ops.a.ptr, ops.b.ptr, ops.offsets.ptr, ops.tokens_sum) == (1 << 32, 2 << 32, 3 << 32, T)
    assert ops.stream == 0  # a raw-pointer call: the legacy stream (after a device sync)
    assert tiling(wrapper_call(recorder)) == ((128, 128), (1, 1))  # the cached plan
    assert len(recorder.timing.calls) == 1 and len(files(recorder)) == 1
    # Another tokens_sum is another signature: timed again.
    wrapper_call(recorder, tokens=2 * T)
    assert len(recorder.timing.calls) == 2 and len(files(recorder)) == 2


def test_a_fresh_process_loads_the_persisted_winner_without_timing(recorder, monkeypatch):
    monkeypatch.setenv(at.ENV, "1")
    wrapper_call(recorder)
    loaded = at.stats()["loaded"]
    gwgrad.clear_cache()  # this process forgets: what a new process would know
    monkeypatch.setattr(at, "measure", never)
    assert tiling(wrapper_call(recorder)) == ((128, 128), (1, 1))
    assert at.stats()["loaded"] == loaded + 1
    gwgrad.clear_cache()
    monkeypatch.setenv(at.ENV, "0")  # off: persisted winners are ignored
    assert tiling(wrapper_call(recorder)) == ((256, 256), (2, 1))


def test_the_explicit_call_is_used_by_later_calls_whatever_the_environment(recorder):
    a, b, offsets, out = call_descs()
    assert tiling(wrapper_call(recorder)) == ((256, 256), (2, 1))  # a plan before tuning
    adapter_plans = plans.PlanCache()  # an adapter's cache: emptied too
    adapter_plans["signature"] = "a plan with the old tiling"
    result = gwgrad.autotune(a, b, offsets_tensor=offsets, wgrad_tensor=out, current_stream=9)
    assert "signature" not in adapter_plans
    assert result.source == "timed" and result.tuning == result.spec.tuning
    assert tiling(result.spec) == ((128, 128), (1, 1))
    assert result.default.mma_tiler_mn == (256, 256)
    assert len(result.timings) == len(recorder.timing.calls[0][0]) > 2
    assert recorder.timing.calls[0][1].stream == 9
    assert result.path and json.loads(open(result.path).read())["winner"]["mma_tiler_mn"] == [128, 128]
    assert tiling(wrapper_call(recorder)) == ((128, 128), (1, 1))  # the old plan is forgotten
    op = gwgrad.GroupedGemmWgrad(a, b, None, None, offsets, out)
    op.compile()
    assert tiling(op.spec) == ((128, 128), (1, 1))  # the class too
    again = gwgrad.autotune(a, b, offsets_tensor=offsets, wgrad_tensor=out)
    assert again.source == "memory" and again.tuning == result.tuning
    assert len(recorder.timing.calls) == 1
    gwgrad.clear_cache()
    assert gwgrad.autotune(a, b, offsets_tensor=offsets, wgrad_tensor=out).source == "disk"
    retuned = gwgrad.autotune(a, b, offsets_tensor=offsets, wgrad_tensor=out, retune=True)
    assert retuned.source == "timed" and len(recorder.timing.calls) == 2


def test_the_class_tunes_on_its_samples_under_the_env_switch(recorder, monkeypatch):
    monkeypatch.setenv(at.ENV, "1")
    a, b, offsets, out = call_descs()
    op = gwgrad.GroupedGemmWgrad(a, b, None, None, offsets, out)
    op.check_support()
    assert tiling(op.spec) == ((128, 128), (1, 1))
    (specs, ops), = recorder.timing.calls
    assert ops.a.ptr == a.ptr and op._samples is None  # the samples are not kept after
    # The wrapper's call of the same signature: the class's choice, untimed.
    assert tiling(wrapper_call(recorder)) == ((128, 128), (1, 1))
    assert len(recorder.timing.calls) == 1


def test_a_caller_tiling_wins(recorder, monkeypatch):
    monkeypatch.setenv(at.ENV, "1")
    spec = wrapper_call(recorder, mma_tiler_mn=(256, 128), cluster_shape_mn=(4, 1))
    assert tiling(spec) == ((256, 128), (4, 1)) and recorder.timing.calls == []
    spec = wrapper_call(recorder, mma_tiler_mn=(128, 256))  # the cluster alone is tuned
    (specs, _), = recorder.timing.calls
    assert {s.mma_tiler_mn for s in specs} == {(128, 256)} and spec.mma_tiler_mn == (128, 256)
    a, b, offsets, out = call_descs()
    result = gwgrad.autotune(a, b, offsets_tensor=offsets, wgrad_tensor=out,
                             mma_tiler_mn=(256, 128), cluster_shape_mn=(4, 1))
    assert result.source == "rules" and tiling(result.spec) == ((256, 128), (4, 1))


def test_a_failing_candidate_is_skipped_and_recorded(recorder):
    recorder.timing.fail = {((128, 128), (1, 1))}
    a, b, offsets, out = call_descs()
    result = gwgrad.autotune(a, b, offsets_tensor=offsets, wgrad_tensor=out)
    assert tiling(result.spec) == ((256, 256), (2, 1))  # the next fastest: the default's 0.5 ms
    failed = [t for t in result.timings if t.ms is None]
    assert [t.tuning.mma_tiler_mn for t in failed] == [(128, 128)] and "RuntimeError" in failed[0].error
    saved = json.loads(open(result.path).read())
    assert any(c["error"] for c in saved["candidates"]) and saved["winner"]["mma_tiler_mn"] == [256, 256]


def test_every_candidate_failing_keeps_the_rules_and_nothing(recorder):
    recorder.timing.fail = set(recorder.timing.fast) | {
        (s.mma_tiler_mn, s.cluster_shape_mn) for s in at.candidates(
            plans.call_request(*call_descs()[:3], wgrad=call_descs()[3])[0], T)}
    a, b, offsets, out = call_descs()
    result = gwgrad.autotune(a, b, offsets_tensor=offsets, wgrad_tensor=out)
    assert result.source == "rules" and tiling(result.spec) == ((256, 256), (2, 1))
    assert result.timings and all(t.ms is None for t in result.timings)
    assert files(recorder) == [] and plans.tuned == {}


def test_the_default_stays_within_the_margin(recorder):
    recorder.timing.fast = {((128, 128), (1, 1)): 0.5 / (1 + at.MARGIN / 2),
                            ((256, 256), (2, 1)): 0.5}
    a, b, offsets, out = call_descs()
    assert tiling(gwgrad.autotune(a, b, offsets_tensor=offsets, wgrad_tensor=out).spec) == (
        (256, 256), (2, 1))


# --- persistence ------------------------------------------------------------------------------

def test_a_corrupt_or_foreign_file_is_ignored_and_rewritten(recorder, monkeypatch):
    a, b, offsets, out = call_descs()
    first = gwgrad.autotune(a, b, offsets_tensor=offsets, wgrad_tensor=out)
    path = first.path
    good = open(path).read()
    tampered = [
        "{not json",
        json.dumps([1, 2]),
        good.replace('"Fake GPU"', '"Other GPU"'),  # another device's file under this name
        good.replace(f'"tokens_sum": {T}', f'"tokens_sum": {T + 8}'),
        good.replace('"format": 1', '"format": 99'),
        good.replace('"mma_tiler_mn": [\n   128,\n   128\n  ]', '"mma_tiler_mn": [\n   "x",\n   128\n  ]', 1),
        good.replace('"raster_group": 16', '"raster_group": 0', 1),  # a tuning left open
    ]
    assert good.count('"mma_tiler_mn": [\n   128,\n   128\n  ]')  # the winner's, replaced above
    for text in tampered:
        assert text != good
        gwgrad.clear_cache()
        open(path, "w").write(text)
        calls = len(recorder.timing.calls)
        result = gwgrad.autotune(a, b, offsets_tensor=offsets, wgrad_tensor=out)
        assert result.source == "timed" and len(recorder.timing.calls) == calls + 1, text[:40]
        assert json.loads(open(path).read())["winner"] == json.loads(good)["winner"]
    # A winner the backend does not run (any more) is not trusted either.
    gwgrad.clear_cache()
    recorder.refused.add(((128, 128), (1, 1)))
    result = gwgrad.autotune(a, b, offsets_tensor=offsets, wgrad_tensor=out)
    assert result.source == "timed" and tiling(result.spec) == ((256, 256), (2, 1))


def test_the_key_names_the_device_the_version_and_the_tokens(recorder, monkeypatch):
    request, tokens = plans.call_request(*call_descs()[:3], wgrad=call_descs()[3])
    key = at.signature_key(request, tokens, "NVIDIA H200")
    assert key == at.signature_key(request, tokens, "NVIDIA H200")
    assert key != at.signature_key(request, tokens, "NVIDIA H100 80GB HBM3")
    assert key != at.signature_key(request, tokens + 8, "NVIDIA H200")
    assert key != at.signature_key(request.with_tuning(mma_tiler_mn=(128, 256)), tokens,
                                   "NVIDIA H200")
    monkeypatch.setattr(at, "__version__", "0.0.0+other")
    assert key != at.signature_key(request, tokens, "NVIDIA H200")


def test_another_version_or_device_times_again(recorder, monkeypatch):
    a, b, offsets, out = call_descs()
    gwgrad.autotune(a, b, offsets_tensor=offsets, wgrad_tensor=out)
    for patch in (("__version__", "0.0.0+other"), ("device_name", lambda d: "Other GPU")):
        gwgrad.clear_cache()
        with monkeypatch.context() as m:
            m.setattr(at, *patch)
            calls = len(recorder.timing.calls)
            assert gwgrad.autotune(a, b, offsets_tensor=offsets, wgrad_tensor=out).source == "timed"
            assert len(recorder.timing.calls) == calls + 1
    assert len(files(recorder)) == 3


def test_with_the_disk_cache_off_the_winner_stays_in_the_process(recorder, monkeypatch):
    monkeypatch.setenv("GWGRAD_CACHE_DIR", "off")
    monkeypatch.setenv(at.ENV, "1")
    assert tiling(wrapper_call(recorder)) == ((128, 128), (1, 1))
    a, b, offsets, out = call_descs()
    result = gwgrad.autotune(a, b, offsets_tensor=offsets, wgrad_tensor=out)
    assert result.source == "memory" and result.path is None
    assert not recorder.cache.exists() or files(recorder) == []
    gwgrad.clear_cache()
    wrapper_call(recorder)  # nothing on disk: timed again
    assert len(recorder.timing.calls) == 2


# --- errors and the reference ---------------------------------------------------------------

def test_bad_arguments_raise_the_wrappers_errors(recorder):
    a, b, offsets, out = call_descs()
    bad_offsets = from_pointer(3 << 32, (E,), None, DType.INT64, 0)
    for kwargs, name in ((dict(offsets_tensor=bad_offsets, wgrad_tensor=out), "offsets_tensor"),
                         (dict(offsets_tensor=offsets, accumulate_on_output=True), "wgrad_tensor"),
                         (dict(offsets_tensor=offsets, wgrad_tensor=out, mma_tiler_mn=(1, 2, 3)),
                          "mma_tiler_mn"),
                         (dict(offsets_tensor=offsets, wgrad_tensor=out, max_candidates=0),
                          "max_candidates"),
                         (dict(offsets_tensor=offsets, wgrad_tensor=out, retune="yes"), "retune")):
        with pytest.raises(ValueError, match=f"^{name}:") as tuned:
            gwgrad.autotune(a, b, **kwargs)
        if name not in ("max_candidates", "retune"):
            with pytest.raises(ValueError) as wrapped:
                gwgrad.grouped_gemm_wgrad(a, b, current_stream=5, **kwargs)
            assert str(tuned.value) == str(wrapped.value)
    with pytest.raises(ValueError, match="^a_tensor:"):
        gwgrad.autotune(None, b, offsets_tensor=offsets)
    assert recorder.timing.calls == []


def test_inside_a_graph_capture_nothing_is_timed(recorder, monkeypatch):
    a, b, offsets, out = call_descs()
    with pytest.raises(RuntimeError, match="captured"):
        gwgrad.autotune(a, b, offsets_tensor=offsets, wgrad_tensor=out, current_stream=0xCA9)
    monkeypatch.setenv(at.ENV, "1")
    monkeypatch.setattr(gwgrad.cuda, "stream_is_capturing", lambda stream: True)
    assert tiling(wrapper_call(recorder)) == ((256, 256), (2, 1))  # the rules' tiling, untimed
    assert recorder.timing.calls == [] and plans.tuned == {}


def test_cpu_arrays_get_the_rules_tuning_untimed(recorder, rng):
    from wgrad_cases import bf16, bf16_problem, layout_a, layout_b

    problem = bf16_problem(rng)
    a = layout_a(bf16(problem.a), problem.counts, "m", "tensor2d").desc
    b = layout_b(bf16(problem.b), problem.counts, "n", "tensor2d").desc
    result = gwgrad.autotune(a, b, offsets_tensor=problem.offsets)
    default, _ = backends_mod.finalize_spec(result.spec)
    assert result.source == "rules" and result.spec.is_cpu and result.timings == ()
    assert result.tuning == default.tuning and recorder.timing.calls == []


def test_the_switch_reads_its_words(monkeypatch):
    for value, on in (("1", True), ("on", True), ("TRUE", True), ("0", False), ("", False),
                      ("off", False)):
        monkeypatch.setenv(at.ENV, value)
        assert at.enabled() is on
    monkeypatch.delenv(at.ENV)
    assert not at.enabled()


# --- the timing loop on a fake clock ------------------------------------------------------------

class FakeClock:
    """CUDA events on a virtual clock that each launch advances by its cost."""

    def __init__(self):
        self.now, self.order = 0.0, []

    def install(self, monkeypatch):
        cuda = gwgrad.cuda
        monkeypatch.setattr(cuda, "event_create", lambda: {"t": None})
        monkeypatch.setattr(cuda, "event_record", lambda e, stream: e.update(t=self.now))
        monkeypatch.setattr(cuda, "event_elapsed_ms", lambda s, e: e["t"] - s["t"])
        monkeypatch.setattr(cuda, "event_destroy", lambda e: None)
        monkeypatch.setattr(cuda, "synchronize", lambda stream: None)

    def run(self, name, cost, fail_at=None):
        count = [0]

        def launch():
            count[0] += 1
            if fail_at is not None and count[0] >= fail_at:
                raise RuntimeError("cudaLaunchKernelEx failed")
            self.now += cost
            self.order.append(name)

        return launch


def test_the_timing_loop_takes_medians_round_robin_and_skips_a_failure(monkeypatch):
    clock = FakeClock()
    clock.install(monkeypatch)
    runs = {0: clock.run(0, 0.5), 1: clock.run(1, 0.25), 2: clock.run(2, 0.1, fail_at=6)}
    times = at.time_interleaved(runs, stream=0, warmup=2, rounds=5, sample_ms=1.0)
    assert times[0] == pytest.approx(0.5) and times[1] == pytest.approx(0.25)
    assert times[2].startswith("launch: RuntimeError")
    # Warm-up (2) and one calibration launch each; then rounds of inner launches (1 ms / cost:
    # 2, 4, 10), the turn rotated by one each round and reversed every other round; the
    # failed candidate (its 6th launch) drops out of the rounds.
    assert clock.order == ([0] * 3 + [1] * 3 + [2] * 3
                           + [0] * 2 + [1] * 4 + [2] * 2  # first turn: 0 1 2
                           + [0] * 2 + [1] * 4  # then (1 2 0) reversed
                           + [0] * 2 + [1] * 4  # 2 0 1
                           + [1] * 4 + [0] * 2  # (0 1 2) reversed
                           + [1] * 4 + [0] * 2)  # 1 2 0


def test_measure_launches_every_candidate_into_scratch_memory(monkeypatch):
    """``measure`` end to end but for the device: a stand-in backend whose launches advance a
    fake clock, host buffers for the scratch memory. Every launch gets the call's A, B and
    offsets, a scratch output (never the caller's) and a zeroed workspace of its candidate's
    own; a candidate that does not compile is recorded and the rest timed."""
    import contextlib

    clock = FakeClock()
    clock.install(monkeypatch)
    cost = {((128, 128), (1, 1)): 0.25}

    class Timed(Recorder):
        def workspace_bytes(self, spec):
            return 4096

        def compile(self, spec):
            if spec.mma_tiler_mn == (128, 256) and spec.cluster_shape_mn == (1, 1):
                raise RuntimeError("ptxas: too many registers")
            return super().compile(spec)

        def launch(self, compiled, spec, args):
            super().launch(compiled, spec, args)
            clock.now += cost.get(tiling(spec), 1.0)

    rec = Timed()
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_100a")
    monkeypatch.setitem(backends_mod._instances,
                        ("gwgrad.backends.bf16_sm100", "Bf16Sm100Backend"), rec)
    monkeypatch.setattr(gwgrad.cuda, "on_device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(gwgrad.cuda, "device_synchronize", lambda device: None)
    zeroed, checked, buffers = [], [], []
    monkeypatch.setattr(gwgrad.cuda, "memset_async",
                        lambda ptr, nbytes, stream: zeroed.append((ptr, nbytes, stream)))
    monkeypatch.setattr(at, "check_values", lambda *args, **kw: checked.append(args))

    def allocate(ref, shape, dtype, stream):
        array = np.zeros(shape, np.uint8)
        buffers.append(array)
        return array, from_pointer(array.ctypes.data, shape, None, dtype, 0)

    monkeypatch.setattr(gwgrad.interop, "allocate", allocate)
    a, b, offsets, out = call_descs()
    for mode in ("dense", "discrete"):
        rec.calls.clear()
        buffers.clear()
        kw = dict(wgrad=out) if mode == "dense" else dict(
            output_mode="discrete", wgrad_ptrs=from_pointer(5 << 32, (E,), None, DType.INT64, 0),
            wgrad_dtype="float32")
        if mode == "discrete":
            monkeypatch.setattr(gwgrad.interop, "pointer_array", lambda stacked, stream: from_pointer(
                0x7000, (E,), None, DType.INT64, 0))
        request, tokens = plans.call_request(a, b, offsets, **kw)
        specs = at.candidates(request, tokens)
        assert any(tiling(s) == ((128, 256), (1, 1)) for s in specs)  # the one that fails
        ops = at.Operands(a, b, offsets, (None,) * 4, tokens, 0, 0x51)
        timings = at.measure(specs, ops)
        assert [t.tuning for t in timings] == [s.tuning for s in specs]
        for spec, timing in zip(specs, timings):
            if tiling(spec) == ((128, 256), (1, 1)):
                assert timing.ms is None and timing.error.startswith("compile: RuntimeError: ptxas")
            else:
                assert timing.ms == pytest.approx(cost.get(tiling(spec), 1.0)), spec
        scratch_out = buffers[0].ctypes.data
        assert buffers[0].nbytes == E * H * N * 4  # the output's bytes (float32)
        workspaces = {args.workspace for _, args in rec.calls}
        assert len(workspaces) == len([t for t in timings if t.ms is not None])
        assert workspaces <= {z[0] for z in zeroed}  # each zeroed before its first launch
        for spec, args in rec.calls:
            assert (args.a.ptr, args.b.ptr, args.offsets.ptr, args.tokens_sum) == (
                a.ptr, b.ptr, offsets.ptr, T)
            assert args.stream == 0x51
            if mode == "dense":
                assert args.wgrad.ptr == scratch_out != out.ptr
            else:
                assert args.wgrad_ptrs.ptr == 0x7000 and args.wgrad is None
    assert len(checked) == 2  # the offsets, checked on the host once per tuning
