"""`python -m benchmarks.fp8`: FP8 weight gradients on an H100/H200, on the MoE shapes of
shapes.json (uniform and zipf counts, multiples of 256), gwgrad's three scale recipes
(gwgrad/scales.py) against what a Hopper user has, in one process and one interleaved
round-robin per row (CUDA events, warm-up, medians; benchmarks.wgrad.time_methods):

* ``gwgrad_bf16``: gwgrad's BF16 kernel on the same problem (x.T M-major, dy N-major);
* ``fp8_channel``: per-expert channel FP32 scales (torch._scaled_grouped_mm's 2D-2D form);
* ``fp8_1x128``: one FP32 scale per channel per 128 tokens of an expert (DeepSeek-V3);
* ``mxfp8``: the contract's MXFP8 (E8M0 per 32 tokens, blocked layout);
* ``torch_scaled_grouped_mm``: torch._scaled_grouped_mm 2D-2D on the channel-scaled inputs;
* ``dense_fp8``: one torch._scaled_mm (rowwise FP32 scales) of equal FLOPs: the FP8 ceiling;
* ``scaled_mm_loop``: a torch._scaled_mm per expert (its rows of the channel scales) into its
  output, an empty expert zeroed: the dense kernel at each expert's own shape, the ceiling
  with the grouped problem's per-expert K (each output tile sums one expert's tokens).

gwgrad's FP8 operands are K-major (x.T and dy.T quantized token-contiguous, as Hopper's FP8
WGMMA needs). Each gwgrad method runs through its launch plan (plan_for + launch, preallocated
workspace): the kernel's own time. The channel recipe's output is checked against
torch._scaled_grouped_mm's (same inputs and semantics).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from typing import Callable, Dict, List, Optional

from .wgrad import (DEFAULT_SHAPES, _cumsum, _error, _rel_err, config_name, parse_tile, time_methods,
               token_counts)


#: gwgrad's FP8 recipes as the bench names them (--recipes): channel scales, 1x128 blocks, MXFP8.
RECIPES = ("channel", "1x128", "mx")


class Fp8Row:
    """One row's FP8 inputs (random values, unit-ish scales) and its gwgrad launchers."""

    def __init__(self, shape: Dict, dist: str, seed: int = 0):
        import torch

        import gwgrad
        from gwgrad import scales as S

        self.shape, self.dist = shape, dist
        m, n = self.hidden, self.intermediate = shape["hidden"], shape["intermediate"]
        e, t = self.num_experts, self.tokens_sum = shape["num_experts"], shape["tokens_sum"]
        self.counts = token_counts(t, e, dist, 256)
        dev = "cuda"
        gen = torch.Generator(device=dev).manual_seed(seed)
        self.offsets = torch.tensor(_cumsum(self.counts), dtype=torch.int32, device=dev)
        fp8 = torch.float8_e4m3fn
        self.a = torch.randn(m, t, device=dev, generator=gen).to(fp8)  # x.T, K-major
        self.bt = torch.randn(n, t, device=dev, generator=gen).to(fp8)  # dy.T
        self.b = self.bt.t()  # (T, N), K-major: strides (1, T)
        self.x = torch.randn(t, m, device=dev, generator=gen, dtype=torch.bfloat16)
        self.dy = torch.randn(t, n, device=dev, generator=gen, dtype=torch.bfloat16)
        self.out = torch.empty(e, m, n, device=dev, dtype=torch.bfloat16)
        self.ref = torch.empty_like(self.out)
        self.scales = {
            "channel": (torch.rand(e, m, device=dev, generator=gen) + 0.5,
                        torch.rand(e, n, device=dev, generator=gen) + 0.5),
        }
        rows = S.columns_needed(self.counts, S.column_rule(S.BLOCK_1X128, 128))
        self.scales["1x128"] = (torch.rand(rows, m, device=dev, generator=gen) + 0.5,
                                torch.rand(rows, n, device=dev, generator=gen) + 0.5)
        cols = S.columns_needed(self.counts, S.column_rule(S.BLOCKED, 32))
        e8m0 = torch.float8_e8m0fnu
        self.scales["mx"] = (
            torch.full((S.round_up(m, 128), cols), 127, dtype=torch.uint8, device=dev).view(e8m0),
            torch.full((S.round_up(n, 128), cols), 127, dtype=torch.uint8, device=dev).view(e8m0))
        self.gwgrad = gwgrad

    @property
    def flops(self) -> float:
        return 2.0 * self.hidden * self.intermediate * self.tokens_sum

    def runner(self, recipe: str, mma_tiler_mn=None, tuning=()) -> Callable[[], None]:
        """gwgrad's FP8 kernel with `recipe` ("channel", "1x128", "mx") through its plan;
        ``tuning``: (StaticSpec tuning field, value) pairs replacing the default's."""
        import torch

        from gwgrad.plan import PlanCache, compile_spec, plan_for_spec
        from gwgrad.spec import Tuning

        gw = self.gwgrad
        desc = gw.as_tensor_desc
        sfa, sfb = self.scales[recipe]
        names = {"channel": ("per_expert_channel", 16), "1x128": ("block_1x128", 128),
                 "mx": (None, 32)}
        scale_recipe, vec = names[recipe]
        extra = {} if mma_tiler_mn is None else {"mma_tiler_mn": tuple(mma_tiler_mn),
                                                 "cluster_shape_mn": (1, 1)}
        if dict(tuning).get("mainloop") == 2:
            extra = {}  # the FP8 default's plan, then the two-pass spec from its request
        descs = (desc(self.a, "a_tensor"), desc(self.b, "b_tensor"),
                 desc(self.offsets, "offsets_tensor"), desc(self.out, "wgrad_tensor"))
        scale_descs = {"sfa": desc(sfa, "sfa_tensor"), "sfb": desc(sfb, "sfb_tensor")}
        # The default as the wrapper runs it (gwgrad sizes the workspace: MXFP8 on SM90 in two
        # passes); a variant names its tiling.
        plan = gw.plan_for(*descs[:3], wgrad=descs[3], sf_vec_size=vec,
                           scale_recipe=scale_recipe, **scale_descs, **extra,
                           grow_workspace=mma_tiler_mn is None and not tuning)
        if dict(tuning).get("mainloop") == 2:
            # The two-pass MXFP8 path: the BF16 kernel's rules fill what the entry leaves open
            # (its tiles are BF16's, not the FP8 default's).
            fields = {"mma_tiler_mn": tuple(mma_tiler_mn), "cluster_shape_mn": (1, 1),
                      **dict(tuning)}
            operator = compile_spec(dataclasses.replace(plan.spec, tuning=Tuning(**fields)))
            plan = plan_for_spec(operator, *descs, None, PlanCache(), **scale_descs,
                                 global_scale_a=None, global_scale_b=None)
        elif tuning:
            operator = compile_spec(plan.spec.with_tuning(**dict(tuning)))
            plan = plan_for_spec(operator, *descs, None, PlanCache(), **scale_descs,
                                 global_scale_a=None, global_scale_b=None)
        ws = torch.zeros(max(plan.workspace_bytes, 1), dtype=torch.uint8, device="cuda")
        stream = torch.cuda.current_stream().cuda_stream
        addrs = (self.a.data_ptr(), self.b.data_ptr(), self.offsets.data_ptr(),
                 self.out.data_ptr())
        scales = (sfa.data_ptr(), sfb.data_ptr(), 0, 0)
        keep = (ws, sfa, sfb)
        launch = plan.launch

        def run():
            launch(*addrs, stream=stream, workspace=ws.data_ptr(), scales=scales)

        run.keep = keep
        run.tile = tuple(plan.spec.mma_tiler_mn)
        return run

    def bf16(self) -> Callable[[], None]:
        from .wgrad import KernelRunner

        return KernelRunner(self.x.t(), self.dy, self.offsets, self.ref)

    def torch_scaled_grouped(self):
        import torch

        sa, sb = self.scales["channel"]
        a, b, offs = self.a, self.b, self.offsets
        flat_a, flat_b = sa.reshape(-1), sb.reshape(-1)
        return lambda: torch._scaled_grouped_mm(a, b, flat_a, flat_b, offs=offs,
                                                out_dtype=torch.bfloat16)

    def dense_fp8(self):
        import torch

        m, n = self.hidden, self.intermediate
        sa = torch.ones(m, 1, device="cuda")
        sb = torch.ones(1, n, device="cuda")
        a, b = self.a, self.b
        return lambda: torch._scaled_mm(a, b, sa, sb, out_dtype=torch.bfloat16)

    def scaled_mm_loop(self):
        import torch

        sa, sb = self.scales["channel"]
        out = self.ref
        calls, empty = [], []
        start = 0
        for e, c in enumerate(self.counts):
            if c:
                calls.append((self.a[:, start:start + c], self.bt[:, start:start + c].t(),
                              sa[e].reshape(-1, 1).contiguous(),
                              sb[e].reshape(1, -1).contiguous(), out[e]))
            else:
                empty.append(out[e])
            start += c

        def loop():
            for a, b, s_a, s_b, o in calls:
                torch._scaled_mm(a, b, s_a, s_b, out_dtype=torch.bfloat16, out=o)
            for o in empty:
                o.zero_()
            return out

        return loop


