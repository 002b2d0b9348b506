"""The SM100 block-scaled kernel (kernels/sm100_blockscaled.py, backends/blockscaled_sm100.py) on a
B200/GB200-class GPU (compute capability 10.x), through the public API with the contract's argument
names (``grouped_gemm_wgrad_wrapper_sm100`` and ``GroupedGemmWgradSm100``), for MXFP8 (e4m3, e5m2;
E8M0 scales per 32 tokens), NVFP4 (packed E2M1, E4M3 scales per 16 tokens, per-expert FP32 global
scales) and MXFP4 (packed E2M1, E8M0 per 32), against float64 products of the dequantized inputs.

Everything here is built independently of gwgrad's own helpers: element values come from torch's
FP8 conversions and a local E2M1 table (two codes per byte, low nibble = even token), scale codes are
drawn at random and their bytes placed with the blocked layout's byte formula
(shared/research/blockscaled-wgrad.md §1.4):

    off = Mpad*S_e + 512*((m>>7)*(C_e>>2) + (j>>2)) + 16*(m&31) + 4*((m>>5)&3) + (j&3)
    C_e = round_up(ceil(count_e / sf_vec), 4),   S_e = sum_{i<e} C_i

Outputs are NaN-poisoned (random when accumulating) inside guard memory that must stay untouched.
Mixed e4m3 x e5m2 is not MXFP8 (a ValueError naming b_tensor, tests/test_scaled_validation.py) and
FP4 operands are K-major only (a ValueError naming the operand: tests/test_bench_blockscaled.py).

No Blackwell GPU was reachable when this was written: the tests skip on anything but compute
capability 10.x. ``tests/test_bench_blockscaled.py`` runs ``run_case`` on the CPU against gwgrad's
reference backend (same construction, same expectations) and checks that every configuration used
here passes ``check_support`` for sm_100a, so the construction itself is verified without the GPU.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Optional

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import gwgrad  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 10,
        reason="needs an SM100-family GPU (compute capability 10.x)",
    ),
]

GUARD = 4096  # elements of guard memory on each side of an output
SENTINEL = 7.0
#: Relative (Frobenius, per expert) error allowed against float64, by output dtype: the kernel
#: accumulates in FP32; 16-bit outputs add their rounding (twice when accumulating).
TOL = {torch.float32: 1e-3, torch.bfloat16: 1e-2, torch.float16: 1e-2}


@dataclasses.dataclass(frozen=True)
class Fmt:
    elem: str  # "e4m3", "e5m2" or "e2m1" (packed two per byte)
    sf: str  # "e8m0" or "e4m3"
    sf_vec: int
    needs_global: bool
    multiple: int  # every expert's token count is a multiple of this (gwgrad/offsets.py)

    @property
    def fp4(self) -> bool:
        return self.elem == "e2m1"


FORMATS = {
    "mxfp8_e4m3": Fmt("e4m3", "e8m0", 32, False, 32),
    "mxfp8_e5m2": Fmt("e5m2", "e8m0", 32, False, 32),
    "nvfp4": Fmt("e2m1", "e4m3", 16, True, 64),
    "mxfp4": Fmt("e2m1", "e8m0", 32, False, 64),
}
FP8_FORMATS = ["mxfp8_e4m3", "mxfp8_e5m2"]
#: Ragged counts with an empty expert: multiples of the format's token multiple, not all of 128
#: (MXFP8: partial 128-token K blocks and partial scale quads) / 256 (FP4: partial 256-token K
#: blocks; MXFP4 also partial quads), some spanning several K blocks.
COUNTS = {"fp8": [256, 0, 96, 416, 32, 160], "fp4": [256, 0, 64, 448, 192, 320]}
#: The contract's tilings, each with a cluster it allows (2-CTA 256-row tiles need an even
#: cluster M), and the default (None).
TILINGS = [None, ((128, 128), (1, 1)), ((128, 256), (2, 1)), ((256, 128), (2, 1)),
           ((256, 256), (2, 1)), ((128, 128), (4, 1)), ((256, 256), (4, 1))]


def counts_for(fmt: str):
    return list(COUNTS["fp4" if FORMATS[fmt].fp4 else "fp8"])


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


# --- independent decoding ------------------------------------------------------------------------

#: E2M1 magnitudes of codes 0..7; bit 3 is the sign.
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
_FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def e2m1_table(device) -> "torch.Tensor":
    return torch.tensor(E2M1 + [-v for v in E2M1], dtype=torch.float64, device=device)


def unpack_fp4(raw: "torch.Tensor") -> "torch.Tensor":
    """float64 values of packed E2M1 bytes (rows, n) -> (rows, 2n): low nibble first."""
    lut = e2m1_table(raw.device)
    raw = raw.to(torch.int64)
    pairs = torch.stack([lut[raw & 0xF], lut[raw >> 4]], dim=-1)
    return pairs.reshape(raw.shape[0], 2 * raw.shape[1])


def scale_values(codes: np.ndarray, sf: str) -> np.ndarray:
    """float64 values of scale codes: E8M0 2**(code - 127) (255: NaN); E4M3 via torch."""
    codes = np.asarray(codes, dtype=np.uint8)
    if sf == "e8m0":
        out = np.ldexp(1.0, codes.astype(np.int64) - 127)
        return np.where(codes == 255, np.nan, out)
    table = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
    return table.double().numpy()[codes]


def scale_codes(rng, shape, sf: str) -> np.ndarray:
    """Random positive scale codes: E8M0 2**-5 .. 2**2; E4M3 2**-4 .. 2**1 * (1 + m/8). Products
    stay well inside FP16's range for the FP16 outputs."""
    if sf == "e8m0":
        return rng.integers(122, 130, size=shape, dtype=np.uint8)
    exp = rng.integers(3, 9, size=shape)
    mant = rng.integers(0, 8, size=shape)
    return ((exp << 3) | mant).astype(np.uint8)


