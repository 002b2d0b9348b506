"""Low-precision number formats on the host: decoding (the reference backend), encoding and the
quantizers that build block-scaled test inputs. NumPy only (ml_dtypes is not needed; the tests
check these tables against it).

Decoding: ``fp8_table(dtype)`` is the float64 value of each of the 256 codes of FP8 E4M3FN (also
NVFP4's E4M3 scale factors), E5M2 and E8M0FNU (``2**(code - 127)``, code 255 NaN);
``FP4_VALUES`` the 16 E2M1 codes; ``unpack_fp4`` unpacks ``float4_e2m1fn_x2`` bytes, two values
per byte along the token axis, the *low nibble first* (the even token).

Encoding (``encode(values, fmt)``, fmt "e4m3", "e5m2", "e2m1" or "e8m0"): one rounding of the
float64 value to the nearest representable value, ties to the even code (for E4M3 / E5M2 /
E2M1 the even mantissa: IEEE round-to-nearest-even); the sign is kept (-0.0 has its own code).
Magnitudes past the largest finite value *saturate* to it, infinities included (PTX's
``cvt.rn.satfinite``, as quantization kernels convert); NaN gives the format's NaN code (E4M3:
0x7F / 0xFF, E5M2: 0x7F / 0xFF, E8M0: 0xFF; E2M1 has no NaN: 0). E8M0 has no sign and no zero:
zero and magnitudes below ``2**-127`` give code 0 (``2**-127``), negative values NaN.

Quantizers (per expert, ``x`` a ``(rows, count)`` float array whose axis 1 is the expert's
tokens; pass ``B_e.T`` for B). They are the models the GPU quantizers (gwgrad/quantizers.py)
match bit for bit on BF16 inputs: ``x`` is taken as FP32 (BF16 values are exact), amaxes are of
the finite magnitudes, and every other step is one IEEE FP32 operation rounded to nearest even
with subnormals kept (NumPy float32; ``mul.rn`` / ``div.rn`` on the GPU), then one rounding as
``encode``. Values are multiplied by the reciprocal of their scale, as Transformer Engine and
DeepGEMM do: one division per block, not per value.

* ``quantize_mx(x, sf_vec, elem)`` (OCP MX: MXFP8 E4M3 / E5M2, MXFP4 E2M1): per row and block
  of ``sf_vec`` tokens (the last one may be shorter) the E8M0 scale ``2**s`` with
  ``s = floor(log2(amax)) - emax(elem)`` (emax: e4m3 8, e5m2 15, e2m1 2; the OCP MX spec's
  choice, also torchao's default), clamped to ``[-127, 127]``; elements ``encode(x / 2**s)``
  (exact scaling by a power of two), saturating (amax / 2**s may reach just below
  ``2**(emax + 1)``, above the largest value). A zero block gets the smallest scale (code 0).
  A block holding NaN or Inf gets the NaN scale (code 255): its dequantized values are NaN; its
  codes are NaN (0x7F) for FP8, 0 for E2M1 (which has no NaN).
* ``quantize_nvfp4(x)``: the per-expert FP32 global scale ``g = amax / 2688`` (448 * 6; 1.0 for
  an all-zero or empty expert), per row and 16 tokens the E4M3 scale
  ``encode(amax_block / (6 * g))`` and elements ``encode(x * (1 / (scale * g)), "e2m1")`` (0
  where ``scale * g`` is 0 or not finite). NaN or Inf makes ``g`` NaN and the block's scale
  NaN (0x7F).
* ``quantize_rowwise_fp8(x, elem, block=None)``: FP32 scales ``max(amax / fmax, 2**-126)``
  (fmax: e4m3 448, e5m2 57344) per row (``block=None``: ``per_expert_channel``) or per row and
  ``block`` tokens (``block=128``: ``block_1x128``, DeepSeek-V3's recipe); an all-zero row /
  block gets scale 1.0, a non-finite one NaN and NaN codes (0x7F); elements
  ``encode(x * (1 / scale))``. NaN and Inf are never clipped to a finite value: they make
  their block's scale NaN, so everything computed from the block is NaN.

Dequantized value: ``decode(code) * decode(scale)`` (times the global scale for NVFP4, which
the GEMM applies as ``alpha_e = global_scale_a[e] * global_scale_b[e]``).
"""

