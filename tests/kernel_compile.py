"""Helpers for the compile-only kernel tests: build a spec, compile it for an architecture
without a GPU (the DSL's --gpu-arch), and return the PTX."""

from __future__ import annotations

import contextlib
import re
import dataclasses
import tempfile

from gwgrad.dtypes import DType
from gwgrad.spec import StaticSpec, Tuning

OUT_DTYPES = {"bfloat16": DType.BFLOAT16, "float16": DType.FLOAT16, "float32": DType.FLOAT32}


def spec(arch, *, hidden=512, intermediate=768, experts=8, a_major="m", b_major="n",
         order="tensor2d", mode="dense", out="bfloat16", acc=False, tile=None, cluster=None):
    return StaticSpec(
        hidden=hidden, intermediate=intermediate, num_experts=experts,
        a_dtype=DType.BFLOAT16, b_dtype=DType.BFLOAT16, wgrad_dtype=OUT_DTYPES[out],
        acc_dtype=DType.FLOAT32, a_major=a_major, b_major=b_major, input_order=order,
        output_mode=mode, accumulate=acc, sf_vec_size=16, arch=arch,
        tuning=Tuning(mma_tiler_mn=tile, cluster_shape_mn=cluster),
    )


FP8 = {"e4m3": DType.FLOAT8_E4M3FN, "e5m2": DType.FLOAT8_E5M2}
RECIPE_SCALES = {"blocked": (DType.FLOAT8_E8M0FNU, 32), "block_1x128": (DType.FLOAT32, 128),
                 "per_expert_channel": (DType.FLOAT32, 0)}


def fp8_spec(arch, recipe, *, a="e4m3", b="e4m3", global_scales=False, **kw):
    """A block-scaled FP8 spec (K-major operands unless given) of a scale recipe."""
    kw.setdefault("a_major", "k")
    kw.setdefault("b_major", "k")
    sf, vec = RECIPE_SCALES[recipe]
    return dataclasses.replace(spec(arch, **kw), a_dtype=FP8[a], b_dtype=FP8[b], sf_dtype=sf,
                               sf_vec_size=vec, scale_recipe=recipe,
                               has_global_scale=global_scales)


def compile_ptx(s: StaticSpec) -> str:
    """Finalize the tiling with the backend's defaults, check support, compile, return PTX."""
    from gwgrad.backends import finalize_spec
    from gwgrad.kernels import compiler

    s, backend = finalize_spec(s)
    kernel = backend.make_kernel(s)
    # The same compile as the backend's (never from the kernel cache), keeping the PTX.
    with private_dump_dir() as options:
        ptx = compiler.compile_kernel(kernel, s, extra_options=options).artifacts.PTX
    assert ptx and ".entry" in ptx
    return ptx


@contextlib.contextmanager
def private_dump_dir():
    """Compile options keeping the PTX in a directory of this compile's own. --keep-ptx writes
    ``<dump dir>/<function name>.<arch>.ptx`` and ``artifacts.PTX`` reads that file back; the
    default dump directory is the working directory and the name is the same for every spec
    of a kernel class, so another process compiling in the same checkout (a second pytest,
    a script) could swap the file between write and read."""
    with tempfile.TemporaryDirectory(prefix="gwgrad-ptx-") as path:
        yield f"--keep-ptx --dump-dir {path}"


def replace(s, **tuning):
    """``s`` with tuning fields replaced (``StaticSpec.with_tuning``)."""
    return s.with_tuning(**tuning)


def kernel_bodies(ptx: str):
    """(prep work, GEMM work) of a compiled launch: the prep kernel's and the GEMM kernel's
    bodies, or for a single-launch kernel (one entry) its code before and after the prep
    hand-off (check_prep_handoff_ptx)."""
    if ptx.count(".entry ") == 1:
        return split_at_prep_handoff(ptx.split(".entry ", 1)[1])
    bodies = {}
    for chunk in ptx.split(".entry ")[1:]:
        name = chunk.split("(", 1)[0]
        bodies["prep" if "prep_kernel" in name else "gemm"] = chunk
    assert set(bodies) == {"prep", "gemm"}, sorted(bodies)
    return bodies["prep"], bodies["gemm"]


