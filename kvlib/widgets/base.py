"""The pattern every widget follows: one figure, made once, redrawn in place."""

from __future__ import annotations

import ipywidgets as widgets
import matplotlib.pyplot as plt
from IPython.display import display


class LiveFigure:
    """A matplotlib figure shown inside an ipywidgets Output and redrawn on every change.

    The figure is created once and closed at once (so the inline backend does not show it a
    second time); callbacks change its artists or clear and redraw its axes, then call
    show(). No callback creates a new figure, so nothing leaks however long a student plays.
    """

    def __init__(self, figsize=(6, 4), n_axes: int = 1, **subplot_options):
        self.figure, axes = plt.subplots(1, n_axes, figsize=figsize, squeeze=False,
                                         **subplot_options)
        self.axes = list(axes[0])
        plt.close(self.figure)
        self.output = widgets.Output()

    @property
    def ax(self):
        return self.axes[0]

    def show(self) -> None:
        with self.output:
            self.output.clear_output(wait=True)
            display(self.figure)


def safely(callback, message_widget: widgets.HTML | None = None):
    """Wrap a widget callback so that a bad value is reported in words, never a traceback."""

    def run(*args, **kwargs):
        try:
            callback(*args, **kwargs)
            if message_widget is not None:
                message_widget.value = ""
        except (ValueError, TypeError) as error:
            if message_widget is None:
                raise
            message_widget.value = f"<b>Cannot show this:</b> {error}"

    return run
