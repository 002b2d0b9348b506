"""The tuning defaults as data: one rule table per kernel family, evaluated by ``resolve``.

A rule is one line, ``"name: condition -> sets"``: its name (docs/PERFORMANCE.md, "Defaults
and why", cites every rule by name with the measurement it rests on), a condition on the
problem and the ``Tuning`` fields it sets (the tile and the cluster as ``MxN MxN``, the other
fields as ``field=value``, ``unit_schedule`` by name). ``resolve`` fills each field the caller
left unset (None / 0) from the first rule of the table, in order, that sets the field and whose
condition holds; the tiling first, so that the later fields' rules may read it. Whether the
kernel runs the result is ``check_support``'s question (the one predicate), not the rules'.

A condition is ``and`` of terms over the facts below: ``fact``, ``not fact`` or ``fact OP
value`` (OP one of ``< <= > >= == !=``, value a number or a word); an empty one holds always.
A comparison with an unknown fact (``tokens`` when the call's tokens_sum is not known) is false.

Facts of the problem:
  tiles      128x128 tiles of one expert's output
  n_tiles    128-column tiles of one expert's output (along intermediate)
  out_bytes  bytes of an output element
  acc        the output is accumulated into (``accumulate``)
  out16      a 16-bit output written, not accumulated
  tokens     tokens per expert on average, when the call's tokens_sum is known
  pair_m     a CTA pair fits the hidden extent (``pair_fits``: a 2x1 pair's rows)
  pair_n     a CTA pair fits the intermediate extent (a 1x2 pair's columns)
  n192       192-wide column tiles cover the intermediate extent with at most 1% padding
             (``fits192``), in a count a 1x2 pair fits
  m192       192-tall row tiles cover the hidden extent with at most 1% padding (``pads``)
  m128       128-tall row tiles cover the hidden extent with at most 1% padding
  recipe     the scale recipe (gwgrad/scales.py), ``none`` for BF16
  open       the caller chose neither the tile nor the cluster
Facts of the tiling chosen (by the caller or a rule), for the later fields:
  schedule   the SM90 tile's consumer schedule: ``cooperative``, ``pingpong`` or ``none``
  two_sets   the kernel runs two sets of epilogue staging buffers on that tile
  pair       the cluster is a CTA pair (1x2 or 2x1)
"""

from __future__ import annotations

import fractions
import operator
import re
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

from ..kernels.tiling import SM90_FP8_TILES, SM90_TILES, UNIT_SCHEDULES, epi_buffer_sets_problem
from ..spec import TUNING_FIELDS, StaticSpec, Tuning