def split_at_prep_handoff(body: str):
    """(before, after) the prep hand-off of a single-launch kernel's body."""
    import re

    check_prep_handoff_ptx(body)
    fence = body.index("fence.acq_rel.gpu;")
    end = re.compile(r"bar\.sync\s+0;").search(body, fence)
    assert end, "no CTA barrier after the prep hand-off"
    return body[:fence], body[end.end():]


def check_prep_handoff_ptx(body: str) -> None:
    """A single-launch kernel's prep work and hand-off (kernels/prep.py prep_in_kernel,
    take_expert, prep_handoff), in order: a prep warp's relaxed take of the next expert from
    workspace byte 8, shared by a shuffle; the expert's descriptors released to the
    tensormap proxy, a warp sync, then the release add of the prepared count (byte 12);
    a CTA barrier; thread 0's acquire loads of byte 12 (the spin), its acq_rel pass on it, the
    last CTA's resets of both words to 0; a GPU-scope fence and a CTA barrier. No system-scope
    atomics."""
    import re

    assert body.count(".entry ") == 0
    ptr = {}
    for offset in (8, 12):
        m = re.search(rf"add\.s64\s+(%rd\d+), (%rd\d+), {offset};", body)
        assert m, f"no pointer to workspace byte {offset}"
        ptr[offset] = (re.escape(m.group(1)), m.group(2))
    assert ptr[8][1] == ptr[12][1], "bytes 8 and 12 of different bases"
    nxt, done = ptr[8][0], ptr[12][0]

    def at(pattern, start=0):
        m = re.compile(pattern).search(body, start)
        assert m, (pattern, body[start:start + 300])
        return m

    take = at(rf"atom\.global(\.relaxed)?(\.gpu)?\.add\.u32\s+%r\d+, \[{nxt}\], 1;")
    at(r"shfl\.sync\.idx\.b32", take.end())
    release = at(r"fence\.proxy\.tensormap::generic\.release\.gpu;", take.end())
    sync = at(r"bar\.warp\.sync", release.end())
    prepared = at(rf"atom\.global\.release(\.gpu)?\.add\.u32\s+%r\d+, \[{done}\], 1;",
                  sync.end())
    cta = at(r"bar\.sync\s+0;", prepared.end())
    spin = at(rf"ld\.acquire\.gpu\.global\.b32\s+%r\d+, \[{done}\];", cta.end())
    passed = at(rf"atom\.global\.acq_rel(\.gpu)?\.add\.u32\s+%r\d+, \[{done}\], 1;", spin.end())
    at(rf"atom\.global\.exch\.b32\s+%r\d+, \[{nxt}\], 0;", passed.end())
    at(rf"atom\.global\.exch\.b32\s+%r\d+, \[{done}\], 0;", passed.end())
    fence = at(r"fence\.acq_rel\.gpu;", passed.end())
    at(r"bar\.sync\s+0;", fence.end())
    assert "atom.global.sys" not in body and "atom.global.acq_rel.sys" not in body


def check_offsets_check_ptx(ptx: str, before_verdict=()) -> None:
    """Prep: the verdict (workspace byte 4) is stored, the status record is claimed with a
    GPU-scope compare-and-swap and published behind system-scope fences. GEMM: its first
    global load is the verdict, none of ``before_verdict`` comes before it, and a branch on it
    skips the whole kernel."""
    import re

    prep, gemm = kernel_bodies(ptx)
    assert re.search(r"st\.global\.b32\s+\[%rd\d+\+4\]", prep)  # the verdict
    # sticky claim of the record: GPU scope (mapped host memory has no system-scope atomics
    # over PCIe)
    assert re.search(r"atom\.global(\.gpu)?\.cas\.b32", prep)
    assert "atom.global.sys" not in prep
    assert re.search(r"fence\.(acq_rel|sc)\.sys|membar\.sys", prep)  # host-visible fields
    assert not re.search(r"atom\.global[\w.]*\.cas", gemm)  # the record is the prep's
    loads = re.findall(r"ld\.global[\w.]*\s+[^;]+;", gemm)
    assert loads and re.search(r"\[%rd\d+\+4\]", loads[0]), loads[:1]
    before, after = gemm.split(loads[0], 1)
    for op in before_verdict:
        assert op not in before, op
    # verdict == 0: a jump straight to the kernel's exit.
    branch = re.match(r"\s*setp\.eq\.b32\s+(%p\d+), %r\d+, 0;\s*@\1 bra\s+(\$\w+);", after)
    assert branch, after[:200]
    assert re.search(re.escape(branch.group(2)) + r":\s*ret;", gemm)


