"""``python -m gwgrad selftest``: a short correctness check of every kernel family and format
the GPU supports, and the first thing to run on a new GPU.

Each case runs in its own subprocess (``python -m gwgrad.selftest --case NAME``) under a
timeout, so a hang is reported as "timeout" and a fault that kills the process (or its CUDA
context) as "crashed (exit code N / signal NAME)", and the other cases still run. A case builds
a small random problem on the host with NumPy (seeded; the seed is printed: ``--seed`` replays
it): 5 experts, one of them empty, counts that end inside a tile and are multiples of the
format's ``token_count_multiple``. It moves the problem to the GPU (torch when importable, else
CuPy, else gwgrad's own cudaMalloc through ``gwgrad.from_pointer``), runs it through the
contract's wrapper ``grouped_gemm_wgrad`` (or ``gwgrad.quantize``) into NaN-poisoned outputs,
and compares it with the CPU reference backend run on the same inputs (the same call with NumPy
arrays): relative Frobenius error <= 1e-5 for BF16 inputs into FP32, 2e-3 for FP8 / FP4 inputs
into FP32 (the tensor cores' FP8 accumulation keeps fewer bits than FP32: about 1e-4 measured
on the H200, docs/results/h200_fuzz.json), 1e-2 into BF16; an empty expert must be exactly 0
(exactly its old values when accumulating). The quantizers must match the reference bit for
bit (gwgrad/formats.py: the GPU kernels implement its model exactly).

A case whose format this GPU's architecture cannot run (FP4 on SM90, FP32 scale factors on
SM100) checks that the call raises ``NotImplementedError`` (``gwgrad.UnsupportedError``) and
reports "needs SMxx", which is not a failure. The exit code is 0 when every case passed or
needs another GPU, 1 otherwise.

Without a GPU the same cases run on CPU arrays through the reference backend, checked against a
direct float64 loop over the experts of the dequantized inputs (the quantizers: against a
per-expert loop of gwgrad/formats.py's quantizers, bit for bit, and the dequantized values
against the input within the element format's rounding).

Test hook (tests/test_selftest.py): ``GWGRAD_SELFTEST_INJECT="case=fault,..."`` makes a case's
subprocess sleep (``sleep``), exit with code 3 (``exit``), abort (``abort``), or compare with a
wrong reference (``wrong``).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from . import cuda
from ._version import __version__
from . import formats as F
from . import scales as S
from .dtypes import DType

__all__ = ["CASES", "main", "run_case"]

HIDDEN, INTERMEDIATE, EXPERTS = 256, 256, 5
#: Channels of the quantizer cases: not a multiple of 128 (a partial blocked-scale atom).
QUANT_CHANNELS = 200
SM90 = ("sm_90a",)
SM100 = ("sm_100a", "sm_103a")
ALL_ARCHS = SM90 + SM100
INJECT_ENV = "GWGRAD_SELFTEST_INJECT"
TIMEOUT_S = 60.0


# --- the cases -------------------------------------------------------------------------------

@dataclass(frozen=True)
class Gemm:
    """A grouped wgrad problem: operand format, scales, output."""

    a_fmt: str = "bf16"  # bf16 | e4m3 | e5m2 | e2m1
    b_fmt: str = "bf16"
    recipe: Optional[str] = None  # None (BF16) | blocked | per_expert_channel | block_1x128
    sf: Optional[str] = None  # blocked scale codes: e8m0 | e4m3
    sf_vec: int = 0
    out: str = "float32"  # float32 | bfloat16
    mode: str = "dense"  # dense | discrete
    accumulate: bool = False


@dataclass(frozen=True)
class Quant:
    """A gwgrad.quantize call."""

    fmt: str
    elem: Optional[str] = None


@dataclass(frozen=True)
class Case:
    name: str
    fmt: str  # the table's "format" column
    kind: str  # "bf16" | "block_scaled" (backends._KERNELS' kinds) | "quantize"
    archs: Tuple[str, ...]  # the architectures whose kernels run it
    what: Union[Gemm, Quant]
    tol: float = 0.0  # relative Frobenius error bound (0: bit-exact)


CASES: Tuple[Case, ...] = (
    Case("bf16_dense", "BF16 -> BF16, dense", "bf16", ALL_ARCHS, Gemm(out="bfloat16"), 1e-2),
    Case("bf16_discrete", "BF16 -> FP32, discrete (wgrad_ptrs)", "bf16", ALL_ARCHS,
         Gemm(mode="discrete"), 1e-5),
    Case("bf16_accumulate", "BF16 -> FP32, accumulate_on_output", "bf16", ALL_ARCHS,
         Gemm(accumulate=True), 1e-5),
    Case("fp8_per_expert_channel", "FP8 e4m3, per_expert_channel FP32 scales -> FP32",
         "block_scaled", SM90, Gemm("e4m3", "e4m3", "per_expert_channel"), 2e-3),
    Case("fp8_block_1x128", "FP8 e4m3 x e5m2, block_1x128 FP32 scales -> BF16", "block_scaled",
         SM90, Gemm("e4m3", "e5m2", "block_1x128", sf_vec=128, out="bfloat16"), 1e-2),
    Case("mxfp8", "MXFP8 e4m3, blocked E8M0 scales / 32 -> FP32", "block_scaled", ALL_ARCHS,
         Gemm("e4m3", "e4m3", "blocked", "e8m0", 32), 2e-3),
    Case("nvfp4", "NVFP4, blocked E4M3 scales / 16 + global -> FP32", "block_scaled", SM100,
         Gemm("e2m1", "e2m1", "blocked", "e4m3", 16), 2e-3),
    Case("mxfp4", "MXFP4, blocked E8M0 scales / 32 -> BF16", "block_scaled", SM100,
         Gemm("e2m1", "e2m1", "blocked", "e8m0", 32, out="bfloat16"), 1e-2),
    Case("quantize_mxfp8", "quantize BF16 -> mxfp8 (e4m3)", "quantize", ALL_ARCHS,
         Quant("mxfp8")),
    Case("quantize_block_1x128", "quantize BF16 -> block_1x128 (e4m3)", "quantize", ALL_ARCHS,
         Quant("block_1x128")),
    Case("quantize_per_expert_channel", "quantize BF16 -> per_expert_channel (e5m2)",
         "quantize", ALL_ARCHS, Quant("per_expert_channel", "e5m2")),
    Case("quantize_nvfp4", "quantize BF16 -> nvfp4", "quantize", ALL_ARCHS, Quant("nvfp4")),
    Case("quantize_mxfp4", "quantize BF16 -> mxfp4", "quantize", ALL_ARCHS, Quant("mxfp4")),
)
CASE_BY_NAME: Dict[str, Case] = {c.name: c for c in CASES}

_DTYPES = {"bf16": DType.BFLOAT16, "e4m3": DType.FLOAT8_E4M3FN, "e5m2": DType.FLOAT8_E5M2,
           "e2m1": DType.FLOAT4_E2M1FN_X2, "e8m0": DType.FLOAT8_E8M0FNU,
           "float32": DType.FLOAT32, "bfloat16": DType.BFLOAT16}


def family(case: Case, arch: str) -> str:
    """The kernel family that runs ``case`` on ``arch`` (on the first architecture that runs
    it, when ``arch`` cannot): the backend module's name, "reference" on the CPU."""
    if case.kind == "quantize":
        return "quantize" if arch != "cpu" else "quantize (reference)"
    if arch == "cpu":
        return "reference"
    from .backends import _KERNELS

    key = (case.kind, arch if arch in case.archs else case.archs[0])
    return _KERNELS[key][0].rsplit(".", 1)[-1] if key in _KERNELS else "-"