from __future__ import annotations

import functools
from typing import Optional, Tuple, Union

import numpy as np

from .dtypes import DType

__all__ = ["FP4_VALUES", "fp8_table", "unpack_fp4", "pack_fp4", "decode_codes", "encode",
           "EMAX", "FMAX", "quantize_mx", "quantize_nvfp4", "quantize_rowwise_fp8",
           "dequantize_blocks"]

#: The 16 E2M1 codes' values (bit 3 the sign).
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                       -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])

#: Exponent of the largest power of two of each element format (OCP MX's emax_elem).
EMAX = {"e4m3": 8, "e5m2": 15, "e2m1": 2}
#: Largest finite value of each format.
FMAX = {"e4m3": 448.0, "e5m2": 57344.0, "e2m1": 6.0, "e8m0": 2.0 ** 127}
#: The smallest normal FP32 value: the least FP32 recipe scale (its reciprocal stays finite).
MIN_NORMAL32 = 2.0 ** -126

_NAMES = {
    "e4m3": "e4m3", "float8_e4m3fn": "e4m3", DType.FLOAT8_E4M3FN: "e4m3",
    "e5m2": "e5m2", "float8_e5m2": "e5m2", DType.FLOAT8_E5M2: "e5m2",
    "e8m0": "e8m0", "float8_e8m0fnu": "e8m0", DType.FLOAT8_E8M0FNU: "e8m0",
    "e2m1": "e2m1", "float4_e2m1fn": "e2m1", "fp4": "e2m1", DType.FLOAT4_E2M1FN_X2: "e2m1",
}


def _fmt(fmt: Union[str, DType]) -> str:
    name = _NAMES.get(fmt) if not isinstance(fmt, str) else _NAMES.get(fmt.lower())
    if name is None:
        raise ValueError(f"fmt: expected e4m3, e5m2, e2m1 or e8m0, got {fmt!r}")
    return name


@functools.lru_cache(maxsize=None)
def _table(name: str) -> np.ndarray:
    codes = np.arange(256)
    if name == "e8m0":
        table = np.ldexp(1.0, codes - 127)
        table[255] = np.nan
        return table
    if name == "e2m1":
        return FP4_VALUES.copy()
    mant_bits, bias = (3, 7) if name == "e4m3" else (2, 15)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    exp = (codes & 0x7F) >> mant_bits
    mant = codes & ((1 << mant_bits) - 1)
    scale = float(1 << mant_bits)
    value = np.where(exp == 0, np.ldexp(mant / scale, 1 - bias),
                     np.ldexp(1.0 + mant / scale, exp - bias))
    value = sign * value
    top = (1 << (7 - mant_bits)) - 1
    if name == "e4m3":  # no infinities; only S.1111.111 is NaN
        value[(exp == top) & (mant == 7)] = np.nan
    else:
        value[(exp == top) & (mant == 0)] = sign[(exp == top) & (mant == 0)] * np.inf
        value[(exp == top) & (mant != 0)] = np.nan
    return value


def fp8_table(dtype: Union[str, DType]) -> np.ndarray:
    """float64 value of each of the 256 codes of an 8-bit float type (E4M3FN, E5M2, E8M0FNU);
    read-only."""
    name = _fmt(dtype)
    if name == "e2m1":
        raise ValueError("fp8_table: e2m1 is a 4-bit format (see FP4_VALUES)")
    table = _table(name)
    table.flags.writeable = False
    return table


def decode_codes(codes: np.ndarray, fmt: Union[str, DType]) -> np.ndarray:
    """float64 values of (unpacked) codes of ``fmt``."""
    name = _fmt(fmt)
    codes = np.asarray(codes)
    if name == "e2m1":
        return FP4_VALUES[codes & 0x0F]
    return _table(name)[codes.astype(np.uint8)]


