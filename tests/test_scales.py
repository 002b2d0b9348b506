"""The scale layouts of gwgrad/scales.py: the blocked (32x4x4) layout against its byte formula,
against the to_blocked recipe cuDNN / CUTLASS / PyTorch write out, and against cuDNN's
``Mpad * begin_e / sf_vec`` convention; the block_1x128 assembly; the offsets' capacity check."""

from __future__ import annotations

import numpy as np
import pytest

from gwgrad import scales
from gwgrad.scales import (assemble_block_1x128, assemble_blocked, blocked_offset, column_rule,
                           column_starts, columns_needed, read_blocked, round_up, to_blocked)


def _raw(rng, rows, cols):
    return rng.integers(0, 256, (rows, cols)).astype(np.uint8)


def _torch_recipe_to_blocked(raw: np.ndarray) -> np.ndarray:
    """cuDNN's ``_wgrad_to_blocked`` / PyTorch's ``to_blocked``, written with NumPy."""
    rows, cols = raw.shape
    rb, cb = -(-rows // 128), -(-cols // 4)
    padded = np.zeros((rb * 128, cb * 4), np.uint8)
    padded[:rows, :cols] = raw
    blocks = padded.reshape(rb, 128, cb, 4).transpose(0, 2, 1, 3)
    return blocks.reshape(-1, 4, 32, 4).transpose(0, 2, 1, 3).reshape(-1, 32, 16).reshape(-1)


@pytest.mark.parametrize("rows,cols", [(1, 1), (32, 4), (128, 4), (130, 5), (200, 7), (256, 12),
                                       (384, 3), (64, 0)])
def test_to_blocked_matches_the_formula_and_the_torch_recipe(rng, rows, cols):
    raw = _raw(rng, rows, cols)
    got = to_blocked(raw)
    mpad, cpad = round_up(rows, 128), round_up(cols, 4)
    assert got.shape == (mpad * cpad,) and got.dtype == np.uint8
    assert np.array_equal(got, _torch_recipe_to_blocked(raw))
    m, j = np.meshgrid(np.arange(rows), np.arange(cols), indexing="ij")
    offsets = blocked_offset(m, j, mpad, 0, cpad)
    assert np.array_equal(got[offsets], raw)
    pad = np.ones(got.size, bool)
    pad[offsets.reshape(-1)] = False
    assert (got[pad] == 0).all()  # zero padding
    # A few offsets by hand: (m, j) -> 512 * (row atom * C/4 + column atom) + 16 (m & 31) + ...
    if rows > 33 and cols > 1:
        assert blocked_offset(33, 1, mpad, 0, cpad) == 16 * 1 + 4 * 1 + 1
    if rows > 129:
        assert blocked_offset(129, 0, mpad, 0, cpad) == 512 * (cpad // 4) + 16


def _direct_assembly(raws, rows, sf_vec, counts):
    """The blocked tensor built byte by byte from the formula (independent of to_blocked)."""
    mpad = round_up(rows, 128)
    widths = [round_up(-(-c // sf_vec), 4) for c in counts]
    out = np.zeros(mpad * sum(widths), np.uint8)
    start = 0
    for raw, c_e in zip(raws, widths):
        for m in range(raw.shape[0]):
            for j in range(raw.shape[1]):
                out[blocked_offset(m, j, mpad, start, c_e)] = raw[m, j]
        start += c_e
    return out.reshape(mpad, sum(widths))


@pytest.mark.parametrize("sf_vec", [16, 32])
@pytest.mark.parametrize("counts", [(96, 0, 32, 256, 64), (0, 0, 160), (32,), (224, 0, 0, 32, 0),
                                    (0,)])
def test_assemble_blocked_ragged_counts_against_the_formula(rng, sf_vec, counts):
    rows = 200  # not a multiple of 128
    raws = [_raw(rng, rows, -(-c // sf_vec)) for c in counts]
    got = assemble_blocked(raws, rows)
    want = _direct_assembly(raws, rows, sf_vec, counts)
    assert got.shape == want.shape == (256, columns_needed(counts, column_rule("blocked", sf_vec)))
    assert np.array_equal(got, want)
    # read_blocked is the inverse, experts and padding included
    back = read_blocked(got, counts, sf_vec, rows)
    assert len(back) == len(counts)
    for raw, b in zip(raws, back):
        assert np.array_equal(raw, b)
    # a larger capacity: zero columns after the experts; the experts' bytes unchanged
    bigger = assemble_blocked(raws, rows, capacity=got.shape[1] + 8)
    assert bigger.shape == (256, got.shape[1] + 8)
    assert np.array_equal(bigger.reshape(-1)[:got.size], got.reshape(-1))
    assert (bigger.reshape(-1)[got.size:] == 0).all()
    for raw, b in zip(raws, read_blocked(bigger, counts, sf_vec, rows)):
        assert np.array_equal(raw, b)


@pytest.mark.parametrize("sf_vec", [16, 32])
def test_counts_multiple_of_128_follow_cudnn_convention(rng, sf_vec):
    """cuDNN's kernel starts expert e's scales at byte Mpad * begin_e / sf_vec, with
    C = round_up(ceil(T / sf_vec), 4): the same bytes when every count is a multiple of 128."""
    rows, counts = 384, (256, 0, 384, 128)
    raws = [_raw(rng, rows, c // sf_vec) for c in counts]
    got = assemble_blocked(raws, rows)
    mpad, tokens = 384, sum(counts)
    assert got.shape == (mpad, round_up(-(-tokens // sf_vec), 4))
    cudnn = np.zeros(mpad * got.shape[1], np.uint8)
    begin = 0
    for raw, count in zip(raws, counts):
        chunk = _torch_recipe_to_blocked(raw)
        start = mpad * begin // sf_vec
        cudnn[start:start + chunk.size] = chunk
        begin += count
    assert np.array_equal(got.reshape(-1), cudnn)
    # cuDNN test's worked example: M = 384, MXFP8, k = [256, 384]: expert 1 starts at 3072 B
    starts = column_starts([256, 384], column_rule("blocked", 32))
    assert starts == [0, 8, 20] and 384 * starts[1] == 3072 == 384 * 256 // 32


def test_read_blocked_needs_the_capacity(rng):
    raws = [_raw(rng, 32, 1), _raw(rng, 32, 1)]
    sf = assemble_blocked(raws, 32)  # (128, 8)
    with pytest.raises(ValueError, match="at least 12 scale columns"):
        read_blocked(sf, [32, 32, 32], 32, 32)
    with pytest.raises(ValueError, match="capacity"):
        assemble_blocked(raws, 32, capacity=4)
    with pytest.raises(ValueError, match="raws"):
        assemble_blocked([_raw(rng, 16, 1)], 32)


def test_assemble_block_1x128(rng):
    counts = (48, 0, 144, 256, 16)  # multiples of 16, not of 128; an empty expert
    channels = 24
    per_expert = [rng.standard_normal((channels, -(-c // 128))).astype(np.float32) for c in counts]
    got = assemble_block_1x128(per_expert)
    starts = column_starts(counts, column_rule("block_1x128", 0))
    assert starts == [0, 1, 1, 3, 5, 6]
    assert got.shape == (6, channels) and got.dtype == np.float32
    for e, c in enumerate(counts):
        for j in range(-(-c // 128)):
            assert np.array_equal(got[starts[e] + j], per_expert[e][:, j])
    padded = assemble_block_1x128(per_expert, capacity=9)
    assert padded.shape == (9, channels) and np.array_equal(padded[:6], got)
    assert (padded[6:] == 0).all()
    with pytest.raises(ValueError, match="capacity"):
        assemble_block_1x128(per_expert, capacity=5)
    with pytest.raises(ValueError, match="per_expert_scales"):
        assemble_block_1x128([np.zeros((3, 1)), np.zeros((4, 1))])
    empty = assemble_block_1x128([np.zeros((channels, 0))])
    assert empty.shape == (0, channels)


def test_column_rules():
    assert column_rule("blocked", 32) == (32, 4) and column_rule("blocked", 16) == (16, 4)
    assert column_rule("block_1x128", 128) == (128, 1)
    assert column_rule("per_expert_channel", 0) is None and column_rule(None, 16) is None
    assert columns_needed([32, 0, 33, 256], (32, 4)) == 4 + 0 + 4 + 8
    assert columns_needed([16, 0, 129], (128, 1)) == 1 + 0 + 2
    assert scales.expert_columns(0, (32, 4)) == 0
