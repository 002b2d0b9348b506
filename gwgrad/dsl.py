"""What gwgrad does around the CuTe DSL as a whole process.

The DSL parses the host program's command line whenever it compiles (``parse_known_args()``
for its ``-diagnostic`` option, with abbreviations: a user script started with ``-d 3``
would exit with code 2, and ``--help`` would print the DSL's help). ``shielded_argv`` hides
the program's arguments from it for the duration of a compile or an import.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from typing import Iterator

__all__ = ["shielded_argv"]

_lock = threading.RLock()


@contextlib.contextmanager
def shielded_argv() -> Iterator[None]:
    """``sys.argv`` reduced to the program name inside (restored after, even on errors)."""
    with _lock:
        saved = sys.argv
        sys.argv = saved[:1] if saved else [""]
        try:
            yield
        finally:
            sys.argv = saved