def _arch_word(archs: Sequence[str]) -> str:
    """("sm_100a", "sm_103a") -> "SM100"."""
    return "SM" + "".join(ch for ch in archs[0] if ch.isdigit()) if archs else "the CPU"


# --- host problems ----------------------------------------------------------------------------

@dataclass
class HostTensor:
    """Raw host memory (C-contiguous, gwgrad.hostview.RAW_NUMPY's dtype for ``dtype``) and the
    strided view the call gets."""

    memory: np.ndarray
    shape: Tuple[int, ...]
    strides: Tuple[int, ...]
    dtype: DType

    @classmethod
    def dense(cls, memory: np.ndarray, dtype: DType) -> "HostTensor":
        from .tensors import contiguous_strides

        memory = np.ascontiguousarray(memory)
        return cls(memory, memory.shape, contiguous_strides(memory.shape), dtype)


def bf16_bits(values) -> np.ndarray:
    """uint16 bits of ``values`` rounded to bfloat16, to nearest even (finite values)."""
    u = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def bf16_values(bits) -> np.ndarray:
    return (np.asarray(bits, np.uint16).astype(np.uint32) << 16).view(np.float32).astype(
        np.float64)


def _count_multiple(g: Gemm) -> int:
    """gwgrad.offsets.token_count_multiple of the case's call (operands' majors as built)."""
    from .offsets import token_count_multiple
    from .spec import StaticSpec

    bf16 = g.a_fmt == "bf16"
    spec = StaticSpec(
        hidden=HIDDEN, intermediate=INTERMEDIATE, num_experts=EXPERTS,
        a_dtype=_DTYPES[g.a_fmt], b_dtype=_DTYPES[g.b_fmt], wgrad_dtype=_DTYPES[g.out],
        acc_dtype=DType.FLOAT32, a_major="m" if bf16 else "k", b_major="n" if bf16 else "k",
        input_order="tensor2d", output_mode=g.mode, accumulate=g.accumulate,
        sf_vec_size=g.sf_vec, arch="cpu",
        sf_dtype=_DTYPES[g.sf] if g.sf else (DType.FLOAT32 if g.recipe else None),
        scale_recipe=g.recipe)
    return token_count_multiple(spec)


