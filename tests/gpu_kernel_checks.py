"""Shared checks of the GPU kernels through the backend interface, against FP64.

Every check draws fresh randn inputs, poisons outputs with NaN (or fills them with random
values when accumulating) and compares with a float64 reference of the contract's semantics.
The arch test modules (test_sm90_kernel_gpu.py, test_sm100_kernel_gpu.py) parametrize them.
"""

from __future__ import annotations

import dataclasses

import itertools

import pytest
import torch

import gwgrad
from gwgrad.backends import finalize_spec
from gwgrad.backends.base import LaunchArgs
from gwgrad.dtypes import DType
from gwgrad.kernels import compiler
from gwgrad.spec import StaticSpec, Tuning
from gwgrad.tensors import TensorDesc

TORCH_TO_DTYPE = {
    torch.bfloat16: DType.BFLOAT16,
    torch.float16: DType.FLOAT16,
    torch.float32: DType.FLOAT32,
    torch.int32: DType.INT32,
    torch.int64: DType.INT64,
    torch.uint8: DType.UINT8,
}
_compiled = {}


def desc(t: "torch.Tensor") -> TensorDesc:
    return TensorDesc(
        t.data_ptr(), tuple(t.shape), tuple(t.stride()), TORCH_TO_DTYPE[t.dtype], "cuda",
        t.device.index or 0, "torch", t,
    )


def make_spec(arch, hidden, intermediate, experts, a_major="m", b_major="n", order="tensor2d",
              mode="dense", out=torch.bfloat16, acc=False, tiling=None):
    # tiling: (tile, cluster) or (tile, cluster, launches per call); None: the defaults.
    tile, cluster, *launches = tiling if tiling is not None else (None, None)
    return StaticSpec(
        hidden=hidden, intermediate=intermediate, num_experts=experts,
        a_dtype=DType.BFLOAT16, b_dtype=DType.BFLOAT16, wgrad_dtype=TORCH_TO_DTYPE[out],
        acc_dtype=DType.FLOAT32, a_major=a_major, b_major=b_major, input_order=order,
        output_mode=mode, accumulate=acc, sf_vec_size=16, arch=arch,
        tuning=Tuning(mma_tiler_mn=tile, cluster_shape_mn=cluster,
                      launches=launches[0] if launches else 0),
    )


def compiled_for(spec):
    if spec not in _compiled:
        final, backend = finalize_spec(spec)
        _compiled[spec] = (final, backend, backend.compile(final))
    return _compiled[spec]


def make_operands(spec, counts):
    """A (hidden, T) and B (T, intermediate) in the spec's majors / input order, plus the
    per-expert (A_e, B_e) float64 views the reference multiplies."""
    m, n = spec.hidden, spec.intermediate
    t = int(sum(counts))
    offs = torch.tensor(list(itertools.accumulate(counts)), dtype=torch.int32, device="cuda")
    starts = [0] + list(itertools.accumulate(counts))[:-1]
    ragged = spec.input_order == "tensor_ragged"
    # A
    if spec.a_major == "k":
        if ragged:
            flat = torch.randn(m * t, device="cuda").to(torch.bfloat16)
            a = flat.view(m, t)  # strides (t, 1) as the contract declares; blocks inside
            a_parts = [flat[s * m:(s + c) * m].view(m, c) for s, c in zip(starts, counts)]
        else:
            a = torch.randn(m, t, device="cuda").to(torch.bfloat16)
            a_parts = [a[:, s:s + c] for s, c in zip(starts, counts)]
    else:
        a = torch.randn(t, m, device="cuda").to(torch.bfloat16).t()
        a_parts = [a[:, s:s + c] for s, c in zip(starts, counts)]
    # B
    if spec.b_major == "k":
        if ragged:
            flat = torch.randn(n * t, device="cuda").to(torch.bfloat16)
            b = flat.view(n, t).t()
            b_parts = [flat[s * n:(s + c) * n].view(n, c).t() for s, c in zip(starts, counts)]
        else:
            b = torch.randn(n, t, device="cuda").to(torch.bfloat16).t()
            b_parts = [b[s:s + c, :] for s, c in zip(starts, counts)]
    else:
        b = torch.randn(t, n, device="cuda").to(torch.bfloat16)
        b_parts = [b[s:s + c, :] for s, c in zip(starts, counts)]
    return a, b, offs, t, a_parts, b_parts


