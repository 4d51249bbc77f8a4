"""Prometheus metrics: the only module that imports prometheus_client.

Components count where things happen (Engine.stats, KVCacheManager.stats, Speculator.stats, request
timings); this module turns those into a registry: histograms observed per request and per step, and
gauges/counters refreshed from the engine's stats on every step.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client import CONTENT_TYPE_LATEST  # noqa: F401  (re-exported for the HTTP server)

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.2, 2.5, 5, 10, 20, 60)
# Request latencies carry the prompt's length as a bounded label: TTFT of a 100-token and an 8k-token prompt are
# different questions. Label values are the bucket's token range.
PROMPT_BUCKETS = ((128, "0-128"), (512, "129-512"), (2048, "513-2048"), (8192, "2049-8192"))


def prompt_bucket(prompt_tokens: int) -> str:
    return next((name for bound, name in PROMPT_BUCKETS if prompt_tokens <= bound), "8193+")


class Metrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        h = lambda name, doc, labels=(): Histogram(name, doc, labels, registry=r, buckets=LATENCY_BUCKETS)  # noqa: E731
        by_prompt = ("prompt_tokens",)
        self.ttft = h("quicksilver_time_to_first_token_seconds", "Request arrival to first token", by_prompt)
        self.tpot = h("quicksilver_time_per_output_token_seconds", "Mean time per output token after the first, per request",
                      by_prompt)
        self.itl = h("quicksilver_inter_token_latency_seconds", "Time between consecutive output tokens (a message "
                     "carrying k speculated tokens counts k tokens, each 1/k of the wait)", by_prompt)
        self.e2e = h("quicksilver_e2e_request_latency_seconds", "Request arrival to last token", by_prompt)
        self.queue = h("quicksilver_request_queue_time_seconds", "Request arrival to first schedule", by_prompt)
        self.prefill_step = h("quicksilver_prefill_step_seconds", "Engine steps that computed prompt tokens")
        self.decode_step = h("quicksilver_decode_step_seconds", "Engine steps that only decoded")
        self.running = Gauge("quicksilver_requests_running", "Requests holding a KV slot", registry=r)
        self.waiting = Gauge("quicksilver_requests_waiting", "Requests queued for a slot", registry=r)
        self.kv_usage = Gauge("quicksilver_kv_cache_usage_percent", "KV memory in use (CPU: resident slot tokens of the budget; GPU: blocks), percent", registry=r)
        self.prefix_blocks = Gauge("quicksilver_prefix_cache_blocks_in_use", "Prefix-cache blocks referenced", registry=r)
        self.batch = Gauge("quicksilver_batch_size", "Sequences in the last engine step", registry=r)
        self.prefix_queries = Counter("quicksilver_prefix_cache_queries_tokens", "Prompt tokens looked up", registry=r)
        self.prefix_hits = Counter("quicksilver_prefix_cache_hits_tokens", "Prompt tokens served from the cache", registry=r)
        self.spec_proposed = Counter("quicksilver_spec_proposed_tokens", "Speculative tokens proposed", registry=r)
        self.spec_accepted = Counter("quicksilver_spec_accepted_tokens", "Speculative tokens accepted", registry=r)
        self.spec_rounds = Counter("quicksilver_spec_verifications", "Verification passes (mean accepted length = "
                                   "accepted / verifications; acceptance rate = accepted / proposed)", registry=r)
        self.prompt_tokens = Counter("quicksilver_prompt_tokens", "Prompt tokens computed", registry=r)
        self.generation_tokens = Counter("quicksilver_generation_tokens", "Tokens generated", registry=r)
        self.finished = Counter("quicksilver_requests_finished", "Finished requests", ["finish_reason"], registry=r)
        self.errors = Counter("quicksilver_request_errors", "Rejected or failed requests", ["code"], registry=r)
        # per tenant (runtime serve --tenants; the configured names, else "default": a bounded set)
        self.tenant_requests = Counter("quicksilver_tenant_requests", "Requests by tenant and outcome (admitted, "
                                       "rate_limited)", ["tenant", "outcome"], registry=r)
        self.tenant_tokens = Counter("quicksilver_tenant_tokens", "Tokens by tenant and kind (prompt, generated)",
                                     ["tenant", "kind"], registry=r)
        # semantic cache (runtime serve --semantic-cache; HTTP and gRPC)
        self.semantic_lookups = Counter("quicksilver_semantic_cache_lookups", "Semantic-cache lookups by result: "
                                        "exact, semantic (hits), miss, bypass (not cacheable)", ["result"], registry=r)
        self.semantic_lookup = h("quicksilver_semantic_cache_lookup_seconds", "Semantic-cache lookup (exact layer, "
                                 "embedding, vector search, verification)")
        self.semantic_candidates = Counter("quicksilver_semantic_cache_candidates", "Semantic-cache candidates "
                                           "above the similarity threshold by outcome: verified (served), the "
                                           "near-miss rule that turned one down (literals, negation, direction, "
                                           "substitution, qualifier, case, layout), verifier (rejected by "
                                           "it), or length (cut shorter or longer than the request allows)", ["result"], registry=r)
        self.semantic_entries = Gauge("quicksilver_semantic_cache_entries", "Answers the semantic cache holds",
                                      registry=r)
        self.published = Gauge("quicksilver_metrics_published_timestamp_seconds", "When a replica last published its "
                               "engine series (Unix time; runtime serve --replicas only): how fresh they are",
                               registry=r)
        # What the engine (not a transport) observes: under `runtime serve --replicas` these come from each replica,
        # the rest (request latencies, errors, tenants, semantic cache) from the front that answered the request.
        self.engine_families = frozenset(family.name for m in (
            self.prefill_step, self.decode_step, self.running, self.waiting, self.kv_usage, self.prefix_blocks,
            self.batch, self.prefix_queries, self.prefix_hits, self.spec_proposed, self.spec_accepted,
            self.spec_rounds, self.prompt_tokens, self.generation_tokens, self.published) for family in m.collect())
        self._seen = {"queries": 0, "hits": 0, "proposed": 0, "accepted": 0, "rounds": 0, "prompt": 0, "generation": 0, "steps": 0}

    def on_step(self, engine) -> None:
        """Called on the engine thread after every step: refresh gauges, advance counters, observe step time."""
        st, kv = engine.stats, engine.kv
        self.running.set(len(engine.scheduler.running))
        self.waiting.set(engine.scheduler.num_waiting)
        self.kv_usage.set(100.0 * kv.usage)
        self.prefix_blocks.set(kv.blocks.num_in_use)
        self.batch.set(st.last_batch)
        spec = engine.speculator.stats if engine.speculator else None
        current = {"queries": kv.stats.queries, "hits": kv.stats.hits, "prompt": st.prompt_tokens,
                   "generation": st.generation_tokens, "steps": st.steps,
                   "proposed": spec.proposed if spec else 0, "accepted": spec.accepted if spec else 0,
                   "rounds": spec.rounds if spec else 0}
        for key, counter in (("queries", self.prefix_queries), ("hits", self.prefix_hits), ("prompt", self.prompt_tokens),
                             ("generation", self.generation_tokens), ("proposed", self.spec_proposed),
                             ("accepted", self.spec_accepted), ("rounds", self.spec_rounds)):
            if current[key] > self._seen[key]:
                counter.inc(current[key] - self._seen[key])
        if current["steps"] > self._seen["steps"]:
            (self.prefill_step if st.last_step_prefill else self.decode_step).observe(st.last_step_s)
        self._seen = current

    def exposition(self) -> bytes:
        """This registry as Prometheus text (what a replica publishes to its cluster's ingress)."""
        return generate_latest(self.registry)

    def on_error(self, code: str) -> None:
        """A request refused or failed, counted once by the transport that answered it (code: invalid_argument,
        overloaded, deadline_exceeded, unavailable, unauthenticated, not_found, …, the names HTTP error.code uses)."""
        self.errors.labels(code=code).inc()

    def on_tenant(self, tenant: str, outcome: str, prompt_tokens: int = 0) -> None:
        self.tenant_requests.labels(tenant=tenant, outcome=outcome).inc()
        if prompt_tokens:
            self.tenant_tokens.labels(tenant=tenant, kind="prompt").inc(prompt_tokens)

    def on_tenant_tokens(self, tenant: str, generated: int) -> None:
        if generated:
            self.tenant_tokens.labels(tenant=tenant, kind="generated").inc(generated)

    def observe_itl(self, gap_s: float, num_tokens: int, prompt_tokens: int) -> None:
        """A streamed message that came `gap_s` after the previous one with `num_tokens` tokens: one sample per
        token, the gap shared among them (speculation delivers several tokens per message)."""
        hist = self.itl.labels(prompt_tokens=prompt_bucket(prompt_tokens))
        for _ in range(num_tokens):
            hist.observe(gap_s / num_tokens)

    def on_semantic_lookup(self, result: str, seconds: float | None = None) -> None:
        self.semantic_lookups.labels(result=result).inc()
        if seconds is not None:
            self.semantic_lookup.observe(seconds)

    def on_semantic_candidate(self, result: str) -> None:
        self.semantic_candidates.labels(result=result).inc()

    def on_finish(self, finish_reason: str, usage) -> None:
        self.finished.labels(finish_reason=finish_reason).inc()
        if usage is None:
            return
        bucket = prompt_bucket(usage.prompt_tokens)
        for hist, value in ((self.ttft, usage.ttft_s), (self.tpot, usage.tpot_s), (self.e2e, usage.e2e_s),
                            (self.queue, usage.queue_wait_s)):
            if value is not None:
                hist.labels(prompt_tokens=bucket).observe(value)



def render(by_model: dict[str, Metrics], replicas: dict[str, dict[str, bytes]] | None = None) -> bytes:
    """One exposition for every model a server hosts: each sample carries a `model_name` label (vLLM's name for
    it), so one family per metric holds every model's series. `replicas`: model → replica → that replica's
    published exposition (runtime serve --replicas); its engine families replace the ingress's own (idle) ones
    and carry a `replica` label."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_ModelLabelled(by_model, replicas or {}))
    return generate_latest(registry)


class _ModelLabelled:
    def __init__(self, by_model: dict[str, Metrics], replicas: dict[str, dict[str, bytes]]):
        self.by_model, self.replicas = by_model, replicas

    def collect(self):
        from prometheus_client.parser import text_string_to_metric_families

        families: dict[str, Metric] = {}

        def add(family, labels: dict[str, str]) -> None:
            merged = families.get(family.name)
            if merged is None:
                merged = families[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
            merged.samples += [s._replace(labels={**labels, **s.labels}) for s in family.samples]

        for model, metrics in self.by_model.items():
            remote = self.replicas.get(model)
            for family in metrics.registry.collect():
                if remote is None or family.name not in metrics.engine_families:
                    add(family, {"model_name": model})
            for replica, text in (remote or {}).items():
                for family in text_string_to_metric_families(text.decode()):
                    if family.name in metrics.engine_families:
                        add(family, {"model_name": model, "replica": replica})
        return families.values()
