"""The tree holds the product, not the history of its development: no source or document names
a numbered round of work (the word session or round followed by its number), and no name
carries a round's suffix (an underscore, ``s`` and the round's number, as result files were
named) nor a comment such a label in parentheses. That history lives in git. Checked on the repository's tracked ``.py``, ``.md`` and ``.sh`` files.

``find_history(paths)`` is the check itself, for a part of the tree:
``python -c "import sys; sys.path.insert(0, 'tests'); import test_no_history as t;
print(*t.find_history(['gwgrad']), sep='\\n')"``.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path
from typing import Iterable, List, Optional

ROOT = Path(__file__).resolve().parents[1]
SUFFIXES = (".py", ".md", ".sh")
#: This file spells the patterns out; it is not checked.
SELF = Path(__file__).resolve()

#: A round label: the word for a session or a round of work and its number ("--rounds 10", a
#: command-line option, is not one).
ROUND_LABEL = re.compile(r"(?<![-\w])(sessions?|rounds?)\s+\d+", re.IGNORECASE)
#: A round's suffix in a name (``_s`` and one or two digits, ending the word or followed by
#: ``_``) or such a label in parentheses. Not PTX types (``.s32``, or ``s16x2`` in a name):
#: the suffix follows an underscore and no letter or digit follows it.
ROUND_SUFFIX = re.compile(r"(?<=_)s\d{1,2}(?![0-9A-Za-z])|\(s\d{1,2}\)")
PATTERNS = (ROUND_LABEL, ROUND_SUFFIX)

#: Folders os.walk skips when git is not available (never part of the tree).
SKIP_DIRS = {"__pycache__", "build", "dist", "node_modules"}


def tracked_files(root: Path = ROOT) -> List[Path]:
    """The repository's tracked files (``git ls-files``), or every file under ``root`` outside
    hidden, build and cache folders when git or the repository is not there."""
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True,
                             check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        files = []
        for folder, dirs, names in os.walk(root):
            dirs[:] = [d for d in dirs if not d.startswith(".") and d not in SKIP_DIRS
                       and not d.endswith(".egg-info")]
            files += [Path(folder) / name for name in names]
        return files
    return [root / name for name in out.decode().split("\0") if name]


def history_in_text(text: str) -> List[str]:
    """Each match in ``text``, as ``line: matched text``."""
    hits = []
    for number, line in enumerate(text.splitlines(), 1):
        for pattern in PATTERNS:
            hits += [f"{number}: {m.group(0)!r} in {line.strip()}" for m in pattern.finditer(line)]
    return hits


def find_history(paths: Optional[Iterable[str]] = None, root: Path = ROOT) -> List[str]:
    """``file:line: match in line`` for every round label or suffix in the tracked ``.py``,
    ``.md`` and ``.sh`` files under ``paths`` (relative to ``root``; None: the whole tree)."""
    scopes = [(root / p).resolve() for p in paths] if paths is not None else None
    hits = []
    for path in sorted(tracked_files(root)):
        path = path.resolve()
        if path.suffix not in SUFFIXES or path == SELF or not path.is_file():
            continue
        if scopes is not None and not any(path == s or s in path.parents for s in scopes):
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        rel = path.relative_to(root.resolve())
        hits += [f"{rel}:{hit}" for hit in history_in_text(text)]
    return hits


def test_the_patterns_find_round_labels_and_suffixes():
    # Built from parts, so that this file holds no label itself.
    word, other, n = "Sess" + "ion", "ro" + "und", "13"
    for text in (f"{word} {n}: a pair of CTAs", f"{word.lower()}s {n}-14", f"{other} {n}",
                 f"h200_bench_s{n}.json", f"h200_gpu_tests_s{n}_b.json", "_s" + "8_before",
                 f"one tile ({'s'}{n})", f"h200_bench_tune_*_s{n}"):
        assert history_in_text(text), text
    for text in ("mad.hi.s32 z, i, -1024, y;", "max_" + "s16x2(a, b)", "--rounds 10 --sample-ms 12",
                 "half the barrier rounds of 32", "round(2t) below 2", "a session's cache",
                 "s16 outputs", "tokens_s = 3"):
        assert not history_in_text(text), text


def test_find_history_reports_file_and_line(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "a.py").write_text('"""Doc."""\n# ' + "sess" + "ion 7: tried it\n")
    (tmp_path / "pkg" / "b.md").write_text("see h200_bench_" + "s16.json\n")
    (tmp_path / "pkg" / "c.txt").write_text("sess" + "ion 7\n")  # not a checked suffix
    (tmp_path / "pkg" / "d.sh").write_text("echo clean\n")
    hits = find_history(root=tmp_path)  # no repository there: the os.walk fallback
    assert [h.split(":")[0:2] for h in hits] == [["pkg/a.py", "2"], ["pkg/b.md", "1"]], hits
    assert find_history(["pkg/d.sh"], root=tmp_path) == []


def test_no_development_history_in_the_tree():
    hits = find_history()
    assert not hits, ("round labels in the tree (history belongs in git; say what the code "
                      "does and why, in the present tense):\n" + "\n".join(hits))
