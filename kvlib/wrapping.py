"""Swap kvlib's building blocks for wrapped ones while a block of code runs
(when_the_cache_is_wrong).

The decode loops call kvlib.model's functions (project_qkv, attention_weights, ...) by their
module-level names, so replacing those names is enough to watch them (kvlib.debug records what
they return) or to change what they return (kvlib.precision rounds it to a 16-bit format). A
learner's own loop that calls kvlib.project_qkv is watched the same way.

    with wrapped(("project_qkv",), lambda name, original: my_version):
        ...
"""

from __future__ import annotations

import contextlib

from . import inference, model


@contextlib.contextmanager
def wrapped(names, wrap):
    """Replace each kvlib.model function named in names by wrap(name, original), where loops
    look it up (kvlib, kvlib.model, kvlib.inference), and put the originals back afterwards,
    even if the block raises. Nested uses wrap the wrapped functions."""
    import kvlib

    saved = []
    try:
        for name in names:
            original = getattr(model, name)
            replacement = wrap(name, original)
            for module in (kvlib, model, inference):
                if getattr(module, name, None) is original:
                    saved.append((module, name, original))
                    setattr(module, name, replacement)
        yield
    finally:
        for module, name, original in reversed(saved):
            setattr(module, name, original)
