"""The contract's rules as pure functions over ``TensorDesc`` objects.

``build_spec`` checks one call completely and returns its ``StaticSpec``; ``check_call``
is the cheap per-call check that a cached operator runs: the call's tensors match the
spec it was compiled for. Neither touches a GPU, so every rule is tested on a CPU-only
machine. Offsets *values* are checked in ``offsets.py`` (they may live on the device).

Every failure is an ``ArgumentError`` (a ``ValueError``) whose ``argument`` names the
argument and whose message says what was expected and what came.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence, Tuple, Union

from .dtypes import BLOCK_SCALED_DTYPES, OUTPUT_DTYPES, DType, as_dtype
from .errors import fail
from .offsets import tokens_sum_multiple
from .scales import BLOCK_1X128, BLOCK_TOKENS, BLOCKED, PER_EXPERT_CHANNEL, RECIPES, round_up
from .spec import INPUT_ORDERS, OUTPUT_MODES, StaticSpec, Tuning
from .tensors import TensorDesc

#: TMA and the vectorized epilogue need 16-byte aligned base addresses (A, B, the outputs, the
#: scale tensors: a 1-byte E8M0 / E4M3 scale tensor too, since the kernels read it through TMA
#: descriptors); int32 offsets and float32 global scales need 4 (gwgrad/plan.py checks the
#: same on every launch).
ALIGNMENT_BYTES = 16
#: Scale-factor dtypes of the ``blocked`` recipe (MXFP8 / MXFP4: E8M0; NVFP4: E4M3).
SF_DTYPES = (DType.FLOAT8_E8M0FNU, DType.FLOAT8_E4M3FN)
SF_VEC_SIZES = (16, 32)
#: FP8 operand dtypes; the FP32-scale recipes may mix them (A e4m3, B e5m2 or the reverse).
FP8_DTYPES = (DType.FLOAT8_E4M3FN, DType.FLOAT8_E5M2)
#: Recipes of FP32 scale factors (gwgrad/scales.py).
FP32_RECIPES = (PER_EXPERT_CHANNEL, BLOCK_1X128)

_MAJOR_WORDS = {"k": "K-major", "m": "M-major", "n": "N-major"}


_fail = fail  # ArgumentError(name, "expected ..., got ...")


def _about(desc: TensorDesc) -> str:
    return f"a {desc.dtype} tensor of shape {desc.shape}"


# --- small rules, shared by build_spec and check_call ----------------------------------------

def require_tensor(desc: Optional[TensorDesc], name: str) -> TensorDesc:
    if desc is None:
        _fail(name, "a tensor", "None")
    return desc


def check_ndim(desc: TensorDesc, name: str, ndim: int, dims: str) -> None:
    if desc.ndim != ndim:
        _fail(name, f"{ndim} dims {dims}", f"shape {desc.shape}")


def check_same_device(desc: Optional[TensorDesc], name: str, ref: TensorDesc) -> None:
    if desc is not None and (desc.device_type != ref.device_type or
                             (desc.is_cuda and desc.device_id != ref.device_id)):
        _fail(name, f"a tensor on {ref.device} like a_tensor (all tensors on one device)",
              f"a tensor on {desc.device}")


def check_aligned(desc: Optional[TensorDesc], name: str, nbytes: int = ALIGNMENT_BYTES) -> None:
    if desc is not None and desc.numel and desc.ptr % nbytes:
        _fail(name, f"a {nbytes}-byte aligned base address", f"{desc.ptr:#x}")


def check_contiguous_1d(desc: TensorDesc, name: str, length: int, dtype: DType,
                        what: str = "(num_experts,)") -> None:
    if desc.ndim != 1 or desc.shape[0] != length:
        _fail(name, f"shape {what} = ({length},)", f"shape {desc.shape}")
    if desc.dtype != dtype:
        _fail(name, f"dtype {dtype}", desc.dtype)
    if length > 1 and desc.strides[0] != 1:
        _fail(name, "a contiguous tensor (stride (1,))", f"strides {desc.strides}")


def _canonical_strides(which: str, shape: Tuple[int, int]) -> dict:
    rows, cols = shape
    if which == "a":  # (hidden, tokens_sum)
        return {"k": (cols, 1), "m": (1, rows)}
    return {"k": (1, rows), "n": (cols, 1)}  # b: (tokens_sum, intermediate)


def _unit_axis(which: str, major: str) -> int:
    k_axis = 1 if which == "a" else 0
    return k_axis if major == "k" else 1 - k_axis


def operand_major(desc: TensorDesc, name: str, which: str, input_order: str,
                  prefer: Optional[str] = None) -> str:
    """The major ("k", "m" for A, "n" for B) that ``desc``'s strides describe.

    ``tensor2d`` needs the contract's exact strides; ``tensor_ragged`` reads only which axis
    has unit stride (the other stride is meaningless there: memory is per-expert blocks).
    Strides of size-1 axes are ignored and empty tensors match any major; when several fit,
    ``prefer`` (a cached operator's major) wins, then an exact canonical match, then K.
    """
    canon = _canonical_strides(which, desc.shape)
    other = "m" if which == "a" else "n"

    def fits(major: str) -> bool:
        if 0 in desc.shape:
            return True
        for axis, size in enumerate(desc.shape):
            if size == 1:
                continue
            if input_order == "tensor_ragged" and axis != _unit_axis(which, major):
                continue
            if desc.strides[axis] != canon[major][axis]:
                return False
        return True

    fitting = [m for m in ("k", other) if fits(m)]
    if not fitting:
        if input_order == "tensor_ragged":
            expected = f"a unit stride on one axis (tensor_ragged) for shape {desc.shape}"
        else:
            expected = (f"strides {canon['k']} (K-major) or {canon[other]} "
                        f"({_MAJOR_WORDS[other]}) for shape {desc.shape}")
        _fail(name, expected, f"strides {desc.strides}")
    if prefer in fitting:
        return prefer
    if len(fitting) == 1:
        return fitting[0]
    exact = [m for m in fitting if desc.strides == canon[m]]
    return exact[0] if len(exact) == 1 else "k"


def _packing(dtype: DType) -> int:
    return 2 if dtype == DType.FLOAT4_E2M1FN_X2 else 1


def operand_dims(desc: TensorDesc, name: str, which: str, major: str) -> Tuple[int, int]:
    """Logical (rows, cols): packed FP4 holds two values per byte along K."""
    rows, cols = desc.shape
    if _packing(desc.dtype) == 2:
        if major != "k":
            _fail(name, "a K-major tensor (float4_e2m1fn_x2 packs two values per byte along "
                  "the token axis)", f"a {_MAJOR_WORDS[major]} one")
        return (rows, 2 * cols) if which == "a" else (2 * rows, cols)
    return rows, cols


def dim_multiple(dtype: DType) -> int:
    """hidden / intermediate granule: 16 bytes of the operand type (rows of M/N-major tiles)."""
    if dtype == DType.FLOAT4_E2M1FN_X2:
        return 32
    return ALIGNMENT_BYTES // dtype.itemsize


def check_tokens_sum(spec: StaticSpec, tokens_sum: int) -> None:
    multiple = tokens_sum_multiple(spec)
    if tokens_sum % multiple:
        if spec.is_block_scaled:
            name, why = "a_tensor", "every expert's token count is, for block-scaled inputs"
        elif spec.input_order == "tensor_ragged":
            name, why = "a_tensor", "every expert's token count is, for K-major tensor_ragged inputs"
        else:
            name = "a_tensor" if spec.a_major == "k" else "b_tensor"
            why = "a K-major operand's row stride is tokens_sum elements; TMA needs 16-byte strides"
        _fail(name, f"tokens_sum (the token axis) to be a multiple of {multiple} ({why})",
              f"tokens_sum = {tokens_sum}")


def check_output_stack(desc: TensorDesc, name: str, num_experts: int, hidden: int,
                        intermediate: int) -> None:
    shape = (num_experts, hidden, intermediate)
    if desc.shape != shape:
        _fail(name, f"shape (num_experts, hidden, intermediate) = {shape}", f"shape {desc.shape}")
    if not desc.is_contiguous():
        _fail(name, f"contiguous strides {(hidden * intermediate, intermediate, 1)}",
              f"strides {desc.strides}")
    if desc.read_only:
        _fail(name, "a writable tensor", "a read-only one")


def _check_ptrs(desc: TensorDesc, name: str, num_experts: int) -> None:
    check_contiguous_1d(desc, name, num_experts, DType.INT64)
    check_aligned(desc, name)


def _pair(value: Any, name: str) -> Optional[Tuple[int, int]]:
    if value is None:
        return None
    try:
        pair = tuple(value)
    except TypeError:
        pair = None
    if (pair is None or len(pair) != 2 or
            not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in pair)):
        _fail(name, "None or a pair of positive ints", repr(value))
    return pair


def _choice(value: Any, name: str, allowed: Sequence[str]) -> str:
    value = getattr(value, "value", value)  # enums whose value is the name
    if value not in allowed:
        _fail(name, " or ".join(repr(a) for a in allowed), repr(value))
    return value


# --- the full check of one call --------------------------------------------------------------

def build_spec(
    *,
    a: Optional[TensorDesc],
    b: Optional[TensorDesc],
    offsets: Optional[TensorDesc],
    sfa: Optional[TensorDesc] = None,
    sfb: Optional[TensorDesc] = None,
    global_scale_a: Optional[TensorDesc] = None,
    global_scale_b: Optional[TensorDesc] = None,
    output_mode: str = "dense",
    wgrad: Optional[TensorDesc] = None,
    wgrad_ptrs: Optional[TensorDesc] = None,
    wgrad_expert: Optional[TensorDesc] = None,
    num_experts: Optional[int] = None,
    wgrad_shape: Optional[Sequence[int]] = None,
    wgrad_dtype: Any = None,
    acc_dtype: Any = DType.FLOAT32,
    mma_tiler_mn: Any = None,
    cluster_shape_mn: Any = None,
    sf_vec_size: int = 16,
    accumulate: bool = False,
    input_order: str = "tensor2d",
    arch: Union[str, Callable[[int], str], None] = None,
    scale_recipe: Optional[str] = None,
) -> StaticSpec:
    """Check every static rule of the contract for one call and return its spec.

    Output storage may be absent (the wrapper allocates it). ``wgrad_expert`` /
    ``num_experts`` / ``wgrad_shape`` are the class API's discrete-mode samples. ``arch``
    is the target for CUDA tensors: a string, or a function of the device ordinal called
    only after the device rules passed (so a mixed-device call fails as such, not as "no
    CUDA"). The tiling stays as given (None: the backend's default, filled in later).
    ``scale_recipe``: block-scaled inputs' scale recipe (gwgrad/scales.py; None: "blocked"
    for FP8 scale factors; FP32 scale factors must name theirs); None for BF16.
    """
    output_mode = _choice(output_mode, "output_mode", OUTPUT_MODES)
    input_order = _choice(input_order, "input_order", INPUT_ORDERS)
    if not isinstance(accumulate, bool):
        _fail("accumulate_on_output", "a bool", repr(accumulate))
    if isinstance(sf_vec_size, bool) or not isinstance(sf_vec_size, int):
        _fail("sf_vec_size", "an int", repr(sf_vec_size))
    mma_tiler_mn = _pair(mma_tiler_mn, "mma_tiler_mn")
    cluster_shape_mn = _pair(cluster_shape_mn, "cluster_shape_mn")
    # None: cuDNN's default, FP32.
    acc = DType.FLOAT32 if acc_dtype is None else as_dtype(acc_dtype, "acc_dtype")
    if acc != DType.FLOAT32:
        _fail("acc_dtype", "float32 (the kernels accumulate in FP32)", acc)

    # Operands: shapes, dtypes, layouts.
    a = require_tensor(a, "a_tensor")
    b = require_tensor(b, "b_tensor")
    offsets = require_tensor(offsets, "offsets_tensor")
    check_ndim(a, "a_tensor", 2, "(hidden, tokens_sum)")
    check_ndim(b, "b_tensor", 2, "(tokens_sum, intermediate)")
    if a.dtype != DType.BFLOAT16 and a.dtype not in BLOCK_SCALED_DTYPES:
        allowed = ", ".join(str(d) for d in (DType.BFLOAT16,) + BLOCK_SCALED_DTYPES)
        _fail("a_tensor", f"dtype {allowed}", a.dtype)
    if b.dtype != a.dtype and not (a.dtype in FP8_DTYPES and b.dtype in FP8_DTYPES):
        # Mixed FP8 types: only FP32-scale recipes take them (checked with the scales).
        _fail("b_tensor", f"dtype {a.dtype} like a_tensor (A and B share one dtype; only "
              "e4m3 and e5m2 mix, with float32 scale factors)", b.dtype)
    block_scaled = a.dtype != DType.BFLOAT16
    a_major = operand_major(a, "a_tensor", "a", input_order)
    b_major = operand_major(b, "b_tensor", "b", input_order)
    hidden, tokens_sum = operand_dims(a, "a_tensor", "a", a_major)
    tokens_b, intermediate = operand_dims(b, "b_tensor", "b", b_major)
    if tokens_b != tokens_sum:
        _fail("b_tensor", f"shape (tokens_sum, intermediate) with tokens_sum = {tokens_sum} "
              "(a_tensor.shape[1])", f"shape {b.shape}")
    multiple = dim_multiple(a.dtype)
    if hidden <= 0 or hidden % multiple:
        _fail("a_tensor", f"hidden (shape[0]) a positive multiple of {multiple} for {a.dtype} "
              "(16-byte rows)", f"hidden = {hidden}")
    multiple = dim_multiple(b.dtype)
    if intermediate <= 0 or intermediate % multiple:
        _fail("b_tensor", f"intermediate (shape[1]) a positive multiple of {multiple} for "
              f"{b.dtype} (16-byte rows)", f"intermediate = {intermediate}")

    # Offsets: shape, dtype, contiguity.
    if offsets.ndim != 1 or offsets.shape[0] < 1:
        _fail("offsets_tensor", "shape (num_experts,) with num_experts >= 1", f"shape {offsets.shape}")
    experts = offsets.shape[0]
    check_contiguous_1d(offsets, "offsets_tensor", experts, DType.INT32)

    # Scale controls: BF16 rejects every one of them; block-scaled needs its scale factors.
    sf_dtype, has_global_scale = None, False
    if not block_scaled:
        if scale_recipe is not None:
            _fail("scale_recipe", "None for bfloat16 inputs (BF16 takes no scale controls)",
                  repr(scale_recipe))
        for value, name in ((sfa, "sfa_tensor"), (sfb, "sfb_tensor"),
                            (global_scale_a, "global_scale_a"), (global_scale_b, "global_scale_b")):
            if value is not None:
                _fail(name, "None for bfloat16 inputs (BF16 takes no scale controls)", _about(value))
        if sf_vec_size != 16:
            _fail("sf_vec_size", "16 for bfloat16 inputs (BF16 takes no scale controls)", sf_vec_size)
    else:
        sfa = require_tensor(sfa, "sfa_tensor")
        sfb = require_tensor(sfb, "sfb_tensor")
        scale_recipe, sf_vec_size = _scale_format(a, b, sfa, sfb, global_scale_a, global_scale_b,
                                                  sf_vec_size, scale_recipe, experts)
        check_scale_shapes(scale_recipe, sf_vec_size, sfa, sfb, hidden, intermediate, experts,
                           tokens_sum)
        sf_dtype, has_global_scale = sfa.dtype, global_scale_a is not None

    # Outputs.
    out_dtype = as_dtype(wgrad_dtype, "wgrad_dtype") if wgrad_dtype is not None else None
    if output_mode == "dense":
        if wgrad_ptrs is not None:
            _fail("wgrad_ptrs", "None in dense output_mode (pass wgrad_tensor)", _about(wgrad_ptrs))
        if wgrad_expert is not None:
            _fail("sample_wgrad_expert", "None in dense output_mode (pass sample_wgrad)",
                  _about(wgrad_expert))
    else:
        if wgrad is not None and wgrad_ptrs is not None:
            _fail("wgrad_tensor", "None when wgrad_ptrs is given (discrete output goes through "
                  "wgrad_ptrs)", _about(wgrad))
        if num_experts is not None and num_experts != experts:
            _fail("num_experts", f"{experts} (offsets_tensor.shape[0])", num_experts)
        if wgrad_shape is not None and tuple(wgrad_shape) != (hidden, intermediate):
            _fail("wgrad_shape", f"(hidden, intermediate) = {(hidden, intermediate)}",
                  tuple(wgrad_shape))
        if wgrad_ptrs is not None:
            _check_ptrs(wgrad_ptrs, "wgrad_ptrs", experts)
        if wgrad_expert is not None:
            if wgrad_expert.shape != (hidden, intermediate) or not wgrad_expert.is_contiguous():
                _fail("sample_wgrad_expert", f"shape {(hidden, intermediate)} with strides "
                      f"{(intermediate, 1)}", f"shape {wgrad_expert.shape} strides {wgrad_expert.strides}")
            out_dtype = _output_dtype(wgrad_expert, "sample_wgrad_expert", out_dtype)
    if wgrad is not None:
        check_output_stack(wgrad, "wgrad_tensor", experts, hidden, intermediate)
        out_dtype = _output_dtype(wgrad, "wgrad_tensor", out_dtype)
    if out_dtype is None:
        out_dtype = DType.BFLOAT16
    if out_dtype not in OUTPUT_DTYPES:
        _fail("wgrad_dtype", " or ".join(str(d) for d in OUTPUT_DTYPES), out_dtype)

    # One device for everything; 16-byte aligned bases.
    named = (("b_tensor", b), ("offsets_tensor", offsets), ("sfa_tensor", sfa), ("sfb_tensor", sfb),
             ("global_scale_a", global_scale_a), ("global_scale_b", global_scale_b),
             ("wgrad_tensor", wgrad), ("wgrad_ptrs", wgrad_ptrs), ("sample_wgrad_expert", wgrad_expert))
    for name, desc in named:
        check_same_device(desc, name, a)
    for name, desc in (("a_tensor", a), ("b_tensor", b), ("sfa_tensor", sfa), ("sfb_tensor", sfb),
                       ("wgrad_tensor", wgrad), ("sample_wgrad_expert", wgrad_expert)):
        check_aligned(desc, name)
    for desc, name in ((offsets, "offsets_tensor"), (global_scale_a, "global_scale_a"),
                       (global_scale_b, "global_scale_b")):
        check_aligned(desc, name, 4)

    if not a.is_cuda:
        target = "cpu"
    elif callable(arch):
        target = arch(a.device_id)
    else:
        target = arch or ""
    spec = StaticSpec(
        hidden=hidden, intermediate=intermediate, num_experts=experts,
        a_dtype=a.dtype, b_dtype=b.dtype, wgrad_dtype=out_dtype, acc_dtype=acc,
        a_major=a_major, b_major=b_major, input_order=input_order, output_mode=output_mode,
        accumulate=accumulate, sf_vec_size=sf_vec_size, arch=target, sf_dtype=sf_dtype,
        has_global_scale=has_global_scale, scale_recipe=scale_recipe if block_scaled else None,
        tuning=Tuning(mma_tiler_mn=mma_tiler_mn, cluster_shape_mn=cluster_shape_mn),
    )
    check_tokens_sum(spec, tokens_sum)
    return spec


def _scale_format(a: TensorDesc, b: TensorDesc, sfa: TensorDesc, sfb: TensorDesc,
                  global_scale_a: Optional[TensorDesc], global_scale_b: Optional[TensorDesc],
                  sf_vec_size: int, scale_recipe: Any, experts: int) -> Tuple[str, int]:
    """The (recipe, spec's sf_vec_size) of block-scaled inputs: exactly MXFP8, NVFP4 and MXFP4
    with ``blocked`` scales, or FP8 with the FP32 recipes; global scales (E,) FP32, in pairs."""
    allowed = SF_DTYPES + (DType.FLOAT32,)
    if sfa.dtype not in allowed:
        _fail("sfa_tensor", f"dtype {', '.join(str(d) for d in allowed)} (scale factors)", sfa.dtype)
    if sfb.dtype != sfa.dtype:
        _fail("sfb_tensor", f"dtype {sfa.dtype} like sfa_tensor", sfb.dtype)
    if scale_recipe is not None:
        scale_recipe = _choice(scale_recipe, "scale_recipe", RECIPES)
    if (global_scale_a is None) != (global_scale_b is None):
        missing = "global_scale_b" if global_scale_b is None else "global_scale_a"
        _fail(missing, "a tensor (global scales come in pairs)", "None")
    for value, name in ((global_scale_a, "global_scale_a"), (global_scale_b, "global_scale_b")):
        if value is not None:
            check_contiguous_1d(value, name, experts, DType.FLOAT32)

    if sfa.dtype == DType.FLOAT32:
        if scale_recipe not in FP32_RECIPES:
            _fail("scale_recipe", " or ".join(repr(r) for r in FP32_RECIPES) + " for float32 "
                  "scale factors", repr(scale_recipe))
        if a.dtype not in FP8_DTYPES:
            _fail("a_tensor", f"dtype {' or '.join(str(d) for d in FP8_DTYPES)} with float32 "
                  f"scale factors ({scale_recipe})", a.dtype)
        if scale_recipe == PER_EXPERT_CHANNEL:
            if sf_vec_size != 16:
                _fail("sf_vec_size", "16, the default (per_expert_channel has one scale per "
                      "expert and channel)", sf_vec_size)
            return scale_recipe, 0
        if sf_vec_size not in (16, BLOCK_TOKENS):
            _fail("sf_vec_size", f"{BLOCK_TOKENS} (or the default 16) for block_1x128",
                  sf_vec_size)
        return scale_recipe, BLOCK_TOKENS

    if scale_recipe not in (None, BLOCKED):
        _fail("scale_recipe", f"'blocked' or None for {sfa.dtype} scale factors (the FP32 "
              "recipes take float32 ones)", repr(scale_recipe))
    if a.dtype in FP8_DTYPES:  # MXFP8
        if b.dtype != a.dtype:
            _fail("b_tensor", f"dtype {a.dtype} like a_tensor (MXFP8 takes one FP8 type for A "
                  "and B; only the FP32-scale recipes mix e4m3 with e5m2)", b.dtype)
        if sfa.dtype != DType.FLOAT8_E8M0FNU:
            _fail("sfa_tensor", f"dtype float8_e8m0fnu for {a.dtype} operands (MXFP8)", sfa.dtype)
        if sf_vec_size != 32:
            _fail("sf_vec_size", f"32 for {a.dtype} operands (MXFP8)", sf_vec_size)
    elif sfa.dtype == DType.FLOAT8_E4M3FN:  # NVFP4
        if sf_vec_size != 16:
            _fail("sf_vec_size", "16 with float8_e4m3fn scale factors (NVFP4)", sf_vec_size)
        if global_scale_a is None:
            _fail("global_scale_a", "a float32 (num_experts,) tensor (NVFP4 needs global "
                  "scales)", "None")
    elif sf_vec_size != 32:  # MXFP4
        _fail("sf_vec_size", "32 with float8_e8m0fnu scale factors (MXFP4)", sf_vec_size)
    return BLOCKED, sf_vec_size


def _check_2d_contiguous(desc: TensorDesc, name: str) -> None:
    if not desc.is_contiguous():
        _fail(name, f"contiguous strides ({desc.shape[1]}, 1)", f"strides {desc.strides}")


def check_scale_shapes(recipe: Optional[str], sf_vec_size: int, sfa: TensorDesc,
                       sfb: TensorDesc, hidden: int, intermediate: int, num_experts: int,
                       tokens_sum: int) -> None:
    """The scale tensors' shapes and strides for ``recipe`` (gwgrad/scales.py); the capacity's
    lower bound that holds for any counts (the offsets' own check is offsets.find_problem)."""
    if recipe in (None, BLOCKED):
        need = round_up(-(-tokens_sum // sf_vec_size), 4)
        rows_a, rows_b = round_up(hidden, 128), round_up(intermediate, 128)
        if (sfa.ndim != 2 or sfa.shape[0] != rows_a or sfa.shape[1] % 4
                or sfa.shape[1] < need):
            _fail("sfa_tensor", f"shape (round_up(hidden, 128), C) = ({rows_a}, C) with C a "
                  f"multiple of 4 and C >= round_up(ceil(tokens_sum / {sf_vec_size}), 4) = {need} "
                  "(blocked scales)", f"shape {sfa.shape}")
        _check_2d_contiguous(sfa, "sfa_tensor")
        columns = sfa.shape[1]
        if sfb.shape != (rows_b, columns):
            _fail("sfb_tensor", f"shape (round_up(intermediate, 128), C) = ({rows_b}, {columns}) "
                  "(C = sfa_tensor.shape[1])", f"shape {sfb.shape}")
        _check_2d_contiguous(sfb, "sfb_tensor")
    elif recipe == PER_EXPERT_CHANNEL:
        for desc, name, width, what in ((sfa, "sfa_tensor", hidden, "hidden"),
                                        (sfb, "sfb_tensor", intermediate, "intermediate")):
            shapes = ((num_experts, width), (num_experts * width,))
            if desc.shape not in shapes:
                _fail(name, f"shape (num_experts, {what}) = {shapes[0]} or flat {shapes[1]} "
                      "(per_expert_channel)", f"shape {desc.shape}")
            if not desc.is_contiguous():
                _fail(name, "a contiguous tensor", f"strides {desc.strides}")
    elif recipe == BLOCK_1X128:
        need = -(-tokens_sum // BLOCK_TOKENS)
        if sfa.ndim != 2 or sfa.shape[1] != hidden or sfa.shape[0] < need:
            _fail("sfa_tensor", f"shape (R, hidden) = (R, {hidden}) with R >= ceil(tokens_sum / "
                  f"{BLOCK_TOKENS}) = {need} (block_1x128)", f"shape {sfa.shape}")
        _check_2d_contiguous(sfa, "sfa_tensor")
        if sfb.shape != (sfa.shape[0], intermediate):
            _fail("sfb_tensor", f"shape (R, intermediate) = ({sfa.shape[0]}, {intermediate}) "
                  "(R = sfa_tensor.shape[0])", f"shape {sfb.shape}")
        _check_2d_contiguous(sfb, "sfb_tensor")


def scale_capacity(spec: StaticSpec, sfa: Optional[TensorDesc]) -> int:
    """What the scale tensors hold for the offsets' prefix sum (gwgrad/scales.py): C columns
    (blocked), R rows (block_1x128); 0 for other recipes and BF16."""
    if sfa is None or not spec.is_block_scaled:
        return 0
    if spec.scale_recipe in (None, BLOCKED):
        return sfa.shape[1] if sfa.ndim == 2 else 0
    if spec.scale_recipe == BLOCK_1X128:
        return sfa.shape[0]
    return 0


def _output_dtype(desc: TensorDesc, name: str, requested: Optional[DType]) -> DType:
    if desc.dtype not in OUTPUT_DTYPES:
        _fail(name, f"dtype {' or '.join(str(d) for d in OUTPUT_DTYPES)}", desc.dtype)
    if requested is not None and requested != desc.dtype:
        _fail("wgrad_dtype", f"{desc.dtype} ({name}'s dtype) or None", requested)
    return desc.dtype


# --- the cheap per-call check of a cached operator -------------------------------------------

def check_call(spec: StaticSpec, a: Optional[TensorDesc], b: Optional[TensorDesc],
               offsets: Optional[TensorDesc], *, sfa: Optional[TensorDesc] = None,
               sfb: Optional[TensorDesc] = None, global_scale_a: Optional[TensorDesc] = None,
               global_scale_b: Optional[TensorDesc] = None, wgrad: Optional[TensorDesc] = None,
               wgrad_ptrs: Optional[TensorDesc] = None) -> int:
    """Check that one call's tensors fit ``spec``; return tokens_sum.

    Dense mode needs ``wgrad``; discrete mode needs ``wgrad_ptrs`` and may also carry the
    stacked ``wgrad`` those addresses point into (see ``LaunchArgs``).
    """
    a = require_tensor(a, "a_tensor")
    b = require_tensor(b, "b_tensor")
    offsets = require_tensor(offsets, "offsets_tensor")
    for desc, name, dtype in ((a, "a_tensor", spec.a_dtype), (b, "b_tensor", spec.b_dtype)):
        if desc.ndim != 2 or desc.dtype != dtype:
            _fail(name, f"a 2-D {dtype} tensor (this operator's spec)", _about(desc))
    for desc, name, which, major in ((a, "a_tensor", "a", spec.a_major),
                                     (b, "b_tensor", "b", spec.b_major)):
        if operand_major(desc, name, which, spec.input_order, prefer=major) != major:
            _fail(name, f"{_MAJOR_WORDS[major]} strides (this operator's spec)",
                  f"strides {desc.strides}")
    hidden, tokens_sum = operand_dims(a, "a_tensor", "a", spec.a_major)
    tokens_b, intermediate = operand_dims(b, "b_tensor", "b", spec.b_major)
    if hidden != spec.hidden:
        _fail("a_tensor", f"hidden = {spec.hidden} (this operator's spec)", f"shape {a.shape}")
    if intermediate != spec.intermediate or tokens_b != tokens_sum:
        _fail("b_tensor", f"shape (tokens_sum, intermediate) = ({tokens_sum}, {spec.intermediate})",
              f"shape {b.shape}")
    check_contiguous_1d(offsets, "offsets_tensor", spec.num_experts, DType.INT32)

    if spec.is_block_scaled:
        for desc, name in ((sfa, "sfa_tensor"), (sfb, "sfb_tensor")):
            if require_tensor(desc, name).dtype != spec.sf_dtype:
                _fail(name, f"dtype {spec.sf_dtype} (this operator's spec)", desc.dtype)
        check_scale_shapes(spec.scale_recipe, spec.sf_vec_size, sfa, sfb, spec.hidden,
                           spec.intermediate, spec.num_experts, tokens_sum)
        for desc, name in ((global_scale_a, "global_scale_a"), (global_scale_b, "global_scale_b")):
            if (desc is not None) != spec.has_global_scale:
                _fail(name, "a tensor" if spec.has_global_scale else "None", "None" if desc is None
                      else _about(desc))
            if desc is not None:
                check_contiguous_1d(desc, name, spec.num_experts, DType.FLOAT32)
    else:
        for desc, name in ((sfa, "sfa_tensor"), (sfb, "sfb_tensor"),
                           (global_scale_a, "global_scale_a"), (global_scale_b, "global_scale_b")):
            if desc is not None:
                _fail(name, "None for bfloat16 inputs (BF16 takes no scale controls)", _about(desc))

    if spec.output_mode == "dense":
        if wgrad_ptrs is not None:
            _fail("wgrad_ptrs", "None in dense output_mode", _about(wgrad_ptrs))
        require_tensor(wgrad, "wgrad_tensor")
    else:
        _check_ptrs(require_tensor(wgrad_ptrs, "wgrad_ptrs"), "wgrad_ptrs", spec.num_experts)
    if wgrad is not None:
        check_output_stack(wgrad, "wgrad_tensor", spec.num_experts, spec.hidden, spec.intermediate)
        if wgrad.dtype != spec.wgrad_dtype:
            _fail("wgrad_tensor", f"dtype {spec.wgrad_dtype} (this operator's spec)", wgrad.dtype)

    for desc, name in ((b, "b_tensor"), (offsets, "offsets_tensor"), (sfa, "sfa_tensor"),
                       (sfb, "sfb_tensor"), (global_scale_a, "global_scale_a"),
                       (global_scale_b, "global_scale_b"), (wgrad, "wgrad_tensor"),
                       (wgrad_ptrs, "wgrad_ptrs")):
        check_same_device(desc, name, a)
    if spec.is_cpu == a.is_cuda:
        _fail("a_tensor", f"a tensor on {'the CPU' if spec.is_cpu else 'a CUDA device'} "
              f"(this operator's arch is {spec.arch})", f"a tensor on {a.device}")
    for desc, name in ((a, "a_tensor"), (b, "b_tensor"), (sfa, "sfa_tensor"), (sfb, "sfb_tensor"),
                       (wgrad, "wgrad_tensor")):
        check_aligned(desc, name)
    for desc, name in ((offsets, "offsets_tensor"), (global_scale_a, "global_scale_a"),
                       (global_scale_b, "global_scale_b")):
        check_aligned(desc, name, 4)
    check_tokens_sum(spec, tokens_sum)
    return tokens_sum
