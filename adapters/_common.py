"""What the three adapters share: their argument names in the core's error messages.

The adapters take the arrays a training step holds, ``x`` (tokens, hidden) and ``dy``
(tokens, intermediate), and hand the core ``a_tensor = x.T`` and ``b_tensor = dy``. The
core's errors name its own arguments; these helpers say which adapter argument that is.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

# core argument -> how the adapters' docs and signatures call it
_NAMES = {
    "a_tensor": "x (a_tensor = x.T)",
    "b_tensor": "dy (b_tensor)",
    "offsets_tensor": "offsets",
    "wgrad_tensor": "out (wgrad_tensor)",
    "wgrad_ptrs": "out (the per-expert outputs)",
    "wgrad_dtype": "out_dtype (wgrad_dtype)",
}


def adapter_message(message: str) -> str:
    """``message`` with a leading core argument name replaced by the adapter's."""
    for core, mine in _NAMES.items():
        if message.startswith(core + ":"):
            return mine + message[len(core):]
    return message


@contextlib.contextmanager
def adapter_names() -> Iterator[None]:
    """Re-raise the core's ValueErrors under the adapter's argument names."""
    try:
        yield
    except ValueError as exc:
        renamed = adapter_message(str(exc))
        if renamed == str(exc):
            raise
        raise ValueError(renamed) from exc


def experts_hidden_intermediate(x_shape, dy_shape, offsets_shape):
    """(num_experts, hidden, intermediate) for allocating an output, or ValueError."""
    if len(x_shape) != 2:
        raise ValueError(f"x: expected 2 dims (tokens, hidden), got shape {tuple(x_shape)}")
    if len(dy_shape) != 2:
        raise ValueError(f"dy: expected 2 dims (tokens, intermediate), got shape {tuple(dy_shape)}")
    if len(offsets_shape) != 1:
        raise ValueError(f"offsets: expected shape (num_experts,), got shape {tuple(offsets_shape)}")
    return int(offsets_shape[0]), int(x_shape[1]), int(dy_shape[1])
