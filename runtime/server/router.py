"""Several models behind one server: requests name a model, or `"model": "auto"` is routed by a declared policy.

The policy (`runtime serve --route FILE`, JSON) is an ordered list of rules and a fallback chain:

    {"auto": [{"model": "draft", "max_prompt_tokens": 256, "max_tokens": 64},
              {"model": "target"}],
     "fallback": {"target": "draft"},
     "saturated_waiting": 4}

The first rule whose bounds all hold picks the model (a rule without bounds always holds; without rules, auto is the
first model). If that model is saturated — `saturated_waiting` requests already queued for it (default: its own
`--max-waiting`, the point where it would shed) — the request walks the fallback chain to the first model that is
not saturated and whose context holds the prompt, instead of being refused; the response says so (`model`, and the
`x-quicksilver-route` header / gRPC metadata). Fallback applies to `auto` only: a request that names a model gets it.
Prompt lengths are counted with the first model's tokenizer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from ..request import InvalidRequest
from .bridge import Bridge

AUTO = "auto"


class UnknownModel(InvalidRequest):
    """A request names a model the server does not serve (404 / NOT_FOUND, as vLLM answers)."""


@dataclass(frozen=True)
class Rule:
    model: str
    max_prompt_tokens: int | None = None
    max_tokens: int | None = None

    def holds(self, prompt_tokens: int, max_tokens: int | None) -> bool:
        """`max_tokens` None (the chat default: the rest of the context) exceeds any bound."""
        return ((self.max_prompt_tokens is None or prompt_tokens <= self.max_prompt_tokens)
                and (self.max_tokens is None or (max_tokens is not None and max_tokens <= self.max_tokens)))


@dataclass(frozen=True)
class RoutePolicy:
    rules: tuple[Rule, ...] = ()
    fallback: dict[str, str] = field(default_factory=dict)
    saturated_waiting: int | None = None     # None: each model's own max_waiting

    def check(self, models: list[str]) -> None:
        """Every name must be a served model and the fallback chain must end (no cycle)."""
        named = [r.model for r in self.rules] + list(self.fallback) + list(self.fallback.values())
        unknown = sorted({m for m in named if m not in models})
        if unknown:
            raise ValueError(f"route policy names {', '.join(map(repr, unknown))}, which this server does not serve "
                             f"(models: {', '.join(models)})")
        for start in self.fallback:
            seen, m = {start}, self.fallback[start]
            while m in self.fallback:
                if m in seen:
                    raise ValueError(f"route policy: the fallback chain from {start!r} is a cycle")
                seen.add(m)
                m = self.fallback[m]


def load_policy(path: Path) -> RoutePolicy:
    """Read and validate a --route file; errors say which field is wrong."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as e:
        raise ValueError(f"cannot read route policy {path}: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"route policy {path} is not JSON: {e}") from None
    if not isinstance(data, dict) or set(data) - {"auto", "fallback", "saturated_waiting"}:
        raise ValueError(f"route policy {path}: expected an object with keys auto, fallback, saturated_waiting")
    rules = []
    for i, r in enumerate(data.get("auto", [])):
        if not isinstance(r, dict) or not isinstance(r.get("model"), str) or set(r) - {"model", "max_prompt_tokens",
                                                                                      "max_tokens"}:
            raise ValueError(f"route policy {path}: auto[{i}] must be {{\"model\": NAME, \"max_prompt_tokens\": N, "
                             f"\"max_tokens\": N}} (bounds optional)")
        for key in ("max_prompt_tokens", "max_tokens"):
            if key in r and (isinstance(r[key], bool) or not isinstance(r[key], int) or r[key] < 1):
                raise ValueError(f"route policy {path}: auto[{i}].{key} must be a positive integer")
        rules.append(Rule(r["model"], r.get("max_prompt_tokens"), r.get("max_tokens")))
    fallback = data.get("fallback", {})
    if not isinstance(fallback, dict) or not all(isinstance(v, str) for v in fallback.values()):
        raise ValueError(f"route policy {path}: fallback must map model names to model names")
    saturated = data.get("saturated_waiting")
    if saturated is not None and (isinstance(saturated, bool) or not isinstance(saturated, int) or saturated < 1):
        raise ValueError(f"route policy {path}: saturated_waiting must be a positive integer")
    return RoutePolicy(tuple(rules), dict(fallback), saturated)


@dataclass(frozen=True)
class Route:
    bridge: Bridge
    reason: str       # for the response header and the log line; "" when the request named its model

    @property
    def headers(self) -> dict[str, str]:
        return {"x-quicksilver-route": f"{self.bridge.model_name}; {self.reason}"} if self.reason else {}


class Router:
    """The served models by name; the first is the default (a request without a model) and counts auto's prompts."""

    def __init__(self, bridges: list[Bridge], policy: RoutePolicy | None = None):
        self.bridges = {b.model_name: b for b in bridges}
        if len(self.bridges) != len(bridges):
            raise ValueError(f"two models share a name ({', '.join(b.model_name for b in bridges)}): name them apart")
        if AUTO in self.bridges:
            raise ValueError(f"{AUTO!r} is the routing model id; name the model otherwise")
        self.primary = bridges[0]
        self.policy = policy or RoutePolicy()
        self.policy.check(list(self.bridges))

    @property
    def routes(self) -> bool:
        """Whether `auto` means a choice (several models) rather than the only one."""
        return len(self.bridges) > 1

    def named(self, model: str | None) -> Bridge | None:
        """The bridge a request's `model` names; None for auto (routed once the prompt is counted)."""
        if model is None or model == "":
            return self.primary
        if not isinstance(model, str):
            raise InvalidRequest("model must be a string")
        if model == AUTO:
            return None if self.routes else self.primary
        bridge = self.bridges.get(model)
        if bridge is None:
            raise UnknownModel(f"unknown model {model!r}; this server serves "
                                 f"{', '.join(map(repr, [*self.bridges, AUTO]))}")
        return bridge

    def auto(self, prompt_tokens: int, max_tokens: int | None) -> Route:
        """The policy's choice for a request of this shape, or its fallback when the choice is saturated."""
        rule = next((r for r in self.policy.rules if r.holds(prompt_tokens, max_tokens)), None)
        chosen = self.bridges[rule.model] if rule else self.primary
        why = (f"auto: rule {self.policy.rules.index(rule)}" if rule else "auto: default model")
        if not self._saturated(chosen):
            return Route(chosen, why)
        for candidate in self._chain(chosen, prompt_tokens, max_tokens):
            if not self._saturated(candidate):
                return Route(candidate, f"fallback: {chosen.model_name} saturated ({chosen.waiting} waiting)")
        return Route(chosen, why)         # nowhere better: the chosen model queues or sheds as usual

    def fallback_after(self, bridge: Bridge, prompt_tokens: int, max_tokens: int | None) -> Route | None:
        """Where an auto request goes if `bridge` shed it anyway (it filled between the check and admission)."""
        candidate = next(self._chain(bridge, prompt_tokens, max_tokens), None)
        return Route(candidate, f"fallback: {bridge.model_name} shed the request") if candidate else None

    def _chain(self, bridge: Bridge, prompt_tokens: int, max_tokens: int | None):
        """The models `bridge` falls back to, in order, that can hold the request: the prompt and its max_tokens
        (None: the rest of the context, whatever the model's), where the model would refuse it otherwise."""
        m = bridge.model_name
        while m in self.policy.fallback:
            m = self.policy.fallback[m]
            if prompt_tokens + (max_tokens or 1) <= self.bridges[m].max_model_len:
                yield self.bridges[m]

    def _saturated(self, bridge: Bridge) -> bool:
        limit = self.policy.saturated_waiting or bridge.max_waiting
        return bridge.waiting >= limit
