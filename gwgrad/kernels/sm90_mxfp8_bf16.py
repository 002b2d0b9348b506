"""Hopper (SM90) MXFP8 weight gradient in two passes: dequantize to BF16, then the BF16 kernel.

Selected by ``Tuning.mainloop = 2`` (``MAINLOOP_DEQUANT``) for the ``blocked`` recipe on SM90
(backends/fp8_sm90.py, ``Mxfp8Bf16Sm90Backend``): the default where gwgrad sizes the workspace
(the wrapper and the adapters without a caller's ``descriptor_workspace``:
``backends.mxfp8_two_pass``), since the workspace grows with the tokens; a caller-owned
workspace of the contract's size, the class API, JAX, tensor_ragged operands and global scales
run the promoting kernel of kernels/sm90_fp8.py (``mainloop = 1``).

Why (issue "MXFP8 on Hopper worth using"). Hopper's FP8 WGMMA has no block scales, so the
promoting kernel issues a K=32 WGMMA per 32-token scale block and promotes each result on CUDA
cores (``acc += tmp * sa * sb``): 2 FP32 ops per accumulator per 32 tokens, issue-bound (ncu,
dsv3-fc1: tensor pipe active 10% of cycles, 19.2 ms against BF16's ~5.3 ms). Budget per
128-token K block of a 128x192 tile on an H200 SM (BF16 dense WGMMA 4096 FLOP/clk/SM, shared
memory ~128 B/clk/SM, 4 issue slots/clk/SM):

  BF16 WGMMA            2*128*192*128 FLOP = 1536 clk; operand reads from shared memory
                        (A 32 KiB, B 2 x 48 KiB: pingpong's two 64-row WGMMAs each read B)
                        128 KiB = 85 B/clk.
  (promote, current)    4 x K=32 FP8 WGMMA (768 clk of tensor time) but 4 x 192 x 2 FP32
                        ops per thread x 128 threads x 2 groups = 6144 warp instructions
                        (+ scale decode) per K block on 4 issue slots: >= 1536 issue clk with
                        the tensor pipe waiting on each wait_group(0): ~0.25x BF16 measured.
  (a) convert in smem   FP8 -> BF16 of (128+192) x 128 values per K block: read 40 KiB FP8,
                        write 80 KiB BF16, then the WGMMA reads 128 KiB: 248 KiB per 1536 clk
                        = 161 B/clk > 128 B/clk: shared-memory bound at <= 0.79x of the BF16
                        mainloop's peak rate before any conversion issue cost. Conversion
                        (PTX on sm_90a: cvt.rn.f16x2.e4m3x2 / .e5m2x2 exist, two values per
                        instruction, exact; there is no cvt to bf16x2 from e4m3x2 and no packed
                        f16x2 -> bf16x2 cvt, so either cvt.f32.f16 + cvt.rn.bf16x2.f32 (3 per
                        pair) or bit placement: E4M3 s.eeee.mmm -> BF16 bits (b & 0x7F) << 4 |
                        (b & 0x80) << 8 is the value times 2^-120 (denormals too; E5M2: << 5,
                        2^-112), the scale then one mul.bf16x2 by 2^(s-7) when that is in
                        BF16's range, two otherwise; NaN / Inf codes need a select): ~2
                        instructions per value, 40960 values = 2560 warp instructions per K
                        block (640 issue clk) on the consumer or a transform warp group, which
                        competes with the epilogue for registers (192 accumulators already).
                        A as a register operand (WGMMA RS, converted after ldmatrix) saves its
                        24 KiB of BF16 writes, B still goes through shared memory: ~145 B/clk.
  (b) two passes        a dequantize kernel writes BF16 K-major copies of A and B into the
                        workspace (HBM: read 1 B + write 2 B per value, plus 1/32 B of scale),
                        then the BF16 kernel (K-major A and B) reads 2 B per value instead of
                        1 B. Extra time / BF16 GEMM time = 3 (M+N) T / BW over 2 M N T / F =
                        3 F (M+N) / (2 BW M N), independent of the tokens per expert
                        (F ~ 720 TFLOP/s measured BF16, BW ~ 4.0 TB/s achievable):
                          dsv3-fc1   M=7168 N=4096, 65536 tokens: 2.2 GB -> 0.55 ms on a
                                     5.35 ms GEMM: ~0.91x BF16 (0.10 extra)
                          gptoss-fc1 M=2880 N=5760, 65536 tokens (2048 per expert): 1.7 GB
                                     -> 0.42 ms on a 3.0 ms GEMM: ~0.88x
                          fine-256e  M=1536 N=1024, 256 experts of 256 tokens: 0.5 GB ->
                                     0.13 ms on BF16's measured ~0.42 ms (~495 TFLOP/s):
                                     ~0.77x (short experts: below the target's rows)
                        Cost: the workspace holds 2 (M + N) T bytes (1.48 GB on dsv3-fc1,
                        1.13 GB gptoss-fc1, 0.34 GB fine-256e). Measured (docs/
                        PERFORMANCE.md, table fp8): 0.85-1.02x BF16 on the >= 2048-token
                        shapes; ncu on dsv3-fc2: both dequantize launches 466 us, DRAM
                        75-81% of peak.
Scheme (b) reaches the >= 0.8x target on the >= 2048-tokens rows from the kernels gwgrad has
measured, with exactly the BF16 kernel's mainloop; (a) is capped near it by shared-memory
bandwidth with a new mainloop of unmeasured cost. This module implements (b).

Launches (one compiled entry, the block-scaled signature): the quantizers' prep kernel
(kernels/quantize.py, one CTA: each expert's sanitized range, its first scale column S_e and
column count C_e, a block-wide prefix sum) writes the expert table; the dequantize kernel runs
once for A and once for B; then the BF16 kernel (kernels/sm90_bf16.py, its own prep work
its prep kernel first: ``launches = 2``) runs on the copies with the FP8 recipe's token-count
multiple (32) and the scale tensors' capacity check (``checked_scales``), so that its offsets
verdict is the FP8 call's (too-small scales or invalid offsets: nothing written).

Workspace (``workspace_bytes(T) = base + 2 (hidden + intermediate) T``): [the BF16 kernel's
workspace (config.py layout; its first 16 bytes zero before the first launch, as for every
gwgrad GEMM)][expert table E x (begin, end, S_e, C_e) int32][a 32-byte tile-table row, unused]
[A as BF16 (hidden, T) K-major][B as BF16 (intermediate, T)].

Dequantize kernel: 256 threads; CTA (x, y) takes tokens 2048x .. 2048x+2047 of rows
ROWS_PER_CTA*y ..; a thread takes 8 of those tokens (THREAD_TOKENS: a warp's loads and stores
each cover one contiguous span), finds their expert by a binary search of the table (experts
own whole 32-token groups: counts are multiples of 32), then per row loads the 8 codes (one
8-byte load), the E8M0 code of their 32-token group (blocked layout, gwgrad/scales.py; the
four threads of a group read the same byte), and stores 8 BF16 (one 16-byte store). Per
value: ``cvt.rn.f16x2.e4m3x2`` (or e5m2x2, two values), ``cvt.f32.f16``, ``mul.rn.f32`` by
2^(s-127) and ``cvt.rn.bf16x2.f32`` (two values): exact in FP32, one rounding into BF16. A
group outside every expert (invalid offsets: the GEMM then writes nothing) is stored as zeros;
a scale byte past the scale tensor's capacity is never read (code 0 used).

Exactness: ``x * 2^(s-127)`` is computed exactly in FP32 (E8M0 0x00 is 2^-127, an FP32
denormal, and 0xFF NaN: the promoting kernel's decoding) and rounded once to BF16. It is
exact whenever the product is representable in BF16 (its lowest set bit at or above BF16's
denormal step 2^-133, its value below 2^128): every E4M3 value for scale codes 3..246, every
E5M2 value for codes 10..239. Below, the product rounds to nearest even (to 0 under 2^-134);
above BF16's largest finite value it becomes +-Inf; NaN codes (E4M3 0x7F / 0xFF, E5M2 NaNs) and scale 0xFF give NaN, E5M2 +-Inf
stays +-Inf (times a NaN scale: NaN). Data quantized from BF16 or FP32 values (gwgrad's
quantizers: the scale follows the block's amax) dequantizes back near those values, inside
BF16's range unless they were within a factor 2 of its limits. The promoting kernel differs only where its FP32 scale
product ``sa * sb`` leaves FP32's range (flushes to 0 or overflows) and in summation order;
tests/test_mxfp8_bf16_sm90_gpu.py checks special codes against the FP64 reference.

Tests: tests/test_mxfp8_bf16.py (selection, workspace, errors, the conversion's NumPy model),
tests/test_compile_mxfp8_bf16.py (-m compile: BF16 WGMMA present, no FP8 WGMMA, the
conversion's cvt instructions, no spills), tests/test_mxfp8_bf16_sm90_gpu.py (-m gpu: against
FP64, every mode, pairs, special codes, e5m2, every expert empty; passed on an H200),
tools/sanitize.py (fp8_blocked_dense_bf16, invalid_fp8_blocked_*: the wrapper's MXFP8 cases),
tests/test_fuzz_gpu.py (MXFP8 tensor2d specs without global scales through the wrapper). Not
yet under the soak run.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T

from ..scales import ATOM_BYTES, ATOM_ROWS
from .config import ProblemConfig, ceil_div
from .entry import ScaledEntryPoints
from .quantize import (GroupedQuantizer, QuantizeConfig, ld_global_words, owner_of,
                       st_global_v4)
from .sm90_bf16 import Sm90GroupedWgrad

DEQ_THREADS = 256
#: Tokens one dequantize thread converts in a row: an 8-byte load and a 16-byte store, so that
#: a warp's load and store instructions each cover one contiguous span (256 and 512 bytes).
THREAD_TOKENS = 8
#: Rows one dequantize CTA converts (each thread: the same 8 tokens of each row, the rows'
#: loads in flight together).
ROWS_PER_CTA = 8
GROUP_TOKENS = 32
#: The expert table's offset past the BF16 kernel's workspace (128-byte aligned), and the
#: unused tile-table row the quantizers' prep kernel is given.
TABLE_ALIGN = 128


def _asm(result, args, asm: str, constraints: str, side_effects: bool = False):
    return llvm.inline_asm(result, [a.ir_value() for a in args], asm, constraints,
                           has_side_effects=side_effects, is_align_stack=False,
                           asm_dialect=llvm.AsmDialect.AD_ATT)


def ld_global_u8(address: Int64) -> Int32:
    """One byte (zero-extended) from global memory (read-only path)."""
    return Int32(_asm(T.i32(), [Int64(address)],
                      "{\n\t.reg .b16 v;\n\tld.global.nc.u8 v, [$1];\n\tcvt.u32.u16 $0, v;\n\t}",
                      "=r,l"))


def e8m0_bits(code: Int32) -> Int32:
    """FP32 bits of 2^(code-127) for an E8M0 code (0..255): the code in FP32's exponent field;
    0x00 is 2^-127 (the denormal 0x00400000) and 0xFF NaN (0x7FC00000), as in
    kernels/sm90_fp8.py (e8m0_byte_value)."""
    bits = (code & 0xFF) << 23
    special = Int32(bits == 0) | Int32(bits == 0x7F800000)
    return bits | (special << 22)


def fp8x4_to_bf16x4(word: Int32, scale: Int32, elem: str):
    """Four FP8 codes (``word``, the first in the low byte) times the FP32 ``scale`` (bits) as
    two words of BF16 pairs (the first value in the low half): exact conversion to FP32
    (through f16x2), one exact power-of-two ``mul.rn.f32`` (denormals kept), one rounding
    ``cvt.rn.bf16x2.f32``."""
    kind = "e4m3x2" if elem == "e4m3" else "e5m2x2"
    words = llvm.inline_asm(
        llvm.StructType.get_literal([T.i32()] * 2), [Int32(word).ir_value(), Int32(scale).ir_value()],
        "{\n\t.reg .b16 lo, hi, h0, h1, h2, h3;\n\t.reg .b32 p01, p23;\n\t"
        ".reg .f32 s, f0, f1, f2, f3;\n\t"
        "mov.b32 {lo, hi}, $2;\n\tmov.b32 s, $3;\n\t"
        f"cvt.rn.f16x2.{kind} p01, lo;\n\tcvt.rn.f16x2.{kind} p23, hi;\n\t"
        "mov.b32 {h0, h1}, p01;\n\tmov.b32 {h2, h3}, p23;\n\t"
        "cvt.f32.f16 f0, h0;\n\tcvt.f32.f16 f1, h1;\n\tcvt.f32.f16 f2, h2;\n\t"
        "cvt.f32.f16 f3, h3;\n\t"
        "mul.rn.f32 f0, f0, s;\n\tmul.rn.f32 f1, f1, s;\n\tmul.rn.f32 f2, f2, s;\n\t"
        "mul.rn.f32 f3, f3, s;\n\t"
        "cvt.rn.bf16x2.f32 $0, f1, f0;\n\tcvt.rn.bf16x2.f32 $1, f3, f2;\n\t}",
        "=r,=r,r,r", has_side_effects=False, is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT)
    return [Int32(llvm.extractvalue(T.i32(), words, [i])) for i in range(2)]


def gemm_config(cfg: ProblemConfig) -> ProblemConfig:
    """The BF16 kernel's config of a two-pass MXFP8 config: BF16 K-major operands, no scales,
    the MXFP8 token-count multiple and the scale tensors' capacity checked by its prep kernel
    (``checked_scales``; two launches), so that its verdict is the FP8 call's."""
    import dataclasses

    return dataclasses.replace(cfg, ab_dtype="bfloat16", b_dtype="", scale_recipe="",
                               checked_scales=cfg.scale_recipe, has_global_scale=False)


