"""Building test problems: logical operands, laid out in memory the way each mode says.

Everything here is independent of gwgrad's reference backend: layouts are written out with
NumPy, the expected result is a direct loop over experts, rounding uses numpy / ml_dtypes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List

import ml_dtypes
import numpy as np

import gwgrad
from gwgrad import DType, from_pointer

NP_OUT = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16, "float32": np.float32}


def bf16(values: np.ndarray) -> np.ndarray:
    return np.asarray(values, dtype=np.float32).astype(ml_dtypes.bfloat16)


def counts_to_offsets(counts) -> np.ndarray:
    return np.cumsum(np.asarray(counts, dtype=np.int64)).astype(np.int32)


def random_counts(rng, experts: int, multiple: int = 1, high: int = 40, empty: bool = True):
    counts = rng.integers(0, high // multiple + 1, experts) * multiple
    if empty and experts > 1:
        counts[rng.integers(experts)] = 0
    if counts.sum() == 0:
        counts[0] = multiple * 3
    return counts


def loop_reference(a: np.ndarray, b: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """float64 W[e] = A[:, begin:end] @ B[begin:end, :]."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    out = np.zeros((len(offsets), a.shape[0], b.shape[1]))
    begin = 0
    for e, end in enumerate(offsets):
        out[e] = a[:, begin:end] @ b[begin:end, :]
        begin = int(end)
    return out


@dataclass
class Operand:
    """Memory holding an operand in one layout, and the descriptor the API gets."""

    memory: np.ndarray
    desc: gwgrad.TensorDesc


def _desc(memory: np.ndarray, shape, strides, dtype: DType, offset_elems: int = 0):
    return from_pointer(memory.ctypes.data + offset_elems * memory.itemsize, shape, strides,
                        dtype, device_type="cpu", owner=memory)


def layout_a(a: np.ndarray, counts, major: str, order: str, dtype=DType.BFLOAT16) -> Operand:
    """A is (hidden, tokens_sum) logically; ``a`` holds its values in the storage dtype."""
    hidden, tokens = a.shape
    if major == "m":  # x.T: memory is (tokens_sum, hidden) row-major
        memory = np.ascontiguousarray(a.T)
        return Operand(memory, _desc(memory, (hidden, tokens), (1, hidden), dtype))
    if order == "tensor2d":
        memory = np.ascontiguousarray(a)
        return Operand(memory, _desc(memory, (hidden, tokens), (tokens, 1), dtype))
    blocks, begin = [], 0
    for c in counts:
        blocks.append(np.ascontiguousarray(a[:, begin:begin + c]).reshape(-1))
        begin += c
    memory = np.concatenate(blocks) if blocks else a.reshape(-1)[:0]
    # Only the unit stride means something in tensor_ragged; the other one is what a (hidden,
    # tokens_sum) view would claim.
    return Operand(memory, _desc(memory, (hidden, tokens), (tokens, 1), dtype))


def layout_b(b: np.ndarray, counts, major: str, order: str, dtype=DType.BFLOAT16) -> Operand:
    """B is (tokens_sum, intermediate) logically."""
    tokens, inter = b.shape
    if major == "n":  # dy: (tokens_sum, intermediate) row-major
        memory = np.ascontiguousarray(b)
        return Operand(memory, _desc(memory, (tokens, inter), (inter, 1), dtype))
    if order == "tensor2d":
        memory = np.ascontiguousarray(b.T)
        return Operand(memory, _desc(memory, (tokens, inter), (1, tokens), dtype))
    blocks, begin = [], 0
    for c in counts:
        blocks.append(np.ascontiguousarray(b[begin:begin + c].T).reshape(-1))
        begin += c
    memory = np.concatenate(blocks) if blocks else b.reshape(-1)[:0]
    return Operand(memory, _desc(memory, (tokens, inter), (1, tokens), dtype))


@dataclass
class Problem:
    hidden: int
    intermediate: int
    counts: np.ndarray
    a: np.ndarray  # logical values, float64
    b: np.ndarray
    offsets: np.ndarray = field(init=False)

    def __post_init__(self):
        self.offsets = counts_to_offsets(self.counts)

    @property
    def tokens_sum(self) -> int:
        return int(self.counts.sum())

    @property
    def experts(self) -> int:
        return len(self.counts)

    def expected(self) -> np.ndarray:
        return loop_reference(self.a, self.b, self.offsets)


def bf16_problem(rng, hidden=16, intermediate=24, counts=(8, 0, 24, 16)) -> Problem:
    counts = np.asarray(counts)
    tokens = int(counts.sum())
    a = bf16(rng.standard_normal((hidden, tokens))).astype(np.float64)
    b = bf16(rng.standard_normal((tokens, intermediate))).astype(np.float64)
    return Problem(hidden, intermediate, counts, a, b)


def poisoned(shape, out_dtype: str) -> np.ndarray:
    return np.full(shape, np.nan, dtype=NP_OUT[out_dtype])


def random_output(rng, shape, out_dtype: str) -> np.ndarray:
    return rng.standard_normal(shape).astype(NP_OUT[out_dtype])


def rel_error(got, want) -> float:
    got = np.asarray(got, dtype=np.float64)
    want = np.asarray(want, dtype=np.float64)
    denom = np.linalg.norm(want)
    return float(np.linalg.norm(got - want) / (denom if denom else 1.0))


def round_like(values: np.ndarray, out_dtype: str) -> np.ndarray:
    """What one rounding of float64 ``values`` to the output dtype gives (within an ulp)."""
    return np.asarray(values).astype(np.float32).astype(NP_OUT[out_dtype]).astype(np.float64)


TOLERANCE = {"float32": 1e-6, "float16": 1e-3, "bfloat16": 8e-3}


def host_ptrs(outputs: List[np.ndarray]) -> np.ndarray:
    return np.array([o.ctypes.data for o in outputs], dtype=np.int64)


def kwargs_bf16(problem: Problem, a_major="m", b_major="n", order="tensor2d") -> dict:
    a = layout_a(bf16(problem.a), problem.counts, a_major, order)
    b = layout_b(bf16(problem.b), problem.counts, b_major, order)
    return dict(a_tensor=a.desc, b_tensor=b.desc, offsets_tensor=problem.offsets,
                input_order=order)

