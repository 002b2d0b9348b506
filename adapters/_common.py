"""What the three adapters share: their argument names in the core's errors.

The adapters take the arrays a training step holds, ``x`` (tokens, hidden) and ``dy``
(tokens, intermediate), and hand the core ``a_tensor = x.T`` and ``b_tensor = dy``. The
core raises ``gwgrad.errors.ArgumentError`` naming its own arguments; ``NAMES`` maps them to
the adapters' (``renamed``), with no message editing.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Mapping

from gwgrad.errors import NAMED_ERRORS, ArgumentError

#: core argument -> how the adapters' docs and signatures call it
NAMES = {
    "a_tensor": "x (a_tensor = x.T)",
    "b_tensor": "dy (b_tensor)",
    "offsets_tensor": "offsets",
    "wgrad_tensor": "out (wgrad_tensor)",
    "wgrad_ptrs": "out (the per-expert outputs)",
    "wgrad_dtype": "out_dtype (wgrad_dtype)",
    "accumulate_on_output": "accumulate (accumulate_on_output)",
    "sfa_tensor": "x_scale (sfa_tensor)",
    "sfb_tensor": "dy_scale (sfb_tensor)",
    "global_scale_a": "x_global_scale (global_scale_a)",
    "global_scale_b": "dy_global_scale (global_scale_b)",
}

#: gwgrad.quantize's output arguments -> the adapters' ``quantize(..., out=(data, scales,
#: global_scale))`` (x, offsets, fmt and elem keep their names)
QUANTIZE_NAMES = {
    "data": "out[0] (data)",
    "scales": "out[1] (scales)",
    "global_scale": "out[2] (global_scale)",
}

#: The FP8 recipes the adapters' ``wgrad_fp8`` take (gwgrad/scales.py), and the core's
#: ``sf_vec_size`` for each.
FP8_RECIPES = {"per_expert_channel": 16, "block_1x128": 128}

FP8_DOC = """FP8 weight gradient with FP32 scales: for every expert e,
    ``W[e] = alpha_e * sum_t (x[t, :] * sx)^T (dy[t, :] * sdy)`` over its tokens, with
    ``alpha_e = x_global_scale[e] * dy_global_scale[e]`` (1 without global scales), FP32
    accumulation promoted every 128 tokens, one rounding to the output dtype.

    x: (tokens, hidden), dy: (tokens, intermediate), float8_e4m3fn or float8_e5m2 (they may
    differ), stored token-contiguous: x is the transpose view of a (hidden, tokens) row-major
    array (``xt.T``; strides (1, tokens)), dy likewise, as Hopper's FP8 tensor cores read them
    (quantize x and dy column-wise). offsets: int32 (num_experts,).
    scale_recipe "per_expert_channel": x_scale float32 (num_experts, hidden) and dy_scale
    (num_experts, intermediate), ``sx = x_scale[e]`` (``torch._scaled_grouped_mm``'s 2D-2D
    convention); "block_1x128": x_scale (R, hidden), dy_scale (R, intermediate), one row per
    128 tokens of an expert, experts' rows in order (expert e's j-th block is row
    ``sum_{i<e} ceil(count_i/128) + j``; R at least that total: checked on the device).
    x_global_scale / dy_global_scale: float32 (num_experts,), both or neither."""


def check_accumulate(accumulate, out) -> None:
    """``accumulate`` as the core takes ``accumulate_on_output``: a bool, and True only with
    an output to add into; named as the adapters name them."""
    if not isinstance(accumulate, bool):
        raise ArgumentError("accumulate", f"expected a bool, got {accumulate!r}")
    if accumulate and out is None:
        raise ArgumentError("out", "expected an initialized output to accumulate into "
                                   "(accumulate=True adds to it), got None")


@contextlib.contextmanager
def adapter_names(names: Mapping[str, str] = NAMES) -> Iterator[None]:
    """Re-raise the core's ArgumentErrors (and UnsupportedErrors) under the adapter's argument
    names (``names``: ``NAMES`` for the GEMMs, ``QUANTIZE_NAMES`` for ``quantize``)."""
    try:
        yield
    except NAMED_ERRORS as exc:
        renamed = exc.renamed(names)
        if renamed is exc:
            raise
        raise renamed from None


def experts_hidden_intermediate(x_shape, dy_shape, offsets_shape):
    """(num_experts, hidden, intermediate) for allocating an output, or ArgumentError."""
    if len(x_shape) != 2:
        raise ArgumentError("x", f"expected 2 dims (tokens, hidden), got shape {tuple(x_shape)}")
    if len(dy_shape) != 2:
        raise ArgumentError("dy", f"expected 2 dims (tokens, intermediate), got shape "
                                  f"{tuple(dy_shape)}")
    if len(offsets_shape) != 1:
        raise ArgumentError("offsets", f"expected shape (num_experts,), got shape "
                                       f"{tuple(offsets_shape)}")
    return int(offsets_shape[0]), int(x_shape[1]), int(dy_shape[1])
