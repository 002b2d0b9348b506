"""The public API with torch CUDA tensors, against the reference backend (the same API on CPU
copies of the inputs). Runs on the GPU host; skipped cleanly elsewhere."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import gwgrad  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs torch with a CUDA GPU"),
]

HIDDEN, INTER = 256, 384


def _call(*args, **kwargs):
    return gwgrad.grouped_gemm_wgrad(*args, **kwargs)


def make_inputs(counts, a_major="m", b_major="n", order="tensor2d", hidden=HIDDEN, inter=INTER):
    """Fresh randn operands on the GPU in the requested layout, and their CPU twins."""
    counts = torch.tensor(counts, dtype=torch.int64)
    tokens = int(counts.sum())
    offsets = torch.cumsum(counts, 0).to(torch.int32)
    a_logical = torch.randn(hidden, tokens, dtype=torch.bfloat16)
    b_logical = torch.randn(tokens, inter, dtype=torch.bfloat16)

    def lay_a(t):
        if a_major == "m":
            return t.T.contiguous().T  # memory (tokens, hidden): x.T
        if order == "tensor2d":
            return t.contiguous()
        blocks = [blk.contiguous().reshape(-1) for blk in torch.split(t, counts.tolist(), dim=1)]
        return torch.cat(blocks).as_strided((hidden, tokens), (tokens, 1))

    def lay_b(t):
        if b_major == "n":
            return t.contiguous()
        if order == "tensor2d":
            return t.T.contiguous().T
        blocks = [blk.T.contiguous().reshape(-1) for blk in torch.split(t, counts.tolist(), dim=0)]
        return torch.cat(blocks).as_strided((tokens, inter), (1, tokens))

    a_cpu, b_cpu = lay_a(a_logical), lay_b(b_logical)
    a_gpu = torch.empty_strided(a_cpu.shape, a_cpu.stride(), dtype=a_cpu.dtype, device="cuda")
    b_gpu = torch.empty_strided(b_cpu.shape, b_cpu.stride(), dtype=b_cpu.dtype, device="cuda")
    # Copy the raw storage so ragged layouts (whose strides lie) arrive byte for byte.
    a_gpu.untyped_storage().copy_(a_cpu.untyped_storage())
    b_gpu.untyped_storage().copy_(b_cpu.untyped_storage())
    return (a_gpu, b_gpu, offsets.cuda()), (a_cpu, b_cpu, offsets)


def rel_err(got, want):
    got, want = got.double().cpu(), want.double().cpu()
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


@pytest.mark.parametrize("a_major,b_major,order,out_dtype", [
    ("m", "n", "tensor2d", torch.bfloat16),
    ("m", "n", "tensor2d", torch.float32),
    ("k", "k", "tensor2d", torch.float16),
    ("k", "n", "tensor_ragged", torch.bfloat16),
    ("m", "k", "tensor_ragged", torch.float32),
])
def test_dense_against_reference(a_major, b_major, order, out_dtype):
    # Not multiples of 256, one empty expert; multiples of 8 where K-major layouts need them.
    counts = [512, 0, 1000, 8, 256] if "k" in (a_major, b_major) else [512, 0, 997, 3, 256]
    gpu, cpu = make_inputs(counts, a_major, b_major, order)
    out = torch.full((5, HIDDEN, INTER), float("nan"), dtype=out_dtype, device="cuda")
    _call(*gpu[:2], offsets_tensor=gpu[2], wgrad_tensor=out, input_order=order)
    (want,) = gwgrad.grouped_gemm_wgrad(*cpu[:2], offsets_tensor=cpu[2], input_order=order,
                                        wgrad_dtype=torch.float32)
    torch.cuda.synchronize()
    assert not out.isnan().any()
    assert rel_err(out, want) <= (1e-2 if out_dtype != torch.float32 else 1e-5)
    assert (out[1] == 0).all()


def test_discrete_allocated_and_caller_owned():
    gpu, cpu = make_inputs([256, 768, 0, 40])
    (want,) = gwgrad.grouped_gemm_wgrad(*cpu[:2], offsets_tensor=cpu[2], wgrad_dtype=torch.float32)
    (stacked,) = _call(*gpu[:2], offsets_tensor=gpu[2], output_mode="discrete")
    assert isinstance(stacked, torch.Tensor) and stacked.is_cuda
    assert rel_err(stacked, want) <= 1e-2
    outputs = [torch.full((HIDDEN, INTER), float("nan"), dtype=torch.float32, device="cuda")
               for _ in range(4)]
    ptrs = torch.tensor([o.data_ptr() for o in outputs], dtype=torch.int64, device="cuda")
    result = _call(*gpu[:2], offsets_tensor=gpu[2], output_mode="discrete", wgrad_ptrs=ptrs,
                   wgrad_dtype=torch.float32)
    assert result["wgrad_tensor"] is None
    torch.cuda.synchronize()
    assert rel_err(torch.stack(outputs), want) <= 1e-5


def test_accumulate_and_one_operator_for_every_tokens_sum():
    """tokens_sum is dynamic: a tiling left to gwgrad depends only on whether the experts are
    short on average (the short-expert rules, backends/tuning_rules.py), so three tokens_sums,
    two of them short (<= 384 tokens per expert on this small output), compile at most two
    kernels."""
    from gwgrad.kernels import compiler

    before = compiler.compile_count  # GPU kernels only (the CPU twin has an operator too)
    for counts in ([128, 0, 640], [1, 2, 3], [0, 0, 2048], [256, 256, 0]):
        gpu, cpu = make_inputs(counts)
        init = torch.randn(3, HIDDEN, INTER, dtype=torch.float32)
        out = init.cuda()
        _call(*gpu[:2], offsets_tensor=gpu[2], wgrad_tensor=out, accumulate_on_output=True)
        expected = init.clone()
        gwgrad.grouped_gemm_wgrad(*cpu[:2], offsets_tensor=cpu[2], wgrad_tensor=expected,
                                  accumulate_on_output=True)
        torch.cuda.synchronize()
        assert rel_err(out, expected) <= 1e-5
    assert compiler.compile_count - before <= 2


def test_stream_argument_and_offsets_checked_on_the_device():
    gpu, cpu = make_inputs([256, 256])
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        out = torch.empty(2, HIDDEN, INTER, dtype=torch.float32, device="cuda")
    _call(*gpu[:2], offsets_tensor=gpu[2], wgrad_tensor=out, current_stream=stream)
    stream.synchronize()
    (want,) = gwgrad.grouped_gemm_wgrad(*cpu[:2], offsets_tensor=cpu[2], wgrad_dtype=torch.float32)
    assert rel_err(out, want) <= 1e-5
    bad = torch.tensor([300, 200], dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="^offsets_tensor:"):  # the host check, asked for
        _call(*gpu[:2], offsets_tensor=bad, wgrad_tensor=out, validate_offsets=True)
    before = out.clone()
    _call(*gpu[:2], offsets_tensor=bad, wgrad_tensor=out)  # default: the device check
    with pytest.raises(ValueError, match="^offsets_tensor: expected non-decreasing"):
        gwgrad.check_errors()
    assert torch.equal(out, before)


def test_cuda_graph_capture():
    gpu, cpu = make_inputs([384, 128])
    out = torch.empty(2, HIDDEN, INTER, dtype=torch.float32, device="cuda")
    _call(*gpu[:2], offsets_tensor=gpu[2], wgrad_tensor=out)  # warm-up: compile, workspace
    torch.cuda.synchronize()
    out.fill_(float("nan"))
    graph = torch.cuda.CUDAGraph()
    # Capture on a stream of the tensors' device: torch.cuda.graph's default capture
    # stream is made once per process, on the device current at its first use.
    with torch.cuda.graph(graph, stream=torch.cuda.Stream(out.device)):
        _call(*gpu[:2], offsets_tensor=gpu[2], wgrad_tensor=out)
    graph.replay()
    torch.cuda.synchronize()
    (want,) = gwgrad.grouped_gemm_wgrad(*cpu[:2], offsets_tensor=cpu[2], wgrad_dtype=torch.float32)
    assert rel_err(out, want) <= 1e-5
