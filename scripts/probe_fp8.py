"""Probe (not part of the package): time variants of the SM90 FP8 kernel on one shape, to find
what bounds it. Variants patch class attributes, so the disk kernel cache is off."""
import os, sys, json, time
os.environ["GWGRAD_CACHE_DIR"] = "off"
import torch
import gwgrad
from gwgrad.kernels import sm90_fp8
from gwgrad.bench import time_interleaved
from gwgrad.bench.fp8 import Fp8Row

K = sm90_fp8.Sm90ScaledGroupedWgrad
orig_main = K.scaled_mainloop


def no_promo(self, tiled_mma, thr_mma, acc, tCrA, tCrB, ab_pipeline, ab_read, ab_release,
             k_tiles, smem_scales, tile_m, tile_n):
    return self.mainloop(tiled_mma, acc, tCrA, tCrB, ab_pipeline, ab_read, ab_release, k_tiles)


VARIANTS = {
    "overlap_128x128": (dict(OVERLAP=True), (128, 128)),
    "serial_128x128": (dict(OVERLAP=False), (128, 128)),
    "serial_128x192": (dict(OVERLAP=False), (128, 192)),
    "overlap_64x128": (dict(OVERLAP=True), (64, 128)),
    "nopromo_128x128": (dict(scaled_mainloop=no_promo), (128, 128)),
    "nopromo_128x192": (dict(scaled_mainloop=no_promo), (128, 192)),
}
shapes = {"dsv3-fc1": dict(name="dsv3-fc1", hidden=7168, intermediate=4096, num_experts=32, tokens_sum=65536),
          "qwen3-30b-fc1": dict(name="qwen3-30b-fc1", hidden=2048, intermediate=1536, num_experts=128, tokens_sum=131072)}
out = {}
for sname in sys.argv[1:] or ["dsv3-fc1"]:
    row = Fp8Row(shapes[sname], "uniform")
    fns = {"bf16": row.bf16()}
    for name, (attrs, tile) in VARIANTS.items():
        saved = {k: K.__dict__.get(k) for k in attrs}
        for k, v in attrs.items():
            setattr(K, k, v)
        from gwgrad.backends.fp8_sm90 import Fp8Sm90Backend
        Fp8Sm90Backend.cache_key = lambda self, spec, _n=name: ("probe", repr(spec) + _n)
        try:
            gwgrad.clear_cache()
            from gwgrad import kernel_cache
            kernel_cache.clear_memory()
            fns[name] = row.runner("channel", tile)
            fns[name]()
            torch.cuda.synchronize()
        except Exception as exc:
            print(name, "failed", type(exc).__name__, str(exc)[:300])
            fns.pop(name, None)
        finally:
            for k, v in saved.items():
                if v is None:
                    delattr(K, k)
                else:
                    setattr(K, k, v)
    times = time_interleaved(fns, rounds=8, sample_ms=12)
    res = {k: round(row.flops / v / 1e9) for k, v in times.items()}
    print(sname, res, flush=True)
    out[sname] = res
    del row
    torch.cuda.empty_cache()
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "probe.json"), "w"))
