"""Scale recipes of block-scaled inputs: the one home of what the scale tensors hold and how an
expert finds its scales (the kernels, the reference backend and the validation import this).

Three recipes (``StaticSpec.scale_recipe``); ``W[e] = alpha_e * sum_t deq(A)[:, t] deq(B)[t, :]``
over the expert's tokens t, ``alpha_e = global_scale_a[e] * global_scale_b[e]`` (1 without
global scales), and ``deq`` the operand times its scale:

``"blocked"`` (the contract's MXFP8 / NVFP4 / MXFP4, cuDNN's tensors)
    ``sfa_tensor`` (E8M0 or E4M3) viewed as ``(round_up(hidden, 128), C)``, ``sfb_tensor`` as
    ``(round_up(intermediate, 128), C)``: per expert, the scales of every ``sf_vec_size``
    tokens in the swizzled 32x4x4 blocked layout, experts concatenated. Expert e owns
    ``C_e = round_up(ceil(count_e / sf_vec_size), 4)`` columns starting at column
    ``S_e = sum_{i<e} C_i`` (a device prefix sum: no host sync). Byte of (row m, scale
    column j of the expert): ``Mpad*S_e + 512*((m >> 7)*(C_e >> 2) + (j >> 2)) + 16*(m & 31)
    + 4*((m >> 5) & 3) + (j & 3)``. When every count is a multiple of ``4 * sf_vec_size``
    this is cuDNN's ``Mpad * begin_e / sf_vec_size`` convention byte for byte.

``"per_expert_channel"`` (FP8; ``torch._scaled_grouped_mm``'s 2D-2D convention)
    ``sfa_tensor`` FP32 ``(E, hidden)`` (or flat ``(E*hidden,)``), ``sfb_tensor`` FP32
    ``(E, intermediate)``: one scale per expert and channel, applied once in the epilogue.

``"block_1x128"`` (FP8; DeepSeek-V3's recipe, DeepGEMM's k-grouped layout)
    ``sfa_tensor`` FP32 ``(R, hidden)``, ``sfb_tensor`` FP32 ``(R, intermediate)``: one scale
    per channel per 128 tokens of an expert. Expert e's j-th block (tokens ``begin_e + 128j``
    .. ``begin_e + 128(j+1)``, the last one possibly shorter) is row ``S_e + j`` with
    ``S_e = sum_{i<e} ceil(count_i / 128)``.

*Capacity*: ``C`` (blocked) or ``R`` (block_1x128) must hold every expert's scales. Without the
offsets values the host checks only the lower bound that holds for any counts
(``round_up(ceil(T/sf_vec), 4)`` columns, ``ceil(T/128)`` rows); the device check (and the host
check of ``validate_offsets=True``) compares ``sum_e C_e`` with the capacity and reports
``SCALES_TOO_SMALL`` (gwgrad/offsets.py) naming ``sfa_tensor``; the kernels never read past it.
"""

from __future__ import annotations

from typing import Iterable, List, Optional, Sequence, Tuple

import numpy as np

BLOCKED = "blocked"
PER_EXPERT_CHANNEL = "per_expert_channel"
BLOCK_1X128 = "block_1x128"
RECIPES = (BLOCKED, PER_EXPERT_CHANNEL, BLOCK_1X128)

#: Tokens per scale of the block_1x128 recipe.
BLOCK_TOKENS = 128
#: Rows of one blocked-layout atom, and scale columns per atom.
ATOM_ROWS, ATOM_COLS, ATOM_BYTES = 128, 4, 512


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def column_rule(recipe: Optional[str], sf_vec_size: int) -> Optional[Tuple[int, int]]:
    """``(tokens per scale column, column padding)`` of a recipe whose experts' scales are
    found by a prefix sum (``C_e = round_up(ceil(count_e / tokens), padding)``), or None."""
    if recipe == BLOCKED:
        return sf_vec_size, ATOM_COLS
    if recipe == BLOCK_1X128:
        return BLOCK_TOKENS, 1
    return None


