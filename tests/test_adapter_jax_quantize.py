"""gwgrad.adapters.jax.quantize without a GPU: every format under jit bit-equal to the NumPy
model (gwgrad.quantizers.reference_quantize), the quantized operands feeding wgrad_fp8 in one
jitted function, shard_map over two (CPU) devices, argument errors, and the CUDA lowering's
custom call (the quantizer's call_tensors entry as an XLA FFI module, compiled for
CUTE_DSL_ARCH, no GPU needed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

jax = pytest.importorskip("jax")

import jax.numpy as jnp  # noqa: E402

from gwgrad import quantizers as Q  # noqa: E402
from quantize_cases import special_values  # noqa: E402
import gwgrad.adapters.jax as gwj  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CHANNELS = 40  # a multiple of 8, not of 64 or 128 (the blocked scales' rows are padded)
CASES = [(fmt, elem) for fmt, f in Q.FORMATS.items() for elem in f.elems]
FP8 = {"e4m3": jnp.float8_e4m3fn, "e5m2": jnp.float8_e5m2}
SCALE_DTYPES = {"mxfp8": jnp.float8_e8m0fnu, "mxfp4": jnp.float8_e8m0fnu,
                "nvfp4": jnp.float8_e4m3fn, "per_expert_channel": jnp.float32,
                "block_1x128": jnp.float32}


def _pythonpath() -> str:
    # The checkout first, then whatever the parent had (the GPU host puts the CuTe DSL there).
    return os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))


@pytest.fixture(autouse=True)
def _on_the_cpu():
    # On a GPU host JAX's default device is the GPU: these tests are about the CPU lowering.
    with jax.default_device(jax.devices("cpu")[0]):
        yield


def counts_for(fmt, units=(3, 0, 5, 1, 0, 9)):
    """Counts that are multiples of the format's count multiple, not all of 128, two empty
    experts (multiples 32: 96, 0, 160, 32, 0, 288; 16: 48, 0, 80, 16, 0, 144)."""
    return [u * Q.count_multiple(fmt) for u in units]


def bf16_input(rng, tokens, channels=CHANNELS, specials=True):
    """tests/quantize_cases.special_values as a BF16 JAX array."""
    x = special_values(rng, tokens, channels, specials=specials)
    return jnp.asarray(x.astype(np.float32), jnp.bfloat16)  # round to nearest even


def bits(arr) -> np.ndarray:
    """An array's bytes as unsigned integers of its width (bit-exact comparisons, NaN too)."""
    arr = np.asarray(arr)
    return arr.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[arr.dtype.itemsize])


def reference(x, offsets, fmt, elem):
    return Q.reference_quantize(np.asarray(x.astype(jnp.float32)), np.asarray(offsets), fmt,
                                elem)


def assert_bits_equal(got, want, fmt, elem):
    data, scales, gs = got
    rd, rs, rg = want
    assert data.dtype == FP8.get(elem, jnp.uint8) and data.shape == rd.shape
    assert scales.dtype == SCALE_DTYPES[fmt] and scales.shape == rs.shape
    np.testing.assert_array_equal(bits(data), rd)
    np.testing.assert_array_equal(bits(scales), bits(rs))
    if rg is None:
        assert gs is None
    else:
        assert gs.dtype == jnp.float32 and gs.shape == rg.shape
        np.testing.assert_array_equal(bits(gs), bits(rg))


@pytest.mark.parametrize("fmt,elem", CASES)
def test_jit_bits_equal_the_numpy_model(rng, fmt, elem):
    counts = counts_for(fmt)
    offsets = jnp.asarray(np.cumsum(counts).astype(np.int32))
    x = bf16_input(rng, sum(counts))
    f = jax.jit(lambda x, o: gwj.quantize(x, o, fmt, elem=elem))
    got = f(x, offsets)
    want = reference(x, offsets, fmt, elem)
    lay = Q.layout(fmt, x.shape[0], CHANNELS, len(counts), elem)
    assert got[0].shape == lay.data_shape and got[1].shape == lay.scale_shape
    assert_bits_equal(got, want, fmt, elem)
    assert f._cache_size() == 1
    # Same shapes, other counts (first and last experts empty now): the same executable.
    other = jnp.asarray(np.cumsum(counts_for(fmt, (0, 7, 1, 0, 10, 0))).astype(np.int32))
    assert_bits_equal(f(x, other), reference(x, other, fmt, elem), fmt, elem)
    assert f._cache_size() == 1
    # eagerly too (the primitive compiles alone), with the elem given as a dtype
    typed = FP8.get(elem, elem)
    assert_bits_equal(gwj.quantize(x, offsets, fmt, elem=typed), want, fmt, elem)


