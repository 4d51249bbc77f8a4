"""OpenTelemetry tracing against a real OTLP receiver in this process: the server's exporter talks OTLP/gRPC to it.
Span names, parentage (the caller's W3C trace context over HTTP headers and gRPC metadata) and attributes; and a
server without --otlp-endpoint does no tracing at all."""

import subprocess
import sys
import time
from concurrent import futures

import grpc
import httpx
import pytest

pytest.importorskip("opentelemetry.sdk")
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc  # noqa: E402

from runtime.client import Client  # noqa: E402

from server_harness import ServerThread  # noqa: E402

TRACE_ID, PARENT_ID = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self):
        self.spans = []

    def Export(self, request, context):
        for resource in request.resource_spans:
            for scope in resource.scope_spans:
                self.spans.extend(scope.spans)
        return trace_service_pb2.ExportTraceServiceResponse()


@pytest.fixture(scope="module")
def receiver():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    rx = Receiver()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(rx, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    rx.endpoint = f"http://127.0.0.1:{port}"
    yield rx
    server.stop(0)


def attrs(span) -> dict:
    out = {}
    for kv in span.attributes:
        v = kv.value
        out[kv.key] = next(getattr(v, f) for f in ("string_value", "int_value", "double_value", "bool_value")
                           if v.HasField(f))
    return out


def wait_for(rx, trace_id: bytes, count: int, timeout: float = 20.0) -> list:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        spans = [s for s in rx.spans if s.trace_id == trace_id]
        if len(spans) >= count:
            return spans
        time.sleep(0.05)
    raise AssertionError(f"{len(spans)} spans of trace {trace_id.hex()} arrived, wanted {count}")


def test_request_spans_follow_the_callers_trace(engine, receiver):
    server = ServerThread(engine("llama"), otlp_endpoint=receiver.endpoint)
    try:
        header = {"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"}
        r = httpx.post(f"{server.http_url}/v1/completions", headers=header, timeout=60,
                       json={"prompt": "def main(argv):\n    return", "max_tokens": 6, "temperature": 0,
                             "ignore_eos": True})
        assert r.status_code == 200
        spans = {s.name: s for s in wait_for(receiver, bytes.fromhex(TRACE_ID), 4)}
        assert set(spans) == {"quicksilver.request", "queue", "prefill", "decode"}
        root = spans["quicksilver.request"]
        assert root.parent_span_id == bytes.fromhex(PARENT_ID)             # a child of the caller's span
        for phase in ("queue", "prefill", "decode"):
            assert spans[phase].parent_span_id == root.span_id
            assert root.start_time_unix_nano <= spans[phase].start_time_unix_nano <= spans[phase].end_time_unix_nano
            assert spans[phase].end_time_unix_nano <= root.end_time_unix_nano
        assert spans["queue"].end_time_unix_nano == spans["prefill"].start_time_unix_nano   # phases abut
        a = attrs(root)
        usage = r.json()["usage"]
        assert a["gen_ai.usage.input_tokens"] == usage["prompt_tokens"] and a["gen_ai.usage.output_tokens"] == 6
        assert a["quicksilver.cached_tokens"] == usage["prompt_tokens_details"]["cached_tokens"]
        assert a["quicksilver.finish_reason"] == "length" and a["quicksilver.prefill_chunks"] == 1
        assert a["gen_ai.request.max_tokens"] == 6 and a["quicksilver.request_id"].startswith("req-")
        # gRPC: the same context in metadata
        other = "0af7651916cd43dd8448eb211c80319c"
        with Client(server.grpc_target, metadata=(("traceparent", f"00-{other}-b7ad6b7169203331-01"),)) as c:
            assert sum(len(m.token_ids) for m in c.generate("x = ", max_tokens=3, temperature=0.0, ignore_eos=True)) == 3
        grpc_root = next(s for s in wait_for(receiver, bytes.fromhex(other), 4) if s.name == "quicksilver.request")
        assert grpc_root.parent_span_id == bytes.fromhex("b7ad6b7169203331")
        assert attrs(grpc_root)["gen_ai.usage.output_tokens"] == 3
        seen = len(receiver.spans)                # a request without trace context starts its own trace
        httpx.post(f"{server.http_url}/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=60)
        deadline = time.monotonic() + 20
        while len(receiver.spans) < seen + 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        fresh = [s for s in receiver.spans[seen:] if s.name == "quicksilver.request"]
        assert len(fresh) == 1 and fresh[0].parent_span_id == b""
        assert fresh[0].trace_id not in (bytes.fromhex(TRACE_ID), bytes.fromhex(other))
    finally:
        server.stop()


def test_no_endpoint_means_no_opentelemetry():
    """Without --otlp-endpoint the server never imports OpenTelemetry (so tracing costs nothing)."""
    code = ("import sys; from runtime.server.app import Server; from runtime.server import bridge, http_server, "
            "grpc_server; print(any(m.startswith('opentelemetry') for m in sys.modules))")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "False"
