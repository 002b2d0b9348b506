"""gwgrad's exceptions, and which one a caller gets when.

* ``ArgumentError`` (a ``ValueError``): a bad argument, one no kernel of gwgrad runs: a wrong
  shape, dtype, layout, value or tiling. Its ``argument`` names the argument at fault and
  ``detail`` says "expected X, got Y".
* ``UnsupportedError`` (a ``NotImplementedError``): a valid call that this machine's
  architecture cannot run but another one gwgrad has kernels for can (FP4 operands on an SM90
  GPU, FP32 scale factors on an SM100 GPU, a GPU gwgrad has no kernels for). Its ``argument``
  names the argument, ``arch`` the architecture asked for and ``needs`` the ones that run it.
  cuDNN frontend's callers (and its own tests) treat an unsupported case as ``except
  (ValueError, NotImplementedError)``; ``NotImplementedError`` is a subclass of
  ``RuntimeError`` in Python, so code written for gwgrad's earlier ``RuntimeError`` (``except
  RuntimeError``) still catches it.
* ``RuntimeError``: an unusable environment, whatever the arguments: no CUDA, a CUDA or
  driver call that failed, ``execute()`` before ``compile()``, a missing optional package.

Both named errors render as ``f"{argument}: {detail}"`` and have ``renamed``, so an adapter
reports them under its own argument names instead of editing message strings.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence, Tuple

__all__ = ["ArgumentError", "UnsupportedError", "NAMED_ERRORS", "fail", "unsupported",
           "arch_names"]


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


class UnsupportedError(NotImplementedError):
    """A call this architecture cannot run and another can: ``str(err) == f"{err.argument}:
    {err.detail}"``, ``err.arch`` the architecture asked for ("sm_90a", "sm_100a", ... or a
    compute capability gwgrad has no kernels for), ``err.needs`` the architectures that run it
    (empty when only the CPU reference does)."""

    def __init__(self, argument: str, detail: str, *, arch: str = "",
                 needs: Sequence[str] = ()):
        super().__init__(f"{argument}: {detail}")
        self.argument = argument
        self.detail = detail
        self.arch = arch
        self.needs: Tuple[str, ...] = tuple(needs)

    def renamed(self, names: Mapping[str, str]) -> "UnsupportedError":
        """The same error under ``names[argument]`` (itself when the name is not mapped)."""
        name = names.get(self.argument)
        if name is None:
            return self
        err = UnsupportedError(name, self.detail, arch=self.arch, needs=self.needs)
        err.__cause__ = self
        return err


#: The errors that name an argument (``except NAMED_ERRORS as exc: raise exc.renamed(...)``).
NAMED_ERRORS = (ArgumentError, UnsupportedError)

#: How messages name the architectures that run a case.
_ARCH_WORDS = {
    ("sm_90a",): "an SM90 GPU (sm_90a: H100 / H200)",
    ("sm_100a", "sm_103a"): "an SM100 GPU (sm_100a/sm_103a)",
    ("sm_90a", "sm_100a", "sm_103a"): "an SM90 (sm_90a) or SM100 (sm_100a/sm_103a) GPU",
}


def arch_names(needs: Sequence[str]) -> str:
    """``needs`` in words: "an SM100 GPU (sm_100a/sm_103a)"."""
    return _ARCH_WORDS.get(tuple(needs), " or ".join(needs) or "the CPU reference")


def fail(argument: str, expected: str, got: Any) -> None:
    """Raise ``ArgumentError(argument, f"expected {expected}, got {got}")``."""
    raise ArgumentError(argument, f"expected {expected}, got {got}")


def unsupported(argument: str, what: str, needs: Sequence[str], arch: str,
                why: str = "") -> None:
    """Raise ``UnsupportedError``: "{argument}: {what} needs {arch_names(needs)}[: {why}];
    this is {arch}"."""
    reason = f": {why}" if why else ""
    raise UnsupportedError(argument, f"{what} needs {arch_names(needs)}{reason}; this is {arch}",
                           arch=arch, needs=needs)
