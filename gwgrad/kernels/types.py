"""The one map from gwgrad's dtype names (``gwgrad.dtypes.DType`` values) to the CuTe DSL's
numeric types, for the kernels' configs and the compile samples (imports the DSL)."""

from __future__ import annotations

import cutlass

CUTLASS_TYPES = {
    "bfloat16": cutlass.BFloat16,
    "float16": cutlass.Float16,
    "float32": cutlass.Float32,
    "int32": cutlass.Int32,
    "int64": cutlass.Int64,
    "uint8": cutlass.Uint8,
    "float8_e4m3fn": cutlass.Float8E4M3FN,
    "float8_e5m2": cutlass.Float8E5M2,
    "float8_e8m0fnu": cutlass.Float8E8M0FNU,
    "float4_e2m1fn_x2": cutlass.Float4E2M1FN,  # packed two per byte: element-indexed views
}


def cutlass_type(name: str):
    """The CuTe DSL type of the dtype named ``name`` (KeyError for a name it has none for)."""
    return CUTLASS_TYPES[name]
