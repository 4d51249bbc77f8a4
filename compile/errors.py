"""User-facing errors of the compile stage: the CLI prints them as one line and exits with code 2. The base class
and ArtifactError live with the artifact format, in artifact/errors.py."""

from artifact.errors import ArtifactError, QuicksilverError

__all__ = ["ArtifactError", "CheckpointError", "QuicksilverError"]


class CheckpointError(QuicksilverError):
    """The Hugging Face checkpoint is missing, incomplete or of an unsupported kind."""
