"""Reading a lesson widget's figure and HTML headless, for the lessons' widget tests.
Not a test module (pytest collects test_*.py only).

A widget is driven as a student drives it: set a control's .value (its observers fire at
once) or call a button's .click(), then read what the figure and the HTML show:

    with no_new_figures():                 # however long it is driven, no figure leaks
        for step in range(20):
            widget.controls["layer"].value = step % 3
    np.testing.assert_allclose(image_of(widget.figure.axes[0]), expected)
    assert "Cache holds 8 positions" in text_of(widget.status.value)
"""

from __future__ import annotations

import contextlib
import re

import matplotlib.pyplot as plt
import numpy as np


@contextlib.contextmanager
def no_new_figures():
    """The block must leave the set of open pyplot figures as it found it."""
    before = set(plt.get_fignums())
    yield
    assert set(plt.get_fignums()) == before, "a figure was left open"


def text_of(html: str) -> str:
    """An HTML string as the words a reader sees: a line break or a block (<br>, <p>, <li>,
    ...) a space, other tags (<b>, <code>, ...) dropped, entities read, runs of white space
    one space."""
    words = re.sub(r"<(br|/?(p|div|li|ul|ol|tr|td|th|table|h\d))\b[^>]*>", " ", html)
    words = re.sub(r"<[^>]+>", "", words).replace("&lt;", "<").replace("&gt;", ">")
    return " ".join(words.replace("&amp;", "&").split())


def assert_check_line_is_computed(monkeypatch, widget, button, differs: str,
                                  equals: str) -> None:
    """The widget's check line compares its cached logits with a full recomputation that it
    really runs: with kvlib.forward off by 1.0 a click of `button` shows `differs`, with the
    real forward again `equals`."""
    import kvlib

    real_forward = kvlib.forward
    monkeypatch.setattr(kvlib, "forward", lambda *a, **k: real_forward(*a, **k) + 1.0)
    button.click()
    assert differs in widget.check.value
    monkeypatch.setattr(kvlib, "forward", real_forward)
    button.click()
    assert equals in widget.check.value


def image_of(ax, index: int = 0):
    """The array shown by an Axes' image (a masked array for attention maps)."""
    return ax.images[index].get_array()


def bar_heights(ax, container: int = 0) -> np.ndarray:
    """The heights of the bars of one ax.bar call (the first one by default)."""
    return np.array([bar.get_height() for bar in ax.containers[container]])
