"""gwgrad's exceptions.

``ArgumentError`` is the ``ValueError`` every contract rule raises: it carries the name of the
argument at fault (``argument``) and the rest of the message (``detail``: "expected X, got
Y"), so that an adapter reports it under its own argument names with ``renamed`` instead of
editing message strings. ``RuntimeError`` stays the error of an unusable environment.
"""

from __future__ import annotations

from typing import Any, Mapping

__all__ = ["ArgumentError", "fail"]


class ArgumentError(ValueError):
    """A bad argument: ``str(err) == f"{err.argument}: {err.detail}"``."""

    def __init__(self, argument: str, detail: str):
        super().__init__(f"{argument}: {detail}")
        self.argument = argument
        self.detail = detail

    def renamed(self, names: Mapping[str, str]) -> "ArgumentError":
        """The same error under ``names[argument]`` (itself when the name is not mapped)."""
        name = names.get(self.argument)
        if name is None:
            return self
        err = ArgumentError(name, self.detail)
        err.__cause__ = self
        return err


def fail(argument: str, expected: str, got: Any) -> None:
    """Raise ``ArgumentError(argument, f"expected {expected}, got {got}")``."""
    raise ArgumentError(argument, f"expected {expected}, got {got}")
