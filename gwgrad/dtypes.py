"""Element types gwgrad knows, with the names the contract and the error messages use."""

from __future__ import annotations

import enum


class DType(enum.Enum):
    """An element type. ``value`` is the name used in messages (torch's spelling)."""

    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"
    FLOAT32 = "float32"
    FLOAT64 = "float64"
    INT32 = "int32"
    INT64 = "int64"
    UINT8 = "uint8"
    FLOAT8_E4M3FN = "float8_e4m3fn"
    FLOAT8_E5M2 = "float8_e5m2"
    FLOAT8_E8M0FNU = "float8_e8m0fnu"
    # Two FP4 E2M1 values packed in one byte; shapes count bytes (torch's float4_e2m1fn_x2).
    FLOAT4_E2M1FN_X2 = "float4_e2m1fn_x2"

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE[self]

    def __str__(self) -> str:  # messages read "bfloat16", not "DType.BFLOAT16"
        return self.value


_ITEMSIZE = {
    DType.BFLOAT16: 2,
    DType.FLOAT16: 2,
    DType.FLOAT32: 4,
    DType.FLOAT64: 8,
    DType.INT32: 4,
    DType.INT64: 8,
    DType.UINT8: 1,
    DType.FLOAT8_E4M3FN: 1,
    DType.FLOAT8_E5M2: 1,
    DType.FLOAT8_E8M0FNU: 1,
    DType.FLOAT4_E2M1FN_X2: 1,
}

#: Output dtypes the BF16 backend writes.
OUTPUT_DTYPES = (DType.BFLOAT16, DType.FLOAT16, DType.FLOAT32)
#: Operand dtypes that select the block-scaled backend (A and B must match).
BLOCK_SCALED_DTYPES = (DType.FLOAT8_E4M3FN, DType.FLOAT8_E5M2, DType.FLOAT4_E2M1FN_X2)

_ALIASES = {
    "bf16": DType.BFLOAT16,
    "fp16": DType.FLOAT16,
    "half": DType.FLOAT16,
    "fp32": DType.FLOAT32,
    "float": DType.FLOAT32,
    "fp64": DType.FLOAT64,
    "double": DType.FLOAT64,
    "int": DType.INT32,
    "long": DType.INT64,
    "e4m3": DType.FLOAT8_E4M3FN,
    "e5m2": DType.FLOAT8_E5M2,
    "e8m0": DType.FLOAT8_E8M0FNU,
    "nvfp4": DType.FLOAT4_E2M1FN_X2,
    # The CuTe DSL's type names, lowercased (cutlass.Float8E4M3FN, ...).
    "float8e4m3fn": DType.FLOAT8_E4M3FN,
    "float8e5m2": DType.FLOAT8_E5M2,
    "float8e8m0fnu": DType.FLOAT8_E8M0FNU,
    "float4e2m1fn": DType.FLOAT4_E2M1FN_X2,
}
_BY_NAME = {d.value: d for d in DType}


def as_dtype(obj, name: str = "dtype") -> DType:
    """A ``DType`` from a DType, its name, or a torch / NumPy / JAX / ml_dtypes dtype.

    Raises ArgumentError (a ValueError) naming ``name`` when the object is not an element type gwgrad knows.
    """
    if isinstance(obj, DType):
        return obj
    text = None
    if isinstance(obj, str):
        text = obj.lower()
    elif type(obj).__module__.startswith("torch"):
        text = str(obj).removeprefix("torch.")  # torch.bfloat16 -> "bfloat16"
    elif getattr(obj, "__module__", "").startswith("cutlass"):
        text = getattr(obj, "__name__", "").lower()  # the CuTe DSL's cutlass.BFloat16 (cuDNN's)
    else:
        try:
            import numpy as np

            text = np.dtype(obj).name  # numpy, ml_dtypes and JAX scalar types
        except Exception:
            text = None
    found = _BY_NAME.get(text) if text is not None else None
    if found is None and text is not None:
        found = _ALIASES.get(text)
    if found is None:
        known = ", ".join(d.value for d in DType)
        from .errors import ArgumentError

        raise ArgumentError(name, f"expected an element type ({known}), got {obj!r}")
    return found