def variant_name(recipe: str, tile: tuple) -> str:
    """The method name of a --tiles variant (a parse_tile result): fp8_<recipe>_MxN[:f=v]."""
    return f"fp8_{recipe}_{config_name(tile)[len('gwgrad_'):]}"


def variant_applies(recipe: str, tile: tuple) -> bool:
    """Whether a --tiles variant (a parse_tile result) is timed for ``recipe``: one that names
    a ``mainloop`` picks between MXFP8's kernels (1: the promoting kernel, 2: dequantized to
    BF16), so it runs for MXFP8 alone."""
    return recipe == "mx" or "mainloop" not in dict(tile[2:])


def run_row(shape: Dict, dist: str, rounds: int, sample_ms: float, tiles: List,
            recipes=RECIPES, fp8_only: bool = False) -> Dict:
    """One row's methods timed together. ``recipes``: gwgrad's FP8 recipes to time (each at
    its default tile and every ``tiles`` variant); ``fp8_only``: leave out gwgrad BF16 and
    torch's methods (an A/B of gwgrad's FP8 variants alone: each method then follows one of
    its kind in the round-robin, so that a competitor's power draw biases none of them)."""
    import torch

    row = {"name": shape["name"], "dist": dist, **{k: shape[k] for k in (
        "hidden", "intermediate", "num_experts", "tokens_sum")}, "methods": {}}
    meth = row["methods"]
    try:
        inp = Fp8Row(shape, dist)
    except Exception as exc:  # noqa: BLE001
        row["error"] = _error(exc)
        return row
    row["counts_min_max"] = [min(inp.counts), max(inp.counts)]
    fns: Dict[str, Callable] = {}

    def add(name, make):
        try:
            fns[name] = make()
        except Exception as exc:  # noqa: BLE001 - recorded, the row goes on
            meth[name] = {"error": _error(exc)}

    if not fp8_only:
        add("gwgrad_bf16", inp.bf16)
    for recipe in recipes:
        add(f"fp8_{recipe}", lambda r=recipe: inp.runner(r))
        for tile in tiles:
            if not variant_applies(recipe, tile):
                continue
            add(variant_name(recipe, tile), lambda r=recipe, t=tile: inp.runner(r, t[:2], t[2:]))
    row["tiles"] = {k: "{}x{}".format(*f.tile) for k, f in fns.items() if hasattr(f, "tile")}
    if not fp8_only:
        add("torch_scaled_grouped_mm", inp.torch_scaled_grouped)
        add("dense_fp8", inp.dense_fp8)
        add("scaled_mm_loop", inp.scaled_mm_loop)
    # Correctness: the channel recipe against torch._scaled_grouped_mm (same semantics), and
    # the per-expert loop against it (timed only on the same answer).
    if "torch_scaled_grouped_mm" in fns:
        want = None
        try:
            want = fns["torch_scaled_grouped_mm"]()
            if "fp8_channel" in fns:
                inp.out.fill_(float("nan"))
                fns["fp8_channel"]()
                torch.cuda.synchronize()
                inp.gwgrad.check_errors()
                row["rel_err_channel_vs_torch"] = _rel_err(inp.out, want)
        except Exception as exc:  # noqa: BLE001
            row["check_error"] = _error(exc)
        if "scaled_mm_loop" in fns:
            try:
                inp.ref.fill_(float("nan"))
                err = row["rel_err_loop_vs_torch"] = _rel_err(fns["scaled_mm_loop"](), want)
                problem = None if err < 1e-2 else f"relative error {err:.3g} vs torch"  # NaN too
            except Exception as exc:  # noqa: BLE001 - no reference (want None) included
                problem = _error(exc)
            if problem:
                fns.pop("scaled_mm_loop")
                meth["scaled_mm_loop"] = {"error": problem}
    times = time_methods(fns, meth, rounds=rounds, sample_ms=sample_ms)
    for name, ms in times.items():
        meth[name] = {"ms": ms, "tflops": inp.flops / ms / 1e9}
    t = {k: v["tflops"] for k, v in meth.items() if "tflops" in v}
    for recipe in RECIPES:
        best = max((v, k) for k, v in t.items() if k.startswith(f"fp8_{recipe}")) if any(
            k.startswith(f"fp8_{recipe}") for k in t) else None
        if best is None:
            continue
        row[f"{recipe}_best"] = {"method": best[1], "tflops": best[0]}
        for comp in ("gwgrad_bf16", "torch_scaled_grouped_mm", "dense_fp8", "scaled_mm_loop"):
            if comp in t:
                row.setdefault("ratios", {})[f"{recipe}_vs_{comp}"] = best[0] / t[comp]
    del inp
    torch.cuda.empty_cache()
    return row


