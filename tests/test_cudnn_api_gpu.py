"""cuDNN frontend 1.32's surface on a GPU: a caller-owned ``descriptor_workspace`` (sized by
``get_grouped_gemm_wgrad_workspace_size_sm100``, zero-filled or not, reused) against a float64
reference; the exception a format this GPU cannot run gets; ``grouped_gemm_wgrad_jax_sm100``
under jit against a float64 reference. Runs on the GPU host; skipped cleanly elsewhere."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import gwgrad  # noqa: E402
from gwgrad.plan import WORKSPACE_ZEROED_BYTES  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs torch with a CUDA GPU"),
]

HIDDEN, INTER = 256, 384
COUNTS = [512, 0, 1000, 8, 256]  # multiples of 8: the cuDNN layout has a K-major A


def _inputs():
    counts = torch.tensor(COUNTS)
    tokens = int(counts.sum())
    offsets = torch.cumsum(counts, 0).to(torch.int32)
    a = torch.randn(HIDDEN, tokens, dtype=torch.bfloat16)  # (hidden, tokens), K-major
    b = torch.randn(tokens, INTER, dtype=torch.bfloat16)   # (tokens, intermediate), N-major
    bounds = [0] + offsets.tolist()
    want = torch.stack([a[:, s:t].double() @ b[s:t].double()
                        for s, t in zip(bounds, bounds[1:])])
    return a.cuda(), b.cuda(), offsets.cuda(), want


def _rel_err(got, want):
    return float((got.double().cpu() - want).norm() / want.norm())


@pytest.mark.parametrize("garbage", [False, True], ids=["zeroed", "garbage"])
@pytest.mark.parametrize("output_mode", ["dense", "discrete"])
def test_descriptor_workspace_is_used_and_left_zero(output_mode, garbage):
    """Zero-filled or full of 0xFF bytes (what torch.empty may hold): the same results, launch
    after launch. A single-launch kernel leaves its prep hand-off words (bytes 8-15 of the
    leading WORKSPACE_ZEROED_BYTES) zero; bytes 0-7, the unit counter and the verdict, every
    launch rewrites before reading them."""
    a, b, offsets, want = _inputs()
    experts = len(COUNTS)
    size = gwgrad.get_grouped_gemm_wgrad_workspace_size_sm100(experts, output_mode=output_mode)
    workspace = torch.full((size,), 0xFF if garbage else 0, dtype=torch.uint8, device="cuda")
    for _ in range(3):  # reused
        out = torch.full((experts, HIDDEN, INTER), float("nan"), device="cuda")
        gwgrad.grouped_gemm_wgrad_wrapper_sm100(a, b, None, None, offsets,
                                                output_mode=output_mode, wgrad_tensor=out,
                                                descriptor_workspace=workspace)
        torch.cuda.synchronize()
        assert _rel_err(out, want) < 1e-5
    op = gwgrad.GroupedGemmWgradSm100(a, b, None, None, offsets, sample_wgrad=out)
    op.compile()
    assert op.workspace_bytes <= size
    for _ in range(2):
        out.fill_(float("nan"))
        op.execute(a, b, None, None, offsets, out, descriptor_workspace=workspace)
        torch.cuda.synchronize()
        assert _rel_err(out, want) < 1e-5
        if op.spec.launches == 1:
            assert not workspace[8:WORKSPACE_ZEROED_BYTES].any()
    with pytest.raises(ValueError, match="^descriptor_workspace: expected at least"):
        op.execute(a, b, None, None, offsets, out,
                   descriptor_workspace=workspace[:op.workspace_bytes - 128])


@pytest.mark.parametrize("output_mode", ["dense", "discrete"])
def test_workspace_garbage_gives_the_same_bits(output_mode):
    """A descriptor_workspace whose every byte past the leading WORKSPACE_ZEROED_BYTES is 0xFF
    gives the same bits as a zero-filled one: the prep work writes each descriptor slot in
    full (kernels/prep.py write_descriptor)."""
    a, b, offsets, _ = _inputs()
    experts = len(COUNTS)
    size = gwgrad.get_grouped_gemm_wgrad_workspace_size_sm100(experts, output_mode=output_mode)
    results = []
    for fill in (0, 0xFF):
        workspace = torch.full((size,), fill, dtype=torch.uint8, device="cuda")
        workspace[:WORKSPACE_ZEROED_BYTES] = 0
        out = torch.full((experts, HIDDEN, INTER), float("nan"), device="cuda")
        gwgrad.grouped_gemm_wgrad_wrapper_sm100(a, b, None, None, offsets,
                                                output_mode=output_mode, wgrad_tensor=out,
                                                descriptor_workspace=workspace)
        torch.cuda.synchronize()
        results.append(out)
    assert not torch.isnan(results[0]).any()
    assert torch.equal(results[0].view(torch.int32), results[1].view(torch.int32))


def test_unsupported_format_on_this_gpu():
    """FP4 on an SM90 GPU, FP32 scale factors on an SM100 GPU: NotImplementedError naming the
    argument, from the wrapper and from check_support()."""
    major, _ = torch.cuda.get_device_capability()
    tokens, experts = 256, 2
    offsets = torch.tensor([128, 256], dtype=torch.int32, device="cuda")
    out = torch.zeros(experts, HIDDEN, INTER, device="cuda")
    if major == 9:
        a = torch.zeros(HIDDEN, tokens // 2, dtype=torch.uint8, device="cuda").view(
            torch.float4_e2m1fn_x2)
        b = torch.zeros(INTER, tokens // 2, dtype=torch.uint8, device="cuda").view(
            torch.float4_e2m1fn_x2).T
        sfa = torch.zeros(HIDDEN, 8, dtype=torch.uint8, device="cuda").view(torch.float8_e8m0fnu)
        sfb = torch.zeros(INTER, 8, dtype=torch.uint8, device="cuda").view(torch.float8_e8m0fnu)
        kwargs, argument = dict(sf_vec_size=32), "a_tensor"
    else:
        a = torch.zeros(HIDDEN, tokens, device="cuda").to(torch.float8_e4m3fn)
        b = torch.zeros(INTER, tokens, device="cuda").to(torch.float8_e4m3fn).T
        sfa = torch.ones(experts, HIDDEN, device="cuda")
        sfb = torch.ones(experts, INTER, device="cuda")
        kwargs, argument = dict(scale_recipe="per_expert_channel"), "sfa_tensor"
    with pytest.raises(NotImplementedError, match=f"^{argument}: "):
        gwgrad.grouped_gemm_wgrad_wrapper_sm100(a, b, sfa, sfb, offsets, wgrad_tensor=out,
                                                **kwargs)
    op = gwgrad.GroupedGemmWgradSm100(a, b, sfa, sfb, offsets, sample_wgrad=out, **kwargs)
    with pytest.raises(NotImplementedError):
        op.check_support()


def test_jax_entry_on_the_gpu():
    jax = pytest.importorskip("jax")
    from jax_gpu import gpus

    if not gpus():
        pytest.skip("needs JAX with a CUDA GPU")
    import jax.numpy as jnp
    import ml_dtypes

    rng = np.random.default_rng()
    offsets = np.cumsum(COUNTS).astype(np.int32)
    tokens = int(offsets[-1])
    a = rng.standard_normal((HIDDEN, tokens)).astype(ml_dtypes.bfloat16)
    b = rng.standard_normal((tokens, INTER)).astype(ml_dtypes.bfloat16)
    bounds = [0] + offsets.tolist()
    want = np.stack([a[:, s:t].astype(np.float64) @ b[s:t].astype(np.float64)
                     for s, t in zip(bounds, bounds[1:])])
    with jax.default_device(gpus()[0]):
        f = jax.jit(lambda a, b, o: gwgrad.grouped_gemm_wgrad_jax_sm100(
            a, b, o, wgrad_dtype=jnp.float32))
        result = f(jnp.asarray(a), jnp.asarray(b), jnp.asarray(offsets))
        w = np.asarray(result["wgrad_tensor"], np.float64)
    assert np.linalg.norm(w - want) / np.linalg.norm(want) < 1e-5
    gwgrad.check_errors()
