"""OpenTelemetry tracing of requests, exported over OTLP/gRPC when a server is given `--otlp-endpoint`.

One span per request ("quicksilver.request"), a child of the caller's span when the request carries W3C trace
context (HTTP `traceparent`/`tracestate` headers, or the same keys in gRPC metadata), with child spans for its
phases — "queue" (arrival → first scheduled), "prefill" (→ first token), "decode" (→ last token) — drawn from the
request's own clock when it ends, and its counts (tokens, prefix-cache hits, prefill chunks, speculative guesses
proposed and accepted, finish reason) as attributes. Without an endpoint nothing of OpenTelemetry is imported and
the server does no tracing work at all.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

from artifact.errors import MissingDependency

SPAN = "quicksilver.request"


class Tracing:
    def __init__(self, endpoint: str, service_name: str = "quicksilver", export_delay_ms: int = 500):
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
            from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
        except ImportError:
            raise MissingDependency("--otlp-endpoint needs OpenTelemetry: pip install '.[tracing]'") from None
        from opentelemetry import trace

        insecure = not endpoint.startswith("https://")
        self.provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        self.provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint, insecure=insecure),
                                                            schedule_delay_millis=export_delay_ms))
        self.tracer = self.provider.get_tracer("quicksilver")
        self.propagator, self._trace = TraceContextTextMapPropagator(), trace

    def start(self, carrier: Mapping[str, str] | None, arrival: float, attributes: dict):
        """The request's span, begun when it arrived (`arrival`: time.monotonic), under the carrier's context."""
        parent = self.propagator.extract({k.lower(): v for k, v in (carrier or {}).items()})
        return self.tracer.start_span(SPAN, context=parent, start_time=_wall_ns(arrival), attributes=attributes)

    def end(self, span, usage, finish_reason: str, error: str | None = None) -> None:
        """Phase spans from the request's usage, its counts as attributes, then the span ends (now)."""
        span.set_attribute("quicksilver.finish_reason", finish_reason)
        if usage is not None:
            span.set_attributes({"gen_ai.usage.input_tokens": usage.prompt_tokens,
                                 "gen_ai.usage.output_tokens": usage.completion_tokens,
                                 "quicksilver.cached_tokens": usage.cached_tokens,
                                 "quicksilver.prefill_chunks": usage.prefill_chunks,
                                 "quicksilver.spec.proposed": usage.spec_proposed,
                                 "quicksilver.spec.accepted": usage.spec_accepted})
            start = span.start_time
            marks = [("queue", usage.queue_wait_s), ("prefill", usage.ttft_s), ("decode", usage.e2e_s)]
            context = self._trace.set_span_in_context(span)
            begin = start
            for name, offset in marks:
                if offset is None:
                    break
                stop = max(begin, start + int(offset * 1e9))
                self.tracer.start_span(name, context=context, start_time=begin).end(end_time=stop)
                begin = stop
        if error is not None:
            span.set_status(self._trace.Status(self._trace.StatusCode.ERROR, error))
        span.end()

    def shutdown(self) -> None:
        self.provider.shutdown()         # exports what is still buffered


def _wall_ns(monotonic: float) -> int:
    return time.time_ns() - int((time.monotonic() - monotonic) * 1e9)
