"""scripts/ab_bench.py: the run order, the table and the --old check (CPU; the bench runs
themselves need the GPU)."""

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def load():
    spec = importlib.util.spec_from_file_location("ab_bench", ROOT / "scripts" / "ab_bench.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_order_puts_each_tree_first_equally_often():
    ab = load()
    assert ab.order(1) == ["old", "new"]
    assert ab.order(4) == ["old", "new", "new", "old", "old", "new", "new", "old"]
    firsts = [ab.order(4)[2 * r] for r in range(4)]
    assert firsts.count("old") == firsts.count("new") == 2


def test_bench_command_defaults_and_overrides():
    ab = load()
    cmd = ab.bench_cmd("x.json", ["--rows", "fine-256e"])
    assert cmd[cmd.index("--tiles") + 1] == "" and cmd[cmd.index("--rounds") + 1] == "10"
    assert cmd[-2:] == ["--rows", "fine-256e"] and "--gwgrad-only" in cmd
    cmd = ab.bench_cmd("x.json", ["--tiles", "128x128", "--rounds", "3"])
    assert cmd.count("--tiles") == 1 and cmd.count("--rounds") == 1


def test_rates_and_summary(tmp_path):
    ab = load()

    def doc(path, default, variant):
        rows = [{"name": "r", "dist": "uniform", "methods": {
            "gwgrad": {"ms": 1.0, "tflops": default},
            "gwgrad_128x128": {"ms": 1.0, "tflops": variant},
            "failed": {"ms": None, "tflops": None}}}]
        path.write_text(json.dumps({"rows": rows}))
        return ab.rates(str(path))

    runs = {"old": [doc(tmp_path / "a.json", 100.0, 50.0), doc(tmp_path / "b.json", 102.0, 50.0)],
            "new": [doc(tmp_path / "c.json", 110.0, 40.0), doc(tmp_path / "d.json", 112.0, 60.0)]}
    table = {t["variant"]: t for t in ab.summarize(runs)}
    assert set(table) == {"gwgrad", "gwgrad_128x128"}  # a method without a rate is left out
    assert table["gwgrad"]["new_over_old"] == pytest.approx(111.0 / 101.0)
    assert table["gwgrad_128x128"]["new_over_old"] == pytest.approx(1.0)
    assert table["gwgrad"]["old"] == [100.0, 102.0]
    # Rep r pairs the r-th run of each tree: both reps faster for the default; the variant
    # is slower in one rep and faster in the other.
    assert table["gwgrad"]["per_rep"] == pytest.approx([1.1, 112.0 / 102.0])
    assert table["gwgrad"]["verdict"] == "faster"
    assert table["gwgrad_128x128"]["verdict"] == "mixed"
    assert ab.overall(list(table.values())) == (
        "2 lines: 1 faster, 0 slower, 1 mixed in every rep; geomean new/old "
        f"{(111.0 / 101.0) ** 0.5:.3f}")


def test_verdict_slower_only_when_every_rep_is():
    ab = load()
    key = ("r", "zipf", "gwgrad")
    runs = {"old": [{key: 100.0}, {key: 100.0}, {key: 100.0}],
            "new": [{key: 95.0}, {key: 99.0}, {key: 101.0}]}
    assert ab.summarize(runs)[0]["verdict"] == "mixed"
    runs["new"][2] = {key: 99.9}
    assert ab.summarize(runs)[0]["verdict"] == "slower"
    assert ab.overall([]) == "no rows"


def test_old_tree_must_hold_gwgrad(tmp_path, capsys):
    with pytest.raises(SystemExit):
        load().main(["--old", str(tmp_path)])
    assert "--old: expected a directory holding gwgrad/__init__.py" in capsys.readouterr().err


def test_new_tree_must_hold_gwgrad(tmp_path, capsys):
    old = tmp_path / "old"
    (old / "gwgrad").mkdir(parents=True)
    (old / "gwgrad" / "__init__.py").write_text("")
    with pytest.raises(SystemExit):
        load().main(["--old", str(old), "--new", str(tmp_path / "missing")])
    assert "--new: expected a directory holding gwgrad/__init__.py" in capsys.readouterr().err
