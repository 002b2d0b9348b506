"""The kernels' structure, read from the source (no DSL import): the shared parts live in one
module each (kernels/config.py, prep.py, scheduler.py, epilogue.py, entry.py; there is no
common.py), the unit scheduler and the epilogue's sub-tile loop are defined once and used by
both the SM90 and the SM100 kernel, and no kernel function runs past LONGEST lines without
saying why ("long because" in its docstring or first comment)."""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path
from typing import Dict, Iterator, List, Set, Tuple

KERNELS = Path(__file__).resolve().parents[1] / "gwgrad" / "kernels"
LONGEST = 110
SHARED = ("config", "prep", "scheduler", "epilogue", "entry")
ARCH = ("sm90_bf16", "sm100_bf16")


def sources() -> Dict[str, str]:
    return {path.stem: path.read_text() for path in sorted(KERNELS.glob("*.py"))}


def trees() -> Dict[str, ast.Module]:
    return {name: ast.parse(text, name) for name, text in sources().items()}


def definitions(tree: ast.AST) -> Iterator[ast.AST]:
    """Every function, method and class definition, at any depth."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield node


def top_level_names(tree: ast.Module) -> Set[str]:
    return {node.name for node in tree.body
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}


def imported_from(tree: ast.Module, module: str) -> Set[str]:
    """Names a kernel module imports from ``.<module>``."""
    return {alias.name for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module == module
            for alias in node.names}


def used_names(tree: ast.Module) -> Set[str]:
    return {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}


def calls_named(tree: ast.AST, attr: str) -> List[ast.Call]:
    return [node for node in ast.walk(tree) if isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute) and node.func.attr == attr]


def long_functions(text: str, longest: int = LONGEST) -> List[Tuple[str, int]]:
    """(name, lines) of the functions in ``text`` longer than ``longest`` lines (from the def
    line to the last) whose docstring or first comment does not say "long because"."""
    lines = text.splitlines()
    found = []
    for node in definitions(ast.parse(text)):
        if isinstance(node, ast.ClassDef):
            continue
        length = node.end_lineno - node.lineno + 1
        if length <= longest:
            continue
        reason = ast.get_docstring(node) or ""
        first_comment = next((line.strip() for line in lines[node.lineno:node.end_lineno]
                              if line.strip().startswith("#")), "")
        if "long because" not in reason + first_comment:
            found.append((node.name, length))
    return found


def test_common_is_gone_and_the_shared_modules_exist():
    assert not (KERNELS / "common.py").exists()
    for name in SHARED:
        assert (KERNELS / f"{name}.py").is_file(), name
    for name, text in sources().items():
        assert "from .common" not in text and "kernels.common" not in text, name


def test_shared_definitions_live_in_one_module():
    """Every top-level function and class of scheduler.py and epilogue.py is defined there
    and nowhere else in gwgrad/kernels (no arch module keeps its own copy)."""
    found = trees()
    owners: Dict[str, List[str]] = {}
    for module, tree in found.items():
        for node in definitions(tree):
            owners.setdefault(node.name, []).append(module)
    shared = {name: module for module in ("scheduler", "epilogue")
              for name in top_level_names(found[module])}
    assert {"UnitScheduler", "DynamicUnits", "BalancedUnits", "ClcUnits", "ClusterMailbox",
            "decode_unit", "publish_words", "take_words", "SubtileStore",
            "store_subtile"} <= set(shared)
    for name, module in shared.items():
        assert owners[name] == [module], (name, owners[name])


def scheduler_variants(tree: ast.Module) -> Set[str]:
    return {node.name for node in tree.body if isinstance(node, ast.ClassDef)
            and any(isinstance(b, ast.Name) and b.id in ("UnitScheduler", "DynamicUnits")
                    for b in node.bases)}


def test_sm90_and_sm100_use_the_one_scheduler_and_the_one_epilogue_loop():
    found = trees()
    variants = scheduler_variants(found["scheduler"])
    assert variants == {"DynamicUnits", "BalancedUnits", "ClcUnits"}
    for module in ARCH:
        tree = found[module]
        from_scheduler = imported_from(tree, "scheduler")
        uses = used_names(tree)
        assert {"decode_unit", "publish_words", "take_words"} <= from_scheduler, module
        assert from_scheduler & variants, (module, from_scheduler)
        assert "SubtileStore" in imported_from(tree, "epilogue"), module
        # Imported and used: each name occurs outside its import.
        for name in (from_scheduler & variants) | {"SubtileStore", "publish_words"}:
            assert name in uses, (module, name)
        # The arch's epilogue goes through SubtileStore.store_tile.
        assert any(isinstance(c.func.value, ast.Name) and c.func.value.id == "subtile_store"
                   for c in calls_named(tree, "store_tile")), module


def test_units_are_taken_and_subtiles_stored_in_the_shared_modules_only():
    """The primitives of taking a unit (CLC queries and responses, the mailbox's st.async,
    the atomic on the unit counter) appear in scheduler.py alone; a function that stages a
    sub-tile between two barrier waits and issues its TMA store appears in epilogue.py
    alone."""
    for module, tree in trees().items():
        taking = (calls_named(tree, "issue_clc_query") + calls_named(tree, "clc_response")
                  + calls_named(tree, "store_async_dsmem")
                  + [c for c in calls_named(tree, "atomic_add")
                     if c.args and "counter" in ast.unparse(c.args[0])])
        assert bool(taking) == (module == "scheduler"), (module, len(taking))
        staging = [
            node.name for node in definitions(tree) if not isinstance(node, ast.ClassDef)
            and len(calls_named(node, "arrive_and_wait")) >= 2
            and len(calls_named(node, "fence_proxy")) >= 1
            and any(isinstance(c.func, ast.Name) and c.func.id == "store_subtile"
                    or isinstance(c.func, ast.Attribute) and c.func.attr == "store_subtile"
                    for c in ast.walk(node) if isinstance(c, ast.Call))]
        assert (staging == ["store_one"]) if module == "epilogue" else not staging, \
            (module, staging)


def test_no_kernel_function_is_long_without_a_reason():
    assert {name: found for name, text in sources().items()
            if (found := long_functions(text))} == {}


def test_the_length_check_sees_a_long_function_and_its_reason():
    body = "\n".join(f"    x{i} = {i}" for i in range(LONGEST))
    plain = f"def f():\n{body}\n"
    assert long_functions(plain) == [("f", LONGEST + 1)]
    with_doc = f'def f():\n    """Setup: long because the DSL needs it inline."""\n{body}\n'
    assert long_functions(with_doc) == []
    with_comment = f"def f():\n    # long because one trace\n{body}\n"
    assert long_functions(with_comment) == []
    method = textwrap.indent(plain, "    ")
    assert long_functions(f"class K:\n{method}") == [("f", LONGEST + 1)]
