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
