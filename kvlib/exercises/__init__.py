"""Exercise checkers: one module per lesson, each exercise a function that says in plain
words what is right or wrong with a student's answer, and its solution, shown on request."""

from .base import Feedback, check_array, show_solution

__all__ = ["Feedback", "check_array", "show_solution"]
