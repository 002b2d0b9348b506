"""Grouped quantizers: BF16 ``x`` (tokens, channels), grouped by expert through ``offsets``, to
the block-scaled operands the weight-gradient kernels read, in the layouts of gwgrad/scales.py.

Output: ``q`` (channels, tokens) token-contiguous (K-major) codes: one byte per FP8 value, or
packed E2M1 (two tokens per byte, the even token in the low nibble), and the scales of the
recipe (bit-exact with the NumPy models of gwgrad/formats.py; the rounding rules are there):

  blocked, MXFP8 / MXFP4   E8M0 per channel and 32 tokens, in the per-expert 32x4x4 blocked
                           layout (padding rows and columns written as code 0: never NaN)
  blocked, NVFP4           E4M3 per channel and 16 tokens, blocked, and the expert's FP32
                           global scale ``amax / (448 * 6)``
  per_expert_channel       FP32 ``amax / fmax`` per expert and channel, (E, channels)
  block_1x128              FP32 ``amax / fmax`` per channel and 128 tokens, (R, channels)

Work split: a prep kernel (one CTA of 512 threads, plus CTAs zeroing the two-pass formats'
amax records) builds the call's tile table in the workspace (a block-wide prefix sum of the
experts' tile and scale-column counts, then a binary search per tile row for its expert; no
host sync). A tile CTA owns one 128-token tile of one
expert (tiles restart at each expert, none straddles two) and 64 channels; the grid's tile
bound ``ceil(T / 128) + E`` covers any counts, rows past the last tile exit. Offsets go
through the GEMMs' sanitized ranges, so no access leaves the caller's tensors whatever they
hold; scale writes past the capacity are dropped (the GEMM then reports SCALES_TOO_SMALL).

Threads (256): the x tile is staged in shared memory (16-byte loads, rows padded by a word);
thread (quarter q, channel c) takes channel c of tokens 32q..32q+31 as FP32 bits (one
``prmt``), its block amax as integers on the bits (NaN / Inf: at or past Inf's bits, codes
forced), and converts with the block's scale (IEEE ``mul.rn`` / ``div.rn``, denormals kept)
by ``cvt.rn.satfinite`` (FP8), ``e2m1x8`` (NVFP4) or ``e2m1x8_bf16x2`` (MXFP4, two values per
instruction); SM90 has no E2M1 cvt, and those functions document their arithmetic. Codes are
stored from a shared tile as 16-byte vectors. The kernel is issue-bound: the E2M1 paths keep
the integer / logic-pipe instructions per value low.

Two-pass recipes (per_expert_channel, NVFP4: an amax over the whole expert): an amax kernel on
the same tiles reduces straight from its loads with one ``atom.max`` per tile and channel (per
tile for NVFP4) into the workspace, then the quantizing kernel reads it. Empty experts get
scale 1.0 (per_expert_channel) and global scale 1.0 (NVFP4).

Verified: PTX and ptxas (no spills) for sm_90a and sm_100a by tests/test_compile_quantize.py;
the E2M1 arithmetic emulated in NumPy against gwgrad.formats by tests/test_e2m1_rounding.py
(every FP32 pattern with GWGRAD_E2M1_FULL=1; every BF16 pattern x E8M0 scale for MXFP4); on
an H200, bit-exact in every format and recipe (NaN / Inf / denormal inputs, empty experts) by
tests/test_quantize_gpu.py and tests/test_adapter_jax_quantize_gpu.py. Never run on an SM100
GPU. Speed: docs/PERFORMANCE.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, Uint8
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T
from cutlass.memory import SmemAllocator

from .prep import sanitized_range

TILE_TOKENS = 128
TILE_CHANNELS = 64
QUARTERS = 4
TOKENS_PER_THREAD = TILE_TOKENS // QUARTERS  # 32
THREADS = TILE_CHANNELS * QUARTERS  # 256
X_CHUNKS = TILE_CHANNELS // 8  # 16-byte chunks per token row of the x tile
X_LOADS = TILE_TOKENS * X_CHUNKS // THREADS  # 4 vector loads per thread
X_ROW_WORDS = TILE_CHANNELS // 2 + 1  # BF16 pairs per token row, + 1 word of padding
Q_ROW_WORDS = TILE_TOKENS // 4 + 1  # FP8 code words per channel row, + 1 (FP4 uses half)
PREP_THREADS = 512
PREP_WARPS = PREP_THREADS // 32

#: Bits of +Inf: the amax record of a block holding NaN or Inf (finite magnitudes are below).
NONFINITE = 0x7F800000
FP32_ONE = 0x3F800000
FP32_NAN = 0x7FC00000
FP32_MIN_NORMAL = 0x00800000
FMAX_BITS = {"e4m3": 0x43E00000, "e5m2": 0x47600000}  # 448.0, 57344.0
EMAX = {"e4m3": 8, "e5m2": 15, "e2m1": 2}
NVFP4_GLOBAL_DIVISOR = 0x45280000  # 2688.0 = 448 * 6
SIX = 0x40C00000


@dataclass(frozen=True)
class QuantizeConfig:
    """The static problem of one quantizer kernel."""

    channels: int
    num_experts: int
    recipe: str  # "blocked" | "per_expert_channel" | "block_1x128"
    elem: str  # "e4m3" | "e5m2" | "e2m1"
    sf_vec: int  # tokens per scale: 32 (MX), 16 (NVFP4), 128 (block_1x128), 0 (channel)
    count_multiple: int  # gwgrad.offsets.token_count_multiple of the consuming GEMM

    @property
    def nvfp4(self) -> bool:
        return self.recipe == "blocked" and self.sf_vec == 16

    @property
    def two_pass(self) -> bool:
        return self.recipe == "per_expert_channel" or self.nvfp4

    @property
    def padded_channels(self) -> int:
        """Rows of the scale tensor the grid covers: the blocked layout pads to 128."""
        if self.recipe == "blocked":
            return -(-self.channels // 128) * 128
        return self.channels

    @property
    def channel_blocks(self) -> int:
        return -(-self.padded_channels // TILE_CHANNELS)

    @property
    def amax_words(self) -> int:
        """uint32 words of workspace (the amax records of the two-pass recipes)."""
        if self.recipe == "per_expert_channel":
            return self.num_experts * self.channels
        return self.num_experts if self.nvfp4 else 0

    # Workspace: [amax records: amax_words x u32][expert table: E x (begin, end, S_e, C_e)]
    # [tile table: tile rows x (expert, tile, begin, end, S_e, C_e, 0, 0)], written by the prep
    # kernel of every call.
    @property
    def expert_table_offset(self) -> int:
        return -(-4 * self.amax_words // 32) * 32

    @property
    def tile_table_offset(self) -> int:
        return self.expert_table_offset + 16 * self.num_experts

    def workspace_bytes(self, tokens_sum: int) -> int:
        """Bytes of workspace of a call with ``tokens_sum`` tokens (its tile rows' table)."""
        return self.tile_table_offset + 32 * self.tile_bound(tokens_sum)

    def tile_bound(self, tokens_sum: int) -> int:
        """Tile rows of the grid: enough for any counts (each expert adds at most one
        partial tile)."""
        return -(-tokens_sum // TILE_TOKENS) + self.num_experts


def problem(cfg: QuantizeConfig):
    """(argument, detail) when no kernel implements ``cfg``, else None."""
    if cfg.channels % 8 or cfg.channels <= 0:
        return "x", f"channels a positive multiple of 8, got {cfg.channels}"
    if cfg.elem not in EMAX:
        return "elem", f"e4m3, e5m2 or e2m1, got {cfg.elem!r}"
    if cfg.recipe == "blocked":
        if (cfg.elem, cfg.sf_vec) not in (("e4m3", 32), ("e5m2", 32), ("e2m1", 32),
                                           ("e2m1", 16)):
            return "sf_vec_size", (f"32 (MXFP8, MXFP4) or 16 with e2m1 (NVFP4), got "
                                   f"{cfg.sf_vec} with {cfg.elem}")
        if cfg.count_multiple % 32:
            return "offsets", f"counts multiples of 32 for blocked scales, got {cfg.count_multiple}"
    elif cfg.recipe in ("per_expert_channel", "block_1x128"):
        if cfg.elem == "e2m1":
            return "elem", f"e4m3 or e5m2 with FP32 scales, got {cfg.elem!r}"
        if cfg.count_multiple % 16:
            return "offsets", f"counts multiples of 16, got {cfg.count_multiple}"
    else:
        return "scale_recipe", f"blocked, per_expert_channel or block_1x128, got {cfg.recipe!r}"
    if cfg.num_experts < 1:
        return "offsets", f"at least one expert, got {cfg.num_experts}"
    return None


# ---------------------------------------------------------------------------------------------
# Exact scalar operations (inline PTX: IEEE rounding, denormals kept)
# ---------------------------------------------------------------------------------------------


def _asm(result, args, asm: str, constraints: str, side_effects: bool = False):
    return llvm.inline_asm(result, [a.ir_value() for a in args], asm, constraints,
                           has_side_effects=side_effects, is_align_stack=False,
                           asm_dialect=llvm.AsmDialect.AD_ATT)


def _f32_op(op: str, a: Int32, b: Int32) -> Int32:
    """``op`` (mul / div) of two FP32 values given and returned as bits, rounded to nearest
    even, subnormals kept (no .ftz)."""
    return Int32(_asm(T.i32(), [Int32(a), Int32(b)],
                      "{\n\t.reg .f32 x, y, z;\n\tmov.b32 x, $1;\n\tmov.b32 y, $2;\n\t"
                      f"{op}.rn.f32 z, x, y;\n\tmov.b32 $0, z;\n\t}}",
                      "=r,r,r"))


def ld_global_words(address: Int64, count: int = 4):
    """``count`` words (2 or 4: 8 or 16 bytes) from a global address aligned to their size
    (read-only path)."""
    operands = ", ".join(f"${i}" for i in range(count))
    words = llvm.inline_asm(llvm.StructType.get_literal([T.i32()] * count),
                            [Int64(address).ir_value()],
                            f"ld.global.nc.v{count}.b32 {{{operands}}}, [${count}];",
                            ",".join(["=r"] * count + ["l"]),
                            has_side_effects=False, is_align_stack=False,
                            asm_dialect=llvm.AsmDialect.AD_ATT)
    return [Int32(llvm.extractvalue(T.i32(), words, [i])) for i in range(count)]



def bf16_to_f32(word: Int32, select: Int32) -> Int32:
    """FP32 bits of one BF16 half of ``word``: ``prmt`` with ``select`` 0x1044 (the low half)
    or 0x3244 (the high half), zeros below."""
    return Int32(_asm(T.i32(), [Int32(word), Int32(select)], "prmt.b32 $0, $1, 0, $2;",
                      "=r,r,r"))


def max_u32(a: Int32, b: Int32) -> Int32:
    """Unsigned maximum of two words (``max.u32``; ptxas folds chains into 3-input VIMNMX3)."""
    return Int32(_asm(T.i32(), [Int32(a), Int32(b)], "max.u32 $0, $1, $2;", "=r,r,r"))


def bf16_pair(a: Int32, b: Int32, select: Int32) -> Int32:
    """One BF16 half of each of two words as one word, ``a``'s in the low half: ``prmt`` with
    ``select`` 0x5410 (the low halves) or 0x7632 (the high halves)."""
    return Int32(_asm(T.i32(), [Int32(a), Int32(b), Int32(select)], "prmt.b32 $0, $1, $2, $3;",
                      "=r,r,r,r"))


def max_u16x2(a: Int32, b: Int32) -> Int32:
    """Unsigned maximum of each 16-bit half (ptxas: VIMNMX3.U16x2 chains)."""
    return Int32(_asm(T.i32(), [Int32(a), Int32(b)], "max.u16x2 $0, $1, $2;", "=r,r,r"))


def max_s16x2(a: Int32, b: Int32) -> Int32:
    """Signed maximum of each 16-bit half (ptxas: VIMNMX3.S16x2 chains)."""
    return Int32(_asm(T.i32(), [Int32(a), Int32(b)], "max.s16x2 $0, $1, $2;", "=r,r,r"))


def st_global_v4(address: Int64, w0: Int32, w1: Int32, w2: Int32, w3: Int32) -> None:
    """Four words to a 16-byte aligned global address."""
    _asm(None, [Int64(address), Int32(w0), Int32(w1), Int32(w2), Int32(w3)],
         "st.global.v4.b32 [$0], {$1, $2, $3, $4};", "l,r,r,r,r", True)


def f32_mul(a: Int32, b: Int32) -> Int32:
    return _f32_op("mul", a, b)


def f32_div(a: Int32, b: Int32) -> Int32:
    return _f32_op("div", a, b)


def fp8x4(q0: Int32, q1: Int32, q2: Int32, q3: Int32, elem: str) -> Int32:
    """Four FP32 values (bits) as four FP8 codes in one word, q0 in the low byte
    (``cvt.rn.satfinite``: nearest even, saturating; NaN gives 0x7F)."""
    kind = "e4m3x2" if elem == "e4m3" else "e5m2x2"
    return Int32(_asm(T.i32(), [Int32(q0), Int32(q1), Int32(q2), Int32(q3)],
                      "{\n\t.reg .f32 a, b, c, d;\n\t.reg .b16 lo, hi;\n\t"
                      "mov.b32 a, $1;\n\tmov.b32 b, $2;\n\tmov.b32 c, $3;\n\tmov.b32 d, $4;\n\t"
                      f"cvt.rn.satfinite.{kind}.f32 lo, b, a;\n\t"
                      f"cvt.rn.satfinite.{kind}.f32 hi, d, c;\n\t"
                      "mov.b32 $0, {lo, hi};\n\t}",
                      "=r,r,r,r,r"))


def e4m3_code(s: Int32) -> Int32:
    """One FP32 value (bits) as an E4M3 code (``cvt.rn.satfinite``)."""
    return fp8x4(s, Int32(0), Int32(0), Int32(0), "e4m3") & 0xFF


def e4m3_value(code: Int32) -> Int32:
    """FP32 bits of an E4M3 code (exact)."""
    return Int32(_asm(T.i32(), [Int32(code)],
                      "{\n\t.reg .b16 c, lo, hi;\n\t.reg .b32 h2;\n\t.reg .f32 f;\n\t"
                      "mov.b32 {c, hi}, $1;\n\tcvt.rn.f16x2.e4m3x2 h2, c;\n\t"
                      "mov.b32 {lo, hi}, h2;\n\tcvt.f32.f16 f, lo;\n\tmov.b32 $0, f;\n\t}",
                      "=r,r"))


def f32_fma(a: Int32, b: Int32, c: Int32) -> Int32:
    """``a * b + c`` (FP32 bits), one rounding to nearest even, subnormals kept."""
    return Int32(_asm(T.i32(), [Int32(a), Int32(b), Int32(c)],
                      "{\n\t.reg .f32 x, y, z, r;\n\tmov.b32 x, $1;\n\tmov.b32 y, $2;\n\t"
                      "mov.b32 z, $3;\n\tfma.rn.f32 r, x, y, z;\n\tmov.b32 $0, r;\n\t}",
                      "=r,r,r,r"))


def e2m1_code(q: Int32) -> Int32:
    """E2M1 code (4 bits) of an FP32 value (bits): nearest, ties to even, saturating to 6;
    NaN gives 0. From 1 up the FP32 mantissa is rounded to one bit on the integer bits (a
    carry moves into the exponent; codes past 7 saturate); below 1 the codes 0, 1, 2 are
    ``2|q| + 2**23`` in FP32 rounded to an integer. The per-value reference of the fast path
    (``e2m1x8``), kept for NVFP4's blocks with an infinite multiplier (where ``0 * Inf`` is
    NaN); ~20 integer operations a value."""
    a = q & 0x7FFFFFFF
    rounded = (a + 0x1FFFFF + ((a >> 22) & 1)) >> 22
    code = cutlass.min(rounded - 252, 7)
    small = f32_fma(a, Int32(0x40000000), Int32(0x4B000000)) - 0x4B000000
    code = code + Int32(a < 0x3F800000) * (small - code)
    return (code | ((q >> 28) & 8)) * Int32(a <= NONFINITE)


#: E2M1 rounding constants of ``e2m1x8`` (FP32, PTX hex): 6.0 (saturation), 1.0 (the smallest
#: binade with a one-bit mantissa; below it the step stays 0.5), 2**23 (adding it rounds
#: ``2t / E`` to an integer: its ulp is 1).
E2M1_SAT, E2M1_ONE, E2M1_MAGIC = "0f40C00000", "0f3F800000", "0f4B000000"


#: ``K`` of ``e2m1x8``: the eight per-value offsets ``0x4AFFFF00`` summed at their nibbles
#: (``0x4AFFFF00 * 0x11111111 mod 2**32``), subtracted once per word.
E2M1_PACK_OFFSET = (0x4AFFFF00 * 0x11111111) % (1 << 32)


def e2m1x8(v, mult: Int32) -> Int32:
    """Eight FP32 values (bits, ``v[0]`` to the low nibble) times ``mult`` as one word of E2M1
    codes, bit-exact with ``e2m1_code(f32_mul(v[k], mult))`` whenever the product is not NaN
    (``mult`` positive; a NaN product only comes from a NaN / Inf value, whose block is forced,
    or from ``0 * Inf``: NVFP4's blocks with an infinite multiplier, which take e2m1_code).
    Per value (SASS: FMUL, 2 FMNMX, LOP3, FFMA, IMAD.HI, IMAD, SHF: 4 on the integer / logic
    pipe, which bounds this kernel, 4 on the FMA pipe):

        q = v * mult                      mul.rn (the model's product)
        t = min(|q|, 6)                   saturation (Inf too); the abs folds into FMNMX
        m = max(t, 1)                     exponent field x = 127 + e' (e' in 0..2: E = 2**e'
                                          the power of two of t's binade, 1 below 1)
        i = ~m & 0x7F800000               2 / E (exponent field 255 - x = 128 - e')
        y = fma(t, i, 2**23)              2**23 + k, k = rint(2t / E) (one rounding, ties to
                                          even: 2**23 is even and its ulp is 1): round(2t)
                                          below 2, round(t) in [2, 4), round(t / 2) in [4, 6]
        z = mad.hi.s32(i, -1024, y)       y's bits + 2e' - 256 = 0x4AFFFF00 + code (code =
                                          k + 2e' <= 7; i's low 23 bits are 0: exact)
        acc = acc * 16 + z                Horner from v[7] down to v[0] (mad.lo)
        signs = (signs:v) << 4            funnel shift: v's top nibble (the sign in its bit 3)
                                          enters at the bottom (values taken 7 down to 0)

    and per word ``acc - E2M1_PACK_OFFSET`` (the nibbles are the codes: each <= 7, so no
    carries), its bit 3s replaced by the signs. 8 PTX instructions a value (4 of them on the
    integer pipe; ~17 SASS for ``e2m1_code``). tests/test_e2m1_rounding.py checks this arithmetic on every
    FP32 bit pattern."""
    body = ["{", ".reg .f32 q, t, m;", ".reg .b32 i, y, z, acc, signs;",
            "mov.b32 signs, 0;"]
    for k in reversed(range(8)):
        body += [f"mul.rn.f32 q, ${k + 1}, $9;",
                 "abs.f32 q, q;",
                 f"min.f32 t, q, {E2M1_SAT};",
                 f"max.f32 m, t, {E2M1_ONE};",
                 "not.b32 i, m;",
                 "and.b32 i, i, 0x7F800000;",
                 f"fma.rn.f32 y, t, i, {E2M1_MAGIC};",
                 "mad.hi.s32 z, i, -1024, y;"]
        body.append("mov.b32 acc, z;" if k == 7 else "mad.lo.u32 acc, acc, 16, z;")
        body.append(f"shf.l.wrap.b32 signs, ${k + 1}, signs, 4;")
    body += [f"sub.u32 acc, acc, {E2M1_PACK_OFFSET};",
             "lop3.b32 $0, acc, signs, 0x88888888, 0xD8;", "}"]
    return Int32(_asm(T.i32(), [Int32(x) for x in v] + [Int32(mult)], "\n\t".join(body),
                      "=r," + ",".join(["r"] * 9)))


#: ``K`` of ``e2m1x8_bf16x2``: the pair offset ``0x42004200`` (0x4200 a half) summed at nibbles
#: 0..3 (Horner), subtracted once per word.
E2M1_PAIR_OFFSET = (0x42004200 * 0x1111) % (1 << 32)


def e2m1x8_bf16x2(pairs, mult2: Int32) -> Int32:
    """MXFP4's eight E2M1 codes of a word from four BF16x2 words: ``pairs[j]`` holds the values
    of nibble j (low half) and nibble j + 4 (high half); ``mult2`` is the block's multiplier
    ``2**-s`` in both halves (BF16, a normal power of two: ``-s`` in -125..127). Bit-exact with
    ``formats.encode(x * 2**-s, "e2m1")`` for every non-NaN BF16 ``x`` and any such scale
    (NaN / Inf blocks are forced to 0 by the caller); tests/test_e2m1_rounding.py checks every
    BF16 pattern in both halves against every E8M0 scale. Per pair (two values; SASS: HFMA2
    (the abs), HMUL2, 2 HMNMX2, LOP3, HFMA2, IMAD.HI, 3/4 IMAD):

        q = mul.rn.bf16x2(|p|, mult2)     exact while q >= 2**-126 (a power-of-two scaling);
                                          smaller products (rounded, or flushed) stay below
                                          2**-126 < 0.25: code 0 either way
        t = min(q, 6)                     saturation (a product past 6, or Inf, gives 7)
        m = max(t, 1)                     exponent field 127 + e' (e' in 0..2: E = 2**e')
        i = ~m & 0x7F807F80               2 / E a half (field 128 - e')
        y = fma.rn.bf16x2(t, i, 128)      128 + k, k = rint(2t / E): ulp 1 in [128, 256), ties
                                          to even (128 even), one rounding: bits 0x4300 + k
        z = mad.hi.s32(i, -2**26, y)      y - (i >> 6) (i's low 7 bits are 0): a half is
                                          0x4300 + k - 2 (128 - e') = 0x4200 + code, code =
                                          k + 2e' <= 7 (the halves never borrow)
        acc = acc * 16 + z                Horner, pairs 3 down to 0 (mad.lo, mod 2**32)

    and per word ``acc - E2M1_PAIR_OFFSET``: nibble j is pair j's low code, nibble j + 4 its
    high code (``16**j * 2**16 = 16**(j + 4)``), all < 8 (no carries, bit 3s clear); then the
    signs: ``prmt`` 0xFBD9 of pairs 1 and 3 replicates each value's sign over a byte, in the
    order of tokens 1, 3, 5, 7 (the bit 7s of the word's bytes: their nibbles' bit 3), of
    pairs 0 and 2 tokens 0, 2, 4, 6 (the bit 3s), merged by two ``lop3``. The rounding is
    e2m1x8's (its constants scaled to BF16) on values exact in BF16; only the packing
    differs. ``mul.rn.bf16x2`` keeps denormal inputs (PTX's bf16 arithmetic has no .ftz; SASS
    HMUL2.BF16_V2 without .FTZ), which a block of BF16 denormals (scale 2**-127) needs
    (tests/test_quantize_gpu.py::test_fp4_tiny_expert)."""
    body = ["{", ".reg .b32 q, t, m, i, y, z, s, e, acc, six, one, magic;",
            "mov.b32 six, 0x40C040C0;", "mov.b32 one, 0x3F803F80;",
            "mov.b32 magic, 0x43004300;"]
    for j in reversed(range(4)):
        body += [f"abs.bf16x2 q, ${j + 1};",
                 "mul.rn.bf16x2 q, q, $5;",
                 "min.bf16x2 t, q, six;",
                 "max.bf16x2 m, t, one;",
                 "not.b32 i, m;",
                 "and.b32 i, i, 0x7F807F80;",
                 "fma.rn.bf16x2 y, t, i, magic;",
                 "mad.hi.s32 z, i, -67108864, y;"]
        body.append("mov.b32 acc, z;" if j == 3 else "mad.lo.u32 acc, acc, 16, z;")
    body += [f"sub.u32 acc, acc, {E2M1_PAIR_OFFSET};",
             "prmt.b32 s, $2, $4, 0xFBD9;",
             "prmt.b32 e, $1, $3, 0xFBD9;",
             "lop3.b32 acc, acc, e, 0x08080808, 0xF8;",
             "lop3.b32 $0, acc, s, 0x80808080, 0xF8;", "}"]
    return Int32(_asm(T.i32(), [Int32(x) for x in pairs] + [Int32(mult2)], "\n\t".join(body),
                      "=r," + ",".join(["r"] * 5)))


# ---------------------------------------------------------------------------------------------
# The kernels
# ---------------------------------------------------------------------------------------------


@cute.jit
def owner_of(firsts: cute.Tensor, stride: cutlass.Constexpr, count: cutlass.Constexpr,
             x: Int32) -> Int32:
    """The last i < ``count`` with ``firsts[stride * i] <= x``, by binary search over
    non-decreasing firsts (0 when none): with each expert's first tile or token there, the
    expert owning ``x`` when any does (empty experts share their successor's first)."""
    lo = Int32(0)
    step = Int32(1 << (count.bit_length() - 1))
    for _ in cutlass.range_constexpr(count.bit_length()):
        probe = lo + step
        if probe < count:
            if firsts[stride * probe] <= x:
                lo = probe
        step = step >> 1
    return lo


class GroupedQuantizer:
    """Quantizer of one QuantizeConfig. ``__call__`` is the compiled entry (raw addresses):
    ``x`` (bf16, (T, channels) row-major), ``offsets`` (int32, E), ``q`` (uint8 codes,
    (channels, T) or (channels, T/2)), ``sf`` (the scale tensor: uint8 codes or float32),
    ``global_scale`` (float32 (E,), NVFP4; else unused), ``workspace`` (``workspace_bytes``),
    ``tokens_sum``, ``sf_capacity`` (blocked: columns; block_1x128: rows; else unused),
    ``tile_bound`` (the grid's tile rows: ``ceil(T / 128) + E``) and the stream."""

    def __init__(self, cfg: QuantizeConfig):
        self.cfg = cfg
        # CTAs per SM the registers must allow (latency hiding): 4 (<= 64 registers) but for
        # 1x128, whose cross-quarter amax keeps the 32 values live (3: <= 80, no spills).
        self.min_blocks = 3 if cfg.recipe == "block_1x128" else 4
        # MXFP4 quantizes BF16 pairs (its multiplier is a power of two: exact in BF16).
        self.packed = cfg.elem == "e2m1" and not cfg.nvfp4

    @cute.jit
    def __call__(
        self,
        x_ptr: cute.Pointer,
        offsets_ptr: cute.Pointer,
        q_ptr: cute.Pointer,
        sf_ptr: cute.Pointer,
        gs_ptr: cute.Pointer,
        workspace_ptr: cute.Pointer,
        tokens_sum: Int32,
        sf_capacity: Int32,
        tile_bound: Int32,
        stream,
    ):
        cfg = self.cfg
        offsets = cute.make_tensor(offsets_ptr, cute.make_layout(cfg.num_experts))
        ws = cute.make_tensor(workspace_ptr, cute.make_layout(max(cfg.amax_words, 1)))
        experts = cute.make_tensor(workspace_ptr + cfg.expert_table_offset // 4,
                                   cute.make_layout(4 * cfg.num_experts))
        table = cute.make_tensor(workspace_ptr + cfg.tile_table_offset // 4,
                                 cute.make_layout(8 * tile_bound))
        self.prep_kernel(offsets, ws, experts, table, tokens_sum, tile_bound).launch(
            grid=(max(1, -(-cfg.amax_words // PREP_THREADS)), 1, 1), block=(PREP_THREADS, 1, 1),
            stream=stream)
        grid = (cfg.channel_blocks, tile_bound, 1)
        if cutlass.const_expr(cfg.two_pass):
            self.amax_kernel(x_ptr, ws, table).launch(
                grid=grid, block=(THREADS, 1, 1), stream=stream)
        self.tile_kernel(x_ptr, offsets, q_ptr, sf_ptr, gs_ptr, ws, table, tokens_sum,
                         sf_capacity).launch(
            grid=grid, block=(THREADS, 1, 1), min_blocks_per_mp=self.min_blocks,
            preferred_smem_carveout=100, stream=stream)

    @cute.jit
    def call_tensors(
        self,
        stream,
        x: cute.Tensor,
        offsets: cute.Tensor,
        q: cute.Tensor,
        sf: cute.Tensor,
        gs: cute.Tensor,
        workspace: cute.Tensor,
        *,
        tokens_sum: cutlass.Constexpr,
        sf_capacity: cutlass.Constexpr,
        tile_bound: cutlass.Constexpr,
    ):
        """The ``(stream, *inputs, *outputs)`` form of ``cutlass.jax.cutlass_call``: inputs
        ``x``, ``offsets``; outputs ``q``, ``sf``, ``gs`` (a one-element dummy but for NVFP4)
        and the uint8 ``workspace`` (at least 4 bytes); only their data pointers are used."""
        self.__call__(
            cute.make_ptr(cutlass.BFloat16, x.iterator.toint(), cute.AddressSpace.gmem,
                          assumed_align=16),
            cute.make_ptr(Int32, offsets.iterator.toint(), cute.AddressSpace.gmem,
                          assumed_align=4),
            cute.make_ptr(Uint8, q.iterator.toint(), cute.AddressSpace.gmem, assumed_align=16),
            cute.make_ptr(cutlass.Float32 if self.cfg.recipe != "blocked" else Uint8,
                          sf.iterator.toint(), cute.AddressSpace.gmem, assumed_align=16),
            cute.make_ptr(cutlass.Float32, gs.iterator.toint(), cute.AddressSpace.gmem,
                          assumed_align=4),
            cute.make_ptr(Int32, workspace.iterator.toint(), cute.AddressSpace.gmem,
                          assumed_align=16),
            Int32(tokens_sum), Int32(sf_capacity), Int32(tile_bound), stream,
        )

    @cute.kernel
    def prep_kernel(self, offsets: cute.Tensor, ws: cute.Tensor, experts: cute.Tensor,
                    table: cute.Tensor, tokens_sum: Int32, tile_bound: Int32):
        """Every CTA zeroes its part of the amax records (two-pass formats); CTA 0 builds the
        call's tile table: a block-wide prefix sum of the experts' tile and scale-column
        counts (into the expert table and shared memory), then for each tile row a binary
        search for its expert."""
        cfg = self.cfg
        tid = cute.arch.thread_idx()[0]
        bid = cute.arch.block_idx()[0]
        if cutlass.const_expr(cfg.amax_words > 0):
            i = bid * PREP_THREADS + tid
            if i < cfg.amax_words:
                ws[i] = Int32(0)
        if bid == 0:
            smem = SmemAllocator()
            first = smem.allocate_tensor(Int32, cute.make_layout(cfg.num_experts), 16)
            totals = smem.allocate_tensor(Int32, cute.make_layout((PREP_WARPS, 2)), 16)
            lane = cute.arch.lane_idx()
            warp = cute.arch.warp_idx()
            running_tiles = Int32(0)
            running_cols = Int32(0)
            for base in cutlass.range(0, cfg.num_experts, PREP_THREADS, unroll=1):
                e = base + tid
                begin = tokens_sum
                end = tokens_sum
                if e < cfg.num_experts:
                    begin, end = sanitized_range(offsets, e, tokens_sum, cfg.count_multiple)
                count = end - begin
                tiles = (count + (TILE_TOKENS - 1)) // TILE_TOKENS
                cols = self.scale_columns(count)
                incl_tiles = tiles
                incl_cols = cols
                for d in cutlass.range_constexpr(5):
                    up_t = cute.arch.shuffle_sync_up(incl_tiles, 1 << d)
                    up_c = cute.arch.shuffle_sync_up(incl_cols, 1 << d)
                    if lane >= (1 << d):
                        incl_tiles += up_t
                        incl_cols += up_c
                if lane == 31:
                    totals[warp, 0] = incl_tiles
                    totals[warp, 1] = incl_cols
                cute.arch.sync_threads()
                before_tiles = Int32(0)
                before_cols = Int32(0)
                chunk_tiles = Int32(0)
                chunk_cols = Int32(0)
                for w in cutlass.range_constexpr(PREP_WARPS):
                    t_w = totals[w, 0]
                    c_w = totals[w, 1]
                    if w < warp:
                        before_tiles += t_w
                        before_cols += c_w
                    chunk_tiles += t_w
                    chunk_cols += c_w
                cute.arch.sync_threads()  # totals are rewritten by the next chunk
                if e < cfg.num_experts:
                    first[e] = running_tiles + before_tiles + incl_tiles - tiles
                    experts[4 * e] = begin
                    experts[4 * e + 1] = end
                    experts[4 * e + 2] = running_cols + before_cols + incl_cols - cols
                    experts[4 * e + 3] = cols
                running_tiles += chunk_tiles
                running_cols += chunk_cols
            cute.arch.sync_threads()
            for b in cutlass.range(tid, tile_bound, PREP_THREADS, unroll=1):
                row = [Int32(-1), Int32(0), Int32(0), Int32(0), Int32(0), Int32(0)]
                if b < running_tiles:
                    lo = owner_of(first, 1, cfg.num_experts, b)  # the expert owning tile b
                    row = [lo, b - first[lo], experts[4 * lo], experts[4 * lo + 1],
                           experts[4 * lo + 2], experts[4 * lo + 3]]
                for k in cutlass.range_constexpr(6):
                    table[8 * b + k] = row[k]

    # -- where a CTA works ----------------------------------------------------------------------

    @cute.jit
    def scale_columns(self, count: Int32) -> Int32:
        """Scale columns (blocked) or rows (block_1x128) of an expert of ``count`` tokens."""
        cfg = self.cfg
        columns = Int32(0)
        if cutlass.const_expr(cfg.recipe == "blocked"):
            columns = (count + (cfg.sf_vec - 1)) // cfg.sf_vec
            columns = (columns + 3) // 4 * 4
        if cutlass.const_expr(cfg.recipe == "block_1x128"):
            columns = (count + (TILE_TOKENS - 1)) // TILE_TOKENS
        return columns

    @cute.jit
    def empty_expert_scales(self, offsets: cute.Tensor, tokens_sum: Int32, sf_ptr: cute.Pointer,
                            gs_ptr: cute.Pointer):
        """Tile row 0: scale 1.0 for the channels of this block of every empty expert
        (per_expert_channel) and global scale 1.0 (NVFP4, channel block 0)."""
        cfg = self.cfg
        tid = cute.arch.thread_idx()[0]
        cb = cute.arch.block_idx()[0]
        for e in cutlass.range(tid, cfg.num_experts, THREADS, unroll=1):
            begin, end = sanitized_range(offsets, e, tokens_sum, cfg.count_multiple)
            if end == begin:
                if cutlass.const_expr(cfg.recipe == "per_expert_channel"):
                    sf = cute.make_tensor(cute.recast_ptr(sf_ptr, dtype=Int32),
                                          cute.make_layout(cfg.num_experts * cfg.channels))
                    for c in cutlass.range(TILE_CHANNELS, unroll=1):
                        ch = cb * TILE_CHANNELS + c
                        if ch < cfg.channels:
                            sf[e * cfg.channels + ch] = Int32(FP32_ONE)
                if cutlass.const_expr(cfg.nvfp4):
                    if cb == 0:
                        gs = cute.make_tensor(cute.recast_ptr(gs_ptr, dtype=Int32),
                                              cute.make_layout(cfg.num_experts))
                        gs[e] = Int32(FP32_ONE)

    # -- the tile kernel ----------------------------------------------------------------------

    @cute.kernel
    def tile_kernel(self, x_ptr: cute.Pointer, offsets: cute.Tensor, q_ptr: cute.Pointer,
                    sf_ptr: cute.Pointer, gs_ptr: cute.Pointer, ws: cute.Tensor,
                    table: cute.Tensor, tokens_sum: Int32, sf_capacity: Int32):
        cfg = self.cfg
        smem = SmemAllocator()
        red = smem.allocate_tensor(Int32, cute.make_layout((TILE_CHANNELS, QUARTERS)), 16)
        # The x tile (128 tokens x 64 channels of BF16 pairs) and the code tile (64 channels x
        # 128 tokens of codes), rows padded by one word: conflict-free both ways.
        xs = smem.allocate_tensor(Int32, cute.make_layout(TILE_TOKENS * X_ROW_WORDS), 16)
        qs = smem.allocate_tensor(Int32, cute.make_layout(TILE_CHANNELS * Q_ROW_WORDS), 16)
        if cutlass.const_expr(cfg.two_pass):
            if cute.arch.block_idx()[1] == 0:
                self.empty_expert_scales(offsets, tokens_sum, sf_ptr, gs_ptr)
        info = self.table_row(table)
        if info[0] >= 0:
            self.tile(x_ptr, q_ptr, sf_ptr, gs_ptr, ws, info, red, xs, qs, tokens_sum,
                      sf_capacity)

    def table_row(self, table: cute.Tensor):
        """This CTA's tile row of the prep kernel's table (the same 32 bytes for every
        thread): [expert (-1: none), tile, begin, end, S_e, C_e]."""
        b = cute.arch.block_idx()[1]
        row = cute.recast_ptr(table.iterator, dtype=Int32).toint() + Int64(b) * 32
        head = ld_global_words(row)
        tail = ld_global_words(row + 16)
        return [head[0], head[1], head[2], head[3], tail[0], tail[1]]

    @cute.kernel
    def amax_kernel(self, x_ptr: cute.Pointer, ws: cute.Tensor, table: cute.Tensor):
        """The two-pass formats' first pass, on the same tiles: each thread takes the maximum
        magnitude bits of its four 16-byte loads (8 channels x 4 tokens) straight from
        registers; per_expert_channel reduces them per channel (shuffles across the lanes of
        a chunk, shared memory across warps: one ``atom.max`` per channel), NVFP4 to one
        value per tile (one ``atom.max`` per CTA). Non-finite values pass Inf's bits or more."""
        cfg = self.cfg
        C = cfg.channels
        tid = cute.arch.thread_idx()[0]
        lane = cute.arch.lane_idx()
        warp = cute.arch.warp_idx()
        cb = cute.arch.block_idx()[0]
        smem = SmemAllocator()
        red = smem.allocate_tensor(Int32, cute.make_layout((THREADS // 32, TILE_CHANNELS)), 16)
        info = self.table_row(table)
        expert, j, begin, end = info[0], info[1], info[2], info[3]
        if expert >= 0:
            tile_begin = begin + j * TILE_TOKENS
            tile_valid = cutlass.min(end - tile_begin, TILE_TOKENS)
            chunk = tid % X_CHUNKS
            first = cb * TILE_CHANNELS + chunk * 8
            m = [Int32(0)] * 8  # channels first .. first + 7
            for r in cutlass.range_constexpr(X_LOADS):
                token = tid // X_CHUNKS + (THREADS // X_CHUNKS) * r
                w = [Int32(0), Int32(0), Int32(0), Int32(0)]
                if token < tile_valid and first < C:
                    w = ld_global_words(x_ptr.toint() + (Int64(tile_begin + token) * C + first) * 2)
                for k in cutlass.range_constexpr(4):
                    m[2 * k] = cutlass.max(m[2 * k], (w[k] << 16) & 0x7FFFFFFF)
                    m[2 * k + 1] = cutlass.max(m[2 * k + 1], w[k] & 0x7FFF0000)
            if cutlass.const_expr(cfg.recipe == "per_expert_channel"):
                # Lanes l, l ^ 8, l ^ 16, l ^ 24 hold the same channels (other tokens).
                for k in cutlass.range_constexpr(8):
                    for d in cutlass.range_constexpr(2):
                        m[k] = cutlass.max(m[k], cute.arch.shuffle_sync_bfly(m[k], 8 << d))
                if lane < X_CHUNKS:
                    for k in cutlass.range_constexpr(8):
                        red[warp, chunk * 8 + k] = m[k]
                cute.arch.sync_threads()
                if tid < TILE_CHANNELS:
                    ch = cb * TILE_CHANNELS + tid
                    total = Int32(0)
                    for wi in cutlass.range_constexpr(THREADS // 32):
                        total = cutlass.max(total, red[wi, tid])
                    if ch < C:
                        cute.arch.atomic_max(ws.iterator + (expert * C + ch), total)
            else:
                mine = Int32(0)
                for k in cutlass.range_constexpr(8):
                    mine = cutlass.max(mine, m[k])
                warp_max = cute.arch.warp_redux_sync(mine, "max")
                if lane == 0:
                    red[warp, 0] = warp_max
                cute.arch.sync_threads()
                if tid == 0:
                    total = Int32(0)
                    for wi in cutlass.range_constexpr(THREADS // 32):
                        total = cutlass.max(total, red[wi, 0])
                    cute.arch.atomic_max(ws.iterator + expert, total)

    @cute.jit
    def tile(self, x_ptr, q_ptr, sf_ptr, gs_ptr, ws, info, red, xs, qs, tokens_sum, sf_capacity):
        cfg = self.cfg
        C = cfg.channels
        tid = cute.arch.thread_idx()[0]
        cb = cute.arch.block_idx()[0]
        expert, j, begin, end = info[0], info[1], info[2], info[3]
        s_e, c_e = info[4], info[5]
        c_local = tid % TILE_CHANNELS
        quarter = tid // TILE_CHANNELS
        ch = cb * TILE_CHANNELS + c_local
        tile_begin = begin + j * TILE_TOKENS
        tile_valid = cutlass.min(end - tile_begin, TILE_TOKENS)
        t0 = tile_begin + quarter * TOKENS_PER_THREAD
        n_valid = cutlass.max(cutlass.min(end - t0, TOKENS_PER_THREAD), 0)
        live = ch < C

        # Stage the x tile in shared memory: 16-byte loads, 8 threads per token row (128 B),
        # zeros past the expert's tokens or the channels.
        for r in cutlass.range_constexpr(X_LOADS):
            v = tid + THREADS * r
            token = v // X_CHUNKS
            chunk = v - token * X_CHUNKS
            w = [Int32(0), Int32(0), Int32(0), Int32(0)]
            first = cb * TILE_CHANNELS + chunk * 8
            if token < tile_valid and first < C:
                address = x_ptr.toint() + (Int64(tile_begin + token) * C + first) * 2
                w = ld_global_words(address)
            for k in cutlass.range_constexpr(4):
                xs[token * X_ROW_WORDS + chunk * 4 + k] = w[k]
        cute.arch.sync_threads()
        if cutlass.const_expr(self.packed):
            self.tile_packed(q_ptr, sf_ptr, gs_ptr, ws, red, xs, qs, expert, j, tile_begin,
                             tile_valid, n_valid, s_e, c_e, ch, c_local, quarter, live,
                             tokens_sum, sf_capacity)
        else:
            # This thread's column: FP32 bits of channel c_local, tokens 32 q .. 32 q + 31.
            vals = cute.make_rmem_tensor(TOKENS_PER_THREAD, Int32)
            # The even channel is the low half of its word: one prmt moves the half to the top.
            select = Int32(0x1044) + Int32(0x2200) * (c_local % 2)
            for i in cutlass.range_constexpr(TOKENS_PER_THREAD):
                word = xs[(quarter * TOKENS_PER_THREAD + i) * X_ROW_WORDS + c_local // 2]
                vals[i] = bf16_to_f32(word, select)

            # Block amaxes of the magnitudes' bits (NONFINITE when a block holds NaN / Inf).
            group = TOKENS_PER_THREAD if cfg.sf_vec != 16 else 16
            groups = TOKENS_PER_THREAD // group
            amax = cute.make_rmem_tensor(groups, Int32)
            bad = cute.make_rmem_tensor(groups, Int32)
            for g in cutlass.range_constexpr(groups):
                if cutlass.const_expr(cfg.elem == "e2m1"):
                    # No per-value mask: the unsigned maximum of the bits is the largest negative
                    # magnitude (with the sign bit) when there is a negative value, the signed
                    # maximum the largest non-negative one when there is one (else negative).
                    mu = vals[g * group]
                    ms = vals[g * group]
                    for i in cutlass.range_constexpr(1, group):
                        mu = max_u32(mu, vals[g * group + i])
                        ms = cutlass.max(ms, vals[g * group + i])
                    m = cutlass.max(mu & 0x7FFFFFFF, ms)
                else:
                    m = Int32(0)
                    for i in cutlass.range_constexpr(group):
                        m = cutlass.max(m, vals[g * group + i] & 0x7FFFFFFF)
                amax[g] = m  # its codes are forced below when the block is not finite
                bad[g] = Int32(m >= NONFINITE)

            self.quantize(q_ptr, sf_ptr, gs_ptr, ws, red, qs, vals, amax, bad, expert, j,
                          tile_begin, tile_valid, n_valid, s_e, c_e, ch, c_local, quarter, live,
                          tokens_sum, sf_capacity)

    @cute.jit
    def tile_packed(self, q_ptr, sf_ptr, gs_ptr, ws, red, xs, qs, expert, j, tile_begin,
                    tile_valid, n_valid, s_e, c_e, ch, c_local, quarter, live, tokens_sum,
                    sf_capacity):
        """MXFP4: the thread's 32 BF16 values as 16 BF16x2 words (pair 4w + k: tokens 8w + k
        and 8w + k + 4, one prmt of two shared words), the block amax by packed 16-bit maxima,
        codes by ``e2m1x8_bf16x2``."""
        pairs = cute.make_rmem_tensor(TOKENS_PER_THREAD // 2, Int32)
        # The even channel is the low half of its word.
        select = Int32(0x5410) + Int32(0x2222) * (c_local % 2)
        for w in cutlass.range_constexpr(TOKENS_PER_THREAD // 8):
            for k in cutlass.range_constexpr(4):
                row = quarter * TOKENS_PER_THREAD + 8 * w + k
                lo = xs[row * X_ROW_WORDS + c_local // 2]
                hi = xs[(row + 4) * X_ROW_WORDS + c_local // 2]
                pairs[4 * w + k] = bf16_pair(lo, hi, select)
        # The unsigned / signed maxima of tile()'s FP4 amax, on each 16-bit half; then the
        # larger half, as FP32 bits (a half >= 0x7F80: NaN / Inf in the block).
        mu = pairs[0]
        ms = pairs[0]
        for i in cutlass.range_constexpr(1, TOKENS_PER_THREAD // 2):
            mu = max_u16x2(mu, pairs[i])
            ms = max_s16x2(ms, pairs[i])
        m = max_s16x2(mu & 0x7FFF7FFF, ms)
        m = max_u32(m << 16, m & Int32(-65536))
        amax = cute.make_rmem_tensor(1, Int32)
        bad = cute.make_rmem_tensor(1, Int32)
        amax[0] = m
        bad[0] = Int32(m >= NONFINITE)
        self.quantize(q_ptr, sf_ptr, gs_ptr, ws, red, qs, pairs, amax, bad, expert, j,
                      tile_begin, tile_valid, n_valid, s_e, c_e, ch, c_local, quarter, live,
                      tokens_sum, sf_capacity)

    @cute.jit
    def combine_quarters(self, red, value: Int32, c_local, quarter) -> Int32:
        """Max of ``value`` over the four quarters of a channel (every thread gets it)."""
        red[c_local, quarter] = value
        cute.arch.sync_threads()
        total = cutlass.max(cutlass.max(red[c_local, 0], red[c_local, 1]),
                            cutlass.max(red[c_local, 2], red[c_local, 3]))
        return total

    @cute.jit
    def amax_scale(self, amax: Int32, divisor: int, floor: int) -> Int32:
        """``amax / divisor`` (FP32 bits), at least ``floor``; 1.0 for an all-zero block, NaN
        for a non-finite one. The FP32 recipes' scale (``fmax``, the smallest normal) and
        NVFP4's global scale (2688, no floor)."""
        scale = f32_div(amax, Int32(divisor))
        if cutlass.const_expr(floor > 0):
            scale = cutlass.max(scale, Int32(floor))
        if amax == 0:
            scale = Int32(FP32_ONE)
        if amax >= NONFINITE:
            scale = Int32(FP32_NAN)
        return scale

    @cute.jit
    def quantize(self, q_ptr, sf_ptr, gs_ptr, ws, red, qs, vals, amax, bad, expert, j,
                 tile_begin, tile_valid, n_valid, s_e, c_e, ch, c_local, quarter, live,
                 tokens_sum, sf_capacity):
        cfg = self.cfg
        C = cfg.channels
        groups = cute.size(amax)
        # Per group: the multiplier of the values (FP32 bits), whether the codes are forced
        # (FP8 of a non-finite block: 0x7F; NVFP4 with a zero / non-finite scale: 0), and the
        # scale to store.
        mult = cute.make_rmem_tensor(groups, Int32)
        forced = cute.make_rmem_tensor(groups, Int32)
        code = cute.make_rmem_tensor(groups, Int32)
        if cutlass.const_expr(cfg.recipe == "blocked" and not cfg.nvfp4):
            for g in cutlass.range_constexpr(groups):
                exp = amax[g] >> 23
                s = cutlass.max(exp - 127 - EMAX[cfg.elem], -127)
                mult[g] = (127 - s) << 23
                forced[g] = Int32(0)
                code[g] = s + 127
                if bad[g] != 0:
                    code[g] = Int32(255)
                    forced[g] = Int32(1)
        if cutlass.const_expr(cfg.nvfp4):
            gbits = self.amax_scale(ws[expert], NVFP4_GLOBAL_DIVISOR, 0)
            if j == 0 and cute.arch.block_idx()[0] == 0 and cute.arch.thread_idx()[0] == 0:
                gs = cute.make_tensor(cute.recast_ptr(gs_ptr, dtype=Int32),
                                      cute.make_layout(cfg.num_experts))
                gs[expert] = gbits
            six_g = f32_mul(Int32(SIX), gbits)
            for g in cutlass.range_constexpr(groups):
                s = f32_div(amax[g], six_g)
                c = e4m3_code(s)
                if bad[g] != 0 or (s & 0x7FFFFFFF) > NONFINITE:
                    c = Int32(0x7F)
                code[g] = c
                denom = f32_mul(e4m3_value(c), gbits)
                mult[g] = f32_div(Int32(FP32_ONE), denom)
                da = denom & 0x7FFFFFFF
                forced[g] = Int32(da == 0) + Int32(da >= NONFINITE)
        if cutlass.const_expr(cfg.recipe != "blocked"):
            block_amax = amax[0]
            if bad[0] != 0:
                block_amax = Int32(NONFINITE)
            if cutlass.const_expr(cfg.recipe == "block_1x128"):
                block_amax = self.combine_quarters(red, block_amax, c_local, quarter)
            else:
                block_amax = Int32(0)
                if live:
                    block_amax = ws[expert * C + ch]
            scale = self.amax_scale(block_amax, FMAX_BITS[cfg.elem], FP32_MIN_NORMAL)
            mult[0] = f32_div(Int32(FP32_ONE), scale)
            forced[0] = Int32(block_amax >= NONFINITE)
            code[0] = scale

        self.store_codes(q_ptr, qs, vals, mult, forced, tile_begin, tile_valid, c_local,
                         quarter, tokens_sum)
        self.store_scales(sf_ptr, code, expert, j, s_e, c_e, ch, quarter, live, n_valid,
                          sf_capacity)

    @cute.jit
    def store_codes(self, q_ptr, qs, vals, mult, forced, tile_begin, tile_valid, c_local, quarter,
                    tokens_sum):
        """The thread's 32 codes into the code tile, then the tile into q: each channel's row
        segment (128 FP8 bytes or 64 FP4 bytes) as 16-byte stores, 8 (FP8) or 4 (FP4) threads
        per row. Only whole 16-byte chunks exist (counts are multiples of 16 / 32)."""
        cfg = self.cfg
        C = cfg.channels
        groups = cute.size(mult)
        group = TOKENS_PER_THREAD // groups
        fp4 = cfg.elem == "e2m1"
        tokens_per_word = 8 if fp4 else 4
        words_per_thread = TOKENS_PER_THREAD // tokens_per_word
        for w in cutlass.range_constexpr(words_per_thread):
            g = (w * tokens_per_word) // group
            if cutlass.const_expr(self.packed):
                # mult: 2**-s as FP32 bits, a normal power of two; as BF16 in both halves
                word = e2m1x8_bf16x2([vals[w * 4 + k] for k in range(4)],
                                     mult[g] | ((mult[g] >> 16) & 0xFFFF))
                if forced[g] != 0:
                    word = Int32(0)
            elif cutlass.const_expr(fp4):
                word = e2m1x8([vals[w * 8 + k] for k in range(8)], mult[g])
                if cutlass.const_expr(cfg.nvfp4):
                    # An infinite multiplier (1 / a subnormal scale * g): 0 * Inf is NaN,
                    # whose code is 0 (the sign of -0 dropped): the per-value path.
                    if mult[g] == NONFINITE:
                        word = Int32(0)
                        for k in cutlass.range_constexpr(8):
                            word = word | (e2m1_code(f32_mul(vals[w * 8 + k], mult[g]))
                                           << (4 * k))
                if forced[g] != 0:
                    word = Int32(0)
            else:
                qv = cute.make_rmem_tensor(tokens_per_word, Int32)
                for k in cutlass.range_constexpr(tokens_per_word):
                    qv[k] = f32_mul(vals[w * tokens_per_word + k], mult[g])
                word = fp8x4(qv[0], qv[1], qv[2], qv[3], cfg.elem)
                if forced[g] != 0:
                    word = Int32(0x7F7F7F7F)
            qs[c_local * Q_ROW_WORDS + quarter * words_per_thread + w] = word
        cute.arch.sync_threads()
        # Row ch of q holds tokens_sum codes (FP8) or tokens_sum / 2 bytes (E2M1).
        row_bytes = tokens_sum // 2 if fp4 else tokens_sum
        tokens_per_chunk = 32 if fp4 else 16
        chunks = TILE_TOKENS // tokens_per_chunk  # 16-byte chunks per row segment
        tid = cute.arch.thread_idx()[0]
        cb = cute.arch.block_idx()[0]
        for r in cutlass.range_constexpr(TILE_CHANNELS * chunks // THREADS):
            v = tid + THREADS * r
            row = v // chunks
            chunk = v - row * chunks
            channel = cb * TILE_CHANNELS + row
            if chunk * tokens_per_chunk < tile_valid and channel < C:
                base = row * Q_ROW_WORDS + chunk * 4
                address = q_ptr.toint() + (Int64(channel) * row_bytes
                                           + (tile_begin + chunk * tokens_per_chunk)
                                           // (2 if fp4 else 1))
                st_global_v4(address, qs[base], qs[base + 1], qs[base + 2], qs[base + 3])

    @cute.jit
    def store_scales(self, sf_ptr, code, expert, j, s_e, c_e, ch, quarter, live, n_valid,
                     sf_capacity):
        cfg = self.cfg
        C = cfg.channels
        if cutlass.const_expr(cfg.recipe == "blocked"):
            # Row ch (< round_up(C, 128) by the grid) of the expert's chunk, its columns of
            # this quarter; padding columns (< C_e, past the tokens) get the zero block's code.
            mpad = cfg.padded_channels
            sf8 = cute.recast_ptr(sf_ptr, dtype=Uint8)
            groups = cute.size(code)
            for g in cutlass.range_constexpr(groups):
                col = (j * TILE_TOKENS + quarter * TOKENS_PER_THREAD) // cfg.sf_vec + g
                if col < c_e:
                    offset = (Int64(mpad) * s_e
                              + 512 * ((ch >> 7) * (c_e >> 2) + (col >> 2))
                              + 16 * (ch & 31) + 4 * ((ch >> 5) & 3) + (col & 3))
                    # The tensor holds Mpad * sf_capacity bytes, addressed flat: bytes past
                    # them are dropped (a column test would let the row atoms >= 1 of a cut
                    # chunk overflow).
                    if offset < Int64(mpad) * sf_capacity:
                        # Padding (rows past the channels, columns past the tokens): code 0,
                        # whatever the expert's global scale (never NaN).
                        value = code[g]
                        if not live or g * (TOKENS_PER_THREAD // groups) >= n_valid:
                            value = Int32(0)
                        (sf8 + offset).store(Uint8(value))
        else:
            sf = cute.recast_ptr(sf_ptr, dtype=Int32)
            if quarter == 0 and live:
                if cutlass.const_expr(cfg.recipe == "block_1x128"):
                    if s_e + j < sf_capacity:
                        (sf + (Int64(s_e + j) * C + ch)).store(code[0])
                else:
                    if j == 0:
                        (sf + (Int64(expert) * C + ch)).store(code[0])