def unpack_fp4(raw: np.ndarray, axis: int) -> np.ndarray:
    """Values of packed E2M1 bytes, doubling ``axis``: the low nibble comes first."""
    raw = np.asarray(raw)
    low = FP4_VALUES[raw & 0x0F]
    high = FP4_VALUES[raw >> 4]
    out = np.stack([low, high], axis=axis + 1)
    shape = list(raw.shape)
    shape[axis] *= 2
    return out.reshape(shape)


def pack_fp4(codes: np.ndarray, axis: int) -> np.ndarray:
    """Pack E2M1 codes (one per element, 0..15) two per byte along ``axis`` (even length):
    element ``2i`` in the low nibble, ``2i + 1`` in the high nibble."""
    codes = np.asarray(codes, dtype=np.uint8)
    if codes.shape[axis] % 2:
        raise ValueError(f"pack_fp4: expected an even length along axis {axis}, got "
                         f"shape {codes.shape}")
    even = np.take(codes, np.arange(0, codes.shape[axis], 2), axis=axis)
    odd = np.take(codes, np.arange(1, codes.shape[axis], 2), axis=axis)
    return np.ascontiguousarray((even & 0x0F) | ((odd & 0x0F) << 4)).astype(np.uint8)


@functools.lru_cache(maxsize=None)
def _magnitudes(name: str) -> Tuple[np.ndarray, np.ndarray]:
    """Ascending finite non-negative values of a format and their codes."""
    if name == "e2m1":
        codes = np.arange(8)
    elif name == "e8m0":
        codes = np.arange(255)
    elif name == "e4m3":
        codes = np.arange(0x7F)
    else:  # e5m2: 0x7C is +inf
        codes = np.arange(0x7C)
    values = _table(name)[codes]
    assert (np.diff(values) > 0).all()
    return values, codes


def encode(values: np.ndarray, fmt: Union[str, DType]) -> np.ndarray:
    """uint8 codes of float64 ``values`` rounded once to ``fmt``: nearest, ties to the even
    code, saturating to the largest finite value (see the module doc). E2M1 codes are one per
    element (``pack_fp4`` packs them)."""
    name = _fmt(fmt)
    x = np.asarray(values, dtype=np.float64)
    mags, codes = _magnitudes(name)
    a = np.abs(x)
    finite_a = np.where(np.isnan(a), 0.0, np.minimum(a, mags[-1]))  # satfinite
    hi = np.clip(np.searchsorted(mags, finite_a, side="left"), 0, mags.size - 1)
    lo = np.maximum(hi - 1, 0)
    d_lo = finite_a - mags[lo]
    d_hi = mags[hi] - finite_a
    take_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (codes[hi] % 2 == 0))
    out = np.where(take_hi, codes[hi], codes[lo]).astype(np.uint8)
    negative = np.signbit(x)
    if name == "e8m0":
        out = np.where(negative & (x != 0), np.uint8(0xFF), out)
        return np.where(np.isnan(x), np.uint8(0xFF), out).astype(np.uint8)
    sign_bit = 0x08 if name == "e2m1" else 0x80
    out = np.where(negative, out | sign_bit, out).astype(np.uint8)
    if name == "e2m1":
        return np.where(np.isnan(x), np.uint8(0), out).astype(np.uint8)
    nan_code = np.uint8(0x7F)  # E4M3: S.1111.111; E5M2: S.11111.11
    return np.where(np.isnan(x), nan_code | np.where(negative, 0x80, 0).astype(np.uint8),
                    out).astype(np.uint8)


# --- quantizers --------------------------------------------------------------------------------

