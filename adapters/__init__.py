"""Framework adapters, imported as ``gwgrad.adapters.torch``, ``gwgrad.adapters.cupy`` and
``gwgrad.adapters.jax``.

Each translates its framework's objects (arrays, current stream, allocation, autograd /
custom-call registration) into the core API and re-implements nothing: validation and
dispatch live in ``gwgrad``. Importing this package imports no framework.

This directory is the ``gwgrad.adapters`` package: the installed package maps it there
(``package-dir`` in pyproject.toml), and a plain checkout on PYTHONPATH finds it through
``gwgrad.__path__`` (see gwgrad/__init__.py).
"""