def check_descriptor_slots_ptx(ptx: str, descriptors: int) -> None:
    """Every per-expert TMA descriptor the prep work writes fills its whole 128-byte slot: each
    64 bytes of descriptor fields (copy_tensormap's 16- or 32-byte vector stores) come with
    the four 16-byte zero stores over bytes 64-127 of the same slot (write_descriptor)."""
    fields = 16 * len(re.findall(r"\bst\.global\.v2\.b64\b", ptx))
    fields += 32 * len(re.findall(r"\bst\.global\.v4\.b64\b", ptx))
    assert fields == 64 * descriptors, (fields, descriptors)
    tails = re.findall(r"st\.global\.v4\.b32 \[(%rd\d+)\+64\], \{0, 0, 0, 0\}; "
                       r"st\.global\.v4\.b32 \[\1\+80\], \{0, 0, 0, 0\}; "
                       r"st\.global\.v4\.b32 \[\1\+96\], \{0, 0, 0, 0\}; "
                       r"st\.global\.v4\.b32 \[\1\+112\], \{0, 0, 0, 0\};", ptx)
    assert len(tails) == descriptors, (len(tails), descriptors)


#: EIATTR codes of a cubin's .nv.info sections (format 4: an attribute with a value; the value
#: of these is (function symbol index, count)): the registers a function is compiled for and its
#: local-memory stack frame (bytes; > 0 where ptxas spilled registers to local memory).
EIATTR_REGCOUNT, EIATTR_FRAME_SIZE = 0x2F, 0x11


def cubin_resources(cubin: bytes):
    """{"regs": [...], "frame": [...]}: each function's register count and stack-frame bytes,
    read from the ELF's .nv.info sections (what ``cuobjdump --dump-resource-usage`` prints)."""
    import struct

    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * shentsize)
                for i in range(shnum)]
    names = sections[shstrndx][4]
    found = {"regs": [], "frame": []}
    for sec in sections:
        name = cubin[names + sec[0]:cubin.index(b"\0", names + sec[0])]
        if not name.startswith(b".nv.info"):
            continue
        data, i = cubin[sec[4]:sec[4] + sec[5]], 0
        while i + 4 <= len(data):
            fmt, attr, size = data[i], data[i + 1], struct.unpack_from("<H", data, i + 2)[0]
            if fmt != 4:  # a value-less or inline-value attribute: 4 bytes
                i += 4
                continue
            if size == 8 and attr in (EIATTR_REGCOUNT, EIATTR_FRAME_SIZE):
                key = "regs" if attr == EIATTR_REGCOUNT else "frame"
                found[key].append(struct.unpack_from("<II", data, i + 4)[1])
            i += 4 + size
    return found


def compile_cubin(s: StaticSpec) -> bytes:
    """Finalize, compile (as compile_ptx) and return the cubin ptxas made."""
    import glob
    import os

    from gwgrad.backends import finalize_spec
    from gwgrad.kernels import compiler

    s, backend = finalize_spec(s)
    kernel = backend.make_kernel(s)
    with tempfile.TemporaryDirectory(prefix="gwgrad-cubin-") as path:
        compiler.compile_kernel(kernel, s, extra_options=f"--keep-cubin --dump-dir {path}")
        cubins = glob.glob(os.path.join(path, "*.cubin"))
        assert len(cubins) == 1, cubins
        with open(cubins[0], "rb") as f:
            return f.read()
