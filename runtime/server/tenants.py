"""Tenants: API keys mapped to named callers with their own limits — requests and tokens per minute (token
buckets), concurrent requests, and the most urgent priority they may ask for.

    {"tenants": [{"name": "acme", "key": "sk-acme-…", "requests_per_minute": 600, "tokens_per_minute": 200000,
                  "max_concurrency": 8, "priority_floor": 0}, …]}      # runtime serve --tenants FILE

A request is charged its prompt tokens + max_tokens when admitted, and what it did not generate is refunded when
it ends, so a tenant cannot overrun its token rate by asking long generations at once. Over a limit the answer is
HTTP 429 / RESOURCE_EXHAUSTED with the seconds after which the bucket will have room (Retry-After); a request that
no bucket could ever hold (more tokens than a minute's) is HTTP 400 / INVALID_ARGUMENT instead. Tenant names
label metrics: a bounded set, the configured names (callers without a tenant are "default").
"""

from __future__ import annotations

import json
import math
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from ..request import InvalidRequest

NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
DEFAULT = "default"


@dataclass(frozen=True)
class Tenant:
    name: str
    key: str
    requests_per_minute: float | None = None
    tokens_per_minute: float | None = None
    max_concurrency: int | None = None
    priority_floor: int = 0

    def __post_init__(self):
        if not isinstance(self.name, str) or not NAME.match(self.name) or self.name == DEFAULT:
            raise ValueError(f"tenant name {self.name!r}: 1-64 letters, digits, '_', '.' or '-' (not {DEFAULT!r})")
        if not isinstance(self.key, str) or len(self.key) < 8:
            raise ValueError(f"tenant {self.name}: key must be a string of at least 8 characters")
        for field in ("requests_per_minute", "tokens_per_minute", "max_concurrency"):
            value = getattr(self, field)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not 0 < value < math.inf):      # NaN passed `<= 0`
                raise ValueError(f"tenant {self.name}: {field} must be a positive number")
        if not isinstance(self.priority_floor, int) or not -100 <= self.priority_floor <= 100:
            raise ValueError(f"tenant {self.name}: priority_floor must be an integer in [-100, 100]")


def load_tenants(path: Path) -> tuple[Tenant, ...]:
    """Tenants from a JSON file ({"tenants": [...]}); ValueError naming what is wrong."""
    try:
        entries = json.loads(Path(path).read_text())["tenants"]
        tenants = tuple(Tenant(**entry) for entry in entries)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"--tenants {path}: {e}") from None
    for attr in ("name", "key"):
        values = [getattr(t, attr) for t in tenants]
        if len(set(values)) != len(values):
            raise ValueError(f"--tenants {path}: two tenants share a {attr}")
    return tenants


class TokenBucket:
    """`rate` per second, holding at most `capacity` (a minute's worth: the burst a per-minute limit allows)."""

    def __init__(self, per_minute: float, clock=time.monotonic):
        self.rate, self.capacity, self.clock = per_minute / 60.0, float(per_minute), clock
        self.level, self.stamp = self.capacity, clock()

    def _refill(self) -> None:
        now = self.clock()
        self.level = min(self.capacity, self.level + (now - self.stamp) * self.rate)
        self.stamp = now

    def take(self, amount: float) -> float:
        """Take `amount` and return 0, or take nothing and return the seconds until it could be taken (an amount
        above the capacity can never be: inf)."""
        self._refill()
        if amount <= self.level:
            self.level -= amount
            return 0.0
        return float("inf") if amount > self.capacity else (amount - self.level) / self.rate

    def give(self, amount: float) -> None:
        self._refill()
        self.level = min(self.capacity, self.level + amount)


class RateLimited(Exception):
    def __init__(self, message: str, retry_after_s: float):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class TenantLimits:
    """Admission against each tenant's buckets and concurrency cap (thread-safe; the event loop calls it)."""

    def __init__(self, tenants: tuple[Tenant, ...], clock=time.monotonic):
        self._lock = threading.Lock()
        self.requests = {t.name: TokenBucket(t.requests_per_minute, clock) for t in tenants if t.requests_per_minute}
        self.tokens = {t.name: TokenBucket(t.tokens_per_minute, clock) for t in tenants if t.tokens_per_minute}
        self.caps = {t.name: t.max_concurrency for t in tenants if t.max_concurrency}
        self.running = {t.name: 0 for t in tenants}

    def admit(self, tenant: Tenant, tokens: int) -> None:
        """Count a request of up to `tokens` tokens against `tenant`, or raise RateLimited (retry later) or
        InvalidRequest (it can never be admitted); nothing is counted then."""
        name = tenant.name
        if name in self.tokens and tokens > self.tokens[name].capacity:     # a fixed capacity: no lock needed
            raise InvalidRequest(f"a request of {tokens} tokens (prompt + max_tokens) exceeds tenant {name}'s "
                                 f"tokens_per_minute of {self.tokens[name].capacity:g}, so it can never be "
                                 f"admitted; lower max_tokens")
        with self._lock:
            cap = self.caps.get(name)
            if cap is not None and self.running[name] >= cap:
                raise RateLimited(f"tenant {name} has {cap} requests running (its max_concurrency)", 1.0)
            wait = self.requests[name].take(1) if name in self.requests else 0.0
            if wait:
                raise RateLimited(f"tenant {name} is over its requests_per_minute", wait)
            if name in self.tokens:
                wait = self.tokens[name].take(tokens)
                if wait:
                    if name in self.requests:
                        self.requests[name].give(1)
                    raise RateLimited(f"tenant {name} is over its tokens_per_minute", wait)
            self.running[name] += 1

    def release(self, tenant: Tenant, unused_tokens: int, ran: bool = True) -> None:
        """The request ended: its slot back, and the tokens it was charged but did not generate; one that never
        ran (shed, or refused by the engine) gives back its place in requests_per_minute too."""
        with self._lock:
            self.running[tenant.name] -= 1
            if tenant.name in self.tokens and unused_tokens > 0:
                self.tokens[tenant.name].give(unused_tokens)
            if not ran and tenant.name in self.requests:
                self.requests[tenant.name].give(1)