def draw_counts(rng: np.random.Generator, multiple: int, experts: int = EXPERTS) -> np.ndarray:
    """Token counts, multiples of ``multiple``: expert 1 empty, expert 0 longer than one
    128-token tile, the last one ending inside a tile (not a multiple of 128)."""
    top = max(1, 320 // multiple)
    counts = rng.integers(1, top + 1, experts).astype(np.int64) * multiple
    counts[0] = S.round_up(128 + int(rng.integers(1, 128)), multiple)
    counts[1] = 0
    for e in (0, experts - 1):
        if counts[e] % 128 == 0:
            counts[e] += multiple
    return counts


@dataclass
class GemmProblem:
    counts: np.ndarray
    tensors: Dict[str, HostTensor]  # the call's array arguments
    kwargs: Dict[str, Any]  # its other arguments
    expected: np.ndarray  # the direct float64 loop, (E, hidden, intermediate)
    initial: Optional[np.ndarray] = None  # float32, accumulate_on_output's old values


def build_gemm(g: Gemm, rng: np.random.Generator) -> GemmProblem:
    """The case's operands, scales and offsets in host memory, and the direct float64 loop
    over experts of the dequantized inputs."""
    counts = draw_counts(rng, _count_multiple(g))
    e_count, h, n = EXPERTS, HIDDEN, INTERMEDIATE
    tokens = int(counts.sum())
    offsets = np.cumsum(counts).astype(np.int32)
    tensors = {"offsets_tensor": HostTensor.dense(offsets, DType.INT32)}
    kwargs: Dict[str, Any] = {}
    alpha = np.ones(e_count)
    if g.a_fmt == "bf16":
        # x.T and dy as a training step holds them: (tokens, hidden) and (tokens,
        # intermediate) row-major (M- and N-major operands).
        a_bits = bf16_bits(rng.standard_normal((h, tokens)))
        b_bits = bf16_bits(rng.standard_normal((tokens, n)))
        a_deq, b_deq = bf16_values(a_bits), bf16_values(b_bits).T
        tensors["a_tensor"] = HostTensor(np.ascontiguousarray(a_bits.T), (h, tokens), (1, h),
                                         DType.BFLOAT16)
        tensors["b_tensor"] = HostTensor(b_bits, (tokens, n), (n, 1), DType.BFLOAT16)
    else:
        # K-major (token-contiguous) operands, each channel at its own magnitude, quantized
        # expert by expert with gwgrad/formats.py and laid out with gwgrad/scales.py.
        x = rng.standard_normal((h, tokens)) * np.exp(rng.uniform(-3, 3, (h, 1)))
        y = rng.standard_normal((n, tokens)) * np.exp(rng.uniform(-3, 3, (n, 1)))  # B.T
        codes = {"a": np.zeros((h, tokens), np.uint8), "b": np.zeros((n, tokens), np.uint8)}
        deq = {"a": np.zeros((h, tokens)), "b": np.zeros((n, tokens))}
        raws: Dict[str, list] = {"a": [], "b": []}
        gs = {"a": np.ones(e_count, np.float32), "b": np.ones(e_count, np.float32)}
        nvfp4 = g.recipe == S.BLOCKED and g.sf == "e4m3"
        begin = 0
        for e, count in enumerate(counts):
            sl = slice(begin, begin + int(count))
            for op, values, fmt in (("a", x[:, sl], g.a_fmt), ("b", y[:, sl], g.b_fmt)):
                if g.recipe == S.BLOCKED:
                    if nvfp4:
                        c, s, gs[op][e] = F.quantize_nvfp4(values)
                    else:
                        c, s = F.quantize_mx(values, g.sf_vec, fmt)
                    scale = np.repeat(F.decode_codes(s, g.sf), g.sf_vec, axis=1)[:, :count]
                elif g.recipe == S.PER_EXPERT_CHANNEL:
                    c, s = F.quantize_rowwise_fp8(values, fmt)
                    scale = s[:, None].astype(np.float64)
                else:
                    c, s = F.quantize_rowwise_fp8(values, fmt, S.BLOCK_TOKENS)
                    scale = np.repeat(s.astype(np.float64), S.BLOCK_TOKENS, axis=1)[:, :count]
                codes[op][:, sl] = c
                deq[op][:, sl] = F.decode_codes(c, fmt) * scale
                raws[op].append(s)
            begin += int(count)
        a_deq, b_deq = deq["a"], deq["b"]
        if g.a_fmt == "e2m1":
            a_mem, b_mem = F.pack_fp4(codes["a"], axis=1), F.pack_fp4(codes["b"], axis=1)
            k = tokens // 2  # packed FP4: shapes and strides count bytes
        else:
            a_mem, b_mem, k = codes["a"], codes["b"], tokens
        tensors["a_tensor"] = HostTensor(a_mem, (h, k), (k, 1), _DTYPES[g.a_fmt])
        tensors["b_tensor"] = HostTensor(b_mem, (k, n), (1, k), _DTYPES[g.b_fmt])
        if g.recipe == S.BLOCKED:
            capacity = S.columns_needed(counts, S.column_rule(S.BLOCKED, g.sf_vec))
            for op, rows in (("a", h), ("b", n)):
                tensors[f"sf{op}_tensor"] = HostTensor.dense(
                    S.assemble_blocked(raws[op], rows, capacity=capacity), _DTYPES[g.sf])
            kwargs["sf_vec_size"] = g.sf_vec
        elif g.recipe == S.PER_EXPERT_CHANNEL:
            for op in ("a", "b"):
                tensors[f"sf{op}_tensor"] = HostTensor.dense(np.stack(raws[op]), DType.FLOAT32)
            kwargs["scale_recipe"] = g.recipe
        else:
            rows = S.columns_needed(counts, S.column_rule(S.BLOCK_1X128, S.BLOCK_TOKENS))
            for op in ("a", "b"):
                tensors[f"sf{op}_tensor"] = HostTensor.dense(
                    S.assemble_block_1x128(raws[op], capacity=rows), DType.FLOAT32)
            kwargs.update(sf_vec_size=S.BLOCK_TOKENS, scale_recipe=g.recipe)
        if nvfp4:
            tensors["global_scale_a"] = HostTensor.dense(gs["a"], DType.FLOAT32)
            tensors["global_scale_b"] = HostTensor.dense(gs["b"], DType.FLOAT32)
            alpha = gs["a"].astype(np.float64) * gs["b"].astype(np.float64)
    expected = np.zeros((e_count, h, n))
    begin = 0
    for e, count in enumerate(counts):  # the direct loop over experts, in float64
        sl = slice(begin, begin + int(count))
        expected[e] = alpha[e] * (a_deq[:, sl] @ b_deq[:, sl].T)
        begin += int(count)
    initial = None
    if g.accumulate:
        initial = rng.standard_normal((e_count, h, n)).astype(np.float32)
        expected += initial
    return GemmProblem(counts, tensors, kwargs, expected, initial)


# --- where the arrays live --------------------------------------------------------------------

def _raw_dtype(dtype: DType) -> np.dtype:
    from .hostview import RAW_NUMPY

    return RAW_NUMPY[dtype]


def _poison(shape, dtype: DType) -> np.ndarray:
    """NaN in every element (0xFF bytes for FP8 / E8M0 / FP4 / uint8 outputs)."""
    if dtype == DType.FLOAT32:
        return np.full(shape, np.nan, np.float32)
    if dtype == DType.BFLOAT16:
        return np.full(shape, 0x7FC0, np.uint16)
    return np.full(shape, 0xFF, _raw_dtype(dtype))


class HostArrays:
    """CPU arrays (gwgrad.from_pointer over NumPy memory): the reference backend."""

    name = "numpy (CPU)"
    is_cuda = False

    def put(self, t: HostTensor) -> Any:
        from .tensors import from_pointer

        memory = np.array(t.memory, copy=True)
        return from_pointer(memory.ctypes.data, t.shape, t.strides, t.dtype, device_type="cpu",
                            owner=memory)

    def address(self, arg) -> int:
        return arg.ptr

    def read(self, arg) -> np.ndarray:
        from .hostview import host_view

        return np.array(host_view(arg), copy=True)

    def sync(self) -> None:
        pass


class TorchArrays:
    """torch tensors on CUDA device ``device`` (None: CPU tensors, which the reference backend
    runs: how the CPU tests check these conversions)."""

    def __init__(self, device: Optional[int]):
        import torch

        self.torch = torch
        self.is_cuda = device is not None
        self.device = torch.device("cuda", device) if self.is_cuda else torch.device("cpu")
        if self.is_cuda:
            torch.cuda.set_device(device)
        self.name = f"torch {torch.__version__}" + ("" if self.is_cuda else " (CPU)")

    def put(self, t: HostTensor) -> Any:
        from .interop.torch import native_dtype

        raw = np.ascontiguousarray(t.memory).reshape(-1).view(np.uint8).copy()
        flat = self.torch.from_numpy(raw).to(self.device)
        return flat.view(native_dtype(t.dtype)).as_strided(t.shape, t.strides)

    def address(self, arg) -> int:
        return arg.data_ptr()

    def read(self, arg) -> np.ndarray:
        from .interop.torch import DTYPES

        raw = arg.contiguous().view(self.torch.uint8).cpu().numpy()
        return raw.view(_raw_dtype(DTYPES[arg.dtype])).reshape(tuple(arg.shape))

    def sync(self) -> None:
        if self.is_cuda:
            self.torch.cuda.synchronize(self.device)


class RawArrays:
    """Device memory of CuPy (when importable) or gwgrad.cuda's cudaMalloc (freed when the
    case's process ends), described with gwgrad.from_pointer: calls run on the legacy default
    stream."""

    is_cuda = True

    def __init__(self, device: int):
        self.device = device
        try:
            import cupy
        except Exception:  # not installed, or a broken install
            cupy = None
        self.cupy = cupy
        self.name = f"cupy {cupy.__version__}" if cupy is not None else "cudaMalloc (gwgrad.cuda)"

    def put(self, t: HostTensor) -> Any:
        from .tensors import from_pointer

        raw = np.ascontiguousarray(t.memory).reshape(-1).view(np.uint8)
        if self.cupy is not None:
            with self.cupy.cuda.Device(self.device):
                owner = self.cupy.asarray(raw)
                self.cupy.cuda.Device(self.device).synchronize()
            ptr = owner.data.ptr
        else:
            ptr = owner = cuda.malloc(max(raw.nbytes, 16), self.device)
            with cuda.on_device(self.device):
                if raw.nbytes:
                    cuda.memcpy_h2d(ptr, raw.ctypes.data, raw.nbytes, 0)
                cuda.synchronize(0)
        return from_pointer(ptr, t.shape, t.strides, t.dtype, self.device, owner=owner)

    def address(self, arg) -> int:
        return arg.ptr

    def read(self, arg) -> np.ndarray:  # outputs: dense row-major
        out = np.empty(arg.shape, _raw_dtype(arg.dtype))
        with cuda.on_device(self.device):
            if out.nbytes:
                cuda.memcpy_d2h(out.ctypes.data, arg.ptr, out.nbytes, 0)
            cuda.synchronize(0)
        return out

    def sync(self) -> None:
        cuda.device_synchronize(self.device)


def device_arrays(device: int):
    """torch's when importable (a CUDA build), else CuPy's or raw CUDA memory."""
    try:
        import torch
    except Exception:  # not installed, or a broken install
        return RawArrays(device)
    if not torch.cuda.is_available():  # a CPU-only build of torch
        return RawArrays(device)
    return TorchArrays(device)


# --- running a case ---------------------------------------------------------------------------

@dataclass
class Outcome:
    status: str  # pass | fail | needs
    detail: str
    extra: Dict[str, Any] = field(default_factory=dict)


class _Needs(Exception):
    """The call raised NotImplementedError on an architecture the case lists as not running
    it, as it should (``error``: that exception)."""

    def __init__(self, error: NotImplementedError):
        super().__init__(str(error))
        self.error = error


def _decode_output(raw: np.ndarray, out: str) -> np.ndarray:
    return bf16_values(raw) if out == "bfloat16" else raw.astype(np.float64)


def call_gemm(arrays, p: GemmProblem, g: Gemm) -> np.ndarray:
    """The contract's wrapper on ``arrays``' copies of the problem; the output, float64."""
    from .api import grouped_gemm_wgrad
    from .status import check_errors

    kw = {name: arrays.put(t) for name, t in p.tensors.items()}
    out_dtype = _DTYPES[g.out]
    shape = p.expected.shape

    def output(index=None):
        if p.initial is None:
            values = _poison(shape if index is None else shape[1:], out_dtype)
        else:
            init = p.initial if index is None else p.initial[index]
            values = init if g.out == "float32" else bf16_bits(init)
        return arrays.put(HostTensor.dense(values, out_dtype))

    if g.mode == "dense":
        out = output()
        grouped_gemm_wgrad(wgrad_tensor=out, accumulate_on_output=g.accumulate, **kw,
                                  **p.kwargs)
        arrays.sync()
        check_errors()
        return _decode_output(arrays.read(out), g.out)
    outs = [output(e) for e in range(shape[0])]
    ptrs = arrays.put(HostTensor.dense(np.array([arrays.address(o) for o in outs], np.int64),
                                       DType.INT64))
    grouped_gemm_wgrad(output_mode="discrete", wgrad_ptrs=ptrs, wgrad_dtype=g.out,
                              accumulate_on_output=g.accumulate, **kw, **p.kwargs)
    arrays.sync()
    check_errors()
    return np.stack([_decode_output(arrays.read(o), g.out) for o in outs])


def compare(got: np.ndarray, want: np.ndarray, counts, tol: float, accumulate: bool,
            versus: str) -> Outcome:
    """Relative Frobenius error <= tol; every value finite; empty experts exact."""
    bad = [e for e in range(got.shape[0]) if not np.isfinite(got[e]).all()]
    if bad:
        nan = int(np.isnan(got).sum())
        return Outcome("fail", f"non-finite values in experts {bad} ({nan} NaN of {got.size}: "
                               "an output left unwritten keeps its NaN poison)")
    norm = float(np.linalg.norm(want)) or 1.0
    err = float(np.linalg.norm(got - want)) / norm
    per_expert = [float(np.linalg.norm(got[e] - want[e])) / (float(np.linalg.norm(want[e]))
                                                            or norm)
                  for e in range(got.shape[0])]
    worst = int(np.argmax(per_expert))
    extra = {"rel_error": err, "tolerance": tol, "versus": versus,
             "per_expert_rel_error": per_expert, "counts": [int(c) for c in counts]}
    for e, count in enumerate(counts):
        if count == 0 and not np.array_equal(got[e], want[e]):
            what = "its old values" if accumulate else "zeros"
            return Outcome("fail", f"empty expert {e}: expected {what} exactly, got max "
                                   f"|difference| {np.abs(got[e] - want[e]).max():.3g}", extra)
    if not err <= tol:
        return Outcome("fail", f"relative error {err:.2e} > {tol:g} vs {versus} (worst expert "
                               f"{worst}, {int(counts[worst])} tokens: {per_expert[worst]:.2e})",
                       extra)
    return Outcome("pass", f"rel. error {err:.1e} <= {tol:g} vs {versus}", extra)


def run_gemm(case: Case, arrays, arch: str, rng: np.random.Generator, wrong: bool) -> Outcome:
    g = case.what
    p = build_gemm(g, rng)
    if arrays.is_cuda and arch not in case.archs:
        try:
            call_gemm(arrays, p, g)
        except NotImplementedError as exc:
            raise _Needs(exc) from None
        return Outcome("fail", f"expected NotImplementedError on {arch} (the case lists "
                               f"{', '.join(case.archs)}), but the call ran")
    got = call_gemm(arrays, p, g)
    if arrays.is_cuda:
        want, versus = call_gemm(HostArrays(), p, g), "the reference backend"
    else:
        want, versus = p.expected, "a direct float64 loop"
    if wrong:  # the test hook: a reference that differs by far more than the bound
        want = want.copy()
        want[0] *= 1.5
    return compare(got, want, p.counts, case.tol, g.accumulate, versus)


# --- quantizer cases --------------------------------------------------------------------------

@dataclass
class QuantProblem:
    counts: np.ndarray
    x: HostTensor  # BF16 (tokens, channels)
    values: np.ndarray  # its float64 values
    offsets: HostTensor
    layout: Any  # gwgrad.quantizers.QuantizedLayout


def build_quant(q: Quant, rng: np.random.Generator) -> QuantProblem:
    from . import quantizers as Q

    counts = draw_counts(rng, Q.count_multiple(q.fmt))
    tokens, channels = int(counts.sum()), QUANT_CHANNELS
    x = rng.standard_normal((tokens, channels)) * np.exp2(rng.uniform(-8, 8, (1, channels)))
    x[:32, 1] = 0.0  # an all-zero scale block
    bits = bf16_bits(x)
    offsets = np.cumsum(counts).astype(np.int32)
    return QuantProblem(counts, HostTensor.dense(bits, DType.BFLOAT16), bf16_values(bits),
                        HostTensor.dense(offsets, DType.INT32),
                        Q.layout(q.fmt, tokens, channels, EXPERTS, q.elem))


def call_quant(arrays, p: QuantProblem, q: Quant):
    """gwgrad.quantize on ``arrays``' copies: (data bytes, scales (uint8 codes or float32),
    global scale or None), into outputs poisoned with 0xFF / NaN."""
    from .quantizers import quantize
    from .status import check_errors

    lay = p.layout
    outs = {"data": arrays.put(HostTensor.dense(_poison(lay.data_shape, lay.data_dtype),
                                                lay.data_dtype)),
            "scales": arrays.put(HostTensor.dense(_poison(lay.scale_shape, lay.scale_dtype),
                                                  lay.scale_dtype))}
    if lay.global_shape is not None:
        outs["global_scale"] = arrays.put(HostTensor.dense(
            _poison(lay.global_shape, DType.FLOAT32), DType.FLOAT32))
    quantize(arrays.put(p.x), arrays.put(p.offsets), q.fmt, elem=q.elem, **outs)
    arrays.sync()
    check_errors()
    gs = arrays.read(outs["global_scale"]) if "global_scale" in outs else None
    return arrays.read(outs["data"]).view(np.uint8), arrays.read(outs["scales"]), gs


def _scale_bytes_used(p: QuantProblem, q: Quant) -> int:
    """Bytes of the scale tensor the experts' scales occupy (the rest is never written)."""
    from . import quantizers as Q

    f = Q.FORMATS[q.fmt]
    lay = p.layout
    if f.recipe == S.BLOCKED:
        return S.columns_needed(p.counts, S.column_rule(S.BLOCKED, f.sf_vec)) * lay.scale_shape[0]
    if f.recipe == S.BLOCK_1X128:
        return S.columns_needed(p.counts, S.column_rule(S.BLOCK_1X128, 0)) * lay.scale_shape[1] * 4
    return int(np.prod(lay.scale_shape)) * 4


def _same_bytes(name: str, got: np.ndarray, want: np.ndarray, used: Optional[int] = None):
    g = np.ascontiguousarray(got).view(np.uint8).reshape(-1)[:used]
    w = np.ascontiguousarray(want).view(np.uint8).reshape(-1)[:used]
    bad = np.flatnonzero(g != w)
    if bad.size:
        return (f"{name}: {bad.size} of {w.size} bytes differ, first at byte {int(bad[0])}: "
                f"got {int(g[bad[0]]):#04x}, want {int(w[bad[0]]):#04x}")
    return None


def direct_quantize(p: QuantProblem, q: Quant):
    """The quantizer's outputs by a direct loop over experts of gwgrad/formats.py's
    quantizers, laid out with gwgrad/scales.py's assemblers: (data, scales, global scale)."""
    from . import quantizers as Q

    f = Q.FORMATS[q.fmt]
    lay = p.layout
    elem = lay.elem
    tokens, channels = p.values.shape
    codes = np.zeros((channels, tokens), np.uint8)
    raws, gs = [], np.ones(EXPERTS, np.float32)
    begin = 0
    for e, count in enumerate(p.counts):
        xe = p.values[begin:begin + int(count)].T
        if f.recipe == S.BLOCKED and f.global_scale:
            c, s, gs[e] = F.quantize_nvfp4(xe)
        elif f.recipe == S.BLOCKED:
            c, s = F.quantize_mx(xe, f.sf_vec, elem)
        elif f.recipe == S.BLOCK_1X128:
            c, s = F.quantize_rowwise_fp8(xe, elem, S.BLOCK_TOKENS)
        else:
            c, s = F.quantize_rowwise_fp8(xe, elem)
        codes[:, begin:begin + int(count)] = c
        raws.append(s)
        begin += int(count)
    if f.recipe == S.BLOCKED:
        sf = S.assemble_blocked(raws, channels, capacity=lay.scale_capacity)
    elif f.recipe == S.BLOCK_1X128:
        sf = S.assemble_block_1x128(raws, capacity=lay.scale_capacity)
    else:
        sf = np.stack(raws).astype(np.float32)
    data = F.pack_fp4(codes, axis=1) if elem == "e2m1" else codes
    return data, sf, (gs if f.global_scale else None)


#: Relative Frobenius error of dequantized values against the input, by element format: the
#: format's largest relative rounding step (MXFP4 also saturates a block's largest values).
ROUNDTRIP_BOUND = {"e4m3": 2.0 ** -4, "e5m2": 2.0 ** -3, "e2m1": 2.0 ** -2}


def dequantize(p: QuantProblem, q: Quant, data, sf, gs) -> np.ndarray:
    """float64 (tokens, channels) values of quantized outputs (scales read back through
    gwgrad/scales.py)."""
    from . import quantizers as Q

    f = Q.FORMATS[q.fmt]
    elem = p.layout.elem
    tokens, channels = p.values.shape
    codes = F.unpack_fp4(data, axis=1) if elem == "e2m1" else F.decode_codes(data, elem)
    out = np.zeros((channels, tokens))
    if f.recipe == S.BLOCKED:
        per_expert = S.read_blocked(sf, p.counts, f.sf_vec, channels)
        sf_fmt = "e4m3" if f.global_scale else "e8m0"
    elif f.recipe == S.BLOCK_1X128:
        starts = S.column_starts(p.counts, S.column_rule(S.BLOCK_1X128, 0))
        per_expert = [np.asarray(sf)[starts[e]:starts[e + 1]].T for e in range(EXPERTS)]
    begin = 0
    for e, count in enumerate(p.counts):
        sl = slice(begin, begin + int(count))
        if f.recipe == S.BLOCKED:
            scale = F.decode_codes(per_expert[e], sf_fmt)
            scale = np.repeat(scale, f.sf_vec, axis=1)[:, :count]
            if f.global_scale:
                scale = scale * float(gs[e])
        elif f.recipe == S.BLOCK_1X128:
            scale = np.repeat(per_expert[e].astype(np.float64), S.BLOCK_TOKENS, axis=1)[:, :count]
        else:
            scale = np.asarray(sf, np.float64)[e][:, None]
        out[:, sl] = codes[:, sl] * scale
        begin += int(count)
    return out.T


def run_quant(case: Case, arrays, arch: str, rng: np.random.Generator, wrong: bool) -> Outcome:
    q = case.what
    p = build_quant(q, rng)
    data, sf, gs = call_quant(arrays, p, q)
    used = _scale_bytes_used(p, q)
    extra: Dict[str, Any] = {"counts": [int(c) for c in p.counts]}
    if arrays.is_cuda:
        want, versus = call_quant(HostArrays(), p, q), "the reference (gwgrad.quantize on CPU)"
    else:
        want, versus = direct_quantize(p, q), "a direct loop over experts of gwgrad.formats"
    want_data = np.array(want[0], copy=True)
    if wrong:  # the test hook: one byte of the reference changed
        want_data.reshape(-1)[0] ^= 0x01
    problems = [_same_bytes("data", data, want_data), _same_bytes("scales", sf, want[1], used)]
    if gs is not None:
        problems.append(_same_bytes("global_scale", gs, want[2]))
    problems = [msg for msg in problems if msg]
    if problems:
        return Outcome("fail", "; ".join(problems) + f" (vs {versus})", extra)
    detail = f"bit-exact vs {versus}"
    if not arrays.is_cuda:
        detail = "bit-exact vs a per-expert loop of gwgrad.formats"
    if not arrays.is_cuda:
        deq = dequantize(p, q, data, sf, gs)
        err = float(np.linalg.norm(deq - p.values) / np.linalg.norm(p.values))
        bound = ROUNDTRIP_BOUND[p.layout.elem]
        extra.update(roundtrip_rel_error=err, roundtrip_bound=bound)
        if not err <= bound:
            return Outcome("fail", f"dequantized values: relative error {err:.2e} > {bound:g}",
                           extra)
        detail += f"; dequantized: rel. error {err:.1e} <= {bound:g}"
    return Outcome("pass", detail, extra)


def _injected(name: str) -> Optional[str]:
    for item in os.environ.get(INJECT_ENV, "").split(","):
        case, _, fault = item.strip().partition("=")
        if case == name:
            return fault.strip()
    return None


def run_case(name: str, target: str = "auto", device: int = 0, seed: int = 0) -> Dict[str, Any]:
    """Run one case in this process; its result record (``status``: pass, fail or needs)."""
    case = CASE_BY_NAME[name]
    fault = _injected(name)
    if fault == "sleep":
        time.sleep(3600)
    elif fault == "exit":
        os._exit(3)
    elif fault == "abort":
        os.abort()
    if target == "auto":
        target = "gpu" if cuda.available() else "cpu"
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    start = time.perf_counter()
    arch, arrays_name = "cpu", HostArrays.name
    try:
        if target == "gpu":
            from .backends import detect_arch

            arch = detect_arch(device)
            arrays = device_arrays(device)
            arrays_name = arrays.name
        else:
            arrays = HostArrays()
        runner = run_quant if case.kind == "quantize" else run_gemm
        outcome = runner(case, arrays, arch, rng, fault == "wrong")
    except _Needs as exc:
        outcome = Outcome("needs", f"needs {_arch_word(_needs_of(exc, case))}: "
                                   f"NotImplementedError: {exc}")
    except Exception as exc:  # noqa: BLE001 - every failure is the case's result
        outcome = Outcome("fail", f"{type(exc).__name__}: {exc}",
                          {"traceback": traceback.format_exc()})
    record = {"case": name, "status": outcome.status, "detail": outcome.detail,
              "family": family(case, arch), "format": case.fmt, "arch": arch,
              "target": target, "arrays": arrays_name, "seed": seed,
              "case_seconds": time.perf_counter() - start,
              "gwgrad": os.path.dirname(os.path.abspath(__file__))}
    record.update(outcome.extra)
    return record


def _needs_of(exc: _Needs, case: Case) -> Tuple[str, ...]:
    needs = getattr(exc.error, "needs", None)  # gwgrad.UnsupportedError's
    return tuple(needs) if needs else case.archs


# --- the parent: subprocesses, the table ------------------------------------------------------

@dataclass
class Running:
    case: Case
    proc: subprocess.Popen
    start: float
    report: str
    log: str


def _child_env() -> Dict[str, str]:
    """The children import this gwgrad (its folder first on PYTHONPATH) and flush at once."""
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in env.get("PYTHONPATH", "").split(
        os.pathsep) if p])
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _kill(proc: subprocess.Popen) -> None:
    """Kill a child and whatever it started (its own process group)."""
    try:
        if hasattr(os, "killpg"):
            os.killpg(proc.pid, signal.SIGKILL)
        else:
            proc.kill()
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def _tail(path: str, lines: int = 15) -> str:
    try:
        with open(path, errors="replace") as handle:
            return "".join(handle.readlines()[-lines:])
    except OSError:
        return ""


