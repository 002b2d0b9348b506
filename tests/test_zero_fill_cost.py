"""scripts/zero_fill_cost.py: the copy without the zero fill differs from the checkout in the
zero warps' loop only, refuses to run when that loop moved, and compiles to a kernel without
the zero stores (CPU; the A/B itself needs the GPU: scripts/gpu_run.sh zerocost)."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def load():
    spec = importlib.util.spec_from_file_location("zero_fill_cost",
                                                  ROOT / "scripts" / "zero_fill_cost.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_copy_differs_in_the_zero_loop_only(tmp_path):
    zc = load()
    zc.no_zeros_tree(str(tmp_path))
    old = (ROOT / zc.KERNEL).read_text().splitlines()
    new = (tmp_path / zc.KERNEL).read_text().splitlines()
    changed = [(a, b) for a, b in zip(old, new) if a != b]
    assert len(old) == len(new) and len(changed) == 1, changed
    assert changed[0][0].strip() == zc.ZERO_LOOP
    assert changed[0][1].strip() == zc.NO_ZERO_LOOP
    indent = len(changed[0][0]) - len(changed[0][0].lstrip())
    assert changed[0][1][:indent].strip() == "" and changed[0][1][indent] != " "
    assert (tmp_path / "gwgrad" / "__init__.py").is_file()
    assert (tmp_path / "gwgrad" / "adapters" / "torch.py").is_file()  # gwgrad.adapters.torch


def test_refuses_unless_the_loop_is_there_once(tmp_path):
    zc = load()
    fake = tmp_path / "root"
    (fake / "gwgrad" / "kernels").mkdir(parents=True)
    (fake / "gwgrad" / "__init__.py").write_text("")
    (fake / zc.KERNEL).write_text("for rank in range(live, E):\n")
    with pytest.raises(RuntimeError, match="found it 0 times"):
        zc.no_zeros_tree(str(tmp_path / "copy"), root=str(fake))
    (fake / zc.KERNEL).write_text(f"    {zc.ZERO_LOOP}\n        {zc.ZERO_LOOP}\n")
    with pytest.raises(RuntimeError, match="found it 2 times"):
        zc.no_zeros_tree(str(tmp_path / "copy2"), root=str(fake))


def test_copy_compiles_without_the_zero_stores(tmp_path):
    """The copy's SM90 kernel has no zero fill (its bulk copies from shared memory to
    global); the checkout's has it."""
    pytest.importorskip("cutlass")
    zc = load()
    zc.no_zeros_tree(str(tmp_path))
    probe = ("import sys; sys.path.insert(0, {tests!r}); import gwgrad; "
             "from kernel_compile import compile_ptx, spec; "
             "p = compile_ptx(spec('sm_90a', tile=(128, 256), cluster=(1, 1))); "
             "print(gwgrad.__file__); print('cp.async.bulk.global.shared::cta' in p.split('.entry ')[-1])")
    results = {}
    for name, tree in (("copy", tmp_path), ("checkout", ROOT)):
        env = dict(os.environ, PYTHONPATH=str(tree) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        out = subprocess.run([sys.executable, "-c", probe.format(tests=str(ROOT / "tests"))],
                             env=env, cwd=str(tree), capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        where, has_zero_stores = out.stdout.strip().splitlines()[-2:]
        assert where.startswith(str(tree)), where
        results[name] = has_zero_stores == "True"
    assert results == {"copy": False, "checkout": True}