def expert_columns(count: int, rule: Tuple[int, int]) -> int:
    tokens, pad = rule
    return round_up(-(-max(count, 0) // tokens), pad)


def columns_needed(counts: Iterable[int], rule: Tuple[int, int]) -> int:
    """``sum_e C_e``: the scale columns (blocked) or rows (block_1x128) the counts need."""
    return sum(expert_columns(c, rule) for c in counts)


# --- NumPy layout helpers (the reference backend, tests, callers building scale tensors) ------

def column_starts(counts: Iterable[int], rule: Tuple[int, int]) -> List[int]:
    """``S_e = sum_{i<e} C_i`` for every expert (and the total as the last entry)."""
    starts = [0]
    for c in counts:
        starts.append(starts[-1] + expert_columns(int(c), rule))
    return starts


def blocked_offset(m, j, Mpad, S_e, C_e):
    """Byte offset in a blocked scale tensor of (row ``m``, scale column ``j`` of the expert)
    for the expert starting at column ``S_e`` with ``C_e`` columns (ints or NumPy arrays)."""
    return (Mpad * S_e + ATOM_BYTES * ((m >> 7) * (C_e >> 2) + (j >> 2)) + 16 * (m & 31)
            + 4 * ((m >> 5) & 3) + (j & 3))


def _bytes(raw) -> np.ndarray:
    raw = np.asarray(raw)
    if raw.ndim != 2 or raw.dtype.itemsize != 1:
        raise ValueError(f"raw: expected a 2-D array of 1-byte scale codes, got shape "
                         f"{raw.shape} dtype {raw.dtype}")
    return raw.view(np.uint8)


def to_blocked(raw) -> np.ndarray:
    """One expert's raw scale codes ``(rows, cols)`` (row: channel, column j: the j-th block
    of sf_vec tokens) as the flat uint8 bytes of the 32x4x4 blocked layout, zero padded to
    ``(round_up(rows, 128), round_up(cols, 4))`` (cuDNN's / CUTLASS's / PyTorch's
    ``to_blocked``)."""
    raw = _bytes(raw)
    rows, cols = raw.shape
    rpad, cpad = round_up(rows, ATOM_ROWS), round_up(cols, ATOM_COLS)
    padded = np.zeros((rpad, cpad), np.uint8)
    padded[:rows, :cols] = raw
    blocks = padded.reshape(rpad // ATOM_ROWS, ATOM_ROWS, cpad // ATOM_COLS, ATOM_COLS)
    blocks = blocks.transpose(0, 2, 1, 3)  # (row atoms, column atoms, 128, 4)
    return np.ascontiguousarray(
        blocks.reshape(-1, 4, 32, ATOM_COLS).transpose(0, 2, 1, 3)).reshape(-1)


def assemble_blocked(raws: Sequence, rows: int, capacity: Optional[int] = None) -> np.ndarray:
    """The blocked scale tensor ``(round_up(rows, 128), C)`` (uint8) of the experts' raw scales
    ``raws[e]`` ``(rows, ceil(count_e / sf_vec))``: expert e's ``to_blocked`` bytes start at byte
    ``Mpad * S_e``. ``C = sum_e C_e``, or ``capacity`` columns (zero filled past the experts)."""
    mpad = round_up(rows, ATOM_ROWS)
    chunks = []
    for e, raw in enumerate(raws):
        raw = _bytes(raw)
        if raw.shape[0] != rows:
            raise ValueError(f"raws[{e}]: expected {rows} rows, got shape {raw.shape}")
        chunks.append(to_blocked(raw))
    flat = np.concatenate(chunks) if chunks else np.zeros(0, np.uint8)
    used = flat.size // mpad
    columns = used if capacity is None else capacity
    if columns < used:
        raise ValueError(f"capacity: expected at least {used} columns, got {capacity}")
    out = np.zeros(mpad * columns, np.uint8)
    out[:flat.size] = flat
    return out.reshape(mpad, columns)


def read_blocked(sf, counts: Iterable[int], sf_vec: int, rows: int) -> List[np.ndarray]:
    """The experts' raw scale codes ``(rows, ceil(count_e / sf_vec))`` in a blocked scale tensor
    (any array of its bytes, e.g. ``(round_up(rows, 128), C)``): the inverse of
    ``assemble_blocked``."""
    flat = np.ascontiguousarray(np.asarray(sf)).view(np.uint8).reshape(-1)
    mpad = round_up(rows, ATOM_ROWS)
    counts = [int(c) for c in counts]
    rule = (sf_vec, ATOM_COLS)
    starts = column_starts(counts, rule)
    if mpad * starts[-1] > flat.size:
        raise ValueError(f"sf: expected at least {starts[-1]} scale columns of {mpad} rows for "
                         f"these counts, got {flat.size} bytes")
    out = []
    for e, count in enumerate(counts):
        c_e = starts[e + 1] - starts[e]
        chunk = flat[mpad * starts[e]: mpad * starts[e + 1]]
        # (row atoms, column atoms, m & 31, (m >> 5) & 3, j & 3) -> (rows, columns)
        chunk = chunk.reshape(mpad // ATOM_ROWS, c_e // ATOM_COLS, 32, 4, ATOM_COLS)
        logical = chunk.transpose(0, 3, 2, 1, 4).reshape(mpad, c_e)
        out.append(np.ascontiguousarray(logical[:rows, :-(-count // sf_vec)]))
    return out


def assemble_block_1x128(per_expert_scales: Sequence, capacity: Optional[int] = None) -> np.ndarray:
    """The block_1x128 scale tensor ``(R, channels)`` (float32) of the experts' scales
    ``per_expert_scales[e]`` ``(channels, ceil(count_e / 128))``: expert e's block j is row
    ``S_e + j``. ``R = sum_e ceil(count_e / 128)``, or ``capacity`` rows (zero filled)."""
    parts = [np.asarray(s, dtype=np.float32) for s in per_expert_scales]
    if not parts:
        raise ValueError("per_expert_scales: expected one (channels, blocks) array per expert, "
                         "got none")
    channels = parts[0].shape[0]
    for e, s in enumerate(parts):
        if s.ndim != 2 or s.shape[0] != channels:
            raise ValueError(f"per_expert_scales[{e}]: expected shape ({channels}, blocks), got "
                             f"{s.shape}")
    stacked = np.concatenate([s.T for s in parts], axis=0)
    rows = stacked.shape[0] if capacity is None else capacity
    if rows < stacked.shape[0]:
        raise ValueError(f"capacity: expected at least {stacked.shape[0]} rows, got {capacity}")
    out = np.zeros((rows, channels), np.float32)
    out[:stacked.shape[0]] = stacked
    return out