@pytest.mark.parametrize("fmt", list(Q.FORMATS))
def test_denormal_blocks_are_not_flushed(fmt):
    # The host callback runs on an XLA thread, which flushes denormals (FTZ / DAZ): the model
    # must run with them kept, as the GPU kernels do (nonzero codes and scales here).
    tokens = 8 * Q.count_multiple(fmt)
    b16 = np.full((tokens, 16), 0x0005, np.uint16)  # BF16 denormals, all of them
    b16[:, 1] = np.arange(tokens, dtype=np.uint16) % 0x7F  # ...and a channel of smaller ones
    x = jax.lax.bitcast_convert_type(jnp.asarray(b16), jnp.bfloat16)
    offsets = jnp.asarray(np.array([0, tokens], np.int32))
    elem = Q.FORMATS[fmt].elems[0]
    want = Q.reference_quantize((b16.astype(np.uint32) << 16).view(np.float32),
                                np.asarray(offsets), fmt, elem)
    assert want[0].any()
    got = jax.jit(lambda x, o: gwj.quantize(x, o, fmt))(x, offsets)
    assert_bits_equal(got, want, fmt, elem)
    assert not gwj._flushes_denormals()  # this (main) thread's environment is untouched


@pytest.mark.parametrize("fmt", list(Q.FORMATS))
def test_default_elem_one_expert_and_no_tokens(rng, fmt):
    x = bf16_input(rng, 8 * Q.count_multiple(fmt), specials=False)
    one = jnp.asarray(np.array([x.shape[0]], np.int32))
    elem = Q.FORMATS[fmt].elems[0]
    assert_bits_equal(jax.jit(lambda x, o: gwj.quantize(x, o, fmt))(x, one),
                      reference(x, one, fmt, elem), fmt, elem)
    empty = jnp.zeros((0, CHANNELS), jnp.bfloat16)
    zeros = jnp.zeros((3,), jnp.int32)
    got = jax.jit(lambda x, o: gwj.quantize(x, o, fmt))(empty, zeros)
    assert_bits_equal(got, reference(empty, zeros, fmt, elem), fmt, elem)


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4", "block_1x128"])
@pytest.mark.parametrize("values", [
    [96, 64, 480, 480],    # decreasing: expert 1 empty, the rest clamped
    [-32, 160, 480, 512],  # negative first offset, last past tokens
    [48, 208, 432, 480],   # counts not multiples of 32 (blocked: those experts empty)
])
def test_invalid_offsets_match_the_model(rng, fmt, values):
    # The quantizer sanitizes offsets as the kernels do (the GEMM reports them): no error.
    x = bf16_input(rng, 480)
    bad = jnp.asarray(np.array(values, np.int32))
    elem = Q.FORMATS[fmt].elems[0]
    got = jax.jit(lambda x, o: gwj.quantize(x, o, fmt))(x, bad)
    assert_bits_equal(got, reference(x, bad, fmt, elem), fmt, elem)


