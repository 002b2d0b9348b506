"""The package's import graph, read from the source (no import runs): every ``import`` and
``from ... import`` of a gwgrad module, at module level or inside a function, is an edge.
There is no cycle (a base kernel asks its subclasses through hooks, not imports), no module
imports the package face (``gwgrad/__init__.py``, which imports everything), and one table
maps gwgrad's dtypes to the CuTe DSL's types. The JAX adapter reaches kernels only through
gwgrad.plan and gwgrad.interop.jax (no gwgrad.backends, no CuTe DSL import)."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, List, Set

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "gwgrad"


def modules() -> Dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = ("gwgrad",) + path.relative_to(PACKAGE).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def import_graph(found: Dict[str, Path]) -> Dict[str, Set[str]]:
    """module -> the gwgrad modules it imports (a name imported from a package counts as
    that submodule when one exists, else as the package)."""
    edges: Dict[str, Set[str]] = {name: set() for name in found}
    for name, path in found.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: List[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = ".".join(package[:len(package) - node.level + 1]
                                    + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in found else base
                           for alias in node.names]
            edges[name].update(t for t in targets if t in found and t != name)
    return edges


def cycles(edges: Dict[str, Set[str]]) -> List[List[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    found: List[List[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle():
    assert cycles(import_graph(modules())) == []


def test_the_walk_sees_a_cycle_and_function_level_imports():
    edges = {"gwgrad.a": {"gwgrad.b"}, "gwgrad.b": {"gwgrad.c"}, "gwgrad.c": {"gwgrad.a"},
             "gwgrad.d": {"gwgrad.a"}}
    assert cycles(edges) == [["gwgrad.a", "gwgrad.b", "gwgrad.c"]]
    graph = import_graph(modules())
    # A function-level import is an edge: the JAX adapter's lowering imports the plan lazily
    # in places; the SM90 scaled kernel subclasses the BF16 one.
    assert "gwgrad.kernels.sm90_bf16" in graph["gwgrad.kernels.sm90_fp8"]
    assert "gwgrad.kernels.sm90_fp8" not in graph["gwgrad.kernels.sm90_bf16"]


def test_no_module_imports_the_package_face():
    graph = import_graph(modules())
    assert sorted(name for name, targets in graph.items()
                  if "gwgrad" in targets and name != "gwgrad") == []


def _cutlass_type_tables(path: Path) -> int:
    """Dict literals in ``path`` whose values are two or more ``cutlass.<Type>`` attributes."""
    count = 0
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Dict):
            values = [v for v in node.values if isinstance(v, ast.Attribute)
                      and isinstance(v.value, ast.Name) and v.value.id == "cutlass"]
            count += len(values) >= 2
    return count


def test_one_dtype_table_for_the_dsl():
    tables = {str(path.relative_to(PACKAGE)): n for path in PACKAGE.rglob("*.py")
              if (n := _cutlass_type_tables(path))}
    assert tables == {"kernels/types.py": 1}
    pytest.importorskip("cutlass")
    from gwgrad.dtypes import DType
    from gwgrad.kernels.types import CUTLASS_TYPES

    # Every dtype a kernel or a compile sample takes (float64 is the CPU reference's alone).
    assert set(CUTLASS_TYPES) == {d.value for d in DType} - {"float64"}


ADAPTERS = PACKAGE.parent / "adapters"
#: What the JAX adapter may import from gwgrad: the runner, the framework room, and the pure
#: modules (rules and descriptors); never the backends, the kernels or the DSL plumbing.
JAX_ADAPTER_IMPORTS = {"gwgrad.plan", "gwgrad.interop", "gwgrad.interop.jax", "gwgrad.dtypes",
                       "gwgrad.errors", "gwgrad.validation", "gwgrad.tensors", "gwgrad.spec",
                       "gwgrad.scales", "gwgrad.offsets", "gwgrad.status", "gwgrad.quantizers",
                       "gwgrad.api"}


def _imports(source: str, top_level_only: bool) -> Set[str]:
    """Absolute module names a module's ``source`` imports (``from gwgrad import plan`` and
    ``from gwgrad.interop import jax`` count as those submodules), at module level only or
    anywhere."""
    tree = ast.parse(source)
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    known = modules()
    found: Set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level:
            found.update(f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in known
                         else node.module for alias in node.names)
    return found


def _forbidden(source: str) -> Set[str]:
    """What a JAX adapter's source imports that it must not: the DSL anywhere, gwgrad modules
    outside JAX_ADAPTER_IMPORTS anywhere, or not the runner and interop at module level."""
    anywhere = _imports(source, top_level_only=False)
    bad = {m for m in anywhere if m.split(".")[0] == "cutlass"}
    bad |= {m for m in anywhere if m.split(".")[0] == "gwgrad"} - JAX_ADAPTER_IMPORTS
    missing = {"gwgrad.plan", "gwgrad.interop.jax"} - _imports(source, top_level_only=True)
    return bad | {f"(not imported) {m}" for m in missing}


def test_the_jax_adapter_imports_the_runner_not_the_backends():
    """adapters/jax.py reaches kernels through gwgrad.plan (its custom calls' modules) and
    gwgrad.interop.jax (the call): no gwgrad.backends, no kernels, no CuTe DSL, anywhere in it
    (module level or inside a function)."""
    assert _forbidden((ADAPTERS / "jax.py").read_text()) == set()


def test_the_adapter_check_sees_a_side_door():
    good = ("from gwgrad import plan, status\nfrom gwgrad.interop import jax as x\n"
            "def f():\n    from gwgrad import quantizers\n")
    assert _forbidden(good) == set()
    assert _forbidden(good + "def g():\n    from gwgrad import backends\n") == \
        {"gwgrad.backends"}
    assert _forbidden(good + "def g():\n    import cutlass.jax as cj\n") == {"cutlass.jax"}
    assert _forbidden(good + "from gwgrad.backends import reference\n") == {
        "gwgrad.backends.reference"}
    assert _forbidden("def f():\n    from gwgrad import plan\n") == {
        "(not imported) gwgrad.plan", "(not imported) gwgrad.interop.jax"}


IMPORT_ADAPTER = """
import sys
import gwgrad.adapters.jax
print(sorted(m for m in sys.modules if m == "cutlass" or m.startswith("cutlass.")))
"""


def test_importing_the_jax_adapter_imports_no_dsl():
    pytest.importorskip("jax")
    import os
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        filter(None, [str(PACKAGE.parent), os.environ.get("PYTHONPATH")])), JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", IMPORT_ADAPTER], cwd=PACKAGE.parent, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[]", proc.stdout


def test_the_version_is_stated_once():
    """``__version__`` is assigned in gwgrad/_version.py only; everything else imports it."""
    assigned = []
    for path in list(PACKAGE.rglob("*.py")) + list(ADAPTERS.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(isinstance(t, ast.Name) and t.id == "__version__" for t in targets):
                    assigned.append(str(path.relative_to(PACKAGE.parent)))
    assert assigned == ["gwgrad/_version.py"]