def run_and_check(spec, counts, out_dtype, tol=1e-2, offsets_override=None, workspace=None):
    """Launch ``spec`` on random operands with ``counts`` and check every expert against FP64
    (outputs NaN-poisoned unless accumulating). ``workspace``: a zeroed uint8 CUDA tensor to
    launch with (the caller reads it afterwards), else a fresh one."""
    spec, backend, compiled = compiled_for(spec)
    a, b, offs, t, a_parts, b_parts = make_operands(spec, counts)
    if offsets_override is not None:
        offs = offsets_override
    e, m, n = spec.num_experts, spec.hidden, spec.intermediate
    if spec.accumulate:
        init = [torch.randn(m, n, device="cuda").to(out_dtype) for _ in range(e)]
    else:
        init = [torch.full((m, n), float("nan"), device="cuda", dtype=out_dtype) for _ in range(e)]
    if spec.output_mode == "dense":
        out = torch.stack(init)
        outs = list(out.unbind(0))
        args_out = dict(wgrad=desc(out))
    else:
        outs = [x.clone() for x in init]
        ptrs = torch.tensor([x.data_ptr() for x in outs], dtype=torch.int64, device="cuda")
        args_out = dict(wgrad_ptrs=desc(ptrs))
    ws = workspace
    if ws is None:
        ws = torch.zeros(max(backend.workspace_bytes(spec), 1), dtype=torch.uint8, device="cuda")
    args = LaunchArgs(
        a=desc(a), b=desc(b), offsets=desc(offs), tokens_sum=t,
        stream=torch.cuda.current_stream().cuda_stream, workspace=ws.data_ptr(), **args_out,
    )
    backend.launch(compiled, spec, args)
    torch.cuda.synchronize()
    for ex in range(e):
        ref = a_parts[ex].double() @ b_parts[ex].double()
        if spec.accumulate:
            ref = ref + init[ex].double()
        got = outs[ex].double()
        assert not torch.isnan(got).any(), f"expert {ex}: output not fully written"
        denom = ref.norm().item()
        err = (got - ref).norm().item() / (denom if denom > 0 else 1.0)
        assert err <= tol, f"expert {ex} (count {counts[ex]}): rel err {err:.3e}"
    return compiled



MAJORS = [("m", "n"), ("k", "n"), ("m", "k"), ("k", "k")]
OUT_DTYPES = [torch.bfloat16, torch.float32, torch.float16]