def _finish(run: Running, rc: Optional[int], timed_out: bool, timeout: float) -> Dict[str, Any]:
    seconds = time.monotonic() - run.start
    record: Dict[str, Any] = {}
    if not timed_out and rc in (0, 1):
        try:
            with open(run.report) as handle:
                record = json.load(handle)
        except (OSError, ValueError):
            record = {}
    if timed_out:
        record = {"status": "timeout", "detail": f"no result after {timeout:g} s: killed"}
    elif not record:
        if rc is not None and rc < 0:
            try:
                how = f"signal {signal.Signals(-rc).name}"
            except ValueError:
                how = f"signal {-rc}"
        else:
            how = f"exit code {rc}"
        record = {"status": "crashed", "crash": how,
                  "detail": f"the case's process ended ({how}) before reporting a result"}
    record.update(case=run.case.name, format=run.case.fmt, seconds=seconds, exit_code=rc,
                  pid=run.proc.pid)
    if record["status"] not in ("pass", "needs"):
        record["output_tail"] = _tail(run.log)
    return record


def run_all(cases: Sequence[Case], *, target: str, device: int, seed: int, timeout: float,
            jobs: int, arch: str, progress: Callable[[Dict[str, Any]], None]) -> List[Dict]:
    """Each case in a subprocess, ``jobs`` at a time, each killed after ``timeout`` s."""
    results: Dict[str, Dict[str, Any]] = {}
    pending = list(cases)
    running: List[Running] = []
    env = _child_env()
    with tempfile.TemporaryDirectory(prefix="gwgrad-selftest-") as tmp:
        try:
            while pending or running:
                while pending and len(running) < jobs:
                    case = pending.pop(0)
                    report = os.path.join(tmp, f"{case.name}.json")
                    log = os.path.join(tmp, f"{case.name}.log")
                    cmd = [sys.executable, "-m", "gwgrad.selftest", "--case", case.name,
                           "--target", target, "--device", str(device), "--seed", str(seed),
                           "--report", report]
                    with open(log, "w") as out:
                        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                                stdin=subprocess.DEVNULL, env=env,
                                                start_new_session=True)
                    running.append(Running(case, proc, time.monotonic(), report, log))
                for run in list(running):
                    rc = run.proc.poll()
                    timed_out = rc is None and time.monotonic() - run.start > timeout
                    if rc is None and not timed_out:
                        continue
                    if timed_out:
                        _kill(run.proc)
                    running.remove(run)
                    record = _finish(run, run.proc.returncode, timed_out, timeout)
                    record.setdefault("family", family(run.case, arch))
                    results[run.case.name] = record
                    progress(record)
                time.sleep(0.02)
        finally:  # interrupted: no child outlives the parent
            for run in running:
                _kill(run.proc)
    return [results[c.name] for c in cases]


