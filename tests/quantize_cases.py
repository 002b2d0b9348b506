"""Shared inputs of the quantizer tests (core, torch / CuPy / JAX adapters, CPU and GPU)."""

from __future__ import annotations

import numpy as np


def special_values(rng, tokens: int, channels: int, *, specials: bool = True,
                   wide: bool = True) -> np.ndarray:
    """float64 ``(tokens, channels)``, not yet rounded to BF16: normal values (``wide``: times
    per-channel magnitudes 2**-30..2**30), plus zeros, BF16 denormals, values near BF16's
    largest and (``specials``) NaN / +-Inf, an all-zero block and an all-denormal block."""
    x = rng.standard_normal((tokens, channels))
    if wide:
        x = x * np.exp2(rng.uniform(-30, 30, (1, channels)))
    if tokens and specials:
        flat = x.reshape(-1)
        pick = rng.choice(flat.size, size=min(flat.size, 24), replace=False)
        flat[pick[:6]] = rng.standard_normal(6) * 1e-39  # BF16 denormals
        flat[pick[6:10]] = 3e38 * np.sign(rng.standard_normal(4))  # near BF16's largest
        flat[pick[10:14]] = 0.0
        flat[pick[14:16]] = np.nan
        flat[pick[16:18]] = np.inf
        flat[pick[18:20]] = -np.inf
        if tokens >= 64 and channels >= 3:
            x[:32, 1] = 0.0
            x[32:64, 2] = 1e-39
    return x


def tiny_expert_values(rng, tokens: int, channels: int) -> np.ndarray:
    """float64 ``(tokens, channels)`` BF16 values of an NVFP4 expert so small (~2**-130, BF16
    denormals) that its global scale is an FP32 denormal and ``1 / (scale * g)``, the blocks'
    multiplier, overflows to +Inf: ``x * Inf`` is +-Inf (code 7 with the sign) but NaN (code
    0, no sign) for +-0, which this input holds in every channel. The FP4 quantizer's fast
    path cannot round a NaN product; these blocks take its per-value path."""
    x = rng.standard_normal((tokens, channels)) * 2.0 ** -130
    x[::5] = 0.0
    x[2::7] = -0.0
    bits = x.astype(np.float32).view(np.uint32)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000  # to BF16, nearest even
    return bits.astype(np.uint32).view(np.float32).astype(np.float64)
