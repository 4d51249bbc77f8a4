"""The protocols a backend implements. The engine loop (runtime/engine.py) and the scheduler see only these, so
nothing outside a backend knows which one runs.

A backend is a KV manager + a model runner + a proposer:
- `KVManager` is the one owner of KV memory: admission (a sequence index and its cached prefix), growth, the
  prefix cache (caching computed blocks, eviction) and freeing. The scheduler drives it; nobody else.
- `Backend.run` computes one step's `ModelInput` and returns its logits (`RunnerOutput`); `step_cost` prices a
  decode step with speculation from measured costs, for the speculation planner.
- `Proposer` (spec_decode/proposer.py) guesses tokens for speculative decoding and reads prompt chunks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

from ..outputs import ModelInput, RunnerOutput
from ..request import Request
from ..spec_decode.proposer import Proposer


@runtime_checkable
class KVManager(Protocol):
    block_size: int
    num_slots: int              # sequences that can hold KV at once (one index each, `req.slot`)
    stats: object               # kv.layout.CacheStats: prefix-cache queries and hits
    min_chunk: int              # fewest prompt tokens a chunk may hold (cpu: 2, see scheduler.prompt_chunk)

    @property
    def usage(self) -> float:
        """Fraction of the KV budget in use (the metric)."""
        ...

    @property
    def num_free_slots(self) -> int: ...

    def can_ever_fit(self, req: Request) -> bool:
        """Whether an empty cache could hold `req`'s prompt + max_tokens (else it would wait forever)."""
        ...

    def allocate(self, req: Request) -> int | None:
        """Admit `req`: a sequence index, its cached prefix and KV for its prompt; returns the number of prompt
        tokens served from the prefix cache (setting `req.num_computed_draft` to those the draft's KV holds), or
        None (holding nothing) when there is no room."""
        ...

    def reserve(self, req: Request, num_tokens: int) -> bool:
        """Make sure `req` has KV memory for its first `num_tokens` tokens; False (nothing taken) if the budget
        cannot supply it now — the scheduler then preempts or waits."""
        ...

    def computed(self, req: Request) -> None:
        """`req` computed more tokens this step: its newly full blocks go to the prefix cache (at `flush`)."""
        ...

    def flush(self) -> None:
        """Cache what `computed` noted. Run at the start of the next step, after the outputs went out, so the
        copy never delays a token."""
        ...

    def idle(self) -> bool:
        """One slice (a few ms at most) of work worth doing while nothing runs: pending prefix-cache copies, then
        making memory resident ahead of the next burst's copies. True while more is left."""
        ...

    def free(self, req: Request, cache: bool = True) -> None:
        """Release everything `req` holds (idempotent); with `cache`, keep its computed blocks in the prefix
        cache first (its KV is complete; an errored request's may not be)."""
        ...


@runtime_checkable
class Backend(Protocol):
    kv: KVManager
    runner: object              # the target's model runner (manifest, vocab_size, engine_dir, max_seq_len)
    draft: object | None        # the draft's model runner, when one speculates
    proposer: Proposer | None
    max_model_len: int

    def run(self, inp: ModelInput) -> RunnerOutput:
        """Compute one step: KV for every fed token, logits where asked."""
        ...

    def step_cost(self, num_decodes: int) -> Callable[[Sequence[int]], float]:
        """Seconds of a step that decodes `num_decodes` sequences, as a function of the guesses of those among
        them that speculate (draft steps and verification included); from costs measured at warm-up and
        refreshed by every step."""
        ...

    def warm_up(self) -> None:
        """Pay ONNX Runtime's first-run costs now, and measure the step costs speculation decides by."""
        ...


def make_proposer(config, draft_proposer: Callable[[], Proposer]) -> Proposer | None:
    """The proposer `config.speculation` asks for: prompt lookup, the backend's draft-model proposer, or none."""
    if config.speculation == "ngram":
        from ..spec_decode.ngram import NgramProposer

        return NgramProposer()
    return draft_proposer() if config.speculation == "draft" else None


def context_length(config, runner, draft) -> int:
    """The longest sequence served: --max-model-len, capped by what the engine (and its draft) were built for."""
    n = min(config.cache.max_model_len or runner.max_seq_len, runner.max_seq_len)
    return min(n, draft.max_seq_len) if draft is not None else n