def result_text(record: Dict[str, Any]) -> str:
    status = record["status"]
    if status == "pass":
        return "pass"
    if status == "needs":
        return record["detail"].split(":", 1)[0]  # "needs SM100"
    if status == "fail":
        return "FAIL"
    if status == "timeout":
        return "timeout"
    return f"crashed ({record.get('crash', '?')})"  # "crashed (signal SIGABRT)"


def _short(text: str, width: int) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= width else text[:width - 3] + "..."


def table(records: Sequence[Dict[str, Any]]) -> str:
    rows = [("case", "kernel family", "format", "result", "s", "detail")]
    for r in records:
        detail = r["detail"] if r["status"] != "needs" else r["detail"].split(": ", 1)[-1]
        rows.append((r["case"], r.get("family", "-"), r["format"], result_text(r),
                     f"{r['seconds']:.1f}", _short(detail, 100)))
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    lines = []
    for i, row in enumerate(rows):
        cells = [row[0].ljust(widths[0]), row[1].ljust(widths[1]), row[2].ljust(widths[2]),
                 row[3].ljust(widths[3]), row[4].rjust(widths[4]), row[5]]
        lines.append("  ".join(cells).rstrip())
        if i == 0:
            lines.append("  ".join("-" * w for w in widths) + "  ------")
    return "\n".join(lines)


