"""Errors users see as one line (the CLIs print them and exit with code 2), shared by both stages (compile adds its
own in compile/errors.py)."""


class QuicksilverError(Exception):
    """Base class: a problem with the user's input, explained in the message."""


class ArtifactError(QuicksilverError):
    """An engine artifact is missing, corrupted, truncated, foreign or of another format version."""


class MissingDependency(QuicksilverError):
    """An optional extra a chosen feature needs is not installed; the message names the pip command."""
