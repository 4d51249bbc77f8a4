"""The per-request policy both transports share: which model serves a request — the one it names, or for
"auto" the one the route policy picks on the prompt as counted by the first model's tokenizer."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from ..request import InvalidRequest
from .router import Route, Router


async def choose_model(router: Router, model, text_prompt: bool, count: Callable[[object], Awaitable],
                       prompt_len: Callable[[object], int], max_tokens: int | None):
    """(bridge, route or None, the first model's prepared prompt or None). `count(bridge)` prepares the prompt for
    a model (its template and tokenizer), `prompt_len` reads its token count from what `count` returned;
    `max_tokens` None: the request leaves it to the context (it passes no max_tokens bound)."""
    named = router.named(model)
    if named is not None:
        return named, None, None
    if not text_prompt:
        raise InvalidRequest("token-id prompts belong to one model's vocabulary: name the model "
                             "(\"auto\" routes text prompts)")
    counted = await count(router.primary)
    route: Route = router.auto(prompt_len(counted), max_tokens)
    return route.bridge, route, counted