def pair_fits(extent: int, width: int = 128) -> bool:
    """Whether a pair of ``width``-wide CTA tiles along an output extent (``intermediate``: a
    1x2 pair; ``hidden``: a 2x1 pair) covers it with at most 1/16 of the pairs' CTAs idle (an
    odd count of tiles leaves the last pair's second CTA without a tile: it computes and stores
    nothing)."""
    tiles = -(-extent // width)
    return tiles >= 2 and (tiles % 2 == 0 or tiles >= 16)


def pads(extent: int, width: int) -> bool:
    """Whether ``width``-wide tiles along ``extent`` pad it by at most 1% (the tile
    quantization: a tile past the extent computes and stores rows that do not exist)."""
    return -(-extent // width) * width * 100 <= extent * 101


def fits192(extent: int) -> bool:
    """Whether 192-wide tiles along ``extent`` (a 128x192 tile's columns) pad it by at most 1%
    (``pads``) and come in a count a CTA pair covers (``pair_fits`` in 192-wide tiles)."""
    return pads(extent, 192) and pair_fits(extent, 192)


class Problem:
    """The facts a condition reads, of one spec (and the call's tokens, when known) and the
    tuning chosen so far."""

    def __init__(self, spec: StaticSpec, tokens_sum: Optional[int], chosen: Dict[str, object]):
        self.spec = spec
        self.chosen = chosen
        out_bytes = spec.wgrad_dtype.itemsize
        self.facts: Dict[str, object] = {
            "tiles": -(-spec.hidden // 128) * -(-spec.intermediate // 128),
            "n_tiles": -(-spec.intermediate // 128),
            "out_bytes": out_bytes,
            "acc": spec.accumulate,
            "out16": out_bytes == 2 and not spec.accumulate,
            "tokens": (None if tokens_sum is None
                       else fractions.Fraction(tokens_sum, max(spec.num_experts, 1))),
            "pair_m": pair_fits(spec.hidden),
            "pair_n": pair_fits(spec.intermediate),
            "n192": fits192(spec.intermediate),
            "m192": pads(spec.hidden, 192),
            "m128": pads(spec.hidden, 128),
            "recipe": spec.scale_recipe or "none",
            "open": spec.mma_tiler_mn is None and spec.cluster_shape_mn is None,
        }

    def _tiling(self, fact: str) -> Tuple[Tuple[int, int], Tuple[int, int]]:
        tile, cluster = self.chosen.get("mma_tiler_mn"), self.chosen.get("cluster_shape_mn")
        if tile is None or cluster is None:
            raise RuntimeError(f"a tuning rule reads {fact!r} before the tiling is chosen")
        return tile, cluster

    def __getitem__(self, fact: str):
        if fact in self.facts:
            return self.facts[fact]
        if fact in ("schedule", "two_sets", "pair"):
            tile, cluster = self._tiling(fact)
            # MXFP8 with mainloop=2 runs the BF16 kernel's tiles.
            fp8 = self.spec.is_block_scaled and self.spec.mainloop != 2
            tiles = SM90_FP8_TILES if fp8 else SM90_TILES
            schedule = tiles.get(tuple(tile)) if self.spec.arch.startswith("sm_9") else None
            if fact == "schedule":
                return schedule or "none"
            if fact == "two_sets":
                return epi_buffer_sets_problem(2, schedule, tile[0]) is None
            return sorted(cluster) == [1, 2]
        raise KeyError(fact)


FACTS = ("tiles", "n_tiles", "out_bytes", "acc", "out16", "tokens", "pair_m", "pair_n", "n192",
         "m192", "m128", "recipe", "open", "schedule", "two_sets", "pair")
_OPS = {"<": operator.lt, "<=": operator.le, ">": operator.gt, ">=": operator.ge,
        "==": operator.eq, "!=": operator.ne}
_TERM = re.compile(r"(?:(not) )?(\w+)(?: (<=|>=|==|!=|<|>) (\w+))?")


def _term(text: str) -> Callable[[Problem], bool]:
    m = _TERM.fullmatch(text.strip())
    if m is None or m.group(2) not in FACTS or (m.group(1) and m.group(3)):
        raise ValueError(f"tuning rule: cannot read the term {text!r} (facts: {FACTS})")
    negate, fact, op, value = m.groups()
    if op is None:
        return (lambda p: not p[fact]) if negate else (lambda p: bool(p[fact]))
    literal = int(value) if value.isdigit() else value
    compare = _OPS[op]

    def holds(p: Problem) -> bool:
        have = p[fact]
        return have is not None and compare(have, literal)

    return holds


_SCHEDULES = {name: number for number, name in UNIT_SCHEDULES.items() if number}
_PAIR = re.compile(r"(\d+)x(\d+)")


def _value(field: str, text: str):
    pair = _PAIR.fullmatch(text)
    if field in ("mma_tiler_mn", "cluster_shape_mn") and pair:
        return int(pair.group(1)), int(pair.group(2))
    if field == "unit_schedule" and text in _SCHEDULES:
        return _SCHEDULES[text]
    if field not in ("mma_tiler_mn", "cluster_shape_mn", "unit_schedule") and text.isdigit():
        return int(text)
    raise ValueError(f"tuning rule: cannot read {field}={text}")


@dataclass(frozen=True)
class Rule:
    """``sets`` where ``condition`` holds. Written ``"name: condition -> sets"``, ``sets`` being
    the tile and cluster (``MxN MxN``) and / or ``field=value`` pairs of ``Tuning``'s fields
    (``unit_schedule`` by name: ``dynamic``, ``balanced``)."""

    name: str
    condition: str
    sets: Tuple[Tuple[str, object], ...]

    @classmethod
    def parse(cls, line: str) -> "Rule":
        m = re.fullmatch(r"([\w-]+): *(.*?) *-> *(.+)", line.strip())
        if m is None:
            raise ValueError(f"tuning rule: expected 'name: condition -> sets', got {line!r}")
        name, condition, text = m.groups()
        words, sets = text.split(), []
        for field, word in zip(("mma_tiler_mn", "cluster_shape_mn"), words[:2]):
            if not _PAIR.fullmatch(word):
                break
            sets.append((field, _value(field, word)))
        for word in words[len(sets):]:
            field, _, value = word.partition("=")
            if field not in TUNING_FIELDS or not value:
                raise ValueError(f"tuning rule {name}: cannot read {word!r} (fields: "
                                 f"{TUNING_FIELDS})")
            sets.append((field, _value(field, value)))
        return cls(name, condition, tuple(sets))

    def __post_init__(self):
        terms = [_term(t) for t in self.condition.split(" and ")] if self.condition else []
        object.__setattr__(self, "_terms", tuple(terms))

    def holds(self, problem: Problem) -> bool:
        return all(term(problem) for term in self._terms)


def rules(*lines: str) -> Tuple[Rule, ...]:
    """A rule table from its lines (``Rule.parse``); names unique."""
    table = tuple(Rule.parse(line) for line in lines)
    names = [rule.name for rule in table]
    if len(set(names)) != len(names):
        raise ValueError(f"tuning rules: a name used twice in {names}")
    return table


def decide(table: Tuple[Rule, ...], spec: StaticSpec,
           tokens_sum: Optional[int] = None) -> Dict[str, Tuple[object, str]]:
    """field -> (value, the name of the rule that set it, or "caller") for every field of
    ``spec.tuning``: the caller's where set (not None / 0), else, in ``Tuning``'s order, the
    first rule of ``table`` that sets the field and whose condition holds. A table sets every
    field (its last rules hold always)."""
    chosen = {f: getattr(spec.tuning, f) for f in TUNING_FIELDS if getattr(spec.tuning, f)}
    decided = {f: (value, "caller") for f, value in chosen.items()}
    problem = Problem(spec, tokens_sum, chosen)
    for field in TUNING_FIELDS:
        if field in chosen:
            continue
        for rule in table:
            sets = dict(rule.sets)
            if field in sets and rule.holds(problem):
                chosen[field] = sets[field]
                decided[field] = (sets[field], rule.name)
                break
        else:
            raise RuntimeError(f"the tuning rules {[r.name for r in table]} set no {field}")
    return {f: decided[f] for f in TUNING_FIELDS}


def resolve(table: Tuple[Rule, ...], spec: StaticSpec,
            tokens_sum: Optional[int] = None) -> Tuning:
    """``spec.tuning`` with every field the caller left unset (None / 0) filled from ``table``
    (``decide``)."""
    return Tuning(**{f: value for f, (value, _) in decide(table, spec, tokens_sum).items()})


# The tables: one line per rule, in priority order; thresholds in 128x128 output tiles per
# expert (``tiles``) and tokens per expert. Measurements: docs/PERFORMANCE.md, "Defaults and
# why", by rule name.

#: SM90 BF16 (backends/bf16_sm90.py).
SM90_BF16_LINES = (
    "sm90-short-192: open and tokens <= 384 and tiles <= 128 and out16 and m192 and pair_n -> 192x128 1x2",
    "sm90-short-pair: open and tokens <= 384 and tiles <= 128 and out16 and pair_m -> 128x256 2x1",
    "sm90-short-coop: open and tokens <= 384 and tiles <= 128 and out16 -> 128x256 1x1",
    "sm90-short-fp32: open and tokens <= 384 and tiles <= 128 and out_bytes == 4 and n_tiles >= 2 -> 128x128 1x2",
    "sm90-192-rows: open and out16 and m192 and not m128 -> 192x128 1x1",
    "sm90-192-pair: open and out16 and n192 -> 128x192 1x2",
    "sm90-fp32-pair: open and out_bytes == 4 and tiles >= 1024 and pair_n -> 128x128 1x2",
    "sm90-wide: tiles >= 4096 -> 128x256 1x1",
    "sm90-pair: open and out16 and pair_n -> 128x128 1x2",
    "sm90-pingpong: -> 128x128 1x1",
    "sm90-epi-16bit: out_bytes == 2 -> raster_group=16 epi_tile_n=64",
    "sm90-epi-fp32: -> raster_group=16 epi_tile_n=32",
    "sm90-sets-pingpong: out16 and schedule == pingpong and tiles >= 1024 -> epi_buffer_sets=2",
    "sm90-sets-coop: out16 and schedule == cooperative and two_sets and tiles <= 128 -> epi_buffer_sets=2",
    "sm90-one-set: -> epi_buffer_sets=1",
    "sm90-fp32-small-dynamic: pair and out_bytes == 4 and tiles < 1024 -> unit_schedule=dynamic",
    "sm90-balanced: pair -> unit_schedule=balanced",
    "sm90-dynamic: -> unit_schedule=dynamic",
    "sm90-one-launch: -> launches=1 mainloop=1",
)
SM90_BF16 = rules(*SM90_BF16_LINES)

#: SM90 FP8, the scale recipes of gwgrad/scales.py (backends/fp8_sm90.py).
SM90_FP8 = rules(
    "fp8-mxfp8: recipe == blocked -> 64x128 1x1",
    "fp8-narrow: n_tiles <= 1 -> 128x128 1x1",
    "fp8-short-pair: open and tokens <= 384 and tiles <= 128 and out16 and recipe != blocked and pair_m -> 128x192 2x1",
    "fp8-channel-pair: recipe == per_expert_channel and pair_m -> 128x192 2x1",
    "fp8-coop: -> 128x192 1x1",
    "fp8-epi-16bit: out_bytes == 2 -> raster_group=16 epi_tile_n=64",
    "fp8-epi-fp32: -> raster_group=16 epi_tile_n=32",
    "fp8-short-sets: tokens <= 384 and tiles <= 128 and out16 and recipe != blocked and two_sets -> epi_buffer_sets=2",
    "fp8-rest: -> epi_buffer_sets=1 unit_schedule=dynamic launches=2 mainloop=1",
)

#: SM90 MXFP8 with mainloop=2 (backends/fp8_sm90.py, Mxfp8Bf16Sm90Backend): the BF16 kernel's
#: rules but two launches (its prep kernel checks the scale tensors' capacity).
SM90_MXFP8_BF16 = rules(
    *(line for line in SM90_BF16_LINES if not line.startswith("sm90-one-launch")),
    "fp8-mxfp8-bf16-launches: -> launches=2 mainloop=2",
)

#: SM100, BF16 and block-scaled (backends/bf16_sm100.py, blockscaled_sm100.py).
SM100 = rules(
    "sm100-narrow: n_tiles <= 1 -> 256x128 2x1",
    "sm100-2cta: -> 256x256 2x1",
    "sm100-rest: -> raster_group=16 epi_tile_n=0 epi_buffer_sets=1 unit_schedule=dynamic launches=2 mainloop=1",
)

#: The CPU reference (backends/reference.py) and any backend without a table of its own: a
#: tiling some GPU kernel runs.
REFERENCE = rules(
    "cpu-tiling: -> 128x256 1x1",
    "cpu-rest: -> raster_group=16 epi_tile_n=64 epi_buffer_sets=1 unit_schedule=dynamic launches=2 mainloop=1",
)

#: Every table by name (the tests and the docs check walk them).
TABLES = {"SM90_BF16": SM90_BF16, "SM90_FP8": SM90_FP8, "SM90_MXFP8_BF16": SM90_MXFP8_BF16,
          "SM100": SM100, "REFERENCE": REFERENCE}
