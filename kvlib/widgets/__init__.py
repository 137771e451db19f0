"""Interactive widgets for the notebooks: one module per lesson, built on LiveFigure.

Each widget function returns an ipywidgets container that also carries what a headless test
needs (its controls, its figure); nothing here runs at import time but the imports.
"""

from .base import LiveFigure

__all__ = ["LiveFigure"]