def dequantized(x, offsets, fmt, elem):
    """(channels, tokens) float64 values of reference_quantize's FP8 operand times its scales
    (gwgrad/scales.py's FP32 recipes)."""
    data, scales, _ = reference(x, offsets, fmt, elem)
    values = np.asarray(jnp.asarray(data).view(FP8[elem]).astype(jnp.float32), np.float64)
    ends = np.asarray(offsets)
    t = np.arange(data.shape[1])
    owner = np.searchsorted(ends, t, side="right")
    if fmt == "per_expert_channel":
        return values * scales[owner].T
    begins = np.concatenate([[0], ends[:-1]])
    blocks = -(-(ends - begins) // 128)
    rows = np.concatenate([[0], np.cumsum(blocks)[:-1]])[owner] + (t - begins[owner]) // 128
    return values * scales[rows].T


@pytest.mark.parametrize("recipe", ["per_expert_channel", "block_1x128"])
def test_quantize_feeds_wgrad_fp8_in_one_jit(rng, recipe):
    counts = [48, 0, 160, 272]
    offsets = jnp.asarray(np.cumsum(counts).astype(np.int32))
    x = jnp.asarray(rng.standard_normal((sum(counts), 32)), jnp.bfloat16)
    dy = jnp.asarray(rng.standard_normal((sum(counts), 48)), jnp.bfloat16)

    def step(x, dy, o):
        xt, xs, _ = gwj.quantize(x, o, recipe)
        dyt, dys, _ = gwj.quantize(dy, o, recipe, elem="e5m2")
        return gwj.wgrad_fp8(xt, dyt, o, xs, dys, scale_recipe=recipe, out_dtype=jnp.float32)

    w = np.asarray(jax.jit(step)(x, dy, offsets), np.float64)
    b = [0] + list(np.cumsum(counts))

    def loop(xt, dyt):
        return np.stack([xt[:, s:e] @ dyt[:, s:e].T for s, e in zip(b, b[1:])])

    def rel(got, want):
        return np.linalg.norm(got - want) / np.linalg.norm(want)

    # The model's operands, dequantized, through a float64 loop: FP32 accumulation apart.
    fp8 = loop(dequantized(x, offsets, recipe, "e4m3"), dequantized(dy, offsets, recipe, "e5m2"))
    assert rel(w, fp8) < 1e-6
    bf16 = loop(np.asarray(x.astype(jnp.float32), np.float64).T,
                np.asarray(dy.astype(jnp.float32), np.float64).T)
    assert rel(w, bf16) < 0.1  # FP8 (e4m3 x, e5m2 dy) against BF16
    assert not w[1].any()  # the empty expert


@pytest.mark.parametrize("fmt", ["mxfp8", "mxfp4", "nvfp4", "block_1x128"])
@pytest.mark.parametrize("values", [
    None,                  # the format's valid counts (two empty experts)
    [96, 64, 480, 480],    # decreasing: overlapping sanitized ranges
    [-32, 160, 480, 512],  # negative first offset, last past tokens
    [48, 208, 432, 480],   # counts not multiples of 32
])
def test_cuda_path_zeroes_the_scales_the_kernel_leaves(rng, fmt, values):
    """The CUDA lowering's mask (the kernel never writes scale columns / rows past the
    experts' ones; XLA's buffers are not zeroed): applied to the model's scales poisoned past
    the used bytes (counted as tests/test_quantize_gpu.py does), it gives the model's."""
    from gwgrad import scales as S

    tokens = 480
    offsets = np.cumsum(counts_for(fmt)[:4]) if values is None else np.array(values)
    offsets = offsets.astype(np.int32)
    if values is None:
        tokens = int(offsets[-1])
    x = bf16_input(rng, tokens)
    elem = Q.FORMATS[fmt].elems[0]
    _, want, _ = reference(x, offsets, fmt, elem)
    lay = Q.layout(fmt, tokens, CHANNELS, len(offsets), elem)
    f = Q.FORMATS[fmt]
    begin, end = Q._counts(offsets, tokens, Q.count_multiple(fmt))
    needed = S.columns_needed((end - begin).tolist(), S.column_rule(f.recipe, f.sf_vec))
    per_column = want.shape[0] if f.recipe == "blocked" else want.shape[1]
    used = min(needed, lay.scale_capacity) * per_column
    assert used < want.size  # the bound leaves columns (rows) unused
    assert not want.reshape(-1)[used:].view(np.uint8).any()  # the model's are zeros
    poisoned = want.copy()
    poisoned.reshape(-1)[used:] = np.frombuffer(b"\xff" * want.itemsize, want.dtype)[0]
    got = jax.jit(lambda s, o: gwj._zero_unwritten_scales(s, o, fmt, tokens,
                                                           lay.scale_capacity))(
        jnp.asarray(poisoned), jnp.asarray(offsets))
    np.testing.assert_array_equal(bits(got), bits(want))


def test_errors_name_the_arguments(rng):
    x = bf16_input(rng, 64, specials=False)
    offsets = jnp.asarray(np.array([32, 64], np.int32))
    with pytest.raises(ValueError, match=r"^fmt: expected one of 'mxfp8'"):
        gwj.quantize(x, offsets, "fp8")
    with pytest.raises(ValueError, match=r"^elem: expected e2m1 for mxfp4"):
        gwj.quantize(x, offsets, "mxfp4", elem="e4m3")
    with pytest.raises(ValueError, match=r"^elem: expected e4m3 or e5m2 for mxfp8"):
        gwj.quantize(x, offsets, "mxfp8", elem=jnp.bfloat16)
    with pytest.raises(ValueError, match=r"^x: .*bfloat16.*float32"):
        gwj.quantize(x.astype(jnp.float32), offsets, "mxfp8")
    with pytest.raises(ValueError, match=r"^x: .*2-D"):
        gwj.quantize(x[None], offsets, "mxfp8")
    with pytest.raises(ValueError, match=r"^x: .*multiple of 8, got 36"):
        gwj.quantize(x[:, :36], offsets, "mxfp8")
    with pytest.raises(ValueError, match=r"^x: .*multiple of 32"):
        gwj.quantize(x[:48], offsets, "mxfp8")
    with pytest.raises(ValueError, match=r"^offsets: .*int32.*int16"):
        gwj.quantize(x, offsets.astype(jnp.int16), "mxfp8")
    with pytest.raises(ValueError, match=r"^offsets: .*at least one expert"):
        gwj.quantize(x, offsets[:0], "mxfp8")
    with pytest.raises(ValueError, match=r"^x: "):  # under jit too, at trace time
        jax.jit(lambda x, o: gwj.quantize(x, o, "nvfp4"))(x[:40], offsets)


def test_shard_map_over_two_cpu_devices():
    code = textwrap.dedent("""
        import os
        os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
        import numpy as np, jax, jax.numpy as jnp
        from jax.sharding import NamedSharding, PartitionSpec as P
        from gwgrad import quantizers as Q
        import gwgrad.adapters.jax as gwj
        mesh = jax.make_mesh((2,), ("ep",), devices=jax.devices("cpu")[:2])
        rng = np.random.default_rng(int(os.environ["GWGRAD_CHILD_SEED"]))
        tokens, experts = 96, 3  # per device: its local experts
        x = jnp.asarray(rng.standard_normal((2 * tokens, 16)), jnp.bfloat16)
        offsets = np.array([32, 32, 96, 0, 64, 96], np.int32)
        put = lambda a: jax.device_put(a, NamedSharding(mesh, P("ep")))
        for fmt in ("per_expert_channel", "nvfp4"):
            for check_vma in (True, False):
                f = jax.jit(jax.shard_map(
                    lambda x, o: gwj.quantize(x, o, fmt)[:2], mesh=mesh,
                    in_specs=(P("ep"), P("ep")), out_specs=(P(None, "ep"), P("ep")),
                    check_vma=check_vma))
                data, scales = f(put(x), put(jnp.asarray(offsets)))
                for d in range(2):
                    rd, rs, _ = Q.reference_quantize(
                        np.asarray(x[d * tokens:(d + 1) * tokens].astype(jnp.float32)),
                        offsets[d * experts:(d + 1) * experts], fmt)
                    cols, rows = rd.shape[1], rs.shape[0]
                    got_d = np.asarray(data).view(np.uint8)[:, d * cols:(d + 1) * cols]
                    got_s = np.asarray(scales).view(rs.dtype)[d * rows:(d + 1) * rows]
                    assert np.array_equal(got_d, rd), (fmt, d)
                    assert np.array_equal(got_s.view(np.uint8), rs.view(np.uint8)), (fmt, d)
        print("ok")
    """)
    env = dict(os.environ, PYTHONPATH=_pythonpath(), JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stdout + proc.stderr


# --- the CUDA lowering, without a GPU -------------------------------------------------------

LOWER_FOR_CUDA = """
import json, os, sys
import numpy as np, jax, jax.numpy as jnp
from gwgrad import quantizers as Q
import gwgrad.adapters.jax as gwj
rng = np.random.default_rng(int(os.environ["GWGRAD_CHILD_SEED"]))
counts = [256, 0, 480, 288]  # multiples of 32, not all of 128
offsets = jnp.asarray(np.cumsum(counts).astype(np.int32))
x = jnp.asarray(rng.standard_normal((1024, 256)), jnp.bfloat16)
texts = {}
for fmt, f in Q.FORMATS.items():
    for elem in f.elems:
        g = jax.jit(lambda x, o: gwj.quantize(x, o, fmt, elem=elem))
        lower = g.trace(x, offsets).lower
        texts[f"{fmt}/{elem}"] = {
            ",".join(p): lower(lowering_platforms=p).as_text()
            for p in (("cuda",), ("cpu", "cuda"), ("cpu",))}
from gwgrad import kernel_cache
json.dump({"texts": texts, "cutlass": "cutlass" in sys.modules,
           "compiles": kernel_cache.stats()["compiles"]}, sys.stdout)
"""

MLIR_DTYPES = {np.dtype(np.uint8): "ui8", np.dtype(np.float32): "f32",
               np.dtype(jnp.float8_e4m3fn): "f8E4M3FN", np.dtype(jnp.float8_e5m2): "f8E5M2",
               np.dtype(jnp.float8_e8m0fnu): "f8E8M0FNU"}


def _custom_calls(text: str):
    """The CuTe DSL custom calls of a lowered module (not the reference's host callback)."""
    return [line for line in text.splitlines()
            if "stablehlo.custom_call" in line and "python_cpu_callback" not in line]


def _tensor(shape, dtype) -> str:
    return f"tensor<{'x'.join(str(d) for d in shape)}x{MLIR_DTYPES[np.dtype(dtype)]}>"


@pytest.fixture(scope="module", params=["sm_90a", "sm_100a"])
def lowered(request, tmp_path_factory):
    """The lowered modules of every format, and whether a second process lowering them with
    the kernels on disk compiled or imported the CuTe DSL."""
    # A process of its own: CUTE_DSL_ARCH must be set before the CuTe DSL is first imported
    # on a machine without a GPU (the DSL reads it once, at import).
    env = dict(os.environ, PYTHONPATH=_pythonpath(), CUTE_DSL_ARCH=request.param,
               JAX_PLATFORMS="cpu", GWGRAD_CACHE_DIR=str(tmp_path_factory.mktemp("cache")),
               # a module's fixture may run before the first test's seed is set
               GWGRAD_CHILD_SEED=os.environ.get("GWGRAD_CHILD_SEED", "0"))
    runs = []
    for _ in range(2):
        proc = subprocess.run([sys.executable, "-c", LOWER_FOR_CUDA], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs.append(json.loads(proc.stdout))
    cold, warm = runs
    return dict(cold["texts"], cold=cold, warm=warm)


@pytest.mark.compile
def test_a_warm_process_lowers_without_the_dsl(lowered):
    """Eight formats: one quantizer operator and one XLA FFI module each, compiled by the
    first process; the second finds them all on disk and lowers the same custom calls."""
    cold, warm = lowered["cold"], lowered["warm"]
    assert cold["cutlass"] and cold["compiles"] == 2 * len(CASES)
    assert not warm["cutlass"] and warm["compiles"] == 0, warm["compiles"]
    for case, texts in cold["texts"].items():
        assert _custom_calls(warm["texts"][case]["cuda"]) == _custom_calls(texts["cuda"])


@pytest.mark.compile
@pytest.mark.parametrize("fmt,elem", CASES)
def test_cuda_lowering_without_a_gpu_holds_the_custom_call(lowered, fmt, elem):
    texts = lowered[f"{fmt}/{elem}"]
    calls = _custom_calls(texts["cuda"])
    assert len(calls) == 1 and "CuteDSLRT_NvJaxCutlassCall" in calls[0]
    assert "NoCudaGraph" not in calls[0]  # allowed in CUDA graphs
    # Inputs x and offsets; outputs the codes, the scales, the global scales (a one-element
    # dummy but for NVFP4) and the uint8 workspace XLA allocates.
    lay = Q.layout(fmt, 1024, 256, 4, elem)
    cfg = Q.kernel_config(fmt, lay.elem, 256, 4)
    scale = np.float32 if SCALE_DTYPES[fmt] == jnp.float32 else np.uint8
    outputs = [_tensor(lay.data_shape, np.uint8), _tensor(lay.scale_shape, scale),
               _tensor(lay.global_shape or (1,), np.float32),
               _tensor((cfg.workspace_bytes(1024),), np.uint8)]
    signature = "(tensor<1024x256xbf16>, tensor<4xi32>) -> (" + ", ".join(outputs) + ")"
    assert calls[0].rstrip().endswith(signature), calls[0][-300:]
    # The function's results: typed FP8 data and E8M0 / E4M3 scales (free bitcasts), the
    # global scales for NVFP4 only; the same on either platform.
    results = [_tensor(lay.data_shape, FP8.get(elem, np.uint8)),
               _tensor(lay.scale_shape, SCALE_DTYPES[fmt])]
    if fmt == "nvfp4":
        results.append(_tensor((4,), np.float32))
    for text in (texts["cuda"], texts["cpu"]):
        head = next(line for line in text.splitlines() if "func.func public @main" in line)
        assert all(r in head for r in results), head
        assert head.count("jax.result_info") == len(results)
    # One function for both platforms: the custom call in the CUDA branch only.
    assert len(_custom_calls(texts["cpu,cuda"])) == 1 and not _custom_calls(texts["cpu"])
