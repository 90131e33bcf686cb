"""User-facing error types.

Everything a user can get wrong (a model name, a spec, a cluster file, a model that cannot be
captured) raises an `AutoparError` subclass with a message that says what was wrong and how to
fix it. The CLI prints that message alone; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations


class AutoparError(Exception):
    """An error caused by the user's input, explained in its message."""


class ModelSpecError(AutoparError):
    """A MODEL argument that names no zoo model, or a spec that does not import or run."""


class CaptureError(AutoparError):
    """A model that `torch.export` cannot capture."""


class ClusterSpecError(AutoparError):
    """An unknown cluster preset or a malformed cluster file."""
