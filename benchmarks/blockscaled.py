"""`python -m benchmarks.blockscaled`: block-scaled weight gradients (MXFP8, NVFP4, MXFP4) on an
SM100-family (Blackwell, compute capability 10.x) GPU, on every MoE shape of
benchmarks/shapes.json (``--shapes`` for another), uniform and zipf counts rounded to
multiples of 256, in one process and one interleaved round-robin per row (CUDA
events, warm-up, medians; benchmarks.wgrad.time_methods):

* ``gwgrad_<fmt>``: gwgrad's block-scaled kernel through its launch plan (plan_for + launch,
  preallocated workspace: the kernel's own time), BF16 output, at the default tiling and at
  every ``--tiles`` value; its operands come from ``gwgrad.quantize`` of BF16 x and dy: data
  K-major (channels, tokens), scales in the blocked layout the GEMM reads (NVFP4 also the
  per-expert global scales);
* ``gwgrad_bf16``: gwgrad's BF16 kernel on the same shape (x.T M-major, dy N-major);
* ``torch_scaled_grouped_mm_mxfp8``: ``torch._scaled_grouped_mm`` MXFP8 2D-2D on gwgrad's
  MXFP8 operands and scales (the per-group blocked layout it reads), where this torch build
  supports it; otherwise reported as n/a with the reason;
* ``dense_scaled_mm_<fmt>``: one ``torch._scaled_mm`` of equal FLOPs (hidden x intermediate x
  tokens_sum) in the same format, where available: the block-scaled ceiling;
* ``copy``: a large device-to-device copy (bytes read + written): the HBM bandwidth of this run,
  for the HBM roofline of the rows with many small experts.

Before timing, each gwgrad format's output (NaN-filled first) is spot-checked against float64
products of the dequantized inputs on two experts, and gwgrad MXFP8 is compared with torch's
2D-2D result where that runs. The paper's targets are printed with a PASS/MISS column per row
(``TARGET_TEXT``). Without an SM100 GPU the command exits with status 2 and says so.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from .wgrad import (DEFAULT_SHAPES, CopyBuffers, KernelRunner, _cumsum, _error, _write,
               record_times, roofline_fraction, select_shapes, time_methods, token_counts)

#: Counts are rounded to this (so that torch._scaled_grouped_mm and every format accept them).
COUNT_MULTIPLE = 256
#: Rows with at least this many tokens per expert carry the throughput targets.
COARSE_TOKENS_PER_EXPERT = 2048
#: TFLOP/s targets (on the coarse rows) and the ratio over torch._scaled_grouped_mm MXFP8.
TARGET_TFLOPS = {"mxfp8": 2400.0, "nvfp4": 4000.0}
TARGET_VS_TORCH = 1.3
TARGET_TEXT = ("MXFP8 >= 2.4 PFLOP/s and NVFP4 >= 4.0 PFLOP/s on the shapes with >= 2048 tokens "
               "per expert; MXFP8 >= 1.3x torch._scaled_grouped_mm MXFP8 2D-2D")
#: Relative error (Frobenius) allowed in the spot checks: FP32 accumulation, BF16 output.
CHECK_TOLERANCE = 1e-2
#: Rows and columns of each spot-checked expert block.
CHECK_BLOCK = 256
NEEDS_SM100 = ("python -m benchmarks.blockscaled needs an SM100-family GPU (Blackwell: B200, "
               "GB200, B300; compute capability 10.x)")


@dataclass(frozen=True)
class BlockFormat:
    """One block-scaled format as gwgrad.quantize makes it and the GEMM reads it."""

    name: str
    elem: str  # "e4m3" or "e2m1" (packed two per byte along the tokens)
    sf_vec: int  # tokens per scale
    sf: str  # scale codes: "e8m0" or "e4m3"
    global_scale: bool  # per-expert FP32 global scales (NVFP4)

    @property
    def fp4(self) -> bool:
        return self.elem == "e2m1"

    @property
    def elem_bytes(self) -> float:
        return 0.5 if self.fp4 else 1.0


FORMATS: Dict[str, BlockFormat] = {
    "mxfp8": BlockFormat("mxfp8", "e4m3", 32, "e8m0", False),
    "nvfp4": BlockFormat("nvfp4", "e2m1", 16, "e4m3", True),
    "mxfp4": BlockFormat("mxfp4", "e2m1", 32, "e8m0", False),
}


# ----------------------------------------------------------------------------------------
# rows, counts and arithmetic (no GPU)
# ----------------------------------------------------------------------------------------


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def row_counts(shape: Dict, dist: str) -> List[int]:
    """The row's per-expert token counts: ``dist`` ("uniform" / "zipf") rounded to 256."""
    return token_counts(shape["tokens_sum"], shape["num_experts"], dist, COUNT_MULTIPLE)