class KernelChecks:
    """Subclassed per architecture: ARCH, and TILINGS = [big tile, small tile] as
    ((mma_tiler_mn), (cluster_shape_mn))."""

    ARCH = ""
    TILINGS = []



    @pytest.mark.parametrize("which", [0, 1], ids=["big_tile", "small_tile"])
    @pytest.mark.parametrize("majors", MAJORS, ids=lambda x: f"A{x[0]}B{x[1]}")
    @pytest.mark.parametrize("order", ["tensor2d", "tensor_ragged"])
    @pytest.mark.parametrize("mode", ["dense", "discrete"])
    def test_modes(self, which, majors, order, mode):
        tiling = self.TILINGS[which]
        # Rotate output dtype and accumulate through the grid so every value meets every mode.
        idx = MAJORS.index(majors) + 2 * (order == "tensor_ragged") + (mode == "discrete")
        out_dtype = OUT_DTYPES[idx % 3]
        acc = bool(idx % 2)
        spec = make_spec(self.ARCH, 256, 384, 6, *majors, order, mode, out_dtype, acc, tiling)
        # A K-major operand needs every count % 8 == 0 (16-byte aligned TMA rows); with both
        # operands M/N-major any count works.
        counts = [0, 256, 40, 512, 8, 1000] if "k" in majors else [0, 256, 37, 511, 1, 1003]
        run_and_check(spec, counts, out_dtype)


    @pytest.mark.parametrize("out_dtype", OUT_DTYPES, ids=str)
    @pytest.mark.parametrize("acc", [False, True])
    def test_primary_layout_dtypes(self, out_dtype, acc):
        spec = make_spec(self.ARCH, 384, 512, 5, "m", "n", "tensor2d", "dense", out_dtype, acc)
        run_and_check(spec, [300, 0, 1024, 64, 777], out_dtype)


    @pytest.mark.parametrize(
        "counts",
        [
            [0, 0, 0, 0],  # every expert empty
            [0, 2048, 0, 0],  # one expert holds every token
            [1, 7, 255, 1000],  # counts not multiples of 256
            [256, 256, 256, 256],
        ],
        ids=["all_empty", "one_hot", "odd", "uniform"],
    )
    def test_distributions(self, counts):
        spec = make_spec(self.ARCH, 256, 256, 4)
        run_and_check(spec, counts, torch.bfloat16)


    @pytest.mark.parametrize("experts", [1, 256])
    def test_expert_counts(self, experts):
        spec = make_spec(self.ARCH, 128, 256, experts, tiling=self.TILINGS[1])
        gen = torch.Generator().manual_seed(experts)
        counts = torch.randint(0, 64, (experts,), generator=gen).tolist()
        run_and_check(spec, counts, torch.bfloat16)


    def test_partial_tiles(self):
        # hidden / intermediate not multiples of the tile (multiples of 8 only).
        spec = make_spec(self.ARCH, 200, 136, 3)
        run_and_check(spec, [100, 0, 333], torch.bfloat16)
        spec = make_spec(self.ARCH, 200, 136, 3, tiling=self.TILINGS[1], acc=True, out=torch.float32)
        run_and_check(spec, [100, 0, 333], torch.float32)


    @pytest.mark.parametrize("which", [0, 1], ids=["big_tile", "small_tile"])
    def test_one_cta_tile_per_output(self, which):
        # The whole output within one CTA tile: with a CTA pair, the peer's part
        # lies past the output and must store nothing. Accumulating into FP32 shows a tile
        # stored twice (it would be added twice); the plain store is NaN-poisoned.
        tiling = self.TILINGS[which]
        (tm, tn) = tiling[0] or (128, 128)  # the CTA's tile (a unit is the cluster's)
        hidden, inter = min(tm, 120), min(tn, 120)
        for out_dtype, acc in ((torch.float32, True), (torch.bfloat16, False)):
            spec = make_spec(self.ARCH, hidden, inter, 5, out=out_dtype, acc=acc, tiling=tiling)
            run_and_check(spec, [300, 0, 64, 1, 500], out_dtype)


    def test_tokens_sum_changes_without_recompiling(self):
        spec = make_spec(self.ARCH, 256, 256, 3)
        run_and_check(spec, [64, 64, 64], torch.bfloat16)
        before = compiler.compile_count
        for counts in ([1, 2, 3], [1000, 0, 4000], [0, 0, 9]):
            run_and_check(spec, counts, torch.bfloat16)
        assert compiler.compile_count == before


    def test_invalid_offsets_write_nothing(self):
        """Offsets that break the contract (decreasing, past tokens_sum, negative) fail the
        prep kernel's check: the GEMM touches no output byte (nor anything outside A, B and
        the outputs), and the status record names the first problem."""
        spec = make_spec(self.ARCH, 256, 256, 4)
        counts = [100, 100, 100, 100]
        bad = torch.tensor([100, 50, 10**9, -5], dtype=torch.int32, device="cuda")
        spec, backend, compiled = compiled_for(spec)
        a, b, offs, t, _, _ = make_operands(spec, counts)
        out = torch.full((4, 256, 256), float("nan"), device="cuda", dtype=torch.bfloat16)
        ws = torch.zeros(backend.workspace_bytes(spec), dtype=torch.uint8, device="cuda")
        args = LaunchArgs(a=desc(a), b=desc(b), offsets=desc(bad), tokens_sum=t, wgrad=desc(out),
                          stream=torch.cuda.current_stream().cuda_stream, workspace=ws.data_ptr())
        backend.launch(compiled, spec, args)
        torch.cuda.synchronize()
        assert torch.isnan(out).all()  # nothing written
        with pytest.raises(ValueError, match=r"^offsets_tensor: expected non-decreasing offsets, "
                                             r"got offsets_tensor\[1\] = 50 after "
                                             r"offsets_tensor\[0\] = 100"):
            gwgrad.check_errors()
        backend.launch(compiled, spec, dataclasses.replace(args, offsets=desc(offs)))
        torch.cuda.synchronize()
        ref0 = a[:, :100].double() @ b[:100].double()
        assert (out[0].double() - ref0).norm() / ref0.norm() < 1e-2


    @pytest.mark.parametrize("bad", ["null", "misaligned"])
    def test_discrete_invalid_pointer_writes_nothing_and_is_reported(self, bad):
        """A null or misaligned address in wgrad_ptrs fails the prep kernel's check: no expert's
        output is written (the valid ones neither) and the error names wgrad_ptrs."""
        spec = make_spec(self.ARCH, 128, 128, 2, mode="discrete", tiling=self.TILINGS[1])
        spec, backend, compiled = compiled_for(spec)
        a, b, offs, t, a_parts, b_parts = make_operands(spec, [64, 64])
        keep = torch.full((128, 128), float("nan"), device="cuda", dtype=torch.bfloat16)
        spare = torch.full((128 * 128 + 8,), float("nan"), device="cuda", dtype=torch.bfloat16)
        address = 0 if bad == "null" else spare.data_ptr() + 2  # 2 bytes past 16-byte aligned
        ptrs = torch.tensor([keep.data_ptr(), address], dtype=torch.int64, device="cuda")
        ws = torch.zeros(backend.workspace_bytes(spec), dtype=torch.uint8, device="cuda")
        args = LaunchArgs(a=desc(a), b=desc(b), offsets=desc(offs), tokens_sum=t,
                          wgrad_ptrs=desc(ptrs), stream=torch.cuda.current_stream().cuda_stream,
                          workspace=ws.data_ptr())
        backend.launch(compiled, spec, args)
        torch.cuda.synchronize()
        assert torch.isnan(keep).all() and torch.isnan(spare).all()  # nothing written
        with pytest.raises(ValueError, match=rf"^wgrad_ptrs: expected a non-null, 16-byte "
                                             rf"aligned address per expert, got wgrad_ptrs\[1\] "
                                             rf"= {address:#x} \(found by the device-side"):
            gwgrad.check_errors()
        ptrs[1] = spare.data_ptr()  # valid addresses: both experts written
        backend.launch(compiled, spec, args)
        torch.cuda.synchronize()
        gwgrad.check_errors()
        for out, i in ((keep, 0), (spare[:128 * 128].view(128, 128), 1)):
            ref = a_parts[i].double() @ b_parts[i].double()
            assert (out.double() - ref).norm() / ref.norm() < 1e-2


    def test_skewed_many_experts(self):
        # Fine-grained MoE shape with a zipf-like distribution.
        experts = 64
        w = [1.0 / (r + 1) ** 1.2 for r in range(experts)]
        total = 16384
        counts = [int(total * x / sum(w)) for x in w]
        spec = make_spec(self.ARCH, 768, 1024, experts)
        run_and_check(spec, counts, torch.bfloat16)