def _blocks(x: np.ndarray, block: int) -> Tuple[np.ndarray, int]:
    """x (rows, count) zero-padded to whole blocks, viewed (rows, blocks, block)."""
    rows, count = x.shape
    nblocks = -(-count // block)
    padded = np.zeros((rows, nblocks * block))
    padded[:, :count] = x
    return padded.reshape(rows, nblocks, block), nblocks


def _block_amax(x: np.ndarray, block: int) -> Tuple[np.ndarray, np.ndarray]:
    """(amax, finite) per row and block: amax of |x| (NaN-free), and whether the block is
    all finite."""
    blocks, _ = _blocks(x, block)
    finite = np.isfinite(blocks).all(axis=2)
    amax = np.where(np.isfinite(blocks), np.abs(blocks), 0.0).max(axis=2, initial=0.0)
    return amax, finite


def _as_2d(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    if x.ndim != 2:
        raise ValueError(f"x: expected a (rows, count) array, got shape {x.shape}")
    return x


def quantize_mx(x: np.ndarray, sf_vec: int, elem: str) -> Tuple[np.ndarray, np.ndarray]:
    """OCP MX quantization of one expert's ``(rows, count)`` values along axis 1.

    Returns ``(codes, scales)``: uint8 ``codes`` (rows, count) of ``elem`` (E2M1: one code per
    element, unpacked) and uint8 E8M0 ``scales`` (rows, ceil(count / sf_vec)).
    """
    name = _fmt(elem)
    if name not in EMAX:
        raise ValueError(f"elem: expected e4m3, e5m2 or e2m1, got {elem!r}")
    x = _as_2d(x)
    rows, count = x.shape
    amax, finite = _block_amax(x, sf_vec)
    _, exp = np.frexp(amax)  # amax = m * 2**exp, m in [0.5, 1): floor(log2) = exp - 1
    shared = np.where(amax > 0, exp - 1 - EMAX[name], -127)
    shared = np.clip(shared, -127, 127)
    scales = np.where(finite, shared + 127, 255).astype(np.uint8)
    per_token = np.repeat(shared, sf_vec, axis=1)[:, :count].astype(np.int32)
    codes = encode(np.ldexp(x, -per_token), name)
    # A non-finite block: NaN codes too (E2M1 has none: 0; the scale is NaN either way).
    bad = np.repeat(~finite, sf_vec, axis=1)[:, :count]
    codes = np.where(bad, np.uint8(0x7F if name != "e2m1" else 0), codes)
    return codes.astype(np.uint8), scales


def quantize_nvfp4(x: np.ndarray, global_scale: Optional[float] = None
                   ) -> Tuple[np.ndarray, np.ndarray, np.float32]:
    """NVFP4 quantization of one expert's ``(rows, count)`` values along axis 1.

    Returns ``(codes, scales, global_scale)``: uint8 E2M1 codes (rows, count) (unpacked),
    uint8 E4M3 scales (rows, ceil(count / 16)) and the FP32 global scale (``amax / (448 * 6)``
    unless given). The arithmetic is FP32's, as the GPU quantizer does it (see the module doc).
    """
    x = _as_2d(x)
    rows, count = x.shape
    if global_scale is None:
        if x.size and not np.isfinite(x).all():
            global_scale = np.nan
        else:
            amax = np.float32(np.abs(x).max()) if x.size else np.float32(0.0)
            global_scale = amax / np.float32(448.0 * 6.0) if amax > 0 else 1.0
    g = np.float32(global_scale)
    amax, finite = _block_amax(x, 16)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        s = amax.astype(np.float32) / (np.float32(6.0) * g)
        scales = encode(s.astype(np.float64), "e4m3")
        scales = np.where(finite & ~np.isnan(s), scales, np.uint8(0x7F)).astype(np.uint8)
        denom = fp8_table("e4m3")[scales].astype(np.float32) * g
        ok = (denom != 0) & np.isfinite(denom)
        r = np.float32(1.0) / np.where(ok, denom, np.float32(1.0))
        per_token = np.repeat(r, 16, axis=1)[:, :count]
        q = x.astype(np.float32) * per_token
    codes = encode(q.astype(np.float64), "e2m1")
    codes = np.where(np.repeat(ok, 16, axis=1)[:, :count], codes, np.uint8(0))
    return codes.astype(np.uint8), scales, g


def quantize_rowwise_fp8(x: np.ndarray, elem: str = "e4m3", block: Optional[int] = None
                         ) -> Tuple[np.ndarray, np.ndarray]:
    """FP8 quantization of one expert's ``(rows, count)`` values with FP32 scales.

    ``block=None``: one scale per row (``per_expert_channel``), scales (rows,);
    ``block=128``: one per row and 128 tokens (``block_1x128``), scales (rows, ceil(count/128)).
    Returns ``(codes, scales)``: uint8 codes (rows, count), float32 scales. The arithmetic is
    FP32's, as the GPU quantizer does it (see the module doc).
    """
    name = _fmt(elem)
    if name not in ("e4m3", "e5m2"):
        raise ValueError(f"elem: expected e4m3 or e5m2, got {elem!r}")
    x = _as_2d(x)
    rows, count = x.shape
    size = max(count, 1) if block is None else block
    amax, finite = _block_amax(x, size)
    scales = amax.astype(np.float32) / np.float32(FMAX[name])
    scales = np.maximum(scales, np.float32(MIN_NORMAL32))
    scales = np.where(amax > 0, scales, np.float32(1.0))
    scales = np.where(finite, scales, np.float32(np.nan)).astype(np.float32)
    if block is None:
        scales = scales[:, 0] if scales.shape[1] else np.ones(rows, np.float32)
        finite = finite[:, 0] if finite.shape[1] else np.ones(rows, bool)
        per_token = np.repeat(scales[:, None], count, axis=1)
        bad = np.repeat(~finite[:, None], count, axis=1)
    else:
        per_token = np.repeat(scales, block, axis=1)[:, :count]
        bad = np.repeat(~finite, block, axis=1)[:, :count]
    with np.errstate(invalid="ignore", over="ignore"):
        q = x.astype(np.float32) * (np.float32(1.0) / per_token)
    codes = np.where(bad, np.uint8(0x7F), encode(q.astype(np.float64), name))
    return codes.astype(np.uint8), scales


def dequantize_blocks(codes: np.ndarray, elem: str, scales: np.ndarray, block: int,
                      scale_fmt: Optional[str] = None) -> np.ndarray:
    """float64 ``decode(codes) * scale`` for ``(rows, count)`` codes with one scale per row and
    ``block`` tokens (``scales`` (rows, ceil(count / block)): codes of ``scale_fmt``, or
    float values when ``scale_fmt`` is None)."""
    values = decode_codes(codes, elem)
    s = np.asarray(scales)
    s = decode_codes(s, scale_fmt) if scale_fmt is not None else s.astype(np.float64)
    if s.ndim == 1:
        s = s[:, None]
    count = values.shape[1]
    return values * np.repeat(s, block, axis=1)[:, :count]


def mx_to_bf16(codes: np.ndarray, fmt: Union[str, DType], scale_codes: np.ndarray) -> np.ndarray:
    """float64 values of the BF16 numbers the two-pass MXFP8 path (kernels/sm90_mxfp8_bf16.py)
    makes of FP8 ``codes`` and their E8M0 ``scale_codes`` (broadcast): ``x * 2^(s-127)``
    exact in FP32 (E8M0 0x00 = 2^-127, 0xFF = NaN), rounded once to BF16 (nearest even,
    denormals kept, past the largest finite value +-Inf)."""
    x = decode_codes(codes, fmt)
    s = np.asarray(scale_codes).astype(np.int64)
    scale = np.where(s == 0xFF, np.nan, np.ldexp(1.0, s - 127))
    with np.errstate(over="ignore", invalid="ignore"):
        f32 = (x * scale).astype(np.float32)  # exact but past FP32's range (then +-Inf)
    bits = f32.view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    out = rounded.astype(np.uint32).view(np.float32).astype(np.float64)
    return np.where(np.isnan(f32), np.nan, out)
