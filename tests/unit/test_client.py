"""runtime.client's target handling: a host without a port dials `runtime serve`'s default gRPC port."""

import pytest

from runtime.client import with_default_port


@pytest.mark.parametrize("target,want", [
    ("localhost", "localhost:50051"), ("10.0.0.1", "10.0.0.1:50051"), ("[::1]", "[::1]:50051"),
    ("localhost:7000", "localhost:7000"), ("[::1]:7000", "[::1]:7000"), ("unix:/tmp/qs.sock", "unix:/tmp/qs.sock"),
    ("dns:///example.com:7000", "dns:///example.com:7000"),
])
def test_default_port(target, want):
    assert with_default_port(target) == want
