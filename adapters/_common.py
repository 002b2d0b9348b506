"""What the three adapters share: their argument names in the core's errors.

The adapters take the arrays a training step holds, ``x`` (tokens, hidden) and ``dy``
(tokens, intermediate), and hand the core ``a_tensor = x.T`` and ``b_tensor = dy``. The
core raises ``gwgrad.errors.ArgumentError`` naming its own arguments; ``NAMES`` maps them to
the adapters' (``renamed``), with no message editing.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from gwgrad.errors import ArgumentError

#: core argument -> how the adapters' docs and signatures call it
NAMES = {
    "a_tensor": "x (a_tensor = x.T)",
    "b_tensor": "dy (b_tensor)",
    "offsets_tensor": "offsets",
    "wgrad_tensor": "out (wgrad_tensor)",
    "wgrad_ptrs": "out (the per-expert outputs)",
    "wgrad_dtype": "out_dtype (wgrad_dtype)",
}


@contextlib.contextmanager
def adapter_names() -> Iterator[None]:
    """Re-raise the core's ArgumentErrors under the adapter's argument names."""
    try:
        yield
    except ArgumentError as exc:
        renamed = exc.renamed(NAMES)
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