def table_offset(cfg: ProblemConfig) -> int:
    """Byte offset of the expert table in the workspace (past the BF16 kernel's)."""
    return ceil_div(gemm_config(cfg).workspace_bytes, TABLE_ALIGN) * TABLE_ALIGN


def copies_offset(cfg: ProblemConfig) -> int:
    """Byte offset of the BF16 copy of A (the expert table and one tile-table row before)."""
    return ceil_div(table_offset(cfg) + 16 * cfg.num_experts + 32, TABLE_ALIGN) * TABLE_ALIGN


def workspace_base(cfg: ProblemConfig) -> int:
    """Workspace bytes besides the BF16 copies."""
    return copies_offset(cfg)


def workspace_per_token(cfg: ProblemConfig) -> int:
    """Workspace bytes per token of a call: the BF16 copies of A and B (2 bytes a value)."""
    return 2 * (cfg.hidden + cfg.intermediate)


def dequant_problem(cfg: ProblemConfig):
    """(argument, detail) when the two-pass path cannot run ``cfg``, else None (the BF16
    kernel's own predicate follows)."""
    for name, dtype in (("a_tensor", cfg.ab_dtype), ("b_tensor", cfg.b_dtype or cfg.ab_dtype)):
        if dtype not in ("float8_e4m3fn", "float8_e5m2"):
            return name, f"expected float8_e4m3fn or float8_e5m2 (MXFP8), got {dtype}"
    if cfg.scale_recipe != "blocked" or cfg.sf_vec != 32:
        return ("scale_recipe", f"expected blocked E8M0 scales per 32 tokens (MXFP8) for "
                                f"mainloop=2, got {cfg.scale_recipe!r} / sf_vec {cfg.sf_vec}")
    if cfg.has_global_scale:
        return ("global_scale_a", "no global scales with mainloop=2 (the promoting kernel, "
                                  "mainloop=1, takes them)")
    if cfg.input_order != "tensor2d" or "k" != cfg.a_major or "k" != cfg.b_major:
        return ("input_order", "K-major tensor2d operands with mainloop=2, got "
                               f"{cfg.input_order} {cfg.a_major}/{cfg.b_major}-major")
    if cfg.launches != 2:
        return ("launches", "expected 2 with mainloop=2 (the BF16 kernel's prep kernel checks the "
                            f"scale tensors' capacity), got {cfg.launches}")
    if cfg.count_multiple % GROUP_TOKENS:
        return "offsets", f"counts multiples of 32, got {cfg.count_multiple}"
    return None


