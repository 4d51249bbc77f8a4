"""What a server knows of an engine — local (AsyncEngine) or on replicas (cluster.remote.RemoteAsyncEngine): the
engine-client protocol. Transports and the cluster read only this, never an engine's internals."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol


@dataclass(frozen=True)
class EngineInfo:
    engine_dir: Path
    manifest: dict
    vocab_size: int
    max_model_len: int          # the longest sequence served
    block_size: int             # prefix-cache granularity (the replicas' router keys prompts by it)
    max_num_seqs: int
    max_waiting: int            # queued requests beyond which submit refuses
    num_slots: int              # sequences that can hold KV (running + retained for reuse)
    speculation: str | None     # "draft" | "ngram" | None
    draft: str | None           # the draft engine's folder name (its path is the server's business)
    sampling_defaults: dict = field(default_factory=dict)   # what requests leaving options out get (generation_config)

    @property
    def name(self) -> str:
        return Path(self.engine_dir).resolve().name


class EngineClient(Protocol):
    info: EngineInfo
    tokenizer: object           # tokenizers.Tokenizer
    grammars: object            # runtime.constraints.Grammars: a server compiles constraints off the event loop

    @property
    def num_waiting(self) -> int: ...

    def generate(self, prompt, params, request_id: str = "", priority: int = 0,
                 arrival: float | None = None) -> AsyncIterator: ...

    def abort(self, request_id: str) -> None: ...