def verdict(records: Sequence[Dict[str, Any]]) -> int:
    """0 when every case passed or needs another architecture, else 1."""
    return 0 if all(r["status"] in ("pass", "needs") for r in records) else 1


def _summary(records: Sequence[Dict[str, Any]], seconds: float) -> str:
    counts: Dict[str, int] = {}
    for r in records:
        key = result_text(r) if r["status"] == "needs" else r["status"]
        key = "crashed" if key.startswith("crashed") else key
        counts[key] = counts.get(key, 0) + 1
    parts = [f"{n} {k}" for k, n in counts.items()]
    cases = f"{len(records)} case" + ("s" if len(records) != 1 else "")
    return f"total {seconds:.1f} s: {cases}, " + ", ".join(parts)


def _list_cases() -> str:
    from .backends import _KERNELS

    rows = [("case", "runs on", "kernel family", "format")]
    for c in CASES:
        if c.kind == "quantize":
            fams = "quantize"
        else:
            fams = " / ".join(dict.fromkeys(_KERNELS[(c.kind, a)][0].rsplit(".", 1)[-1]
                                            for a in c.archs))
        rows.append((c.name, " ".join(c.archs), fams, c.fmt))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    return "\n".join("  ".join([r[0].ljust(widths[0]), r[1].ljust(widths[1]),
                                r[2].ljust(widths[2]), r[3]]) for r in rows)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m gwgrad selftest",
        description="A short correctness check of every kernel family and format this GPU "
                    "supports, each case in its own subprocess under a timeout, against gwgrad's "
                    "CPU reference backend. Without a GPU: the reference backend against a "
                    "direct float64 loop. Exit code 0 when every supported case passed.")
    p.add_argument("--device", type=int, default=0, help="CUDA device ordinal (default 0)")
    p.add_argument("--timeout", type=float, default=TIMEOUT_S,
                   help=f"seconds per case before it is killed and reported as a timeout "
                        f"(default {TIMEOUT_S:g})")
    p.add_argument("--jobs", type=int, default=None,
                   help="cases run at once (default: half the CPU cores, at most 8)")
    p.add_argument("--seed", type=int, default=None, help="the problems' seed (default: random, "
                   "printed)")
    p.add_argument("--only", default=None, metavar="CASE[,CASE...]", help="run these cases only")
    p.add_argument("--json", default=None, metavar="PATH", help="write the results to PATH")
    p.add_argument("--list", action="store_true", help="list the cases and exit")
    p.add_argument("--case", default=None, metavar="NAME",
                   help="run one case in this process (what each subprocess runs)")
    p.add_argument("--target", choices=("auto", "gpu", "cpu"), default="auto",
                   help=argparse.SUPPRESS)
    p.add_argument("--report", default=None, help=argparse.SUPPRESS)
    return p


