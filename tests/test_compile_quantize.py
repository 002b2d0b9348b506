"""The grouped quantizers (kernels/quantize.py) compile without a GPU for sm_90a and sm_100a in
every format and element type, and their PTX holds what bit-exactness with gwgrad/formats.py
rests on: FP8 codes by ``cvt.rn.satfinite``, FP32 arithmetic rounded to nearest even with no
flush to zero and no approximate division, 16-byte code stores, byte stores of blocked scales;
a prep kernel building the call's tile table, and for the two-pass formats (per_expert_channel,
NVFP4) an amax pass combining the experts' amaxes with a global atomic max before the
quantizing pass. Configurations no kernel implements are refused with the argument named;
ptxas (when installed) assembles the PTX without spilling."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

pytest.importorskip("cutlass")

from gwgrad import quantizers as Q  # noqa: E402
from gwgrad.errors import ArgumentError  # noqa: E402
from gwgrad.kernels.quantize import QuantizeConfig, problem  # noqa: E402
from kernel_compile import private_dump_dir  # noqa: E402

ARCHS = ["sm_90a", "sm_100a"]
CASES = [(fmt, elem) for fmt, f in Q.FORMATS.items() for elem in f.elems]
# Neither a multiple of 64 (a partial channel block) nor of 128 (blocked scale padding rows).
CHANNELS, EXPERTS = 200, 7
TWO_PASS = {"per_expert_channel", "nvfp4"}
FP32_RECIPES = {"per_expert_channel", "block_1x128"}
BLOCKED = {fmt for fmt, f in Q.FORMATS.items() if f.recipe == "blocked"}
#: The amax record of the two-pass formats: non-negative FP32 bits ordered as integers.
ATOM_MAX = "atom.global.max.s32"


@pytest.fixture(scope="module")
def ptx_of():
    """PTX of (fmt, elem, arch), each compiled once for the module (~0.5 s a compile)."""
    cache = {}

    def get(fmt, elem, arch):
        key = (fmt, elem, arch)
        if key not in cache:
            cfg = Q.kernel_config(fmt, elem, CHANNELS, EXPERTS)
            with private_dump_dir() as options:
                ptx = Q.compile_quantizer(cfg, arch, options).artifacts.PTX
            assert ptx and ".entry" in ptx
            cache[key] = ptx
        return cache[key]

    return get


def entries(ptx):
    """{kernel name: body} of every ``.entry`` of the PTX."""
    return {chunk.split("(", 1)[0].strip(): chunk for chunk in ptx.split(".entry ")[1:]}


def kernels_of(ptx):
    """(prep body, amax pass body or None, quantizing pass body), by kernel name."""
    bodies = entries(ptx)
    prep = [b for name, b in bodies.items() if "prep_kernel" in name]
    amax = [b for name, b in bodies.items() if "amax_kernel" in name]
    quant = [b for name, b in bodies.items() if "tile_kernel" in name]
    assert len(prep) == 1 and len(quant) == 1 and len(amax) <= 1, sorted(bodies)
    assert len(prep) + len(amax) + len(quant) == len(bodies), sorted(bodies)
    return prep[0], (amax[0] if amax else None), quant[0]


def global_stores(body):
    """The kinds of global stores, u8 / s8 counted as b8 and u32 / s32 as b32."""
    kinds = set(re.findall(r"\bst\.global((?:\.[a-z0-9]+)*)\s", body))
    return {re.sub(r"\.[us](8|16|32|64)$", r".b\1", k) for k in kinds}


@pytest.mark.compile
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("fmt,elem", CASES)
def test_kernels_and_targets(ptx_of, fmt, elem, arch):
    """A prep kernel (the tile table; zeroing the amax records of the two-pass formats), then
    the amax pass (two-pass formats) and the quantizing pass: 3 kernels or 2."""
    ptx = ptx_of(fmt, elem, arch)
    assert re.search(rf"^\.target\s+{arch}\b", ptx, re.M)
    assert len(entries(ptx)) == (3 if fmt in TWO_PASS else 2), sorted(entries(ptx))
    _, amax, _ = kernels_of(ptx)
    assert (amax is not None) == (fmt in TWO_PASS)


@pytest.mark.compile
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("fmt,elem", CASES)
def test_conversions(ptx_of, fmt, elem, arch):
    ptx = ptx_of(fmt, elem, arch)
    cvts = set(re.findall(r"cvt\.rn\.satfinite\.(\w+)\.f32", ptx))
    if elem in ("e4m3", "e5m2"):
        assert cvts == {f"{elem}x2"}, cvts  # nearest even, saturating, NaN to 0x7F
        assert f"cvt.rn.satfinite.{elem}x2.f32" in ptx
    elif fmt == "nvfp4":
        # E4M3 scale codes, and their values back through FP16 (exact)
        assert cvts == {"e4m3x2"}, cvts
        assert "cvt.rn.f16x2.e4m3x2" in ptx
    else:  # MXFP4: E2M1 codes in software (no E2M1 cvt before sm_100a)
        assert not cvts, cvts


def instructions(body):
    """The instructions of a kernel body (no directives, labels, braces or comments)."""
    lines = (line.strip() for line in body.splitlines())
    return [line for line in lines if line and ";" in line and not line.startswith(
        ("//", ".", "{", "}", "$")) and not line.endswith(":")]


@pytest.mark.compile
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("fmt,elem", CASES)
def test_values_from_bf16_by_prmt(ptx_of, fmt, elem, arch):
    """Each of a thread's 32 values is its BF16 half of a shared word moved to the top by one
    ``prmt`` (zeros below); MXFP4 pairs two tokens' halves of the channel by one ``prmt``
    (and takes the signs of a word's 8 codes by 2 more)."""
    _, _, quant = kernels_of(ptx_of(fmt, elem, arch))
    assert len(re.findall(r"\bprmt\.b32\b", quant)) == (16 + 8 if fmt == "mxfp4" else 32)


@pytest.mark.compile
@pytest.mark.parametrize("arch", ARCHS)
def test_mxfp4_packed_path(ptx_of, arch):
    """MXFP4 quantizes BF16 pairs (e2m1x8_bf16x2; tests/test_e2m1_rounding.py emulates it on
    every BF16 pattern and scale): per pair one abs / mul.rn / min / max / fma.rn on bf16x2
    and the code by one ``mad.hi.s32`` (an integer multiply-add: the FMA pipe), packed by
    ``mad.lo`` (3 a word); per word the signs by 2 ``prmt`` and 2 ``lop3``; the block amax
    by 16-bit maxima. No FP32 rounding of values and no funnel shifts; the kernel stays
    within 2 PTX instructions a value of MXFP8's."""
    _, _, quant = kernels_of(ptx_of("mxfp4", "e2m1", arch))
    ops = ("mul.rn.bf16x2", "abs.bf16x2", "min.bf16x2", "max.bf16x2", "fma.rn.bf16x2",
           "mad.hi.s32", "mad.lo.u32", "max.u16x2", "max.s16x2", "mul.rn.f32",
           "fma.rn.f32", "min.f32", "max.f32", "shf.l.wrap.b32", "mad.hi.u32")
    count = {op: len(re.findall(rf"^\s*{re.escape(op)}\s", quant, re.M)) for op in ops}
    for op in ops[:6]:
        assert count[op] == 16, count
    assert count["mad.lo.u32"] == 12, count
    assert count["max.u16x2"] == 15 and count["max.s16x2"] == 16, count
    for op in ops[9:]:
        assert count[op] == 0, count
    assert len(re.findall(r"^\s*prmt\.b32\s.*0xFBD9;", quant, re.M)) == 8
    _, _, fp8 = kernels_of(ptx_of("mxfp8", "e4m3", arch))
    extra = len(instructions(quant)) - len(instructions(fp8))
    assert extra <= 2 * 32, extra


@pytest.mark.compile
@pytest.mark.parametrize("arch", ARCHS)
def test_nvfp4_fast_path(ptx_of, arch):
    """NVFP4's E2M1 codes by e2m1x8 (tests/test_e2m1_rounding.py emulates it on every FP32
    pattern): per value min / max on FP32, one fma rounding 2t / E against 2**23, the code by
    one ``mad.hi`` and packed by one ``mad.lo`` (integer multiply-adds: the FMA pipe, not the
    integer / logic pipe that bounds the kernel), the sign by one funnel shift; no per-value
    NaN test; the per-value e2m1_code for blocks with an infinite multiplier (one fma
    each)."""
    _, _, quant = kernels_of(ptx_of("nvfp4", "e2m1", arch))
    count = {op: len(re.findall(rf"^\s*{re.escape(op)}\s", quant, re.M))
             for op in ("shf.r.wrap.b32", "shf.l.wrap.b32", "min.f32", "max.f32", "abs.f32",
                        "fma.rn.f32", "lop3.b32", "mad.hi.s32", "mad.lo.u32")}
    assert count["shf.l.wrap.b32"] == 32 and count["shf.r.wrap.b32"] == 0, count
    assert count["min.f32"] == count["max.f32"] == count["abs.f32"] == 32, count
    assert count["mad.hi.s32"] == 32 and count["mad.lo.u32"] == 28, count  # 7 a word
    assert count["lop3.b32"] == 4, count  # one per word: the signs into the codes
    assert count["fma.rn.f32"] == 64, count


@pytest.mark.compile
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("fmt,elem", CASES)
def test_ieee_fp32_arithmetic(ptx_of, fmt, elem, arch):
    """FP32 steps are IEEE operations rounded to nearest even with subnormals kept (the NumPy
    float32 model): no .ftz anywhere, nothing approximate, no FP32 operation without an
    explicit rounding (ptxas may contract a plain mul + add into an FMA)."""
    ptx = ptx_of(fmt, elem, arch)
    assert ".ftz" not in ptx
    for op in ("div.approx", "div.full", "rcp.approx", "ex2.approx", "lg2.approx", "mad.f32"):
        assert op not in ptx, op
    arith = re.findall(r"\b(?:add|sub|mul|div|fma)(?:\.[a-z0-9]+)*\.(?:f32|bf16x2)\b", ptx)
    assert arith and all(".rn." in op for op in arith), sorted(set(arith))
    if fmt == "mxfp4":  # BF16 pairs times a power of two (exact), no FP32 arithmetic
        assert not [op for op in arith if op.endswith(".f32")], sorted(set(arith))
        assert "mul.rn.bf16x2" in ptx and "fma.rn.bf16x2" in ptx
    else:
        assert "mul.rn.f32" in ptx  # values times the reciprocal of their scale
    if fmt in FP32_RECIPES or fmt == "nvfp4":
        assert "div.rn.f32" in ptx  # amax / fmax (or / 2688, / 6g) and 1 / scale
    else:  # MX: the scale is a power of two built from the amax's exponent bits
        assert "div." not in ptx


@pytest.mark.compile
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("fmt,elem", CASES)
def test_stores(ptx_of, fmt, elem, arch):
    """The quantizing pass stores codes as 16-byte vectors, blocked scale codes as bytes and
    FP32 scales (and NVFP4's global scales) as words; the amax pass stores nothing."""
    prep, amax, quant = kernels_of(ptx_of(fmt, elem, arch))
    stores = global_stores(quant)
    expected = {".v4.b32"}
    if fmt in BLOCKED:
        expected.add(".b8")
    if fmt in FP32_RECIPES or fmt == "nvfp4":
        expected.add(".b32")
    assert stores == expected, stores
    assert global_stores(prep) == {".b32"}  # the tile table (and zeroed amax records)
    if amax is not None:
        assert not global_stores(amax)


@pytest.mark.compile
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("fmt,elem", CASES)
def test_amax_pass(ptx_of, fmt, elem, arch):
    ptx = ptx_of(fmt, elem, arch)
    atoms = set(re.findall(r"\b(?:atom|red)\.[\w.]+", ptx))
    if fmt not in TWO_PASS:
        assert not atoms, atoms
        return
    assert atoms == {ATOM_MAX}, atoms
    # Only the amax pass combines amaxes; the quantizing pass reads the records.
    prep, amax, quant = kernels_of(ptx)
    assert ATOM_MAX in amax
    assert ATOM_MAX not in quant and ATOM_MAX not in prep


# --- configurations no kernel implements --------------------------------------------------------

def _config(**kw):
    base = dict(channels=64, num_experts=4, recipe="blocked", elem="e4m3", sf_vec=32,
                count_multiple=32)
    base.update(kw)
    return QuantizeConfig(**base)


BAD = [
    ("e2m1, per_expert_channel", dict(recipe="per_expert_channel", elem="e2m1", sf_vec=0,
                                      count_multiple=16), "elem"),
    ("e2m1, block_1x128", dict(recipe="block_1x128", elem="e2m1", sf_vec=128,
                               count_multiple=16), "elem"),
    ("blocked sf_vec 64", dict(elem="e2m1", sf_vec=64), "sf_vec_size"),
    ("blocked sf_vec 128", dict(sf_vec=128), "sf_vec_size"),
    ("blocked sf_vec 0", dict(sf_vec=0), "sf_vec_size"),
    ("FP8 with sf_vec 16", dict(sf_vec=16), "sf_vec_size"),
    ("channels 100", dict(channels=100), "x"),
    ("channels 0", dict(channels=0), "x"),
    ("elem int8", dict(elem="int8"), "elem"),
    ("unknown recipe", dict(recipe="per_tensor"), "scale_recipe"),
    ("blocked, counts of 16", dict(count_multiple=16), "offsets"),
    ("no experts", dict(num_experts=0), "offsets"),
]


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_unsupported_configs_are_refused(case):
    _, kw, argument = case
    cfg = _config(**kw)
    found = problem(cfg)
    assert found is not None and found[0] == argument, found
    with pytest.raises(ArgumentError) as err:
        Q.compile_quantizer(cfg, "sm_90a")
    assert err.value.argument == argument
    assert isinstance(err.value, ValueError)


@pytest.mark.parametrize("fmt,elem", CASES)
def test_every_format_config_is_supported(fmt, elem):
    for channels in (8, 200, 4096):
        assert problem(Q.kernel_config(fmt, elem, channels, 1)) is None


# --- ptxas ---------------------------------------------------------------------------------------

# NVFP4: three kernels, the most FP32 divisions; 1x128: the tightest register budget (its
# cross-quarter amax keeps the 32 values live under 3 CTAs per SM); MXFP4: the packed path.
@pytest.mark.compile
@pytest.mark.parametrize("fmt,elem", [("nvfp4", "e2m1"), ("block_1x128", "e4m3"),
                                      ("mxfp4", "e2m1")])
@pytest.mark.parametrize("arch", ARCHS)
def test_ptxas_assembles_without_spills(ptx_of, fmt, elem, arch, tmp_path):
    ptxas = shutil.which("ptxas")
    if ptxas is None:
        pytest.skip("ptxas is not on PATH")
    ptx = ptx_of(fmt, elem, arch)
    src = tmp_path / "quantize.ptx"
    src.write_text(ptx)
    done = subprocess.run([ptxas, f"-arch={arch}", "-v", str(src), "-o",
                           str(tmp_path / "quantize.cubin")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    report = done.stdout + done.stderr
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    assert len(spills) == len(entries(ptx)), report[-2000:]
    assert all(s == ("0", "0") for s in spills), report[-2000:]
    registers = [int(r) for r in re.findall(r"Used (\d+) registers", report)]
    assert registers and max(registers) <= 255, registers


# --- through gwgrad.plan: one compiled operator, kept on disk -----------------------------------

@pytest.mark.compile
def test_the_plan_compiles_once_and_finds_it_on_disk(tmp_path, monkeypatch):
    """gwgrad.plan's quantizer operator compiles the kernel once (gwgrad.kernel_cache), keeps
    its workspace rule with it, and a process that finds it on disk (memory cleared here)
    gets the same rule without compiling."""
    from gwgrad import kernel_cache, plan
    from gwgrad.kernels import compiler

    monkeypatch.setenv("GWGRAD_CACHE_DIR", str(tmp_path))
    kernel_cache.clear_memory()
    plan.clear_cache()
    request = Q.request("nvfp4", "e2m1", CHANNELS, EXPERTS, "sm_100a")
    cfg = Q.kernel_config("nvfp4", "e2m1", CHANNELS, EXPERTS)
    before = compiler.compile_count
    try:
        op = plan.compile_quantizer(request)
        assert plan.compile_quantizer(request) is op and compiler.compile_count == before + 1
        plan.clear_cache()
        kernel_cache.clear_memory()
        stats = kernel_cache.stats()
        again = plan.compile_quantizer(request)
        assert again is not op and compiler.compile_count == before + 1
        assert kernel_cache.stats()["disk_hits"] == stats["disk_hits"] + 1
        for tokens in (0, 32, 1000, 65536):
            assert again.workspace_bytes(tokens) == cfg.workspace_bytes(tokens)
            assert again.tile_bound(tokens) == cfg.tile_bound(tokens)
    finally:
        plan.clear_cache()
        kernel_cache.clear_memory()
