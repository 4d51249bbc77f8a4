"""The benchmark scripts' option parsers: what a policy or a late-streams spec means."""

import runpy
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[2] / "tools"
BURST = runpy.run_path(str(TOOLS / "bench_burst.py"))
SERVE = runpy.run_path(str(TOOLS / "bench_serve.py"))


def test_a_burst_policy_may_ask_for_unpacked_steps():
    policy = BURST["policy"]
    assert policy("4096,256,2") == (4096, 256, 2.0)
    assert policy("512,64") == (512, 64, 4.0)                 # the ratio's default, as before
    assert policy("4096,256,2,unpacked") == (4096, 256, 2.0, "unpacked")
    assert policy("4096,256,unpacked") == (4096, 256, 4.0, "unpacked")
    with pytest.raises(ValueError):
        policy("4096,256,2,packed")
    assert policy("4096,256,2,stall=inf") == (4096, 256, 2.0, "stall=inf")    # the burst bound: inf = always whole
    assert policy("4096,256,stall=0.5,unpacked") == (4096, 256, 4.0, "stall=0.5", "unpacked")


def test_late_streams_are_a_count_and_milliseconds():
    late = SERVE["late_streams"]
    assert late("2,1300") == (2, 1300.0)
    with pytest.raises(ValueError):
        late("2")


class _Completions(__import__("http.server").server.BaseHTTPRequestHandler):
    """An OpenAI-compatible /v1/completions that streams three tokens: as text, or (for a prompt that says
    "silent") as chunks without text, as a server does for tokens that decode to nothing."""

    def do_POST(self):  # noqa: N802
        import json
        import time

        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        silent = "silent" in body["prompt"]
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()

        def send(chunk):
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.flush()

        base = {"id": "c", "object": "text_completion", "created": 0, "model": "m"}
        for text in "abc":
            time.sleep(0.01)
            send({**base, "choices": [{"index": 0, "text": "" if silent else text, "finish_reason": None}]})
        send({**base, "choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 3, "total_tokens": 4}})
        self.wfile.write(b"data: [DONE]\n\n")

    def log_message(self, *args):
        pass


@pytest.fixture
def completions_url():
    import http.server
    import threading

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Completions)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()


def test_a_stream_without_text_counts_its_tokens_and_times_nothing(completions_url):
    import asyncio

    client = SERVE["openai_client"](completions_url)
    fig = asyncio.run(SERVE["level"](client, "m", [["one prompt", "a silent prompt"]], 3))
    assert fig["textless_streams"] == 1
    assert fig["tokens"] == 6                          # the silent stream's three count towards the aggregate
    assert 0.0 < fig["ttft_ms"] < 1000.0
    # the timed stream alone gives the gaps: two of ~10 ms, none of them the silent stream's
    assert 5.0 < fig["itl_p50_ms"] < 500.0
    prefix = asyncio.run(SERVE["prefix_case"](client, "m", "silent", 3, "t"))
    assert prefix["cold_ttft_ms"] is None and prefix["warm_ttft_ms"] is None


def test_a_level_with_no_text_at_all_says_so(completions_url):
    import asyncio

    client = SERVE["openai_client"](completions_url)
    with pytest.raises(RuntimeError, match="no text in any stream"):
        asyncio.run(SERVE["level"](client, "m", [["silent one", "silent two"]], 3))