def table(rows: List[Dict]) -> str:
    head = (f"{'row':<22}{'bf16':>7}{'chan':>7}{'1x128':>7}{'mx':>7}{'torchSG':>8}{'denseF8':>8}"
            f"{'loopF8':>8}{'ch/tSG':>7}{'ch/dF8':>7}{'ch/loop':>8}{'ch/bf16':>8}{'1x/bf16':>8}"
            f"{'mx/bf16':>8}")
    lines = [head]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['name'] + ' ' + r['dist']:<22} error: {r['error'][:80]}")
            continue
        m = r["methods"]

        def tf(k):
            v = m.get(k, {}).get("tflops")
            return f"{v:7.0f}" if v else f"{'-':>7}"

        best = {k: r.get(f"{k}_best", {}).get("tflops") for k in RECIPES}
        ratios = r.get("ratios", {})

        def ra(k, w=7):
            v = ratios.get(k)
            return f"{v:{w}.2f}" if v else f"{'-':>{w}}"

        lines.append(
            f"{r['name'] + ' ' + r['dist']:<22}{tf('gwgrad_bf16')}"
            + "".join(f"{v:7.0f}" if v else f"{'-':>7}" for v in best.values())
            + f"{tf('torch_scaled_grouped_mm'):>8}{tf('dense_fp8'):>8}"
            + f"{tf('scaled_mm_loop'):>8}"
            + ra("channel_vs_torch_scaled_grouped_mm") + ra("channel_vs_dense_fp8")
            + ra("channel_vs_scaled_mm_loop", 8)
            + ra("channel_vs_gwgrad_bf16", 8) + ra("1x128_vs_gwgrad_bf16", 8)
            + ra("mx_vs_gwgrad_bf16", 8))
    return "\n".join(lines)


