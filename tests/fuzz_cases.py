"""Seeded fuzz cases for the grouped weight-gradient GEMMs (issue #13), and the one runner that
executes and checks them (the GPU fuzz test, tools/sanitize.py and the CPU tests share it).

A *case* is one static spec (everything a kernel compile bakes in: dims, experts, majors,
input order, output mode and dtype, accumulate, tiling, FP8 recipe / formats / global scales)
plus one *draw* (one call: token counts, entry point, data seed, maybe invalid offsets). The
generator is pure Python / NumPy: importing this module needs neither torch nor a GPU; torch is
imported by the runner only (``run_case`` / ``run_all`` / ``run_quantize_case``).

What a default run covers (``tests/test_fuzz_cases.py`` asserts it for fixed master seeds and
the test's random one; the slot plan below makes it hold for any seed):

* BF16 specs: hidden / intermediate multiples of 8 from 8 to 4096, log-uniform (skewed small),
  about 60% not multiples of 128; 1..512 experts; every (a_major, b_major) of ("m"|"k",
  "n"|"k"); tensor2d / tensor_ragged; dense / discrete outputs; bf16 / fp16 / fp32 outputs;
  accumulate on / off; the default tiling and every SM90 tile (cooperative 128x256, 256x128;
  pingpong 128x192, 192x128, 128x128, 64x256, 64x128), with CTA pairs (1x2, 2x1) on every
  other spec of the tiles that run them (SM90_BF16_CLUSTERS).
* FP8 specs (K-major operands only): the SM90 recipes ``per_expert_channel``, ``block_1x128`` and
  MXFP8 ``blocked``; e4m3 / e5m2 (mixed for the FP32 recipes); with and without global scales;
  every SM90 FP8 tile; operands drawn directly (random codes and scales) or produced by
  ``gwgrad.quantize`` from BF16 ``x`` / ``dy`` (one spec per recipe).
* Draws: token counts including zeros, all-empty calls, one-hot (every token in one expert),
  counts that are not multiples of 8 / 128 (only multiples of the spec's
  ``gwgrad.token_count_multiple``: 1, 8 with a K-major operand, 16 for the FP32 recipes, 32 for
  blocked scales), huge experts (up to 65536 tokens), zipf / sparse / uniform splits; entry
  points: the contract's wrapper, the ``GroupedGemmWgrad`` class (one operator per spec, reused
  across draws with other tokens_sum) and the torch adapter (``wgrad`` / ``wgrad_fp8`` /
  ``quantize``); ``validate_offsets=True`` on some; and 2 draws in 12 have invalid offsets
  (decreasing, last != tokens_sum, a count not a multiple, scale tensors too small), which must
  write nothing and be reported (at once, or by ``gwgrad.check_errors()``).

Cost bounds (a GPU compile costs 2-3 s per distinct spec): at most ``MAX_SPECS`` specs, about
``DRAWS_PER_SPEC`` draws each; per case E*hidden*intermediate <= 8 Mi elements, hidden *
intermediate <= 4 Mi, operands <= 64 MiB; the FP64 reference is computed one expert at a time in
token chunks, so a case holds a few hundred MB at most.

Seeds: ``GWGRAD_FUZZ_SEED`` picks the run's master seed (default: random, printed);
``GWGRAD_FUZZ_CASES`` the number of cases (default 500); a spec's fields and each draw derive
from (master seed, spec index, draw index) only, so ``GWGRAD_FUZZ_ONLY=s07d03`` (comma
separated case ids, or spec ids such as ``s07``) replays single cases of a run whatever its size,
and ``GWGRAD_FUZZ_SKIP`` leaves cases out (triage after a case that kills the CUDA context).
Each case logs its own data seed.

Checks (``run_case``): outputs are NaN-poisoned (random values when accumulating) inside guard
bytes on both sides (discrete outputs: one slot per expert, in shuffled order, each between
guards); after the call the guards must be bit-unchanged, and every expert must match a float64
reference of the dequantized inputs: relative Frobenius error <= ``rel_tol`` (1e-2 for 16-bit
outputs; for FP32: 2e-3 with FP8 inputs, as the existing GPU tests use, and with BF16 inputs
max(1e-5, 2.5e-9 K), K the largest expert's tokens: the H200's tensor-core FP32 accumulation
drifts linearly in K, 1.2e-9 K measured) and, per element, ``|got - ref| <= 2u(|ref| + |product|) + elem_tol
* rms(ref)`` (u: the output's unit roundoff; elem_tol: 30x the FP32 tolerance), which catches a
few wrong elements that the Frobenius norm would average away. Invalid offsets: the whole output
buffer must keep every byte and the error must name ``offsets_tensor`` (or ``sfa_tensor`` for
too-small scales). A valid call that the device check flags, or any exception, fails the case.

Re-run: ``python -m pytest -q tests/test_fuzz_gpu.py`` on an SM90 GPU (see its header for the
environment variables); ``python -m pytest -q tests/test_fuzz_cases.py`` on any machine (the
generator's guarantees, and generated cases through this runner on the CPU reference backend);
``python tools/sanitize.py`` (compute-sanitizer over fixed cases built with these types).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
import secrets
import time
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

import numpy as np

# --- bounds --------------------------------------------------------------------------------------

MAX_SPECS = 44  # distinct static specs (kernel compiles) in a run, at most
DRAWS_PER_SPEC = 12  # calls per spec in a default run (500 cases -> 42 specs)
DEFAULT_CASES = 500
OUT_ELEMS_CAP = 8 << 20  # experts * hidden * intermediate
HN_CAP = 4 << 20  # hidden * intermediate
IN_BYTES_CAP = 64 << 20  # bytes of A + B (and of the BF16 x, dy of a quantize draw)
TOKENS_CAP = 65536
MAX_DIM = 4096

# --- vocabularies ---------------------------------------------------------------------------------

OUT_DTYPES = ("bfloat16", "float16", "float32")
BF16_MAJORS = (("m", "n"), ("k", "n"), ("m", "k"), ("k", "k"))
ORDERS = ("tensor2d", "tensor_ragged")
MODES = ("dense", "discrete")
RECIPES = ("per_expert_channel", "block_1x128", "blocked")
FP32_RECIPES = ("per_expert_channel", "block_1x128")
FP8_FORMATS = ("e4m3", "e5m2")
#: gwgrad/kernels/tiling.py's SM90_TILES / SM90_FP8_TILES (a CPU test keeps them equal).
SM90_BF16_TILES = ((128, 256), (256, 128), (128, 192), (192, 128), (128, 128), (64, 256),
                   (64, 128))
SM90_FP8_TILES = ((128, 128), (128, 192), (64, 128), (64, 192))
#: SM90 BF16 tiles -> the CTA clusters the fuzz gives every other spec of that tile in turn
#: (the pairs tests/test_sm90_kernel_gpu.py runs; a cluster's unit is its CTAs' tiles side
#: by side, so small outputs put a CTA's part past the output).
SM90_BF16_CLUSTERS = {(128, 256): ((1, 2), (2, 1)), (128, 128): ((1, 2), (2, 1)),
                      (128, 192): ((1, 2), (2, 1)), (192, 128): ((1, 2), (2, 1))}
DISTS = ("random", "uniform", "zipf", "one_hot", "sparse", "unaligned", "huge", "tiny",
         "all_empty")
INVALID_KINDS = ("decreasing", "last", "multiple", "scales")
ENTRIES = ("wrapper", "class", "adapter")
EXPERT_CATS = ("few", "one", "some", "many", "few", "some")
#: gwgrad.quantize's format for a GEMM scale recipe.
QUANTIZE_FMT = {"per_expert_channel": "per_expert_channel", "block_1x128": "block_1x128",
                "blocked": "mxfp8"}
SF_VEC = {"per_expert_channel": 16, "block_1x128": 128, "blocked": 32}


def derive_seed(master: int, *path: Any) -> int:
    """A 48-bit seed for ``path`` under ``master`` (stable across platforms and versions)."""
    text = "/".join(str(p) for p in ("gwgrad-fuzz", int(master)) + tuple(path))
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:6], "little")


def _rng(master: int, *path: Any) -> np.random.Generator:
    return np.random.default_rng(derive_seed(master, *path))


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


# --- specs and draws ------------------------------------------------------------------------------

@dataclass(frozen=True)
class Spec:
    """The static part of a case: one kernel compile (``key``) on the GPU."""

    index: int
    kind: str  # "bf16" | "fp8"
    hidden: int
    intermediate: int
    experts: int
    a_major: str
    b_major: str
    order: str
    mode: str
    out_dtype: str
    accumulate: bool
    tiling: Optional[Tuple[int, int]]
    recipe: Optional[str] = None
    a_fmt: Optional[str] = None
    b_fmt: Optional[str] = None
    global_scales: bool = False
    source: str = "direct"  # FP8: "direct" codes + scales, or "quantize" (gwgrad.quantize)
    cluster: Optional[Tuple[int, int]] = None  # SM90 BF16 with a tiling: None is (1, 1)

    @property
    def id(self) -> str:
        return f"s{self.index:02d}"

    @property
    def key(self) -> tuple:
        """Everything but the index: equal keys compile the same kernel."""
        return dataclasses.astuple(self)[1:]

    @property
    def count_multiple(self) -> int:
        """gwgrad.token_count_multiple of this spec (a CPU test checks they agree)."""
        if self.kind == "fp8":
            return 32 if self.recipe == "blocked" else 16
        return 8 if "k" in (self.a_major, self.b_major) else 1

    @property
    def granule(self) -> int:
        return 16 if self.kind == "fp8" else 8

    @property
    def entries(self) -> Tuple[str, ...]:
        """Entry points that can express this spec (the adapters take no tiling and no
        input order; the torch FP8 adapter takes the FP32 recipes)."""
        adapter = (self.tiling is None and self.order == "tensor2d"
                   and (self.kind == "bf16" or self.recipe in FP32_RECIPES))
        return ("wrapper", "class") + (("adapter",) if adapter else ())

    @property
    def token_bytes(self) -> int:
        """Operand bytes per token and row of A / B (BF16 x, dy and FP8 codes when quantizing)."""
        if self.kind == "bf16":
            return 2
        return 3 if self.source == "quantize" else 1

    @property
    def max_tokens(self) -> int:
        t = IN_BYTES_CAP // ((self.hidden + self.intermediate) * self.token_bytes)
        m = self.count_multiple
        return max(0, min(TOKENS_CAP, t) // m * m)

    @property
    def name(self) -> str:
        parts = [self.kind, f"{self.hidden}x{self.intermediate}", f"E{self.experts}",
                 f"A{self.a_major}B{self.b_major}", self.order, self.mode,
                 f"out={self.out_dtype}", "acc" if self.accumulate else "overwrite",
                 "tile=" + ("default" if self.tiling is None else "x".join(map(str, self.tiling)))]
        if self.cluster is not None:
            parts.append("cluster=" + "x".join(map(str, self.cluster)))
        if self.kind == "fp8":
            parts += [self.recipe, f"{self.a_fmt}/{self.b_fmt}",
                      "global" if self.global_scales else "no-global", self.source]
        return " ".join(parts)

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["tiling"] = list(self.tiling) if self.tiling else None
        d["cluster"] = list(self.cluster) if self.cluster else None
        return d


@dataclass(frozen=True)
class Draw:
    """One call of a spec: counts (the data layout, tokens_sum), the offsets passed (invalid
    for ``invalid`` draws), the entry point, the data seed."""

    index: int
    seed: int
    dist: str
    counts: Tuple[int, ...]
    offsets: Tuple[int, ...]
    entry: str
    invalid: Optional[str] = None
    expect_error: Optional[str] = None  # the ArgumentError's argument for invalid draws
    validate_offsets: bool = False
    extra_capacity: int = 0  # blocked: extra 4-column groups; block_1x128: extra rows
    capacity: Optional[int] = None  # explicit scale capacity (invalid "scales" draws)
    flat_scales: bool = False  # per_expert_channel: (E*M,) scale tensors
    explicit_blocked: bool = False  # blocked: pass scale_recipe="blocked" (else None)

    @property
    def tokens_sum(self) -> int:
        return int(sum(self.counts))

    def summary(self) -> dict:
        c = np.asarray(self.counts, dtype=np.int64)
        nz = c[c > 0]
        return {"dist": self.dist, "experts": int(c.size), "tokens_sum": int(c.sum()),
                "zeros": int((c == 0).sum()), "max": int(c.max()) if c.size else 0,
                "min_nonzero": int(nz.min()) if nz.size else 0,
                "not_mult_128": int((nz % 128 != 0).sum()), "not_mult_8": int((nz % 8 != 0).sum()),
                "head": [int(x) for x in c[:8]]}


@dataclass(frozen=True)
class Case:
    spec: Spec
    draw: Draw
    master_seed: int

    @property
    def id(self) -> str:
        return f"{self.spec.id}d{self.draw.index:02d}"

    def replay(self) -> str:
        return f"GWGRAD_FUZZ_SEED={self.master_seed} GWGRAD_FUZZ_ONLY={self.id}"


# --- drawing specs --------------------------------------------------------------------------------

def _experts(rng, cat: str) -> int:
    if cat == "one":
        return 1
    if cat == "few":
        return int(rng.integers(2, 9))
    if cat == "some":
        return int(rng.integers(9, 65))
    return int(round(math.exp(rng.uniform(math.log(65), math.log(512)))))


def _dim(rng, g: int, hi: int, lo: int = 0) -> int:
    """A multiple of ``g`` in [max(g, lo), hi], log-uniform; 40% rounded to a multiple of 128."""
    hi = max(g, hi // g * g)
    lo = min(hi, max(g, round_up(lo, g)))
    v = math.exp(rng.uniform(math.log(lo), math.log(hi)))
    if rng.random() < 0.4 and v >= 128 and hi >= 128:
        v = max(128, round(v / 128) * 128)
    else:
        v = round(v / g) * g
    return int(min(hi, max(lo, v)))


def _dims(rng, g: int, experts: int, slot: int) -> Tuple[int, int]:
    cap = min(HN_CAP, OUT_ELEMS_CAP // experts)
    if slot == 1:  # the smallest hidden
        h = g
        return h, _dim(rng, g, min(MAX_DIM, cap // h))
    if slot == 4:  # the smallest intermediate
        n = g
        return _dim(rng, g, min(MAX_DIM, cap // n)), n
    if slot == 2:  # hidden a multiple of 128
        h = max(128, _dim(rng, g, min(MAX_DIM, cap // g)) // 128 * 128)
        return h, _dim(rng, g, min(MAX_DIM, cap // h))
    if slot in (0, 7) and cap >= 2048 * g:  # a large one
        h = _dim(rng, g, min(MAX_DIM, cap // g), lo=2048)
        return h, _dim(rng, g, min(MAX_DIM, cap // h))
    h = _dim(rng, g, min(MAX_DIM, cap // g))
    return h, _dim(rng, g, min(MAX_DIM, cap // h))


def plan_specs(master_seed: int) -> List[Spec]:
    """The ``MAX_SPECS`` spec slots of a run. Slot i is FP8 when i % 3 == 2. The first 16 BF16
    slots take every (a_major, b_major, input order, output mode), the first 12 FP8 slots every
    (recipe, input order, output mode), in a seeded order; output dtype x accumulate, tiles and
    expert-count categories rotate; slots 1 / 4 get the smallest hidden / intermediate, slot 2
    a hidden multiple of 128, slots 0 / 7 a dimension >= 2048; the other fields are random."""
    rng = _rng(master_seed, "specs")
    bf16_combos = [(a, b, o, md) for a, b in BF16_MAJORS for o in ORDERS for md in MODES]
    bf16_combos = [bf16_combos[i] for i in rng.permutation(len(bf16_combos))]
    fp8_combos = [(r, o, md) for r in RECIPES for o in ORDERS for md in MODES]
    fp8_combos = [fp8_combos[i] for i in rng.permutation(len(fp8_combos))]
    specs: List[Spec] = []
    j = i = 0
    quantized: set = set()
    blocked_seen = blocked_2d = fp32_seen = fp8_tiled = bf16_tiled = 0
    clustered = {tile: 0 for tile in SM90_BF16_CLUSTERS}
    untiled_2d: set = set()
    for index in range(MAX_SPECS):
        if index % 3 != 2:
            a, b, order, mode = bf16_combos[j] if j < len(bf16_combos) else bf16_combos[
                int(rng.integers(len(bf16_combos)))]
            experts = 512 if j == 3 else _experts(rng, EXPERT_CATS[j % len(EXPERT_CATS)])
            if j == 7:
                experts = int(rng.integers(2, 5))
            hidden, inter = _dims(rng, 8, experts, j)
            # Odd slots take the SM90 tiles in turn, but the first tensor2d slot of each output
            # mode keeps the default tiling (the torch adapter takes none).
            tiling = None
            if j % 2 == 1 and not (order == "tensor2d" and mode not in untiled_2d):
                tiling = SM90_BF16_TILES[bf16_tiled % len(SM90_BF16_TILES)]
                bf16_tiled += 1
            cluster = None
            if tiling in SM90_BF16_CLUSTERS:  # every other spec of a tile: its clusters in turn
                turn = clustered[tiling]
                clustered[tiling] += 1
                if turn % 2 == 0:
                    options = SM90_BF16_CLUSTERS[tiling]
                    cluster = options[(turn // 2) % len(options)]
            if tiling is None and order == "tensor2d":
                untiled_2d.add(mode)
            specs.append(Spec(
                index=index, kind="bf16", hidden=hidden, intermediate=inter, experts=experts,
                a_major=a, b_major=b, order=order, mode=mode, out_dtype=OUT_DTYPES[j % 3],
                accumulate=bool((j // 3) % 2), tiling=tiling, cluster=cluster))
            j += 1
            continue
        recipe, order, mode = fp8_combos[i] if i < len(fp8_combos) else fp8_combos[
            int(rng.integers(len(fp8_combos)))]
        if recipe == "blocked":
            a_fmt = b_fmt = FP8_FORMATS[blocked_seen % 2] if blocked_seen < 2 else FP8_FORMATS[
                int(rng.integers(2))]
            blocked_seen += 1
        else:
            if fp32_seen < 2:
                a_fmt, b_fmt = (("e4m3", "e5m2"), ("e5m2", "e4m3"))[fp32_seen]
            else:
                a_fmt, b_fmt = (FP8_FORMATS[int(rng.integers(2))] for _ in range(2))
            fp32_seen += 1
        source = "direct"
        if order == "tensor2d" and recipe not in quantized:
            source = "quantize"
            quantized.add(recipe)
        # Odd slots take the FP8 tiles in turn, but the quantize specs keep the default tiling
        # (so that the torch adapter, which takes none, can run the FP32 recipes' ones).
        tiling = None
        if i % 2 == 1 and source == "direct":
            tiling = SM90_FP8_TILES[fp8_tiled % len(SM90_FP8_TILES)]
            fp8_tiled += 1
        experts = 512 if i == 3 else _experts(rng, EXPERT_CATS[i % len(EXPERT_CATS)])
        hidden, inter = _dims(rng, 16, experts, i)
        global_scales = (i % 4) in (1, 2)
        if recipe == "blocked" and order == "tensor2d":
            # Every other MXFP8 tensor2d spec without global scales: the wrapper then runs the
            # two-pass path (its default where it sizes the workspace), the class API the
            # promoting kernel.
            global_scales = blocked_2d % 2 == 1
            blocked_2d += 1
        specs.append(Spec(
            index=index, kind="fp8", hidden=hidden, intermediate=inter, experts=experts,
            a_major="k", b_major="k", order=order, mode=mode, out_dtype=OUT_DTYPES[i % 3],
            accumulate=bool((i // 3) % 2), tiling=tiling,
            recipe=recipe, a_fmt=a_fmt, b_fmt=b_fmt, global_scales=global_scales,
            source=source))
        i += 1
    return specs


# --- drawing calls --------------------------------------------------------------------------------

def _log_uniform_int(rng, lo: int, hi: int) -> int:
    lo, hi = max(1, lo), max(1, hi)
    if hi <= lo:
        return hi
    return int(min(hi, max(lo, round(math.exp(rng.uniform(math.log(lo), math.log(hi + 1)))))))


def _unaligned_count(rng, m: int, q_max: int) -> int:
    """A count that is a multiple of ``m`` but not of 128 (and, for m == 1, not of 8)."""
    q = int(rng.integers(0, max(0, q_max) + 1))
    if m == 1:
        return 8 * q + int(rng.integers(1, 8))
    step = 128 // m  # units per 128 tokens
    return m * (step * q + int(rng.integers(1, step)))


def draw_counts(rng, dist: str, experts: int, m: int, t_max: int) -> np.ndarray:
    """Token counts (multiples of ``m``, sum <= ``t_max``) of a distribution kind."""
    e = experts
    units = t_max // m
    counts = np.zeros(e, dtype=np.int64)
    if units == 0 or dist == "all_empty":
        return counts
    if dist == "one_hot":
        counts[int(rng.integers(e))] = _log_uniform_int(rng, 1, units)
    elif dist == "huge":
        k = int(rng.integers(e))
        counts[k] = int(rng.integers(max(1, units // 2), units + 1))
        rest = units - counts[k]
        small = rng.integers(0, 3, e)
        small[k] = 0
        keep = np.cumsum(small) <= rest
        counts += np.where(keep, small, 0)
    elif dist == "uniform":
        per = units // e
        if per == 0:
            counts[rng.choice(e, size=units, replace=False)] = 1
        else:
            counts[:] = _log_uniform_int(rng, 1, per)
    elif dist == "random":
        avg = _log_uniform_int(rng, 1, max(1, units // e))
        counts = rng.integers(0, 2 * avg + 1, e)
    elif dist == "zipf":
        total = _log_uniform_int(rng, max(1, e // 2), units)
        w = 1.0 / np.arange(1, e + 1) ** 1.2
        w = w[rng.permutation(e)]
        counts = np.floor(total * w / w.sum()).astype(np.int64)
    elif dist == "sparse":
        nz = int(rng.integers(1, max(1, e // 8) + 2))
        nz = min(nz, e)
        picks = rng.choice(e, size=nz, replace=False)
        for p in picks:
            counts[p] = _log_uniform_int(rng, 1, max(1, units // nz))
    elif dist == "tiny":
        counts = rng.integers(0, 5, e)
    elif dist == "unaligned":
        q_max = max(0, (t_max // max(1, e)) // 128 - 1)
        counts_t = np.array([_unaligned_count(rng, m, min(q_max, 8)) for _ in range(e)])
        counts_t[rng.random(e) < 0.2] = 0
        order = rng.permutation(e)
        for k in order:  # drop experts until the tokens fit
            if counts_t.sum() <= t_max:
                break
            counts_t[k] = 0
        return counts_t.astype(np.int64)
    else:
        raise ValueError(f"unknown distribution {dist!r}")
    counts = counts.astype(np.int64) * m
    if counts.sum() > t_max:  # scale down, keeping multiples of m
        counts = (counts * (t_max / counts.sum())).astype(np.int64) // m * m
    return counts


def _columns_needed(counts, recipe: str) -> int:
    if recipe == "blocked":
        return int(sum(round_up(-(-int(c) // 32), 4) for c in counts))
    return int(sum(-(-int(c) // 128) for c in counts))


def capacity_lower_bound(recipe: str, tokens_sum: int) -> int:
    """What the host's shape check demands of a scale tensor for any counts (gwgrad/scales.py)."""
    if recipe == "blocked":
        return round_up(-(-tokens_sum // 32), 4)
    return -(-tokens_sum // 128)


def scale_capacity(spec: Spec, draw: Draw) -> int:
    """Columns (blocked) or rows (block_1x128) of the scale tensors a direct draw builds."""
    if draw.capacity is not None:
        return draw.capacity
    need = _columns_needed(draw.counts, spec.recipe)
    if spec.recipe == "blocked":
        return need + 4 * draw.extra_capacity
    return need + draw.extra_capacity


def _mutate(rng, spec: Spec, counts: np.ndarray, kind: str):
    """(kind, offsets, capacity, argument) of invalid offsets of ``kind`` (or a fallback)."""
    offs = np.cumsum(counts).astype(np.int64)
    e, m, t = len(counts), spec.count_multiple, int(counts.sum())
    if kind == "scales" and spec.kind == "fp8" and spec.recipe in ("blocked", "block_1x128") \
            and spec.source == "direct":
        cap = capacity_lower_bound(spec.recipe, t)
        if _columns_needed(counts, spec.recipe) > cap:
            return kind, offs, cap, "sfa_tensor"
    if kind == "decreasing" and e >= 2:
        cands = [k for k in range(1, e) if offs[k - 1] > 0]
        if cands:
            k = cands[int(rng.integers(len(cands)))]
            offs[k] = offs[k - 1] - int(rng.integers(1, offs[k - 1] + 1))
            return kind, offs, None, "offsets_tensor"
    if kind == "multiple" and m > 1:
        cands = [k for k in range(e - 1) if counts[k + 1] >= m or counts[k] >= m]
        if cands:
            k = cands[int(rng.integers(len(cands)))]
            delta = int(rng.integers(1, m))
            offs[k] += delta if counts[k + 1] >= m else -delta
            return kind, offs, None, "offsets_tensor"
    offs[-1] = t + m * int(rng.integers(1, 4))
    return "last", offs, None, "offsets_tensor"


def invalid_kinds(spec: Spec) -> Tuple[str, ...]:
    """The invalid-offsets kinds that apply to ``spec``, the first one tried first."""
    kinds = ("decreasing", "last") + (("multiple",) if spec.count_multiple > 1 else ())
    if spec.kind == "fp8" and spec.recipe != "per_expert_channel" and spec.source == "direct":
        kinds = ("scales",) + kinds
    return kinds


def make_draw(spec: Spec, master_seed: int, d: int) -> Draw:
    """Draw ``d`` of ``spec``: a function of (master seed, spec index, d) only."""
    rng = _rng(master_seed, "draw", spec.index, d)
    dist = DISTS[(d + 2 * spec.index) % len(DISTS)]
    counts = draw_counts(rng, dist, spec.experts, spec.count_multiple, spec.max_tokens)
    extra = int(rng.integers(0, 3))
    invalid = expect = capacity = None
    offs = np.cumsum(counts).astype(np.int64)
    if d % 6 == 5:  # two draws in twelve: invalid offsets, the spec's kinds in turn
        kinds = invalid_kinds(spec)
        want = kinds[(d // 6 + spec.index // 3) % len(kinds)] if d >= 6 else kinds[0]
        invalid, offs, capacity, expect = _mutate(rng, spec, counts, want)
        for _ in range(4):  # too-small scales need counts whose scale chunks waste some room
            if invalid == want or want != "scales" or spec.experts < 2:
                break
            dist = "unaligned"
            counts = draw_counts(rng, dist, spec.experts, spec.count_multiple, spec.max_tokens)
            invalid, offs, capacity, expect = _mutate(rng, spec, counts, want)
    entries = spec.entries
    entry = entries[(d + spec.index) % len(entries)]
    if entry == "class" and counts.sum() == 0:
        entry = "wrapper"  # the class takes its layout from its first call's tensors
    if spec.recipe in ("blocked", "block_1x128") and counts.sum() == 0:
        extra = max(extra, 1)  # no zero-size scale tensors (an edge left to a targeted test)
    return Draw(
        index=d, seed=derive_seed(master_seed, "data", spec.index, d), dist=dist,
        counts=tuple(int(c) for c in counts), offsets=tuple(int(o) for o in offs), entry=entry,
        invalid=invalid, expect_error=expect, validate_offsets=((d + spec.index) % 7 == 3),
        extra_capacity=extra, capacity=capacity,
        flat_scales=spec.recipe == "per_expert_channel" and d % 4 == 1,
        explicit_blocked=spec.recipe == "blocked" and d % 2 == 1)


def generate(master_seed: int, n_cases: int = DEFAULT_CASES) -> List[Case]:
    """``n_cases`` cases: the first ``ceil(n / DRAWS_PER_SPEC)`` (at most ``MAX_SPECS``) spec
    slots, the cases split evenly over them, grouped by spec (one compile, then its draws)."""
    specs = plan_specs(master_seed)
    n_specs = min(MAX_SPECS, max(1, -(-n_cases // DRAWS_PER_SPEC)))
    cases = []
    for s in range(n_specs):
        k = n_cases // n_specs + (1 if s < n_cases % n_specs else 0)
        cases += [Case(specs[s], make_draw(specs[s], master_seed, d), master_seed)
                  for d in range(k)]
    return cases


def from_env(default_cases: int = DEFAULT_CASES,
             default_master: Optional[int] = None) -> Tuple[int, List[Case]]:
    """(master seed, cases) as the environment asks: GWGRAD_FUZZ_SEED (master seed; default
    ``default_master``, else random), GWGRAD_FUZZ_CASES (default 500), GWGRAD_FUZZ_ONLY (case ids
    ``s07d03`` and / or spec ids ``s07``, comma separated: a case id is rebuilt directly, whatever
    the run's size), GWGRAD_FUZZ_SKIP (ids to leave out, same syntax)."""
    seed_text = os.environ.get("GWGRAD_FUZZ_SEED", "").strip()
    if seed_text:
        master = int(seed_text, 0)
    else:
        master = default_master if default_master is not None else secrets.randbits(32)
    n = int(os.environ.get("GWGRAD_FUZZ_CASES", "").strip() or default_cases)
    only = os.environ.get("GWGRAD_FUZZ_ONLY", "").strip()
    cases = replay_cases(master, only, n) if only else generate(master, n)
    skip = {w.strip() for w in os.environ.get("GWGRAD_FUZZ_SKIP", "").split(",") if w.strip()}
    if skip:  # triage: leave out cases (or specs) that, e.g., kill the CUDA context
        cases = [c for c in cases if c.id not in skip and c.spec.id not in skip]
    return master, cases


def replay_cases(master: int, only: str, n_cases: int = DEFAULT_CASES) -> List[Case]:
    """The cases ``only`` names (see ``from_env``), in the order given."""
    specs = plan_specs(master)
    cases: List[Case] = []
    run = None
    for word in (w.strip() for w in only.split(",")):
        if not word:
            continue
        m = re.fullmatch(r"s(\d+)d(\d+)", word)
        if m and int(m.group(1)) < len(specs):
            spec = specs[int(m.group(1))]
            cases.append(Case(spec, make_draw(spec, master, int(m.group(2))), master))
        elif re.fullmatch(r"s\d+", word):
            run = generate(master, n_cases) if run is None else run
            cases += [c for c in run if c.spec.id == word]
        else:
            raise ValueError(f"GWGRAD_FUZZ_ONLY: expected case ids like s07d03 or spec ids like "
                             f"s07, got {word!r}")
    return cases


# --- the static view: what gwgrad is asked to compile -----------------------------------------------

def to_static_spec(spec: Spec, arch: str = "sm_90a"):
    """The ``gwgrad.StaticSpec`` a call of ``spec`` describes (tiling as requested)."""
    from gwgrad.dtypes import DType
    from gwgrad.spec import StaticSpec, Tuning

    fp8 = {"e4m3": DType.FLOAT8_E4M3FN, "e5m2": DType.FLOAT8_E5M2}
    kw = dict(
        hidden=spec.hidden, intermediate=spec.intermediate, num_experts=spec.experts,
        a_dtype=DType.BFLOAT16, b_dtype=DType.BFLOAT16, wgrad_dtype=DType(spec.out_dtype),
        acc_dtype=DType.FLOAT32, a_major=spec.a_major, b_major=spec.b_major,
        input_order=spec.order, output_mode=spec.mode, accumulate=spec.accumulate,
        sf_vec_size=16, arch=arch,
        tuning=Tuning(mma_tiler_mn=spec.tiling, cluster_shape_mn=spec.cluster))
    if spec.kind == "fp8":
        kw.update(a_dtype=fp8[spec.a_fmt], b_dtype=fp8[spec.b_fmt],
                  sf_vec_size={"per_expert_channel": 0, "block_1x128": 128,
                               "blocked": 32}[spec.recipe],
                  sf_dtype=DType.FLOAT8_E8M0FNU if spec.recipe == "blocked" else DType.FLOAT32,
                  has_global_scale=spec.global_scales, scale_recipe=spec.recipe)
    return StaticSpec(**kw)


def _torch_strides(shape) -> Tuple[int, ...]:
    """torch's contiguous strides (a size-0 axis counts as 1), as gwgrad.tensors has them."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(int(size), 1)
    return tuple(reversed(strides))


def operand_layout(spec: Spec, which: str, tokens: int) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
    """(shape, strides) of A (``which="a"``) or B as the runner materializes them: the storage
    is created contiguous and viewed (``.t()`` / ``.view``) as the major and order say."""
    h, n = spec.hidden, spec.intermediate
    if which == "a":
        if spec.a_major == "m":  # storage (T, H), viewed .t()
            s = _torch_strides((tokens, h))
            return (h, tokens), (s[1], s[0])
        return (h, tokens), _torch_strides((h, tokens))  # (H, T); ragged: flat.view(H, T)
    if spec.b_major == "n":
        return (tokens, n), _torch_strides((tokens, n))
    s = _torch_strides((n, tokens))  # storage (N, T) (ragged: flat.view(N, T)), viewed .t()
    return (tokens, n), (s[1], s[0])


def static_descs(case: Case, base: int = 1 << 20) -> dict:
    """TensorDescs (fake, aligned CUDA addresses on device 0) of every argument the wrapper gets
    for ``case``: what ``gwgrad.validation.build_spec`` checks. The CPU tests run the project's
    own validation and support checks on them."""
    from gwgrad.dtypes import DType
    from gwgrad.tensors import TensorDesc

    spec, draw = case.spec, case.draw
    t, e, h, n = draw.tokens_sum, spec.experts, spec.hidden, spec.intermediate
    addr = [base]

    def desc(shape, strides, dtype):
        d = TensorDesc(addr[0], tuple(shape), tuple(strides), dtype, "cuda", 0, "torch")
        addr[0] += round_up(max(1, int(np.prod(shape))) * 4, 256)
        return d

    if spec.kind == "bf16":
        ab = (DType.BFLOAT16, DType.BFLOAT16)
    else:
        fp8 = {"e4m3": DType.FLOAT8_E4M3FN, "e5m2": DType.FLOAT8_E5M2}
        ab = (fp8[spec.a_fmt], fp8[spec.b_fmt])
    out = {"a": desc(*operand_layout(spec, "a", t), ab[0]),
           "b": desc(*operand_layout(spec, "b", t), ab[1]),
           "offsets": desc((e,), (1,), DType.INT32)}
    if spec.mode == "dense":
        out["wgrad"] = desc((e, h, n), _torch_strides((e, h, n)), DType(spec.out_dtype))
    else:
        out["wgrad_ptrs"] = desc((e,), (1,), DType.INT64)
    if spec.kind == "fp8":
        if spec.recipe == "per_expert_channel":
            sa, sb = ((e * h,), (e * n,)) if draw.flat_scales else ((e, h), (e, n))
            sdt = DType.FLOAT32
        elif spec.source == "quantize":
            sa, sb, sdt = _quantized_scale_shapes(spec, t)
        elif spec.recipe == "block_1x128":
            r = scale_capacity(spec, draw)
            sa, sb, sdt = (r, h), (r, n), DType.FLOAT32
        else:
            c = scale_capacity(spec, draw)
            sa, sb, sdt = (round_up(h, 128), c), (round_up(n, 128), c), DType.FLOAT8_E8M0FNU
        out["sfa"] = desc(sa, _torch_strides(sa), sdt)
        out["sfb"] = desc(sb, _torch_strides(sb), sdt)
        if spec.global_scales:
            out["global_scale_a"] = desc((e,), (1,), DType.FLOAT32)
            out["global_scale_b"] = desc((e,), (1,), DType.FLOAT32)
    return out


def _quantized_scale_shapes(spec: Spec, tokens: int):
    """Scale shapes gwgrad.quantize returns for the operands of a quantize draw."""
    from gwgrad import quantizers
    from gwgrad.dtypes import DType

    fmt = QUANTIZE_FMT[spec.recipe]
    la = quantizers.layout(fmt, tokens, spec.hidden, spec.experts, spec.a_fmt)
    lb = quantizers.layout(fmt, tokens, spec.intermediate, spec.experts, spec.b_fmt)
    sdt = DType.FLOAT8_E8M0FNU if spec.recipe == "blocked" else DType.FLOAT32
    return la.scale_shape, lb.scale_shape, sdt


def build_spec_of(case: Case, arch: str = "sm_90a"):
    """``gwgrad.validation.build_spec`` of the wrapper call the runner makes for ``case``."""
    from gwgrad.validation import build_spec

    spec = case.spec
    d = static_descs(case)
    kw = {}
    if spec.kind == "fp8":
        kw = dict(sfa=d["sfa"], sfb=d["sfb"], global_scale_a=d.get("global_scale_a"),
                  global_scale_b=d.get("global_scale_b"), sf_vec_size=SF_VEC[spec.recipe],
                  scale_recipe=spec.recipe)
    return build_spec(a=d["a"], b=d["b"], offsets=d["offsets"], output_mode=spec.mode,
                      wgrad=d.get("wgrad"), wgrad_ptrs=d.get("wgrad_ptrs"),
                      wgrad_dtype=spec.out_dtype, mma_tiler_mn=spec.tiling,
                      cluster_shape_mn=spec.cluster,
                      accumulate=spec.accumulate, input_order=spec.order, arch=arch, **kw)


def case_bytes(case: Case) -> int:
    """An upper estimate of the device memory one case holds at once (bytes)."""
    spec, draw = case.spec, case.draw
    t, e, h, n = draw.tokens_sum, spec.experts, spec.hidden, spec.intermediate
    es = {"bfloat16": 2, "float16": 2, "float32": 4}[spec.out_dtype]
    inputs = (h + n) * t * spec.token_bytes
    staging = max(h, n) * t * 2 if spec.kind == "fp8" else 0  # BF16 randn before the FP8 cast
    arena = e * (round_up(h * n * es, 256) + 2 * guard_bytes(spec)) + 2 * guard_bytes(spec)
    # the reference: one expert's float64 product, reference and comparison temporaries, and
    # a token chunk of float64 operands (and their scaled copies and scales for FP8)
    expert_tmp = h * n * 8 * 5 + (h + n) * ref_chunk(spec) * 8 * (3 if spec.kind == "fp8" else 1)
    scales = (h + n) * (t // 128 + 4 * e + 64) * 4 if spec.kind == "fp8" else 0
    # arena: the output buffer, its copy from before the call, its outside-the-slots mask
    return inputs + scales + 3 * arena + max(staging, expert_tmp)


def guard_bytes(spec: Spec) -> int:
    """Guard bytes on each side of an output slot: a whole expert's output (up to 16 MiB) around
    a dense output, a quarter of one (16 KiB .. 4 MiB) around each discrete slot."""
    es = {"bfloat16": 2, "float16": 2, "float32": 4}[spec.out_dtype]
    one = spec.hidden * spec.intermediate * es
    if spec.mode == "dense":
        return round_up(min(max(one, 16384), 16 << 20), 256)
    return round_up(min(max(one // 4, 16384), 4 << 20), 256)


def ref_chunk(spec: Spec) -> int:
    """Tokens per float64 chunk of the reference (<= 32 MiB of float64 operands)."""
    return max(128, ((32 << 20) // 8 // (spec.hidden + spec.intermediate)) // 128 * 128)


# --- the runner (torch, imported here only) ------------------------------------------------------------

SENTINEL = 0xA5  # guard bytes
POISON = 0xFF  # output bytes before a non-accumulating call: NaN in bf16, fp16 and fp32
UNIT_ROUNDOFF = {"bfloat16": 2.0 ** -8, "float16": 2.0 ** -11, "float32": 2.0 ** -24}
ELEM_FACTOR = 30.0


def tolerances(spec: Spec, max_count: int) -> Tuple[float, float, float]:
    """(rel_tol, elem_tol, unit roundoff of the output): the existing GPU tests' relative
    Frobenius tolerances (1e-2 for 16-bit outputs; FP32: max(1e-5, 2.5e-9 K) with BF16
    inputs, K the largest expert's tokens, and 2e-3 with FP8 inputs); per element,
    ``ELEM_FACTOR`` times the FP32-accumulation part, in units of the expert's rms."""
    # BF16 inputs: the tensor cores' FP32 accumulation drifts from FP64 linearly in the tokens
    # per expert, 1.2e-9 x K relative on the H200 (7.6e-5 at 65536 tokens; cuBLAS's BF16 GEMM
    # with FP32 output: 4.4e-6): 2.5e-9 x K here.
    acc_tol = 2e-3 if spec.kind == "fp8" else max(1e-5, 2.5e-9 * max_count)
    rel_tol = acc_tol if spec.out_dtype == "float32" else 1e-2
    return rel_tol, ELEM_FACTOR * acc_tol, UNIT_ROUNDOFF[spec.out_dtype]


def compare_expert(got, ref, prod, rel_tol: float, elem_tol: float, u_out: float) -> dict:
    """One expert's output ``got`` (any float dtype) against float64 ``ref`` (``prod``: the
    product part of ``ref``, which differs from it when accumulating). Returns rel (relative
    Frobenius error), elem (the worst element's excess over its rounding bound, in rms units),
    nans (NaN / Inf outputs where the reference is finite) and ok. One host sync."""
    import torch

    g = got.to(torch.float64)
    finite = torch.isfinite(ref)
    bad = (~torch.isfinite(g) & finite).sum().to(torch.float64)
    r = ref.masked_fill(~finite, 0.0)
    d = (g - r).masked_fill(~finite, 0.0)
    bound = (2.0 * u_out) * (r.abs() + prod.masked_fill(~finite, 0.0).abs())
    excess = (d.abs() - bound).clamp_min(0.0).amax() if d.numel() else d.new_zeros(())
    nans, nref, nd, worst = torch.stack([bad, r.norm(), d.norm(), excess]).tolist()
    if nans:
        return {"rel": math.inf, "elem": math.inf, "nans": int(nans), "ok": False}
    rms = nref / math.sqrt(max(1, ref.numel())) if nref > 0 else 1.0
    rel = nd / (nref if nref > 0 else 1.0)
    elem = worst / rms
    return {"rel": rel, "elem": elem, "nans": 0, "ok": rel <= rel_tol and elem <= elem_tol}


class Arena:
    """Output memory: ``slots`` byte ranges, each between guard bytes (``SENTINEL``), in one
    uint8 buffer; ``view(k, shape, dtype)`` is slot k typed. The slots lie in ``order`` (a
    permutation) so that discrete outputs are not in expert order in memory."""

    def __init__(self, torch, device: str, slot_bytes: Sequence[int], guard: int, order=None):
        order = list(range(len(slot_bytes))) if order is None else list(order)
        self.starts = [0] * len(slot_bytes)
        self.sizes = list(slot_bytes)
        pos = guard
        for k in order:
            self.starts[k] = pos
            pos += round_up(max(1, slot_bytes[k]), 256) + guard
        self.buf = torch.full((pos,), SENTINEL, dtype=torch.uint8, device=device)
        self.outside = torch.ones(pos, dtype=torch.bool, device=device)
        for start, size in zip(self.starts, self.sizes):
            self.outside[start:start + size] = False
        self.guard = guard

    def raw(self, k: int):
        return self.buf[self.starts[k]:self.starts[k] + self.sizes[k]]

    def view(self, k: int, shape, dtype):
        return self.raw(k).view(dtype).view(shape)

    def guard_writes(self) -> int:
        """Bytes outside every slot that no longer hold SENTINEL."""
        return int(((self.buf != SENTINEL) & self.outside).sum())


def _sync(torch, device: str) -> None:
    if device != "cpu":
        torch.cuda.synchronize()


def _gen(torch, device: str, seed: int):
    return torch.Generator(device=device).manual_seed(int(seed) & ((1 << 63) - 1))


class _Inputs:
    """A case's tensors as the API gets them (``sf_capacity``: the scale tensors' columns
    (blocked) or rows (block_1x128), which the reference reads the scales back with)."""

    a = b = sfa = sfb = gsa = gsb = None
    sf_capacity = 0


def _fp8_dtype(torch, fmt: str):
    return {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}[fmt]


def _operand(torch, spec: Spec, which: str, counts, gen, device, dtype):
    """A (H, T) or B (T, N) in the spec's layout, plus a function e -> expert e's block."""
    width = spec.hidden if which == "a" else spec.intermediate
    t = int(sum(counts))
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    major = spec.a_major if which == "a" else spec.b_major
    k_major = major == "k"
    fp8 = dtype != torch.bfloat16

    def values(n_elems):
        v = torch.randn(n_elems, generator=gen, device=device, dtype=torch.bfloat16)
        return v.mul_(2.0).to(dtype) if fp8 else v

    if k_major and spec.order == "tensor_ragged":
        flat = values(width * t)
        full = flat.view(width, t)
        if which == "a":
            def block(e):
                s, c = int(starts[e]), int(counts[e])
                return flat[s * width:(s + c) * width].view(width, c)
            return full, block
        full = full.t()

        def block(e):
            s, c = int(starts[e]), int(counts[e])
            return flat[s * width:(s + c) * width].view(width, c).t()
        return full, block
    if which == "a":
        full = values(width * t).view(width, t) if k_major else values(t * width).view(t, width).t()
        return full, lambda e: full[:, int(starts[e]):int(starts[e]) + int(counts[e])]
    full = values(width * t).view(width, t).t() if k_major else values(t * width).view(t, width)
    return full, lambda e: full[int(starts[e]):int(starts[e]) + int(counts[e])]


def _blocked_offsets(torch, device, rows: int, counts, capacity: int):
    """Per expert: (byte offsets (rows, blocks) into a blocked scale tensor of ``capacity``
    columns, or None when the expert's columns lie past the capacity)."""
    mpad = round_up(rows, 128)
    m = torch.arange(rows, device=device, dtype=torch.int64)[:, None]
    out, start = [], 0
    for c in counts:
        nb = -(-int(c) // 32)
        c_e = round_up(nb, 4)
        if start + c_e > capacity or nb == 0:
            out.append(None)
        else:
            j = torch.arange(nb, device=device, dtype=torch.int64)[None, :]
            out.append(mpad * start + 512 * ((m >> 7) * (c_e >> 2) + (j >> 2)) + 16 * (m & 31)
                       + 4 * ((m >> 5) & 3) + (j & 3))
        start += c_e
    return out


def _direct_scales(torch, spec: Spec, draw: Draw, gen, device, inp: _Inputs) -> None:
    e, h, n = spec.experts, spec.hidden, spec.intermediate
    counts = draw.counts
    if spec.recipe == "per_expert_channel":
        inp.sfa = torch.rand(e, h, generator=gen, device=device).add_(0.25)
        inp.sfb = torch.rand(e, n, generator=gen, device=device).add_(0.25)
        if draw.flat_scales:
            inp.sfa, inp.sfb = inp.sfa.reshape(-1), inp.sfb.reshape(-1)
        return
    cap = scale_capacity(spec, draw)
    inp.sf_capacity = cap
    if spec.recipe == "block_1x128":
        inp.sfa = torch.rand(cap, h, generator=gen, device=device).add_(0.25)
        inp.sfb = torch.rand(cap, n, generator=gen, device=device).add_(0.25)
        return
    # blocked (MXFP8): E8M0 codes 2^-5 .. 2^3 per 32 tokens, 2^-3 .. 2^1 for FP16 outputs (with
    # 65536 tokens, global scales and 6-sigma elements the results stay below FP16's 65504);
    # padding bytes 0 (2^-127: never read for real tokens).
    lo, hi = (124, 129) if spec.out_dtype == "float16" else (122, 131)
    tensors = []
    for rows in (h, n):
        flat = torch.zeros(round_up(rows, 128) * cap, dtype=torch.uint8, device=device)
        for off in _blocked_offsets(torch, device, rows, counts, cap):
            if off is not None:
                flat[off.reshape(-1)] = torch.randint(
                    lo, hi, (off.numel(),), generator=gen, device=device, dtype=torch.uint8)
        tensors.append(flat.view(round_up(rows, 128), cap).view(torch.float8_e8m0fnu))
    inp.sfa, inp.sfb = tensors


def _quantized_inputs(torch, spec: Spec, draw: Draw, gen, device, inp: _Inputs):
    """x (T, H) and dy (T, N) BF16 through gwgrad.quantize (the torch adapter's for adapter
    draws), with the valid offsets: data (H, T) / (N, T) K-major, scales as returned."""
    import gwgrad

    t = draw.tokens_sum
    valid = torch.tensor(np.cumsum(draw.counts).tolist(), dtype=torch.int32, device=device)
    x = torch.randn(t, spec.hidden, generator=gen, device=device, dtype=torch.bfloat16)
    dy = torch.randn(t, spec.intermediate, generator=gen, device=device, dtype=torch.bfloat16)
    fmt = QUANTIZE_FMT[spec.recipe]
    if draw.entry == "adapter":
        import gwgrad.adapters.torch as gwt

        xq, sx, _ = gwt.quantize(x, valid, fmt, elem=spec.a_fmt)
        dq, sd, _ = gwt.quantize(dy, valid, fmt, elem=spec.b_fmt)
    else:
        rx = gwgrad.quantize(x, valid, fmt, elem=spec.a_fmt)
        rd = gwgrad.quantize(dy, valid, fmt, elem=spec.b_fmt)
        xq, sx, dq, sd = rx["data"], rx["scales"], rd["data"], rd["scales"]
    inp.a, inp.b, inp.sfa, inp.sfb = xq, dq.t(), sx, sd
    if spec.recipe == "blocked":
        inp.sf_capacity = int(sx.shape[1])
    elif spec.recipe == "block_1x128":
        inp.sf_capacity = int(sx.shape[0])
    starts = np.concatenate([[0], np.cumsum(draw.counts)[:-1]]).astype(np.int64)
    a_full, b_full = inp.a, inp.b
    return (lambda e: a_full[:, int(starts[e]):int(starts[e]) + draw.counts[e]],
            lambda e: b_full[int(starts[e]):int(starts[e]) + draw.counts[e]])


class _ScaleExpander:
    """float64 scales of expert e broadcast to its (H, c) A block / (c, N) B block, read back
    from the scale tensors the API got (the blocked bytes with the layout formula)."""

    def __init__(self, torch, spec: Spec, counts, inp: _Inputs, device):
        self.torch, self.spec, self.counts = torch, spec, [int(c) for c in counts]
        self.inp, self.device = inp, device
        self.starts = np.concatenate([[0], np.cumsum(self.counts)]).astype(np.int64)
        if spec.recipe == "block_1x128":
            self.rows = np.concatenate([[0], np.cumsum([-(-c // 128) for c in self.counts])])
        if spec.recipe == "blocked":
            cap = inp.sf_capacity
            self.off_a = _blocked_offsets(torch, device, spec.hidden, self.counts, cap)
            self.off_b = _blocked_offsets(torch, device, spec.intermediate, self.counts, cap)

    def _e8m0(self, sf, off):
        torch = self.torch
        codes = sf.view(torch.uint8).reshape(-1)[off].to(torch.float64)
        vals = torch.pow(2.0, codes - 127.0)
        return torch.where(codes == 255, torch.full_like(vals, math.nan), vals)

    def a(self, e: int, k0: int, k1: int):
        """(H, k1 - k0) float64 scales of expert e's tokens k0..k1."""
        torch, spec, inp = self.torch, self.spec, self.inp
        if spec.recipe == "per_expert_channel":
            return inp.sfa.reshape(spec.experts, spec.hidden)[e].to(torch.float64)[:, None]
        k = torch.arange(k0, k1, device=self.device)
        if spec.recipe == "block_1x128":
            return inp.sfa[int(self.rows[e]) + k // 128].to(torch.float64).t()
        return self._e8m0(inp.sfa, self.off_a[e])[:, k // 32]

    def b(self, e: int, k0: int, k1: int):
        """(k1 - k0, N) float64 scales."""
        torch, spec, inp = self.torch, self.spec, self.inp
        if spec.recipe == "per_expert_channel":
            return inp.sfb.reshape(spec.experts, spec.intermediate)[e].to(torch.float64)[None, :]
        k = torch.arange(k0, k1, device=self.device)
        if spec.recipe == "block_1x128":
            return inp.sfb[int(self.rows[e]) + k // 128].to(torch.float64)
        return self._e8m0(inp.sfb, self.off_b[e])[:, k // 32].t()


def _product(torch, spec: Spec, a_blk, b_blk, scales: Optional[_ScaleExpander], e: int):
    """float64 A_e @ B_e (dequantized), in token chunks."""
    h, n, c = spec.hidden, spec.intermediate, int(a_blk.shape[1])
    acc = torch.zeros(h, n, dtype=torch.float64, device=a_blk.device)
    step = ref_chunk(spec)
    for k0 in range(0, c, step):
        k1 = min(c, k0 + step)
        a = a_blk[:, k0:k1].to(torch.float64)
        b = b_blk[k0:k1].to(torch.float64)
        if scales is not None:
            a = a * scales.a(e, k0, k1)
            b = b * scales.b(e, k0, k1)
        acc.addmm_(a, b)
    return acc


def _json_float(x: float):
    return x if math.isfinite(x) else str(x)


def _is_fatal(exc: BaseException) -> bool:
    """A CUDA error that leaves the context unusable (every later case would fail too)."""
    text = f"{type(exc).__name__}: {exc}".lower()
    return any(s in text for s in ("illegal", "misaligned address", "launch failure",
                                   "cudaerrorlaunch", "device-side assert", "acceleratorerror",
                                   "uncorrectable", "hardware stack error", "launch timed out",
                                   "not permitted when stream is capturing"))


#: The argument an invalid draw's error names: the core's name, or the torch adapter's.
_ERROR_NAMES = {"offsets_tensor": ("offsets_tensor", "offsets"),
                "sfa_tensor": ("sfa_tensor", "x_scale (sfa_tensor)")}


def run_case(case: Case, device: str = "cuda", *, operators: Optional[dict] = None,
             corrupt: Optional[str] = None) -> dict:
    """Run one case through gwgrad's public API on ``device`` ("cuda" or "cpu": CPU tensors run
    the reference backend) and check it; returns the case's record (``ok``, ``mismatch``,
    ``guard_bytes``, errors, ...). ``operators``: the class entry's operators, kept across the
    draws of a run. ``corrupt`` (tests of this checker only): damage the result after the call
    ("value", "nan", "row", "guard" or "inside") so that the check must fail."""
    import torch

    import gwgrad

    spec, draw = case.spec, case.draw
    operators = {} if operators is None else operators
    record = {"id": case.id, "seed": draw.seed, "master_seed": case.master_seed,
              "spec": spec.as_dict(), "spec_name": spec.name, "counts": draw.summary(),
              "entry": draw.entry, "invalid": draw.invalid,
              "validate_offsets": draw.validate_offsets, "rel_err": 0.0, "elem_err": 0.0,
              "guard_bytes": 0, "ok": False, "mismatch": False, "fatal": False, "error": None,
              "replay": case.replay()}
    start = time.perf_counter()
    try:
        _run(torch, gwgrad, case, device, operators, corrupt, record)
    except Exception as exc:  # the record says what went wrong; the run goes on
        record["error"] = f"{type(exc).__name__}: {exc}"[:2000]
        record["fatal"] = device != "cpu" and _is_fatal(exc)
        record["mismatch"] = True
        record["ok"] = False
    record["seconds"] = round(time.perf_counter() - start, 4)
    for key in ("rel_err", "elem_err"):
        record[key] = _json_float(record[key])
    return record


def _run(torch, gwgrad, case: Case, device: str, operators: dict, corrupt, record: dict) -> None:
    spec, draw = case.spec, case.draw
    e, h, n = spec.experts, spec.hidden, spec.intermediate
    out_dtype = getattr(torch, spec.out_dtype)
    gen = _gen(torch, device, draw.seed)
    inp = _Inputs()
    scales = None
    if spec.kind == "fp8" and spec.source == "quantize":
        a_block, b_block = _quantized_inputs(torch, spec, draw, gen, device, inp)
    else:
        ab = torch.bfloat16 if spec.kind == "bf16" else None
        inp.a, a_block = _operand(torch, spec, "a", draw.counts, gen, device,
                                  ab or _fp8_dtype(torch, spec.a_fmt))
        inp.b, b_block = _operand(torch, spec, "b", draw.counts, gen, device,
                                  ab or _fp8_dtype(torch, spec.b_fmt))
        if spec.kind == "fp8":
            _direct_scales(torch, spec, draw, gen, device, inp)
    if spec.kind == "fp8" and spec.global_scales:
        inp.gsa = torch.rand(e, generator=gen, device=device).add_(0.5)
        inp.gsb = torch.rand(e, generator=gen, device=device).add_(0.5)
    offsets = torch.tensor(list(draw.offsets), dtype=torch.int32, device=device)

    # Outputs: poisoned (or random when accumulating) inside guards.
    es = torch.empty((), dtype=out_dtype).element_size()
    slot = h * n * es
    rng = np.random.default_rng(draw.seed)
    if spec.mode == "dense":
        arena = Arena(torch, device, [e * slot], guard_bytes(spec))
        stack = arena.view(0, (e, h, n), out_dtype)
        outs = list(stack.unbind(0))
    else:
        arena = Arena(torch, device, [slot] * e, guard_bytes(spec), order=rng.permutation(e))
        stack = None
        outs = [arena.view(k, (h, n), out_dtype) for k in range(e)]
    for k in range(len(arena.sizes)):
        arena.raw(k).fill_(POISON)
    if spec.accumulate:
        for o in outs:
            o.copy_(torch.randn(h, n, generator=gen, device=device, dtype=torch.float32))
    before = arena.buf.clone()
    init = ([before[arena.starts[0]:arena.starts[0] + arena.sizes[0]].view(out_dtype).view(e, h, n)[k]
             for k in range(e)] if spec.mode == "dense" else
            [before[arena.starts[k]:arena.starts[k] + arena.sizes[k]].view(out_dtype).view(h, n)
             for k in range(e)])
    ptrs = None
    if spec.mode == "discrete":
        ptrs = torch.tensor([o.data_ptr() for o in outs], dtype=torch.int64, device=device)

    gwgrad.check_errors()  # nothing pending from earlier work
    raised = None
    try:
        _call(torch, gwgrad, case, inp, offsets, stack, outs, ptrs, out_dtype, operators, device)
    except ValueError as exc:
        raised = exc
    _sync(torch, device)
    deferred = None
    try:
        gwgrad.check_errors()
    except ValueError as exc:
        deferred = exc

    if corrupt == "guard":
        arena.buf[arena.starts[-1] + arena.sizes[-1]] ^= 1  # the byte right after the last slot
    elif corrupt == "inside":
        arena.raw(0).view(-1)[0] ^= 1

    record["guard_bytes"] = arena.guard_writes()
    if draw.invalid is not None:
        err = raised or deferred
        problems = []
        if err is None:
            problems.append("invalid offsets were not reported")
        elif getattr(err, "argument", None) not in _ERROR_NAMES[draw.expect_error]:
            problems.append(f"reported as {err!r}, expected an error naming {draw.expect_error}")
        changed = int((arena.buf != before).sum())
        if changed:
            problems.append(f"{changed} output bytes written despite invalid offsets")
        record["error"] = "; ".join(problems) or None
        record["mismatch"] = bool(problems)
        record["ok"] = not problems and record["guard_bytes"] == 0
        return
    if raised is not None:
        raise raised
    if deferred is not None:
        raise AssertionError(f"valid offsets flagged by the device check: {deferred}")

    if corrupt in ("value", "nan", "row"):
        k = int(np.argmax(draw.counts)) if e else 0
        tgt = outs[k]
        if corrupt == "value":
            flat = tgt.view(-1)
            flat[flat.numel() // 2] += 1.0 + abs(float(flat[flat.numel() // 2]))
        elif corrupt == "nan":
            tgt.view(-1)[-1] = math.nan
        else:
            tgt[-1].zero_()
            if not spec.accumulate and draw.counts[k] == 0:
                tgt[-1].fill_(1.0)

    if spec.kind == "fp8":
        scales = _ScaleExpander(torch, spec, draw.counts, inp, device)
    rel_tol, elem_tol, u = tolerances(spec, max(draw.counts) if draw.counts else 0)
    alpha = None
    if spec.kind == "fp8" and spec.global_scales:
        alpha = (inp.gsa.to(torch.float64) * inp.gsb.to(torch.float64)).tolist()
    worst = {"rel": 0.0, "elem": 0.0}
    bad = []
    for k in range(e):
        prod = _product(torch, spec, a_block(k), b_block(k), scales, k)
        if alpha is not None:
            prod = prod * alpha[k]
        ref = prod + init[k].to(torch.float64) if spec.accumulate else prod
        res = compare_expert(outs[k], ref, prod, rel_tol, elem_tol, u)
        worst["rel"] = max(worst["rel"], res["rel"])
        worst["elem"] = max(worst["elem"], res["elem"])
        if not res["ok"]:
            bad.append(f"expert {k} (count {draw.counts[k]}): rel {res['rel']:.2e} (tol "
                       f"{rel_tol:.1e}), elem {res['elem']:.2e} (tol {elem_tol:.1e}), "
                       f"non-finite {res['nans']}")
    record["rel_err"], record["elem_err"] = worst["rel"], worst["elem"]
    record["mismatch"] = bool(bad)
    if bad:
        record["error"] = f"{len(bad)} experts wrong: " + "; ".join(bad[:4])
    record["ok"] = not bad and record["guard_bytes"] == 0


def _call(torch, gwgrad, case: Case, inp: _Inputs, offsets, stack, outs, ptrs, out_dtype,
          operators: dict, device: str) -> None:
    """The API call of the draw's entry point."""
    spec, draw = case.spec, case.draw
    fp8 = spec.kind == "fp8"
    dense = spec.mode == "dense"
    recipe_arg = None
    if fp8:
        recipe_arg = spec.recipe if spec.recipe != "blocked" or draw.explicit_blocked else None
    sf_vec = SF_VEC[spec.recipe] if fp8 else 16
    if draw.entry == "adapter":
        import gwgrad.adapters.torch as gwt

        out = stack if dense else outs
        if fp8:
            gwt.wgrad_fp8(inp.a.t(), inp.b, offsets, inp.sfa, inp.sfb, scale_recipe=spec.recipe,
                          out=out, accumulate=spec.accumulate, x_global_scale=inp.gsa,
                          dy_global_scale=inp.gsb, validate_offsets=draw.validate_offsets)
        else:
            gwt.wgrad(inp.a.t(), inp.b, offsets, out=out, accumulate=spec.accumulate,
                      validate_offsets=draw.validate_offsets)
        return
    if draw.entry == "class":
        key = (device, spec.key)
        op = operators.get(key)
        if op is None:
            op = gwgrad.GroupedGemmWgradSm100(
                sample_a=inp.a, sample_b=inp.b, sample_sfa=inp.sfa, sample_sfb=inp.sfb,
                sample_offsets=offsets, sample_wgrad=stack if dense else None,
                num_experts=None if dense else spec.experts,
                wgrad_shape=None if dense else (spec.hidden, spec.intermediate),
                wgrad_dtype=None if dense else out_dtype,
                sample_global_scale_a=inp.gsa, sample_global_scale_b=inp.gsb,
                mma_tiler_mn=spec.tiling, cluster_shape_mn=spec.cluster, sf_vec_size=sf_vec,
                accumulate_on_output=spec.accumulate, input_order=spec.order,
                output_mode=spec.mode, scale_recipe=recipe_arg)
            op.check_support()
            op.compile()
            want = to_static_spec(spec, op.spec.arch)
            for field in ("a_major", "b_major", "input_order", "output_mode", "accumulate",
                          "wgrad_dtype", "num_experts", "a_dtype", "b_dtype", "scale_recipe"):
                if getattr(op.spec, field) != getattr(want, field):
                    raise AssertionError(f"the operator's spec has {field}="
                                         f"{getattr(op.spec, field)!r}, the case wants "
                                         f"{getattr(want, field)!r}")
            operators[key] = op
        op.execute(a_tensor=inp.a, b_tensor=inp.b, sfa_tensor=inp.sfa, sfb_tensor=inp.sfb,
                   offsets_tensor=offsets, wgrad_tensor=stack if dense else None,
                   wgrad_ptrs=None if dense else ptrs, global_scale_a=inp.gsa,
                   global_scale_b=inp.gsb, validate_offsets=draw.validate_offsets)
        return
    kwargs = dict(a_tensor=inp.a, b_tensor=inp.b, sfa_tensor=inp.sfa, sfb_tensor=inp.sfb,
                  offsets_tensor=offsets, output_mode=spec.mode,
                  global_scale_a=inp.gsa, global_scale_b=inp.gsb,
                  accumulate_on_output=spec.accumulate, input_order=spec.order,
                  mma_tiler_mn=spec.tiling, cluster_shape_mn=spec.cluster, sf_vec_size=sf_vec,
                  validate_offsets=draw.validate_offsets, scale_recipe=recipe_arg)
    if dense:
        kwargs["wgrad_tensor"] = stack
    else:
        kwargs.update(wgrad_ptrs=ptrs, wgrad_dtype=out_dtype)
    gwgrad.grouped_gemm_wgrad_wrapper_sm100(**kwargs)


def run_all(cases: Sequence[Case], device: str = "cuda", *, log_path: Optional[str] = None,
            master_seed: Optional[int] = None, echo=None) -> dict:
    """Run ``cases`` in order; returns the summary (``line``: the one-line summary; ``failures``:
    every failing case's record). Stops after a fatal CUDA error (the rest are "not run").
    ``log_path``: write every record and the summary as JSON there. ``echo``: a function that
    gets a line per failing case."""
    from gwgrad.kernels import compiler

    compiles_before = compiler.compile_count
    operators: dict = {}
    records: List[dict] = []
    start = time.perf_counter()
    not_run: List[str] = []
    for i, case in enumerate(cases):
        rec = run_case(case, device, operators=operators)
        records.append(rec)
        if log_path and (i + 1) % 100 == 0:  # what finished survives a crash of the process
            _write_log(log_path, {"partial": True, "cases_done": i + 1,
                                  "master_seed": master_seed}, records)
        if not rec["ok"] and echo is not None:
            echo(f"FAIL {rec['id']} seed={rec['seed']} [{rec['spec_name']}] entry={rec['entry']} "
                 f"{rec['counts']['dist']} T={rec['counts']['tokens_sum']}: {rec['error']} "
                 f"(guard bytes {rec['guard_bytes']}); replay: {rec['replay']}")
        if rec["fatal"]:
            not_run = [c.id for c in cases[i + 1:]]
            break
    seconds = time.perf_counter() - start
    specs = len({c.spec.key for c in cases})
    mismatches = sum(1 for r in records if r["mismatch"])
    guards = sum(1 for r in records if r["guard_bytes"])
    master = master_seed if master_seed is not None else (
        cases[0].master_seed if cases else None)
    line = (f"fuzz: {len(records)} cases, {specs} specs, {mismatches} mismatches, {guards} guard "
            f"writes, {seconds:.0f} s, master seed {master}")
    summary = {
        "line": line, "cases": len(records), "specs": specs, "mismatches": mismatches,
        "guard_writes": guards, "seconds": round(seconds, 2), "master_seed": master,
        "device": device, "not_run": not_run,
        "compiles": compiler.compile_count - compiles_before,
        "invalid_cases": sum(1 for r in records if r["invalid"]),
        "failures": [r for r in records if not r["ok"]],
    }
    if log_path:
        _write_log(log_path, {k: v for k, v in summary.items() if k != "failures"}, records)
    return summary


def _write_log(path: str, summary: dict, records: List[dict]) -> None:
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump({"summary": summary, "cases": records}, f, indent=1)
    os.replace(tmp, path)


# --- quantizer cases (tools/sanitize.py) ------------------------------------------------------

@dataclass(frozen=True)
class QuantCase:
    """One ``gwgrad.quantize`` call, checked bit for bit against the NumPy model."""

    name: str
    fmt: str
    elem: Optional[str]
    channels: int
    counts: Tuple[int, ...]
    seed: int


def run_quantize_case(q: QuantCase, device: str = "cuda", corrupt: Optional[str] = None) -> dict:
    """Quantize BF16 values (many magnitudes, zeros, denormals, NaN / Inf) into outputs poisoned
    with 0xFF inside SENTINEL guards; compare with ``gwgrad.quantizers.reference_quantize``:
    data and the used scale bytes bit for bit, unused scale bytes still 0xFF, guards intact."""
    import torch

    import gwgrad
    from gwgrad import quantizers as Q
    from gwgrad import scales as S
    from gwgrad.interop.torch import native_dtype
    from quantize_cases import special_values

    record = {"id": q.name, "ok": False, "error": None, "guard_bytes": 0}
    start = time.perf_counter()
    try:
        rng = np.random.default_rng(q.seed)
        t = int(sum(q.counts))
        x64 = special_values(rng, t, q.channels)
        xt = torch.from_numpy(x64.astype(np.float32)).to(torch.bfloat16)
        values = xt.to(torch.float64).numpy()
        offsets_host = np.cumsum(q.counts).astype(np.int32)
        lay = Q.layout(q.fmt, t, q.channels, len(q.counts), q.elem)
        shapes = [("data", lay.data_shape, lay.data_dtype),
                  ("scales", lay.scale_shape, lay.scale_dtype)]
        if lay.global_shape is not None:
            shapes.append(("global_scale", lay.global_shape, gwgrad.DType.FLOAT32))
        sizes = [int(np.prod(s)) * d.itemsize for _, s, d in shapes]
        arena = Arena(torch, device, sizes, 4096)
        views = {}
        for k, (name, shape, dtype) in enumerate(shapes):
            arena.raw(k).fill_(POISON)
            views[name] = arena.view(k, shape, native_dtype(dtype))
        gwgrad.quantize(xt.to(device), torch.from_numpy(offsets_host).to(device), q.fmt,
                        elem=q.elem, data=views["data"], scales=views["scales"],
                        global_scale=views.get("global_scale"))
        _sync(torch, device)
        gwgrad.check_errors()
        if corrupt == "guard":
            arena.buf[0] ^= 1
        elif corrupt == "value":
            arena.raw(0)[0] ^= 1
        record["guard_bytes"] = arena.guard_writes()
        want = Q.reference_quantize(values, offsets_host, q.fmt, q.elem)
        problems = []
        got = arena.raw(0).cpu().numpy().reshape(want[0].shape)
        if not np.array_equal(got, want[0]):
            problems.append(f"data: {int((got != want[0]).sum())} bytes differ")
        got_s = arena.raw(1).cpu().numpy()
        want_s = np.ascontiguousarray(want[1]).view(np.uint8).reshape(-1)
        f = Q.FORMATS[q.fmt]
        used = want_s.size
        rule = S.column_rule(f.recipe, f.sf_vec)
        if rule is not None:  # blocked: Mpad bytes per column; block_1x128: 4 * channels per row
            per = lay.scale_shape[0] if f.recipe == "blocked" else 4 * q.channels
            used = min(S.columns_needed(q.counts, rule), lay.scale_capacity) * per
        if not np.array_equal(got_s[:used], want_s[:used]):
            problems.append(f"scales: {int((got_s[:used] != want_s[:used]).sum())} of {used} "
                            "bytes differ")
        # The GPU kernels never write past the experts' scales (the NumPy path on the CPU
        # writes whole arrays).
        if device != "cpu" and (got_s[used:] != POISON).any():
            problems.append("scales: bytes past the experts' scales were written")
        if want[2] is not None:
            got_g = arena.raw(2).cpu().numpy().view(np.float32)
            if not np.array_equal(got_g.view(np.uint32), want[2].view(np.uint32)):
                problems.append("global_scale differs")
        record["error"] = "; ".join(problems) or None
        record["ok"] = not problems and record["guard_bytes"] == 0
    except Exception as exc:
        record["error"] = f"{type(exc).__name__}: {exc}"[:2000]
    record["seconds"] = round(time.perf_counter() - start, 4)
    return record