def flops(hidden: int, intermediate: int, tokens_sum: int) -> float:
    """The weight gradient's FLOPs: one multiply-add per (row, column, token)."""
    return 2.0 * hidden * intermediate * tokens_sum


def tokens_per_expert(shape: Dict) -> float:
    return shape["tokens_sum"] / shape["num_experts"]


def is_coarse(shape: Dict) -> bool:
    """A row the PFLOP/s targets apply to: at least 2048 tokens per expert on average."""
    return tokens_per_expert(shape) >= COARSE_TOKENS_PER_EXPERT


def scale_columns(counts: Sequence[int], sf_vec: int) -> int:
    """Blocked scale columns the counts need: sum of round_up(ceil(count / sf_vec), 4)."""
    return sum(round_up(-(-int(c) // sf_vec), 4) for c in counts)


def hbm_bytes(fmt: str, hidden: int, intermediate: int, counts: Sequence[int],
              out_bytes: int = 2) -> int:
    """Bytes a block-scaled weight gradient must move at least: both operands and their scales
    read once, the output written once."""
    f = FORMATS[fmt]
    tokens = sum(counts)
    data = int((hidden + intermediate) * tokens * f.elem_bytes)
    cols = scale_columns(counts, f.sf_vec)
    scales = (round_up(hidden, 128) + round_up(intermediate, 128)) * cols
    return data + scales + out_bytes * len(counts) * hidden * intermediate


def parse_formats(text: str) -> List[str]:
    names = [s.strip().lower() for s in text.split(",") if s.strip()]
    unknown = [n for n in names if n not in FORMATS]
    if unknown or not names:
        raise ValueError(f"expected a comma-separated subset of {', '.join(FORMATS)}, got "
                         f"{text!r}")
    return list(dict.fromkeys(names))


def parse_tiling(text: str) -> Tuple[Tuple[int, int], Tuple[int, int]]:
    """"MxN" or "MxN@CMxCN": an mma_tiler_mn and its cluster (default (2, 1): valid for every
    tile of the block-scaled kernel, 2-CTA for 256-row tiles)."""
    tile, _, cluster = text.lower().partition("@")
    m, n = (int(v) for v in tile.split("x"))
    cm, cn = (int(v) for v in cluster.split("x")) if cluster else (2, 1)
    return (m, n), (cm, cn)


def device_problem(available: bool, capability: Optional[Tuple[int, int]] = None,
                   name: str = "") -> Optional[str]:
    """Why this machine cannot run the benchmark (None: it can)."""
    if not available:
        return f"{NEEDS_SM100}; no CUDA GPU is usable here"
    if capability is None or capability[0] != 10:
        cc = "?" if capability is None else f"{capability[0]}.{capability[1]}"
        return f"{NEEDS_SM100}; CUDA device 0 ({name or 'unknown'}) has compute capability {cc}"
    return None


def new_row(shape: Dict, dist: str) -> Dict:
    return {"name": shape["name"], "dist": dist, "hidden": shape["hidden"],
            "intermediate": shape["intermediate"], "num_experts": shape["num_experts"],
            "tokens_sum": shape["tokens_sum"], "tokens_per_expert": tokens_per_expert(shape),
            "coarse": is_coarse(shape), "methods": {}}


def best_method(row: Dict, prefix: str) -> Optional[Tuple[str, float]]:
    """(method, TFLOP/s) of the fastest timed method named ``prefix`` or ``prefix_<tile>``."""
    cands = [(v["tflops"], k) for k, v in row.get("methods", {}).items()
             if (k == prefix or k.startswith(prefix + "_")) and "tflops" in v]
    if not cands:
        return None
    tflops, name = max(cands)
    return name, tflops


def summarize(row: Dict, times: Dict[str, float], formats: Sequence[str],
              copy_bytes: int = 0, counts: Optional[Sequence[int]] = None) -> Dict:
    """Fill ``row`` from the methods' median milliseconds: TFLOP/s (GB/s for the copy), each
    format's best tile, the ratios and the HBM roofline shares."""
    record_times(row, times, flops(row["hidden"], row["intermediate"], row["tokens_sum"]),
                 copy_bytes)
    meth = row["methods"]
    ratios = row.setdefault("ratios", {})
    best = row.setdefault("best", {})
    torch_sg = meth.get("torch_scaled_grouped_mm_mxfp8", {}).get("tflops")
    bf16 = meth.get("gwgrad_bf16", {}).get("tflops")
    for fmt in formats:
        b = best_method(row, f"gwgrad_{fmt}")
        if b is None:
            continue
        best[fmt] = {"method": b[0], "tflops": b[1]}
        if bf16:
            ratios[f"{fmt}_vs_bf16"] = b[1] / bf16
        dense = meth.get(f"dense_scaled_mm_{fmt}", {}).get("tflops")
        if dense:
            ratios[f"{fmt}_vs_dense"] = b[1] / dense
        if fmt == "mxfp8" and torch_sg:
            ratios["mxfp8_vs_torch"] = b[1] / torch_sg
    if counts is not None and "gbps" in meth.get("copy", {}):
        bandwidth = meth["copy"]["gbps"] * 1e9
        row["hbm"] = {}
        for fmt in formats:
            if fmt in best:
                nbytes = hbm_bytes(fmt, row["hidden"], row["intermediate"], counts)
                ms = meth[best[fmt]["method"]]["ms"]
                row["hbm"][fmt] = {"bytes": nbytes,
                                   "fraction": roofline_fraction(nbytes, bandwidth, ms)}
    return row


def evaluate_targets(row: Dict, formats: Sequence[str]) -> Dict:
    """PASS / MISS per target that applies to the row ("n/a": it applies but a method it needs
    did not run), and the row's verdict: MISS if any target is missed, PASS if every applicable
    target is met, "-" if none applies."""
    targets = {}
    best = row.get("best", {})
    if row.get("coarse"):
        for fmt, goal in TARGET_TFLOPS.items():
            if fmt in formats:
                got = best.get(fmt, {}).get("tflops")
                key = f"{fmt}>={goal / 1000:.1f}PF"
                targets[key] = "MISS" if got is None or got < goal else "PASS"
    if "mxfp8" in formats:
        key = f"mxfp8>={TARGET_VS_TORCH}x_torch"
        ratio = row.get("ratios", {}).get("mxfp8_vs_torch")
        if ratio is not None:
            targets[key] = "PASS" if ratio >= TARGET_VS_TORCH else "MISS"
        elif "tflops" not in row.get("methods", {}).get("torch_scaled_grouped_mm_mxfp8", {}):
            targets[key] = "n/a"
        else:  # torch ran, gwgrad MXFP8 did not
            targets[key] = "MISS"
    row["targets"] = targets
    decided = [v for v in targets.values() if v in ("PASS", "MISS")]
    if "MISS" in decided:
        row["verdict"] = "MISS"
    elif decided:
        row["verdict"] = "PASS"
    else:
        row["verdict"] = "-"
    return row


# ----------------------------------------------------------------------------------------
# dequantization (torch, any device): the spot checks
# ----------------------------------------------------------------------------------------

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def blocked_offsets(m, j, mpad: int, start: int, columns: int):
    """Byte offsets in a blocked scale tensor of (row m, scale column j of the expert whose
    ``columns`` columns start at column ``start``): gwgrad/scales.py's formula."""
    return (mpad * start + 512 * ((m >> 7) * (columns >> 2) + (j >> 2)) + 16 * (m & 31)
            + 4 * ((m >> 5) & 3) + (j & 3))


def decode_scales(codes, sf: str):
    """float64 values of uint8 scale codes (E8M0: 2**(c - 127), 255 NaN; E4M3 via torch)."""
    import torch

    if sf == "e8m0":
        values = torch.exp2(codes.to(torch.float64) - 127.0)
        return torch.where(codes == 255, torch.full_like(values, float("nan")), values)
    return codes.view(torch.float8_e4m3fn).to(torch.float64)


def dequantize_block(data, scales, fmt: str, channels: int, rows: Tuple[int, int],
                     begin: int, count: int, start_column: int):
    """float64 values (rows, count) of rows [r0, r1) of quantized K-major ``data`` (channels,
    tokens) (packed FP4: (channels, tokens // 2) bytes) over one expert's tokens [begin,
    begin + count), times their blocked scales (the expert's chunk starts at scale column
    ``start_column``)."""
    import torch

    f = FORMATS[fmt]
    r0, r1 = rows
    dev = data.device
    if f.fp4:
        raw = data.view(torch.uint8)[r0:r1, begin // 2:(begin + count) // 2].to(torch.int64)
        lut = torch.tensor(E2M1, dtype=torch.float64, device=dev)
        values = torch.stack([lut[raw & 0xF], lut[raw >> 4]], dim=-1).reshape(r1 - r0, count)
    else:
        values = data[r0:r1, begin:begin + count].to(torch.float64)
    columns = round_up(-(-count // f.sf_vec), 4)
    m = torch.arange(r0, r1, device=dev, dtype=torch.int64)[:, None]
    j = (torch.arange(count, device=dev, dtype=torch.int64) // f.sf_vec)[None, :]
    off = blocked_offsets(m, j, round_up(channels, 128), start_column, columns)
    codes = scales.view(torch.uint8).reshape(-1)[off]
    return values * decode_scales(codes, f.sf)


# ----------------------------------------------------------------------------------------
# one row's inputs and methods
# ----------------------------------------------------------------------------------------


class BlockScaledRow:
    """One row's BF16 x (tokens, hidden) and dy (tokens, intermediate), int32 offsets, the
    operands of each format from gwgrad.quantize (scale tensors of exactly the columns the
    counts need: the per-group blocked layout torch._scaled_grouped_mm reads too) and one
    shared BF16 output."""

    def __init__(self, shape: Dict, dist: str, formats: Sequence[str], device: str = "cuda",
                 seed: int = 0):
        import torch

        import gwgrad
        from gwgrad import quantizers as Q

        self.gwgrad = gwgrad
        self.hidden, self.intermediate = shape["hidden"], shape["intermediate"]
        self.num_experts, self.tokens_sum = shape["num_experts"], shape["tokens_sum"]
        self.counts = row_counts(shape, dist)
        self.starts = [0] + _cumsum(self.counts)[:-1]
        self.device = torch.device(device)
        gen = torch.Generator(device=device).manual_seed(seed)
        t, m, n = self.tokens_sum, self.hidden, self.intermediate
        self.offsets = torch.tensor(_cumsum(self.counts), dtype=torch.int32, device=device)
        self.x = torch.randn(t, m, device=device, generator=gen).to(torch.bfloat16)
        self.dy = torch.randn(t, n, device=device, generator=gen).to(torch.bfloat16)
        self.out = torch.empty(self.num_experts, m, n, device=device, dtype=torch.bfloat16)
        self.q = {}
        for fmt in formats:
            f = FORMATS[fmt]
            cols = scale_columns(self.counts, f.sf_vec)
            ops = {}
            for name, src, ch in (("x", self.x, m), ("dy", self.dy, n)):
                lay = Q.layout(fmt, t, ch, self.num_experts, scale_capacity=cols)
                sf = torch.empty(lay.scale_shape, dtype=getattr(torch, lay.scale_dtype.value),
                                 device=device)
                ops[name] = gwgrad.quantize(src, self.offsets, fmt, scales=sf)
            self.q[fmt] = ops

    @property
    def flops(self) -> float:
        return flops(self.hidden, self.intermediate, self.tokens_sum)

    def release(self) -> None:
        """Drop the row's tensors (the runners made from it hold their own references)."""
        self.q.clear()
        self.x = self.dy = self.out = None

    def operands(self, fmt: str):
        """(a, b, sfa, sfb, global_scale_a, global_scale_b) of the GEMM in ``fmt``."""
        qx, qdy = self.q[fmt]["x"], self.q[fmt]["dy"]
        return (qx["data"], qdy["data"].t(), qx["scales"], qdy["scales"], qx["global_scale"],
                qdy["global_scale"])

    def runner(self, fmt: str, tiling=None) -> Callable[[], None]:
        """gwgrad's block-scaled kernel in ``fmt`` through its launch plan."""
        import torch

        gw = self.gwgrad
        desc = gw.as_tensor_desc
        a, b, sfa, sfb, gsa, gsb = self.operands(fmt)
        extra = {}
        if tiling is not None:
            extra = {"mma_tiler_mn": tuple(tiling[0]), "cluster_shape_mn": tuple(tiling[1])}
        plan = gw.plan_for(desc(a, "a_tensor"), desc(b, "b_tensor"),
                           desc(self.offsets, "offsets_tensor"),
                           wgrad=desc(self.out, "wgrad_tensor"), sfa=desc(sfa, "sfa_tensor"),
                           sfb=desc(sfb, "sfb_tensor"),
                           global_scale_a=None if gsa is None else desc(gsa, "global_scale_a"),
                           global_scale_b=None if gsb is None else desc(gsb, "global_scale_b"),
                           sf_vec_size=FORMATS[fmt].sf_vec, **extra)
        on_gpu = self.device.type == "cuda"
        ws = None
        if on_gpu and plan.workspace_bytes:
            ws = torch.zeros(plan.workspace_bytes, dtype=torch.uint8, device=self.device)
        stream = torch.cuda.current_stream(self.device).cuda_stream if on_gpu else 0
        addrs = (a.data_ptr(), b.data_ptr(), self.offsets.data_ptr(), self.out.data_ptr())
        scales = (sfa.data_ptr(), sfb.data_ptr(), 0 if gsa is None else gsa.data_ptr(),
                  0 if gsb is None else gsb.data_ptr())
        options = {"stream": stream, "workspace": 0 if ws is None else ws.data_ptr(),
                   "scales": scales}
        launch = plan.launch

        def run():
            launch(*addrs, **options)

        run.keep = (ws, a, b, sfa, sfb, gsa, gsb)
        run.tile = tuple(plan.spec.mma_tiler_mn)
        return run

    def bf16(self) -> Callable[[], None]:
        """gwgrad's BF16 kernel on the same problem (x.T M-major, dy N-major)."""
        return KernelRunner(self.x.t(), self.dy, self.offsets, self.out)

    def torch_scaled_grouped(self) -> Callable[[], object]:
        """torch._scaled_grouped_mm MXFP8 2D-2D: out[g] = A[:, group g] @ B[group g, :] with A
        (hidden, tokens) row-major e4m3, B (tokens, intermediate) column-major, E8M0 scales in
        the per-group blocked layout (gwgrad's). One trial call: a torch build without it
        raises here and the method is reported n/a with the reason."""
        import torch

        a, b, sfa, sfb, _, _ = self.operands("mxfp8")
        offs = self.offsets

        def run():
            return torch._scaled_grouped_mm(a, b, sfa, sfb, offs=offs, out_dtype=torch.bfloat16)

        run()
        return run

    def dense_scaled_mm(self, fmt: str) -> Callable[[], object]:
        """One torch._scaled_mm of equal FLOPs in ``fmt`` (hidden x intermediate x tokens_sum;
        the scale bytes are the grouped ones: right sizes, values not meant as a product)."""
        import torch

        a, b, sfa, sfb, _, _ = self.operands(fmt)

        def run():
            return torch._scaled_mm(a, b, sfa, sfb, out_dtype=torch.bfloat16)

        run()
        return run

    def check_experts(self) -> List[int]:
        """The experts the spot checks look at: the largest and the smallest non-empty."""
        live = [e for e, c in enumerate(self.counts) if c]
        if not live:
            return []
        by_count = sorted(live, key=lambda e: (self.counts[e], e))
        return sorted({by_count[-1], by_count[0]})

    def reference_block(self, fmt: Optional[str], expert: int):
        """float64 (rows, cols) of expert ``expert``'s output on the checked block (the first
        CHECK_BLOCK rows, the last CHECK_BLOCK columns); ``fmt`` None: the BF16 product."""
        import torch

        begin, count = self.starts[expert], self.counts[expert]
        r = (0, min(self.hidden, CHECK_BLOCK))
        c = (max(0, self.intermediate - CHECK_BLOCK), self.intermediate)
        if fmt is None:
            a = self.x[begin:begin + count, r[0]:r[1]].to(torch.float64).t()
            b = self.dy[begin:begin + count, c[0]:c[1]].to(torch.float64)
            return a @ b, r, c
        f = FORMATS[fmt]
        start = scale_columns(self.counts[:expert], f.sf_vec)
        qx, qdy = self.q[fmt]["x"], self.q[fmt]["dy"]
        a = dequantize_block(qx["data"], qx["scales"], fmt, self.hidden, r, begin, count, start)
        b = dequantize_block(qdy["data"], qdy["scales"], fmt, self.intermediate, c, begin,
                             count, start)
        ref = a @ b.t()
        if f.global_scale:
            ref = ref * (qx["global_scale"][expert].double() * qdy["global_scale"][expert].double())
        return ref, r, c


def _rel_err(got, want) -> float:
    den = want.norm().item()
    return (got.double() - want).norm().item() / (den if den > 0 else 1.0)


def check_row(row: Dict, inp: BlockScaledRow, fns: Dict[str, Callable], formats: Sequence[str],
              sync: Callable[[], None]) -> None:
    """Each gwgrad method at its default tile into the NaN-filled output: no NaN anywhere, empty
    experts zero, two experts' blocks within CHECK_TOLERANCE of float64; gwgrad MXFP8 against
    torch._scaled_grouped_mm's result (same operands) where that ran."""
    import torch

    errs = row.setdefault("rel_err", {})
    failed = row.setdefault("check_failed", [])
    empty = [e for e, c in enumerate(inp.counts) if c == 0]
    for name in ["gwgrad_bf16"] + [f"gwgrad_{fmt}" for fmt in formats]:
        fn = fns.get(name)
        if fn is None:
            continue
        fmt = None if name == "gwgrad_bf16" else name[len("gwgrad_"):]
        try:
            inp.out.fill_(float("nan"))
            fn()
            sync()
            inp.gwgrad.check_errors()
            if torch.isnan(inp.out).any():
                raise AssertionError("NaN left in the output (not fully written, or a NaN scale "
                                     "was used)")
            if empty and not (inp.out[empty] == 0).all():
                raise AssertionError("an empty expert's output is not zero")
            worst = 0.0
            for e in inp.check_experts():
                ref, r, c = inp.reference_block(fmt, e)
                worst = max(worst, _rel_err(inp.out[e, r[0]:r[1], c[0]:c[1]], ref))
            errs[name] = worst
            if not worst <= CHECK_TOLERANCE:
                failed.append(name)
            if fmt == "mxfp8" and "torch_scaled_grouped_mm_mxfp8" in fns:
                want = fns["torch_scaled_grouped_mm_mxfp8"]()
                sync()
                live = [e for e, cnt in enumerate(inp.counts) if cnt]
                errs["mxfp8_vs_torch_scaled_grouped_mm"] = _rel_err(
                    inp.out[live], want[live].double())
                del want
        except Exception as exc:  # noqa: BLE001 - recorded, the row goes on
            errs[name] = float("nan")
            failed.append(name)
            row.setdefault("check_errors", {})[name] = _error(exc)


def run_row(shape: Dict, dist: str, formats: Sequence[str], *, tilings: Sequence = (),
            rounds: int = 10, sample_ms: float = 12.0, check: bool = True,
            copy: Optional[CopyBuffers] = None, device: str = "cuda",
            timer: Optional[Callable] = None) -> Dict:
    """One row: inputs, every method, checked, timed together, summarized, targets evaluated.
    (``device="cpu"`` with a ``timer`` stand-in exercises the wiring without a GPU: gwgrad runs
    its reference backend there and the torch methods are reported n/a.)"""
    import torch

    on_gpu = torch.device(device).type == "cuda"
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    row = new_row(shape, dist)
    inp = BlockScaledRow(shape, dist, formats, device=device)
    row["counts_min_max"] = [min(inp.counts), max(inp.counts)]
    meth = row["methods"]
    fns: Dict[str, Callable] = {}

    def add(name, make):
        try:
            fns[name] = make()
        except Exception as exc:  # noqa: BLE001 - n/a with the reason; the row goes on
            meth[name] = {"error": _error(exc)}

    add("gwgrad_bf16", inp.bf16)
    for fmt in formats:
        add(f"gwgrad_{fmt}", lambda fmt=fmt: inp.runner(fmt))
        for tiling in tilings:
            name = "gwgrad_{}_{}x{}".format(fmt, *tiling[0])
            add(name, lambda fmt=fmt, tiling=tiling: inp.runner(fmt, tiling))
    row["tiles"] = {k: "{}x{}".format(*f.tile) for k, f in fns.items() if hasattr(f, "tile")}
    if "mxfp8" in formats:
        add("torch_scaled_grouped_mm_mxfp8", inp.torch_scaled_grouped)
    for fmt in formats:
        add(f"dense_scaled_mm_{fmt}", lambda fmt=fmt: inp.dense_scaled_mm(fmt))
    if check:
        check_row(row, inp, fns, formats, sync)
    if copy is not None:
        fns["copy"] = copy
    times = time_methods(fns, meth, rounds=rounds, sample_ms=sample_ms, timer=timer, sync=sync)
    summarize(row, times, formats, copy.nbytes if copy is not None else 0, inp.counts)
    evaluate_targets(row, formats)
    fns.clear()  # the row's tensors go before the next row's are made
    inp.release()
    if on_gpu:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    return row


# ----------------------------------------------------------------------------------------
# reporting
# ----------------------------------------------------------------------------------------


def _tf(row: Dict, name: str) -> str:
    entry = row.get("methods", {}).get(name, {})
    if "tflops" in entry:
        return f"{entry['tflops']:.0f}"
    return "n/a" if "error" in entry else "-"


def _best(row: Dict, fmt: str, with_tile: bool = True) -> str:
    b = row.get("best", {}).get(fmt)
    if b is None:
        return "n/a" if "error" in row.get("methods", {}).get(f"gwgrad_{fmt}", {}) else "-"
    tile = row.get("tiles", {}).get(b["method"])
    return f"{b['tflops']:.0f} ({tile})" if with_tile and tile else f"{b['tflops']:.0f}"


def _ratio(row: Dict, key: str) -> str:
    v = row.get("ratios", {}).get(key)
    return "-" if v is None else f"{v:.2f}"


def _check(row: Dict) -> str:
    if "error" in row:
        return "ERR"
    if row.get("check_failed"):
        return "FAIL"
    return "ok" if row.get("rel_err") else "-"


def _verdict(row: Dict) -> str:
    verdict = row.get("verdict", "-")
    missed = [k for k, v in row.get("targets", {}).items() if v == "MISS"]
    return f"MISS ({', '.join(missed)})" if missed else verdict


COLUMNS = [
    ("shape", lambda r: r["name"]),
    ("tokens", lambda r: r["dist"]),
    ("tok/exp", lambda r: f"{r['tokens_per_expert']:.0f}"),
    ("gwgrad BF16", lambda r: _tf(r, "gwgrad_bf16")),
    ("MXFP8 (tile)", lambda r: _best(r, "mxfp8")),
    ("NVFP4 (tile)", lambda r: _best(r, "nvfp4")),
    ("MXFP4 (tile)", lambda r: _best(r, "mxfp4")),
    ("torch SGMM MXFP8", lambda r: _tf(r, "torch_scaled_grouped_mm_mxfp8")),
    ("dense MXFP8", lambda r: _tf(r, "dense_scaled_mm_mxfp8")),
    ("dense NVFP4", lambda r: _tf(r, "dense_scaled_mm_nvfp4")),
    ("MXFP8 / torch", lambda r: _ratio(r, "mxfp8_vs_torch")),
    ("MXFP8 / BF16", lambda r: _ratio(r, "mxfp8_vs_bf16")),
    ("NVFP4 / BF16", lambda r: _ratio(r, "nvfp4_vs_bf16")),
    ("check", _check),
    ("targets", _verdict),
]


def table(rows: List[Dict]) -> str:
    cells = [[name for name, _ in COLUMNS]]
    for r in rows:
        if "error" in r and not r.get("methods"):
            cells.append([r["name"], r["dist"]] + ["-"] * (len(COLUMNS) - 4)
                         + ["ERR", r["error"][:60]])
            continue
        cells.append([fn(r) for _, fn in COLUMNS])
    widths = [max(len(row[i]) for row in cells) for i in range(len(COLUMNS))]
    lines = ["  ".join(c.rjust(w) if i > 1 else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths)))
             for row in cells]
    lines.insert(1, "-" * len(lines[0]))
    lines.append(f"(TFLOP/s; targets: {TARGET_TEXT})")
    return "\n".join(lines)


def markdown(rows: List[Dict]) -> str:
    lines = ["| " + " | ".join(name for name, _ in COLUMNS) + " |",
             "|" + "---|" * len(COLUMNS)]
    for r in rows:
        if "error" in r and not r.get("methods"):
            continue
        lines.append("| " + " | ".join(fn(r) for _, fn in COLUMNS) + " |")
    lines.append("")
    lines.append(f"Targets: {TARGET_TEXT}.")
    return "\n".join(lines)


def summary(rows: List[Dict]) -> Dict:
    errors = [f"{r['name']}/{r['dist']}: {k}: {v['error'][:200]}" for r in rows
              for k, v in r.get("methods", {}).items() if "error" in v]
    errors += [f"{r['name']}/{r['dist']}: {r['error'][:200]}" for r in rows if "error" in r]
    return {
        "rows": len(rows),
        "pass": [f"{r['name']}/{r['dist']}" for r in rows if r.get("verdict") == "PASS"],
        "miss": [f"{r['name']}/{r['dist']}" for r in rows if r.get("verdict") == "MISS"],
        "check_failed": [f"{r['name']}/{r['dist']}" for r in rows if r.get("check_failed")],
        "errors": errors,
    }


# ----------------------------------------------------------------------------------------
# the command
# ----------------------------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.blockscaled",
        description=("Block-scaled grouped weight gradients (MXFP8, NVFP4, MXFP4) on an "
                     "SM100-family GPU (Blackwell, compute capability 10.x): gwgrad against "
                     "torch._scaled_grouped_mm MXFP8 2D-2D, gwgrad BF16, dense torch._scaled_mm "
                     "and a device-to-device copy, on every row of shapes.json with uniform and "
                     "zipf counts rounded to 256; methods interleaved, CUDA events, medians. "
                     "Exits with status 2 without an SM100 GPU. Targets: " + TARGET_TEXT + "."))
    p.add_argument("--shapes", default=DEFAULT_SHAPES, help="shapes JSON (default: "
                   "benchmarks/shapes.json)")
    p.add_argument("--rows", default="", help="comma-separated shape names (default: all)")
    p.add_argument("--dist", default="uniform,zipf", help="token distributions (uniform, zipf)")
    p.add_argument("--formats", default="mxfp8,nvfp4,mxfp4",
                   help="comma-separated block-scaled formats (mxfp8, nvfp4, mxfp4)")
    p.add_argument("--tiles", default="",
                   help="gwgrad tilings timed besides the default, comma-separated MxN[@CMxCN] "
                        "(cluster default 2x1), e.g. 128x256,256x128")
    p.add_argument("--rounds", type=int, default=10, help="interleaved rounds per row")
    p.add_argument("--sample-ms", type=float, default=12.0, help="milliseconds per sample")
    p.add_argument("--copy-gib", type=float, default=2.0,
                   help="size of the device-to-device copy timed for the HBM bandwidth (0: none)")
    p.add_argument("--no-check", action="store_true", help="skip the spot checks")
    p.add_argument("--time-budget", type=float, default=0.0,
                   help="seconds: rows not started by then are skipped (0: no limit)")
    p.add_argument("--json", default="bench_blockscaled.json", help="output JSON ('' for none)")
    p.add_argument("--markdown", action="store_true", help="also print a markdown table")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    try:
        formats = parse_formats(args.formats)
        dists = [d for d in args.dist.split(",") if d]
        for d in dists:
            token_counts(COUNT_MULTIPLE, 1, d)  # an unknown distribution fails here
        tilings = [parse_tiling(s) for s in args.tiles.split(",") if s]
    except ValueError as exc:
        p.error(f"--formats / --dist / --tiles: {exc}")
    shapes = select_shapes(args.shapes, args.rows)

    try:
        import torch
    except ImportError:
        print(f"{NEEDS_SM100}; torch is not installed", file=sys.stderr)
        return 2
    available = torch.cuda.is_available()
    capability = torch.cuda.get_device_capability() if available else None
    name = torch.cuda.get_device_name() if available else ""
    problem = device_problem(available, capability, name)
    if problem is not None:
        print(problem, file=sys.stderr)
        return 2

    import gwgrad

    print(f"device: {name} (compute capability {capability[0]}.{capability[1]})  torch "
          f"{torch.__version__}  gwgrad {gwgrad.__version__}", flush=True)
    print(f"targets: {TARGET_TEXT}", flush=True)
    payload = {"device": name, "capability": list(capability), "torch": torch.__version__,
               "gwgrad": gwgrad.__version__, "target_text": TARGET_TEXT,
               "targets": {"tflops": TARGET_TFLOPS, "vs_torch": TARGET_VS_TORCH,
                           "coarse_tokens_per_expert": COARSE_TOKENS_PER_EXPERT},
               "settings": {"formats": formats, "dist": dists, "tiles": args.tiles,
                            "rounds": args.rounds, "sample_ms": args.sample_ms,
                            "copy_gib": args.copy_gib, "count_multiple": COUNT_MULTIPLE,
                            "shapes": args.shapes},
               "rows": []}
    copy = None
    if args.copy_gib > 0:
        try:
            copy = CopyBuffers(int(args.copy_gib * 2 ** 30))
        except Exception as exc:  # noqa: BLE001 - the rest runs without the bandwidth
            payload["copy_error"] = _error(exc)
    rows = payload["rows"]
    t0 = time.time()
    todo = [(shape, dist) for shape in shapes for dist in dists]
    for i, (shape, dist) in enumerate(todo, 1):
        if args.time_budget and time.time() - t0 > args.time_budget:
            row = new_row(shape, dist)
            row["error"] = f"skipped: --time-budget {args.time_budget:.0f} s spent"
            rows.append(row)
            continue
        start = time.time()
        try:
            row = run_row(shape, dist, formats, tilings=tilings, rounds=args.rounds,
                          sample_ms=args.sample_ms, check=not args.no_check, copy=copy)
        except Exception as exc:  # noqa: BLE001 - one row must not stop the others
            row = new_row(shape, dist)
            row["error"] = _error(exc)
            try:
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
            except Exception:  # noqa: BLE001
                pass
        row["seconds"] = time.time() - start
        rows.append(row)
        print(f"[{i}/{len(todo)}] " + table([row]).splitlines()[2], flush=True)
        payload["seconds"] = time.time() - t0
        _write(args.json, payload)
    payload["summary"] = summary(rows)
    payload["seconds"] = time.time() - t0
    _write(args.json, payload)
    print()
    print(table(rows))
    if args.markdown:
        print()
        print(markdown(rows))
    s = payload["summary"]
    print(f"targets met on {len(s['pass'])} rows, missed on {len(s['miss'])}"
          + (f"; CHECK FAILED: {', '.join(s['check_failed'])}" if s["check_failed"] else ""))
    for e in s["errors"][:20]:
        print("n/a: " + e)
    if args.json:
        print(f"wrote {args.json} ({payload['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