#: The NaN byte of each scale format: what padding bytes are poisoned with.
NAN_BYTE = {"e8m0": 0xFF, "e4m3": 0x7F}
_SF_TORCH = {"e8m0": "float8_e8m0fnu", "e4m3": "float8_e4m3fn"}


# --- inputs --------------------------------------------------------------------------------------

def _fp8_values(n, elem, gen, device):
    return torch.randn(n, generator=gen, device=device).mul_(2.0).to(_FP8[elem])


def _fp4_bytes(n, gen, device):
    return torch.randint(0, 256, (n,), generator=gen, device=device, dtype=torch.uint8)


def operands(f: Fmt, hidden, inter, counts, order, majors, gen, device):
    """A (hidden, T) and B (T, intermediate) as the contract declares them (tensor_ragged, K-major:
    per-expert K-contiguous blocks inside; M/N-major: the same memory in both orders; FP4: packed
    bytes, K-major), with per-expert float64 values (A_e (hidden, k_e), B_e (k_e, intermediate))."""
    a_major, b_major = majors
    t = int(sum(counts))
    starts = [0] + list(itertools.accumulate(counts))[:-1]
    spans = list(zip(starts, counts))
    ragged = order == "tensor_ragged"
    if f.fp4:
        assert majors == ("k", "k"), "FP4 operands are K-major only"
        fp4 = torch.float4_e2m1fn_x2
        flat_a = _fp4_bytes(hidden * t // 2, gen, device)
        flat_b = _fp4_bytes(inter * t // 2, gen, device)
        a = flat_a.view(hidden, t // 2).view(fp4)
        b = flat_b.view(inter, t // 2).view(fp4).t()  # (T/2, N) bytes, strides (1, T/2)
        if ragged:
            a_parts = [unpack_fp4(flat_a[s * hidden // 2:(s + c) * hidden // 2].view(hidden, c // 2))
                       for s, c in spans]
            b_parts = [unpack_fp4(flat_b[s * inter // 2:(s + c) * inter // 2].view(inter, c // 2)).t()
                       for s, c in spans]
        else:
            a_bytes, b_bytes = flat_a.view(hidden, t // 2), flat_b.view(inter, t // 2)
            a_parts = [unpack_fp4(a_bytes[:, s // 2:(s + c) // 2]) for s, c in spans]
            b_parts = [unpack_fp4(b_bytes[:, s // 2:(s + c) // 2]).t() for s, c in spans]
        return a, b, a_parts, b_parts
    flat_a = _fp8_values(hidden * t, f.elem, gen, device)
    flat_b = _fp8_values(inter * t, f.elem, gen, device)
    if a_major == "k":
        a = flat_a.view(hidden, t)
        if ragged:
            a_parts = [flat_a[s * hidden:(s + c) * hidden].view(hidden, c) for s, c in spans]
        else:
            a_parts = [a[:, s:s + c] for s, c in spans]
    else:  # M-major: x (T, hidden) row-major, A = x.T
        a = flat_a.view(t, hidden).t()
        a_parts = [a[:, s:s + c] for s, c in spans]
    if b_major == "k":
        b = flat_b.view(inter, t).t()
        if ragged:
            b_parts = [flat_b[s * inter:(s + c) * inter].view(inter, c).t() for s, c in spans]
        else:
            b_parts = [b[s:s + c, :] for s, c in spans]
    else:  # N-major: dy (T, intermediate) row-major
        b = flat_b.view(t, inter)
        b_parts = [b[s:s + c, :] for s, c in spans]
    return a, b, [p.double() for p in a_parts], [p.double() for p in b_parts]


def place_blocked(raws, rows, capacity, sf_vec, pad=None):
    """Scale bytes (round_up(rows, 128), capacity) of per-expert raw codes (rows, ceil(k_e/sf_vec)),
    placed byte by byte with the layout formula. ``pad`` fills padding bytes (default 0, as
    ``to_blocked`` zero-pads): ``{"quad": b}`` the columns j in [ceil(k_e/sf_vec), C_e) of an
    expert's last quad, ``{"rows": b}`` the rows m in [rows, Mpad) of the expert's columns,
    ``{"tail": b}`` the capacity past the last expert."""
    pad = pad or {}
    mpad = round_up(rows, 128)
    out = np.full(mpad * capacity, pad.get("tail", 0), dtype=np.uint8)
    start = 0
    m_all = np.arange(mpad)[:, None]
    for raw in raws:
        cols = raw.shape[1]
        c_e = round_up(cols, 4)
        j_all = np.arange(c_e)[None, :]
        off = (mpad * start + 512 * ((m_all >> 7) * (c_e >> 2) + (j_all >> 2)) + 16 * (m_all & 31)
               + 4 * ((m_all >> 5) & 3) + (j_all & 3))
        chunk = np.zeros((mpad, c_e), np.uint8)
        chunk[:, cols:] = pad.get("quad", 0)
        chunk[rows:, :] = pad.get("rows", 0)
        chunk[:rows, :cols] = raw
        out[off] = chunk
        start += c_e
    assert start <= capacity
    return out.reshape(mpad, capacity)


def read_blocked(sf_bytes: np.ndarray, counts, sf_vec, rows):
    """The experts' raw codes (rows, ceil(k_e/sf_vec)) of a blocked scale tensor's bytes, read with
    the same formula (for outputs of gwgrad.quantize)."""
    flat = np.ascontiguousarray(sf_bytes).view(np.uint8).reshape(-1)
    mpad = round_up(rows, 128)
    start, out = 0, []
    m = np.arange(rows)[:, None]
    for c in counts:
        cols = -(-c // sf_vec)
        c_e = round_up(cols, 4)
        j = np.arange(cols)[None, :]
        off = (mpad * start + 512 * ((m >> 7) * (c_e >> 2) + (j >> 2)) + 16 * (m & 31)
               + 4 * ((m >> 5) & 3) + (j & 3))
        out.append(flat[off])
        start += c_e
    return out


def scale_inputs(f: Fmt, hidden, inter, counts, rng, device, extra=0, pad=None):
    """(sfa, sfb, per-expert float64 scale expansions (A (hidden, k_e), B (k_e, inter)))."""
    raws_a = [scale_codes(rng, (hidden, -(-c // f.sf_vec)), f.sf) for c in counts]
    raws_b = [scale_codes(rng, (inter, -(-c // f.sf_vec)), f.sf) for c in counts]
    capacity = sum(round_up(-(-c // f.sf_vec), 4) for c in counts) + 4 * extra
    dtype = getattr(torch, _SF_TORCH[f.sf])
    sfa = torch.from_numpy(place_blocked(raws_a, hidden, capacity, f.sf_vec, pad)).to(device).view(dtype)
    sfb = torch.from_numpy(place_blocked(raws_b, inter, capacity, f.sf_vec, pad)).to(device).view(dtype)
    expand = []
    for ra, rb, c in zip(raws_a, raws_b, counts):
        va = torch.from_numpy(scale_values(ra, f.sf)).to(device)
        vb = torch.from_numpy(scale_values(rb, f.sf)).to(device)
        k = torch.arange(c, device=device) // f.sf_vec
        expand.append((va[:, k], vb[:, k].t()))
    return sfa, sfb, expand


def guarded(shape, dtype, fill, device):
    """A tensor of `shape` inside a buffer with GUARD elements of SENTINEL on each side."""
    n = int(np.prod(shape))
    buf = torch.full((n + 2 * GUARD,), SENTINEL, dtype=dtype, device=device)
    view = buf[GUARD:GUARD + n].view(shape)
    view.copy_(fill)
    return buf, view


def guards_intact(buf):
    return bool((buf[:GUARD] == SENTINEL).all() and (buf[-GUARD:] == SENTINEL).all())


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


# --- the check -----------------------------------------------------------------------------------

@dataclasses.dataclass
class Case:
    """One run's inputs (for callers that look further)."""

    a: "torch.Tensor"
    b: "torch.Tensor"
    sfa: "torch.Tensor"
    sfb: "torch.Tensor"
    offsets: "torch.Tensor"
    gsa: Optional["torch.Tensor"]
    gsb: Optional["torch.Tensor"]
    outs: list
    kwargs: dict


def run_case(seed, fmt, counts, *, hidden=256, inter=384, out_dtype=torch.bfloat16, mode="dense",
             accumulate=False, order="tensor2d", majors=("k", "k"), global_scales=None,
             tiling=None, extra=0, pad=None, api="wrapper", device="cuda", tol=None) -> Case:
    """Build one problem, run it through the public API, check it against float64.

    ``tiling``: None (the default) or ``((tile_m, tile_n), (cluster_m, cluster_n))``;
    ``global_scales``: None for what the format needs (NVFP4: yes, MX: no), True / False;
    ``api``: "wrapper" (grouped_gemm_wgrad_wrapper_sm100) or "class" (GroupedGemmWgradSm100)."""
    f = FORMATS[fmt]
    gen = torch.Generator(device=device).manual_seed(seed)
    rng = np.random.default_rng(seed)
    e = len(counts)
    a, b, a_parts, b_parts = operands(f, hidden, inter, counts, order, majors, gen, device)
    sfa, sfb, expand = scale_inputs(f, hidden, inter, counts, rng, device, extra, pad)
    offs = torch.tensor(list(itertools.accumulate(counts)), dtype=torch.int32, device=device)
    use_gs = f.needs_global if global_scales is None else global_scales
    gsa = gsb = None
    if use_gs:
        gsa = torch.rand(e, generator=gen, device=device) + 0.5
        gsb = torch.rand(e, generator=gen, device=device) + 0.5
    if accumulate:
        init = torch.randn(e, hidden, inter, generator=gen, device=device).to(out_dtype)
    else:
        init = torch.full((e, hidden, inter), float("nan"), device=device, dtype=out_dtype)
    tile, cluster = tiling if tiling is not None else (None, None)
    common = dict(mma_tiler_mn=tile, cluster_shape_mn=cluster, sf_vec_size=f.sf_vec,
                  accumulate_on_output=accumulate, input_order=order)
    if mode == "dense":
        buf, out = guarded((e, hidden, inter), out_dtype, init, device)
        bufs, outs = [buf], list(out.unbind(0))
        target = dict(wgrad_tensor=out)
    else:
        pairs = [guarded((hidden, inter), out_dtype, init[x], device) for x in range(e)]
        bufs, outs = [p[0] for p in pairs], [p[1] for p in pairs]
        ptrs = torch.tensor([o.data_ptr() for o in outs], dtype=torch.int64, device=device)
        target = dict(wgrad_ptrs=ptrs)
    if api == "wrapper":
        extra_out = {} if mode == "dense" else {"wgrad_dtype": out_dtype}
        result = gwgrad.grouped_gemm_wgrad_wrapper_sm100(
            a_tensor=a, b_tensor=b, sfa_tensor=sfa, sfb_tensor=sfb, offsets_tensor=offs,
            output_mode=mode, global_scale_a=gsa, global_scale_b=gsb, acc_dtype=torch.float32,
            **target, **extra_out, **common)
        if mode == "discrete":
            assert result["wgrad_tensor"] is None
        else:
            assert result["wgrad_tensor"] is target["wgrad_tensor"]
    else:
        samples = (dict(sample_wgrad=target["wgrad_tensor"]) if mode == "dense" else
                   dict(sample_wgrad_expert=outs[0], num_experts=e, wgrad_shape=(hidden, inter),
                        wgrad_dtype=out_dtype))
        op = gwgrad.GroupedGemmWgradSm100(
            sample_a=a, sample_b=b, sample_sfa=sfa, sample_sfb=sfb, sample_offsets=offs,
            sample_global_scale_a=gsa, sample_global_scale_b=gsb, acc_dtype=torch.float32,
            **samples, **common)
        assert op.check_support()
        op.compile()
        op.execute(a_tensor=a, b_tensor=b, sfa_tensor=sfa, sfb_tensor=sfb, offsets_tensor=offs,
                   global_scale_a=gsa, global_scale_b=gsb, **target)
    _sync(device)
    gwgrad.check_errors()
    assert all(guards_intact(buf) for buf in bufs), "memory around the output was written"
    if tol is None:
        tol = TOL[out_dtype]
    for x in range(e):
        sa, sb = expand[x]
        ref = (a_parts[x] * sa) @ (b_parts[x] * sb)
        if use_gs:
            ref = ref * (gsa[x].double() * gsb[x].double())
        if accumulate:
            ref = ref + init[x].double()
        got = outs[x].double()
        assert not torch.isnan(got).any(), f"expert {x} (count {counts[x]}): not fully written"
        denom = ref.norm().item()
        err = (got - ref).norm().item() / (denom if denom > 0 else 1.0)
        assert err <= tol, f"expert {x} (count {counts[x]}): relative error {err:.2e} > {tol}"
        if counts[x] == 0 and not accumulate:
            assert (got == 0).all(), f"expert {x} is empty: expected zeros"
    return Case(a, b, sfa, sfb, offs, gsa, gsb, outs, common)


# --- every mode of the contract, every format -------------------------------------------------------

#: output_mode x output dtype x accumulate; the input order alternates so that each mode and each
#: accumulate flag runs with both orders.
MODES = [dict(mode=mode, out_dtype=out, accumulate=acc,
              order="tensor_ragged" if (mode == "discrete") != acc else "tensor2d")
         for mode in ("dense", "discrete")
         for out in (torch.bfloat16, torch.float16, torch.float32)
         for acc in (False, True)]


def _mode_id(m):
    return f"{m['mode']}-{str(m['out_dtype']).split('.')[-1]}-{'acc' if m['accumulate'] else 'new'}-{m['order']}"


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("case", MODES, ids=_mode_id)
def test_modes(seed, fmt, case):
    run_case(seed, fmt, counts_for(fmt), **case)


@pytest.mark.parametrize("fmt", FP8_FORMATS)
@pytest.mark.parametrize("majors", [("m", "n"), ("k", "n"), ("m", "k")], ids="-".join)
@pytest.mark.parametrize("order", ["tensor2d", "tensor_ragged"])
def test_fp8_mn_major_operands(seed, fmt, majors, order):
    """MXFP8 takes M-major A / N-major B (x.T and dy as a training step holds them)."""
    run_case(seed, fmt, counts_for(fmt), majors=majors, order=order, out_dtype=torch.float32,
             accumulate=order == "tensor_ragged")


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("tiling", TILINGS, ids=lambda t: "default" if t is None else
                         "{}x{}-c{}x{}".format(*t[0], *t[1]))
def test_tilings(seed, fmt, tiling):
    # hidden / intermediate not multiples of the tiles (partial tiles, padding rows of the scale
    # atoms), global scales for every format, spare scale capacity.
    run_case(seed, fmt, counts_for(fmt), hidden=352, inter=416, tiling=tiling,
             global_scales=True, extra=1, out_dtype=torch.float32)


@pytest.mark.parametrize("fmt", ["mxfp8_e4m3", "mxfp4"])
def test_global_scales_optional_for_mx(seed, fmt):
    for gs in (False, True):
        run_case(seed, fmt, counts_for(fmt), global_scales=gs, out_dtype=torch.float32)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_every_expert_empty(seed, fmt):
    """tokens_sum 0: zeros written (nothing added when accumulating)."""
    for acc in (False, True):
        run_case(seed, fmt, [0, 0, 0], accumulate=acc, out_dtype=torch.float32)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_many_units(seed, fmt):
    """More work units than SMs (persistent schedule), zipf-like counts with empty experts."""
    rng = np.random.default_rng(seed)
    m = FORMATS[fmt].multiple
    weights = 1.0 / np.arange(1, 17) ** 1.2
    counts = [int(c) * m for c in rng.permutation(np.floor(weights / weights.sum() * 12000 / m))]
    counts[5] = counts[11] = 0
    run_case(seed, fmt, counts, hidden=1024, inter=1536, out_dtype=torch.float32)
    run_case(seed, fmt, counts, hidden=1024, inter=1536, out_dtype=torch.bfloat16,
             tiling=((128, 256), (2, 1)), mode="discrete")


# --- the per-expert TMA bounds on their own ----------------------------------------------------------

@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("order", ["tensor2d", "tensor_ragged"])
def test_every_mma_step_sees_only_the_experts_tokens(seed, fmt, order, monkeypatch):
    """With the tests-only switch (BlockScaledSm100Backend.EVERY_MMA_STEP) the MMA warp issues
    all four steps of an expert's last K block, also those past its last token: only the
    per-expert TMA bounds (zero fill) then keep the next expert's tokens out of the sum. Every
    count here is a whole number of MMA steps (32 tokens for FP8, 64 for FP4) but not of K
    blocks, and experts sit back to back, so a bound one step too long is a wrong result."""
    from gwgrad import plan
    from gwgrad.backends.blockscaled_sm100 import BlockScaledSm100Backend

    step = 32 if not FORMATS[fmt].fp4 else 64
    counts = [step, 3 * step, 0, 5 * step, 2 * step, 7 * step]
    monkeypatch.setattr(BlockScaledSm100Backend, "EVERY_MMA_STEP", True)
    plan.clear_cache()
    try:
        run_case(seed, fmt, counts, order=order, out_dtype=torch.float32)
        run_case(seed, fmt, counts, order=order, out_dtype=torch.bfloat16, mode="discrete",
                 tiling=((128, 256), (1, 1)))
    finally:
        plan.clear_cache()


# --- padding scale bytes never reach an MMA -----------------------------------------------------------

@pytest.mark.parametrize("fmt", ["mxfp8_e4m3", "mxfp8_e5m2", "mxfp4"])
def test_nan_padding_in_the_last_quad_is_never_read(seed, fmt):
    """The padding columns of an expert's last scale quad hold NaN (E8M0 0xFF): results are those
    of zero padding, bit for bit. (NVFP4 counts are multiples of 64 = 4 x 16 tokens: its quads have
    no padding columns; see the next test.)"""
    f = FORMATS[fmt]
    counts = counts_for(fmt)
    assert any(c % (4 * f.sf_vec) for c in counts), "the counts must leave padding columns"
    kw = dict(hidden=224, inter=416, out_dtype=torch.float32)
    clean = run_case(seed, fmt, counts, **kw)
    poisoned = run_case(seed, fmt, counts, pad={"quad": NAN_BYTE[f.sf]}, **kw)
    for x, (c, p) in enumerate(zip(clean.outs, poisoned.outs)):
        assert torch.equal(c, p), f"expert {x}: NaN padding changed the result"


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("tiling", [None, ((128, 128), (1, 1))], ids=["default", "128x128"])
def test_nan_padding_rows_and_tail_change_nothing(seed, fmt, tiling):
    """NaN in every padding byte (last quads, the rows past hidden / intermediate in the 128-row
    atoms, the spare capacity past the last expert) changes no stored output."""
    f = FORMATS[fmt]
    nan = NAN_BYTE[f.sf]
    kw = dict(hidden=224, inter=416, out_dtype=torch.float32, extra=2, tiling=tiling)
    clean = run_case(seed, fmt, counts_for(fmt), **kw)
    poisoned = run_case(seed, fmt, counts_for(fmt), pad={"quad": nan, "rows": nan, "tail": nan}, **kw)
    for x, (c, p) in enumerate(zip(clean.outs, poisoned.outs)):
        assert torch.equal(c, p), f"expert {x}: NaN padding changed the result"


# --- the scale tensors' shapes ------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_cudnn_shaped_scales(seed, fmt):
    """Every count a multiple of 4 * sf_vec: cuDNN's (round_up(M,128), round_up(T/sf_vec, 4))
    tensors are exactly the per-expert layout."""
    f = FORMATS[fmt]
    counts = [256, 4 * f.sf_vec, 0, 512]
    case = run_case(seed, fmt, counts, out_dtype=torch.float32)
    assert case.sfa.shape[1] == round_up(-(-sum(counts) // f.sf_vec), 4)


@pytest.mark.parametrize("fmt", ["mxfp8_e4m3", "mxfp4"])
def test_scales_too_small_write_nothing(seed, fmt):
    """Counts not multiples of 4 * sf_vec with cuDNN-sized scale tensors: the experts' chunks need
    more columns than the tensors hold; the device check refuses (naming sfa_tensor), the output
    keeps every byte."""
    f = FORMATS[fmt]
    gen = torch.Generator(device="cuda").manual_seed(seed)
    rng = np.random.default_rng(seed)
    counts, hidden, inter = [f.multiple, f.multiple, 2 * f.multiple], 128, 128
    a, b, _, _ = operands(f, hidden, inter, counts, "tensor2d", ("k", "k"), gen, "cuda")
    t = sum(counts)
    cap = round_up(-(-t // f.sf_vec), 4)
    need = sum(round_up(-(-c // f.sf_vec), 4) for c in counts)
    assert need > cap
    raws = [scale_codes(rng, (hidden, cap), f.sf)]
    sf_dtype = getattr(torch, _SF_TORCH[f.sf])
    sfa = torch.from_numpy(place_blocked(raws, hidden, cap, f.sf_vec)).cuda().view(sf_dtype)
    sfb = torch.from_numpy(place_blocked(raws, inter, cap, f.sf_vec)).cuda().view(sf_dtype)
    offs = torch.tensor(list(itertools.accumulate(counts)), dtype=torch.int32, device="cuda")
    out = torch.randn(3, hidden, inter, generator=gen, device="cuda")
    before = out.clone()
    gwgrad.grouped_gemm_wgrad_wrapper_sm100(a, b, sfa, sfb, offs, wgrad_tensor=out,
                                            sf_vec_size=f.sf_vec, accumulate_on_output=True)
    torch.cuda.synchronize()
    with pytest.raises(ValueError, match="^sfa_tensor:"):
        gwgrad.check_errors()
    assert torch.equal(out, before)


# --- invalid offsets ------------------------------------------------------------------------------------

def _invalid_offsets_setup(seed, fmt):
    f = FORMATS[fmt]
    gen = torch.Generator(device="cuda").manual_seed(seed)
    rng = np.random.default_rng(seed)
    counts, hidden, inter = [64, 128, 64], 128, 128
    a, b, _, _ = operands(f, hidden, inter, counts, "tensor2d", ("k", "k"), gen, "cuda")
    sfa, sfb, _ = scale_inputs(f, hidden, inter, counts, rng, "cuda", extra=4)
    gs = {}
    if f.needs_global:
        gs = dict(global_scale_a=torch.ones(3, device="cuda"),
                  global_scale_b=torch.ones(3, device="cuda"))
    out = torch.randn(3, hidden, inter, generator=gen, device="cuda")
    kwargs = dict(a_tensor=a, b_tensor=b, sfa_tensor=sfa, sfb_tensor=sfb, wgrad_tensor=out,
                  accumulate_on_output=True, sf_vec_size=f.sf_vec, **gs)
    # A count that is not a multiple of the format's (MXFP8: 8 of 32; FP4: 32 of 64, the
    # FP4-only rule), then decreasing offsets. tokens_sum stays 256.
    half = f.multiple // 2
    bad = [([half, 200, 256] if f.fp4 else [8, 200, 256], f"multiple of {f.multiple}"),
           ([128, 64, 256], "non-decreasing")]
    return f, out, kwargs, bad


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_invalid_offsets_write_nothing(seed, fmt):
    """The device check refuses both launches: an accumulated FP32 output keeps every byte and
    gwgrad.check_errors() raises a ValueError naming offsets_tensor; validate_offsets=True raises
    at the call; a valid call afterwards runs normally."""
    f, out, kwargs, bad = _invalid_offsets_setup(seed, fmt)
    before = out.clone()
    for values, message in bad:
        offs = torch.tensor(values, dtype=torch.int32, device="cuda")
        gwgrad.grouped_gemm_wgrad_wrapper_sm100(offsets_tensor=offs, **kwargs)
        torch.cuda.synchronize()
        with pytest.raises(ValueError, match=f"^offsets_tensor: .*{message}"):
            gwgrad.check_errors()
        assert torch.equal(out, before)
        with pytest.raises(ValueError, match=f"^offsets_tensor: .*{message}"):
            gwgrad.grouped_gemm_wgrad_wrapper_sm100(offsets_tensor=offs, validate_offsets=True,
                                                    **kwargs)
        torch.cuda.synchronize()
        assert torch.equal(out, before)
    good = torch.tensor([64, 192, 256], dtype=torch.int32, device="cuda")
    gwgrad.grouped_gemm_wgrad_wrapper_sm100(offsets_tensor=good, **kwargs)
    torch.cuda.synchronize()
    gwgrad.check_errors()
    assert not torch.equal(out, before) and not torch.isnan(out).any()


def test_invalid_offsets_raise_at_the_next_call(seed):
    """Without check_errors(): the next gwgrad call raises (naming offsets_tensor) once the failed
    launch has completed, and is not enqueued."""
    f, out, kwargs, bad = _invalid_offsets_setup(seed, "nvfp4")
    before = out.clone()
    offs = torch.tensor(bad[0][0], dtype=torch.int32, device="cuda")
    gwgrad.grouped_gemm_wgrad_wrapper_sm100(offsets_tensor=offs, **kwargs)
    torch.cuda.synchronize()
    good = torch.tensor([64, 192, 256], dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="^offsets_tensor: .*multiple of 64"):
        gwgrad.grouped_gemm_wgrad_wrapper_sm100(offsets_tensor=good, **kwargs)
    torch.cuda.synchronize()
    assert torch.equal(out, before)
    gwgrad.check_errors()  # reported once


# --- the class API, allocation, gwgrad.quantize ----------------------------------------------------------

@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("mode", ["dense", "discrete"])
def test_class_api(seed, fmt, mode):
    run_case(seed, fmt, counts_for(fmt), api="class", mode=mode, accumulate=True,
             out_dtype=torch.float32, order="tensor_ragged" if mode == "dense" else "tensor2d")


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_class_one_operator_for_every_tokens_sum(seed, fmt):
    """One compiled operator serves later calls with other counts and tokens_sum."""
    f = FORMATS[fmt]
    first = run_case(seed, fmt, counts_for(fmt), api="class", out_dtype=torch.float32)
    before = gwgrad.cache_info()["compiled"]
    gen = torch.Generator(device="cuda").manual_seed(seed + 1)
    rng = np.random.default_rng(seed + 1)
    e = len(first.outs)
    counts = [f.multiple * k for k in (3, 0, 1, 9, 2, 5)][:e]
    a, b, a_parts, b_parts = operands(f, 256, 384, counts, "tensor2d", ("k", "k"), gen, "cuda")
    sfa, sfb, expand = scale_inputs(f, 256, 384, counts, rng, "cuda")
    offs = torch.tensor(list(itertools.accumulate(counts)), dtype=torch.int32, device="cuda")
    op = gwgrad.GroupedGemmWgradSm100(
        sample_a=first.a, sample_b=first.b, sample_sfa=first.sfa, sample_sfb=first.sfb,
        sample_offsets=first.offsets, sample_wgrad=torch.empty(e, 256, 384, device="cuda"),
        sample_global_scale_a=first.gsa, sample_global_scale_b=first.gsb, sf_vec_size=f.sf_vec)
    op.compile()
    out = torch.full((e, 256, 384), float("nan"), device="cuda")
    op.execute(a_tensor=a, b_tensor=b, sfa_tensor=sfa, sfb_tensor=sfb, offsets_tensor=offs,
               wgrad_tensor=out, global_scale_a=first.gsa, global_scale_b=first.gsb)
    torch.cuda.synchronize()
    gwgrad.check_errors()
    assert gwgrad.cache_info()["compiled"] - before <= 1
    for x in range(e):
        ref = (a_parts[x] * expand[x][0]) @ (b_parts[x] * expand[x][1])
        if first.gsa is not None:
            ref = ref * (first.gsa[x].double() * first.gsb[x].double())
        err = (out[x].double() - ref).norm().item() / max(ref.norm().item(), 1.0)
        assert err <= TOL[torch.float32], (x, err)


def test_wrapper_allocates_its_output(seed):
    f = FORMATS["nvfp4"]
    gen = torch.Generator(device="cuda").manual_seed(seed)
    rng = np.random.default_rng(seed)
    counts = counts_for("nvfp4")
    a, b, a_parts, b_parts = operands(f, 256, 384, counts, "tensor2d", ("k", "k"), gen, "cuda")
    sfa, sfb, expand = scale_inputs(f, 256, 384, counts, rng, "cuda")
    offs = torch.tensor(list(itertools.accumulate(counts)), dtype=torch.int32, device="cuda")
    gs = torch.ones(len(counts), device="cuda")
    for mode in ("dense", "discrete"):
        (w,) = gwgrad.grouped_gemm_wgrad_wrapper_sm100(
            a_tensor=a, b_tensor=b, sfa_tensor=sfa, sfb_tensor=sfb, offsets_tensor=offs,
            global_scale_a=gs, global_scale_b=gs, output_mode=mode, wgrad_dtype=torch.float32,
            sf_vec_size=16)
        torch.cuda.synchronize()
        gwgrad.check_errors()
        assert w.shape == (len(counts), 256, 384) and w.dtype == torch.float32
        for x in range(len(counts)):
            ref = (a_parts[x] * expand[x][0]) @ (b_parts[x] * expand[x][1])
            err = (w[x].double() - ref).norm().item() / max(ref.norm().item(), 1.0)
            assert err <= TOL[torch.float32], (mode, x, err)


#: gwgrad.quantize format and element of each case, and the relative error allowed against the
#: BF16 product (quantization only; the NumPy models give 4.2% e4m3, 7.6% e5m2, 13.4% NVFP4 and
#: 16.2% MXFP4 on these randn inputs).
QUANT = {"mxfp8_e4m3": ("mxfp8", "e4m3", 0.06), "mxfp8_e5m2": ("mxfp8", "e5m2", 0.11),
         "nvfp4": ("nvfp4", None, 0.2), "mxfp4": ("mxfp4", None, 0.24)}


def quantize_case(seed, fmt, device="cuda"):
    """BF16 x and dy through gwgrad.quantize (K-major data, blocked scales in the layout the GEMM
    reads, NVFP4 global scales), then the GEMM: equal to float64 of the quantizer's own outputs
    (dequantized here with the byte formula), and near the BF16 weight gradient (quantization
    error only; a misplaced scale is far off)."""
    f = FORMATS[fmt]
    qfmt, elem, loose = QUANT[fmt]
    gen = torch.Generator(device=device).manual_seed(seed)
    counts = counts_for(fmt)
    hidden, inter, t = 256, 384, sum(counts)
    offs = torch.tensor(list(itertools.accumulate(counts)), dtype=torch.int32, device=device)
    x = torch.randn(t, hidden, generator=gen, device=device).to(torch.bfloat16)
    dy = torch.randn(t, inter, generator=gen, device=device).to(torch.bfloat16)
    qx = gwgrad.quantize(x, offs, qfmt, elem=elem)
    qdy = gwgrad.quantize(dy, offs, qfmt, elem=elem)
    out = torch.full((len(counts), hidden, inter), float("nan"), device=device)
    gwgrad.grouped_gemm_wgrad_wrapper_sm100(
        a_tensor=qx["data"], b_tensor=qdy["data"].t(), sfa_tensor=qx["scales"],
        sfb_tensor=qdy["scales"], offsets_tensor=offs, wgrad_tensor=out,
        global_scale_a=qx["global_scale"], global_scale_b=qdy["global_scale"],
        sf_vec_size=f.sf_vec)
    _sync(device)
    gwgrad.check_errors()

    def dequant(q, rows):
        data = q["data"]
        values = unpack_fp4(data.view(torch.uint8)) if f.fp4 else data.double()
        raws = read_blocked(q["scales"].view(torch.uint8).cpu().numpy(), counts, f.sf_vec, rows)
        parts, start = [], 0
        for raw, c in zip(raws, counts):
            s = torch.from_numpy(scale_values(raw, f.sf)).to(device)
            k = torch.arange(c, device=device) // f.sf_vec
            parts.append(values[:, start:start + c] * s[:, k])
            start += c
        return parts

    xs, dys = dequant(qx, hidden), dequant(qdy, inter)
    start, errors = 0, []
    for e, c in enumerate(counts):
        ref = xs[e] @ dys[e].t()
        if f.needs_global:
            ref = ref * (qx["global_scale"][e].double() * qdy["global_scale"][e].double())
        got = out[e].double()
        if c == 0:
            assert (got == 0).all(), f"expert {e} is empty: expected zeros"
            continue
        err = (got - ref).norm().item() / ref.norm().item()
        assert err <= TOL[torch.float32], f"expert {e}: relative error {err:.2e}"
        bf = x[start:start + c].double().t() @ dy[start:start + c].double()
        errors.append((got - bf).norm().item() / bf.norm().item())
        assert errors[-1] <= loose, f"expert {e}: {errors[-1]:.3f} off the BF16 product"
        start += c
    return errors


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_gwgrad_quantize_then_gemm(seed, fmt):
    quantize_case(seed, fmt)