class Sm90DequantGroupedWgrad(ScaledEntryPoints):
    """The two-pass MXFP8 GEMM of one ProblemConfig (FP8 operands, blocked scales): the
    compiled entry takes the block-scaled signature (ScaledEntryPoints)."""

    def __init__(self, cfg: ProblemConfig):
        problem = dequant_problem(cfg)
        if problem is not None:
            raise ValueError(f"{problem[0]}: {problem[1]}")
        self.cfg = cfg
        self.gemm = Sm90GroupedWgrad(gemm_config(cfg))
        # The workspace rule (backends/_cutedsl.py keeps it with the compiled kernel).
        self.workspace_base = workspace_base(cfg)
        self.workspace_per_token = workspace_per_token(cfg)
        self.elem_a = "e4m3" if cfg.ab_dtype == "float8_e4m3fn" else "e5m2"
        self.elem_b = "e4m3" if (cfg.b_dtype or cfg.ab_dtype) == "float8_e4m3fn" else "e5m2"
        # The quantizers' prep kernel builds the expert table (ranges, S_e, C_e).
        self.prep = GroupedQuantizer(QuantizeConfig(
            channels=cfg.hidden, num_experts=cfg.num_experts, recipe="blocked",
            elem="e4m3", sf_vec=GROUP_TOKENS, count_multiple=cfg.count_multiple))

    @classmethod
    def can_implement(cls, cfg: ProblemConfig):
        return dequant_problem(cfg) or Sm90GroupedWgrad.can_implement(gemm_config(cfg))

    @cute.jit
    def launch(self, a_ptr, b_ptr, offsets_ptr, c_ptr, workspace_ptr, status_ptr, tokens_sum,
               grid_size, stream, scales):
        sfa_ptr, sfb_ptr, _, _, sf_capacity = scales  # no global scales (dequant_problem)
        cfg = self.cfg
        ws = workspace_ptr.toint()
        table_ptr = cute.make_ptr(Int32, ws + table_offset(cfg), cute.AddressSpace.gmem,
                                  assumed_align=16)
        offsets = cute.make_tensor(offsets_ptr, cute.make_layout(cfg.num_experts))
        experts = cute.make_tensor(table_ptr, cute.make_layout(4 * cfg.num_experts))
        unused = cute.make_tensor(table_ptr + 4 * cfg.num_experts, cute.make_layout(8))
        self.prep.prep_kernel(offsets, experts, experts, unused, tokens_sum, Int32(0)).launch(
            grid=(1, 1, 1), block=(512, 1, 1), stream=stream)
        a16 = ws + copies_offset(cfg)
        b16 = a16 + Int64(tokens_sum) * (2 * cfg.hidden)
        span = THREAD_TOKENS * DEQ_THREADS
        spans = (tokens_sum + (span - 1)) // span
        spans = spans + Int32(spans == 0)  # a grid of at least one CTA (0 tokens: no rows)
        for rows, src, dst, sf, elem in ((cfg.hidden, a_ptr, a16, sfa_ptr, self.elem_a),
                                         (cfg.intermediate, b_ptr, b16, sfb_ptr, self.elem_b)):
            self.dequant_kernel(src.toint(), sf.toint(), dst, experts, tokens_sum, sf_capacity,
                                rows, elem).launch(
                grid=(spans, ceil_div(rows, ROWS_PER_CTA), 1),
                block=(DEQ_THREADS, 1, 1), stream=stream)
        a_bf16 = cute.make_ptr(cutlass.BFloat16, a16, cute.AddressSpace.gmem, assumed_align=16)
        b_bf16 = cute.make_ptr(cutlass.BFloat16, b16, cute.AddressSpace.gmem, assumed_align=16)
        self.gemm.launch(a_bf16, b_bf16, offsets_ptr, c_ptr, workspace_ptr, status_ptr,
                         tokens_sum, grid_size, stream, sf_capacity=sf_capacity)

    @cute.kernel
    def dequant_kernel(self, src: Int64, sf: Int64, dst: Int64, experts: cute.Tensor,
                       tokens_sum: Int32, sf_capacity: Int32, rows: cutlass.Constexpr,
                       elem: cutlass.Constexpr):
        """BF16 (rows, T) = FP8 (rows, T) times its E8M0 scales (module doc)."""
        cfg = self.cfg
        tid = cute.arch.thread_idx()[0]
        bx, by, _ = cute.arch.block_idx()
        t0 = (bx * DEQ_THREADS + tid) * THREAD_TOKENS
        mpad = ceil_div(rows, ATOM_ROWS) * ATOM_ROWS
        if t0 < tokens_sum:
            lo = owner_of(experts, 4, cfg.num_experts, t0)  # the expert owning token t0
            begin = experts[4 * lo]
            end = experts[4 * lo + 1]
            s_e = experts[4 * lo + 2]
            c_e = experts[4 * lo + 3]
            owned = Int32(begin <= t0) & Int32(t0 < end)
            j = (t0 - begin) >> 5
            limit = Int64(mpad) * Int64(sf_capacity)
            col_base = Int64(mpad) * Int64(s_e)
            for r in cutlass.range_constexpr(ROWS_PER_CTA):
                m = by * ROWS_PER_CTA + r
                if m < rows:
                    offset = (col_base + ATOM_BYTES * ((m >> 7) * (c_e >> 2) + (j >> 2))
                              + 16 * (m & 31) + 4 * ((m >> 5) & 3) + (j & 3))
                    code = Int32(0)
                    if owned != 0 and offset < limit:
                        code = ld_global_u8(sf + offset)
                    scale = e8m0_bits(code) * owned  # 0.0 outside every expert
                    index = Int64(m) * Int64(tokens_sum) + Int64(t0)
                    words = ld_global_words(src + index, 2)
                    out = (fp8x4_to_bf16x4(words[0], scale, elem)
                           + fp8x4_to_bf16x4(words[1], scale, elem))
                    st_global_v4(dst + 2 * index, out[0], out[1], out[2], out[3])