def markdown(rows: List[Dict]) -> str:
    """The README's table of the rows (TFLOP/s, each recipe at its best tile; ratios)."""
    lines = ["| shape | tokens | gwgrad BF16 | FP8 channel (tile) | FP8 1x128 (tile) | MXFP8 | "
             "`torch._scaled_grouped_mm` | dense FP8 `_scaled_mm` | per-expert `_scaled_mm` | "
             "channel / torch | channel / dense FP8 | channel / per-expert | channel / BF16 | "
             "1x128 / BF16 | MXFP8 / BF16 |",
             "|" + "---|" * 15]
    for r in rows:
        if "error" in r or not r.get("ratios"):
            continue
        m, ra = r["methods"], r["ratios"]

        def tf(k):
            return f"{m[k]['tflops']:.0f}" if "tflops" in m.get(k, {}) else "-"

        def best(recipe):
            b = r.get(f"{recipe}_best")
            if not b:
                return "-"
            tile = r.get("tiles", {}).get(b["method"], "?")
            return f"{b['tflops']:.0f} ({tile})"

        def ratio(k):
            return f"{ra[k]:.2f}" if k in ra else "-"

        lines.append(
            f"| {r['name']} | {r['dist']} | {tf('gwgrad_bf16')} | {best('channel')} | "
            f"{best('1x128')} | {best('mx')} | {tf('torch_scaled_grouped_mm')} | "
            f"{tf('dense_fp8')} | {tf('scaled_mm_loop')} | "
            f"{ratio('channel_vs_torch_scaled_grouped_mm')} | {ratio('channel_vs_dense_fp8')} | "
            f"{ratio('channel_vs_scaled_mm_loop')} | {ratio('channel_vs_gwgrad_bf16')} | "
            f"{ratio('1x128_vs_gwgrad_bf16')} | {ratio('mx_vs_gwgrad_bf16')} |")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.fp8",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default=DEFAULT_SHAPES)
    p.add_argument("--rows", default="")
    p.add_argument("--dist", default="uniform,zipf")
    p.add_argument("--tiles", default="",
                   help="extra FP8 tiles timed besides the default (comma-separated MxN, or "
                        "MxN:field=value with a tuning field, as in python -m benchmarks.wgrad; "
                        "MxN[:cluster=..]:mainloop=2 times MXFP8 dequantized to BF16 then the "
                        "BF16 kernel at that BF16 tile, MxN:mainloop=1 MXFP8's promoting "
                        "kernel; a variant naming a mainloop runs for MXFP8 only)")
    p.add_argument("--recipes", default=",".join(RECIPES),
                   help="gwgrad's FP8 recipes to time (comma-separated: channel, 1x128, mx)")
    p.add_argument("--fp8-only", action="store_true",
                   help="time gwgrad's FP8 recipes and variants alone (no BF16, no torch)")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--sample-ms", type=float, default=12.0)
    p.add_argument("--time-budget", type=float, default=0.0,
                   help="seconds; rows not started within it are skipped (0: no limit)")
    p.add_argument("--json", default="bench_fp8.json")
    p.add_argument("--markdown", action="store_true", help="also print the README's table")
    args = p.parse_args(argv)
    start = time.monotonic()
    with open(args.shapes) as f:
        shapes = json.load(f)["shapes"]
    wanted = [s for s in args.rows.split(",") if s]
    tiles = [parse_tile(t.strip()) for t in args.tiles.split(",") if t.strip()]
    recipes = tuple(r for r in args.recipes.split(",") if r)
    unknown = [r for r in recipes if r not in RECIPES]
    if unknown or not recipes:
        p.error(f"--recipes: expected some of {', '.join(RECIPES)}, got {args.recipes!r}")
    rows = []
    for shape in shapes:
        if wanted and shape["name"] not in wanted:
            continue
        for dist in args.dist.split(","):
            if args.time_budget and time.monotonic() - start > args.time_budget:
                rows.append({"name": shape["name"], "dist": dist,
                             "error": "skipped: --time-budget spent"})
                continue
            rows.append(run_row(shape, dist, args.rounds, args.sample_ms, tiles, recipes,
                                args.fp8_only))
            print(table(rows[-1:]).splitlines()[-1], flush=True)
            with open(args.json, "w") as f:
                json.dump({"rows": rows}, f, indent=1)
    print(table(rows))
    if args.markdown:
        print(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