def _one_case(args) -> int:
    if args.case not in CASE_BY_NAME:
        print(f"unknown case {args.case!r}; --list lists them", file=sys.stderr)
        return 2
    record = run_case(args.case, args.target, args.device, args.seed or 0)
    status = record["status"]
    print(f"{args.case} [{record['family']}, {record['format']}] on {record['arch']} "
          f"({record['arrays']}, seed {record['seed']}): "
          f"{'FAIL' if status == 'fail' else status} - {record['detail']} "
          f"({record['case_seconds']:.1f} s)")
    if status == "fail" and "traceback" in record:
        print(record["traceback"], end="")
    code = 0 if status in ("pass", "needs") else 1
    if args.report:
        with open(args.report, "w") as handle:
            json.dump(record, handle, indent=1)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # skip interpreter and CUDA teardown: the result is written
    return code


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    if args.list:
        print(_list_cases())
        return 0
    if args.case is not None:
        return _one_case(args)
    cases = list(CASES)
    if args.only:
        names = [n.strip() for n in args.only.split(",") if n.strip()]
        unknown = [n for n in names if n not in CASE_BY_NAME]
        if unknown:
            print(f"unknown case(s) {', '.join(unknown)}; --list lists them", file=sys.stderr)
            return 2
        cases = [CASE_BY_NAME[n] for n in names]
    seed = args.seed if args.seed is not None else secrets.randbelow(2 ** 31)
    jobs = args.jobs or max(1, min(8, (os.cpu_count() or 2) // 2))
    count = cuda.device_count()
    header = f"gwgrad {__version__} selftest"
    if count == 0:
        target, arch = "cpu", "cpu"
        print(f"{header}: no CUDA GPU found: checking the reference backend instead (CPU "
              "arrays against a direct float64 loop; the quantizers against a per-expert loop "
              "of gwgrad.formats)")
    else:
        if not 0 <= args.device < count:
            print(f"{header}: CUDA device {args.device} does not exist ({count} found)",
                  file=sys.stderr)
            return 2
        from .backends import detect_arch
        from .errors import UnsupportedError

        major, minor = cuda.compute_capability(args.device)
        name = cuda.device_name(args.device)
        try:
            arch = detect_arch(args.device)
        except UnsupportedError as exc:
            print(f"{header}: cuda:{args.device} {name} (compute capability {major}.{minor}): "
                  f"{exc.detail}")
            return 1
        target = "gpu"
        print(f"{header}: cuda:{args.device} {name}, compute capability {major}.{minor}, "
              f"kernels for {arch}")
    print(f"{len(cases)} cases, {jobs} at a time, timeout {args.timeout:g} s each, seed {seed} "
          f"(replay: python -m gwgrad selftest --seed {seed})", flush=True)
    start = time.monotonic()

    def progress(record):
        print(f"  {record['case']}: {result_text(record)} ({record['seconds']:.1f} s)",
              flush=True)

    records = run_all(cases, target=target, device=args.device, seed=seed, timeout=args.timeout,
                      jobs=jobs, arch=arch, progress=progress)
    seconds = time.monotonic() - start
    code = verdict(records)
    print()
    print(table(records))
    for r in records:
        if r["status"] not in ("pass", "needs"):
            print(f"\n{r['case']}: {result_text(r)}: {r['detail']}")
            if r.get("output_tail"):
                print("  output (last lines):")
                print("".join(f"    {line}\n" for line in r["output_tail"].rstrip().split("\n")),
                      end="")
    arrays = sorted({r["arrays"] for r in records if r.get("arrays")})
    print(f"\n{_summary(records, seconds)} (seed {seed}; arrays: {', '.join(arrays) or '-'})")
    print(f"selftest: {'PASS' if code == 0 else 'FAIL'}")
    if args.json:
        summary = {"gwgrad": __version__, "target": target, "arch": arch,
                   "device": args.device if target == "gpu" else None, "seed": seed,
                   "timeout_s": args.timeout, "jobs": jobs, "total_s": seconds,
                   "exit_code": code, "results": records}
        if target == "gpu":
            summary["device_name"] = cuda.device_name(args.device)
        with open(args.json, "w") as handle:
            json.dump(summary, handle, indent=1)
    return code


if __name__ == "__main__":
    sys.exit(main())
