"""CompileConfig: the validated options of one `compile build`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

PRECISIONS = ("fp32", "fp16")
TARGETS = ("cpu",)


@dataclass(frozen=True)
class CompileConfig:
    model_dir: Path
    out_dir: Path
    precision: str = "fp32"
    target: str = "cpu"
    max_seq_len: int | None = None  # None: the model's max_position_embeddings
    overwrite: bool = False

    def __post_init__(self):
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, not {self.precision!r}")
        if self.target not in TARGETS:
            raise ValueError(f"target must be one of {', '.join(TARGETS)}, not {self.target!r}")
        if self.max_seq_len is not None and self.max_seq_len < 16:
            raise ValueError(f"max_seq_len must be at least 16, not {self.max_seq_len}")
