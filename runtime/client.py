"""A small Python client for Quicksilver's gRPC API.

    from runtime.client import Client
    with Client("127.0.0.1:50051") as c:
        for msg in c.generate("def fibonacci(n):", max_tokens=64):
            print(msg.text, end="", flush=True)
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc

from .server.proto import quicksilver_pb2 as pb
from .server.proto import quicksilver_pb2_grpc as pb_grpc


DEFAULT_PORT = 50051      # `runtime serve --grpc-port`'s default


def with_default_port(target: str) -> str:
    """HOST → HOST:50051 (gRPC itself would dial 443); HOST:PORT, [IPv6]:PORT and scheme:… targets are kept."""
    host = target.rsplit("]", 1)[-1] if target.startswith("[") else target
    if ":" in host or "/" in target:
        return target
    return f"{target}:{DEFAULT_PORT}"


class Client:
    def __init__(self, target: str = "127.0.0.1:50051", api_key: str | None = None, tls_ca: Path | None = None,
                 metadata: tuple[tuple[str, str], ...] = ()):
        """target: HOST[:PORT] (default port 50051); tls_ca: PEM certificate(s) to trust, for a TLS server;
        metadata: sent with every call (e.g. a W3C `traceparent`, which a tracing server continues)."""
        target = with_default_port(target)
        if tls_ca is not None:
            self.channel = grpc.secure_channel(target, grpc.ssl_channel_credentials(Path(tls_ca).read_bytes()))
        else:
            self.channel = grpc.insecure_channel(target)
        self.stub = pb_grpc.GenerationStub(self.channel)
        self.metadata = ((("authorization", f"Bearer {api_key}"),) if api_key else ()) + tuple(metadata)

    def generate(self, prompt: str | list[int], timeout: float | None = None, request_id: str = "", priority: int = 0,
                 model: str = "", **sampling) -> Iterator[pb.GenerateResponse]:
        """Stream responses; sampling keywords are the fields of quicksilver.v1.SamplingParams (`stop` may be one
        string or a list). Breaking out of the loop cancels the call (the server aborts the request)."""
        if isinstance(sampling.get("stop"), str):     # protobuf would take each character as a stop string
            sampling["stop"] = [sampling["stop"]]
        req = pb.GenerateRequest(request_id=request_id, priority=priority, model=model,
                                 sampling=pb.SamplingParams(**sampling))
        if isinstance(prompt, str):
            req.text = prompt
        else:
            req.token_ids.ids.extend(prompt)
        call = self.stub.Generate(req, timeout=timeout, metadata=self.metadata)
        try:
            yield from call
        finally:
            call.cancel()

    def tokenize(self, text: str) -> list[int]:
        return list(self.stub.Tokenize(pb.TokenizeRequest(text=text), metadata=self.metadata).token_ids)

    def model_info(self, model: str = "") -> pb.ModelInfoResponse:
        """The server's first model, or the hosted model `model` names."""
        return self.stub.ModelInfo(pb.ModelInfoRequest(model=model), metadata=self.metadata)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
