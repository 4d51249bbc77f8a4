"""User-facing errors of the compile stage: the CLI prints them as one line and exits with code 2."""


class QuicksilverError(Exception):
    """Base class: a problem with the user's input, explained in the message."""


class CheckpointError(QuicksilverError):
    """The Hugging Face checkpoint is missing, incomplete or of an unsupported kind."""


class ArtifactError(QuicksilverError):
    """An engine artifact is missing, corrupted, truncated, foreign or of another format version."""
