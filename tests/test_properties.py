"""Property-based: for any valid token distribution and layout, the public API on CPU arrays
equals the direct NumPy loop, and the offsets rules accept exactly the valid offsets."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gwgrad
from gwgrad.offsets import check_offsets_values, token_count_multiple
from gwgrad.validation import build_spec
from wgrad_cases import bf16_problem, layout_a, layout_b, bf16, poisoned, rel_error

LAYOUTS = st.sampled_from([(a, b, o) for a in "km" for b in "kn"
                           for o in ("tensor2d", "tensor_ragged")])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layout=LAYOUTS, experts=st.integers(1, 6), data=st.data(),
       out_dtype=st.sampled_from(["float32", "bfloat16"]), seed=st.integers(0, 2**32 - 1))
def test_api_equals_loop(layout, experts, data, out_dtype, seed):
    a_major, b_major, order = layout
    # A K-major operand needs counts that are multiples of 8 (16-byte aligned TMA rows).
    multiple = 8 if "k" in (a_major, b_major) else 1
    counts = np.array(data.draw(st.lists(st.integers(0, 6), min_size=experts,
                                         max_size=experts))) * multiple
    problem = bf16_problem(np.random.default_rng(seed), hidden=8, intermediate=16, counts=counts)
    a = layout_a(bf16(problem.a), problem.counts, a_major, order)
    b = layout_b(bf16(problem.b), problem.counts, b_major, order)
    out = poisoned((experts, 8, 16), out_dtype)
    gwgrad.grouped_gemm_wgrad(a.desc, b.desc, offsets_tensor=problem.offsets, wgrad_tensor=out,
                              input_order=order)
    got = out.astype(np.float64)
    assert not np.isnan(got).any()
    assert rel_error(got, problem.expected()) <= (1e-6 if out_dtype == "float32" else 8e-3)


def _spec():
    d = gwgrad.from_pointer
    return build_spec(a=d(1 << 20, (8, 64), (1, 8), "bfloat16"),
                      b=d(1 << 20, (64, 8), (8, 1), "bfloat16"),
                      offsets=d(1 << 20, (4,), None, "int32"), arch="sm_90a")


@settings(max_examples=200, deadline=None)
@given(values=st.lists(st.integers(-5, 80), min_size=1, max_size=6), tokens=st.integers(0, 80))
def test_offsets_rule_accepts_exactly_the_valid_offsets(values, tokens):
    spec = _spec()
    offsets = np.array(values)
    counts = np.diff(offsets, prepend=0)
    valid = bool((counts >= 0).all() and offsets[-1] == tokens and
                 (counts % token_count_multiple(spec) == 0).all())
    if valid:
        check_offsets_values(offsets, tokens, spec)
    else:
        with pytest.raises(ValueError, match="^offsets_tensor:"):
            check_offsets_values(offsets, tokens, spec)
