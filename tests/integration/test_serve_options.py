"""`runtime serve --chat-template FILE` renders chats with that template instead of the model's."""

from __future__ import annotations

import httpx

from runtime.config import CacheConfig, EngineConfig, SchedulerConfig
from runtime.engine import Engine
from runtime.request import SamplingParams

from server_harness import ServerThread


def test_a_chat_template_file_replaces_the_models(engine, tmp_path):
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }}\n{% endfor %}<reply>")
    server = ServerThread(engine("llama"), chat_template=template)
    try:
        r = httpx.post(f"{server.http_url}/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "def f(x):"}], "max_tokens": 8, "temperature": 0,
            "ignore_eos": True})
        assert r.status_code == 200, r.text
        eng = Engine(engine("llama"), EngineConfig(SchedulerConfig(max_num_seqs=1), CacheConfig(kv_budget_bytes=16 << 20)))
        want = eng.generate(["<user> def f(x):\n<reply>"], SamplingParams(max_tokens=8, ignore_eos=True))[0]
        assert r.json()["choices"][0]["message"]["content"] == want["text"]
        assert r.json()["usage"]["prompt_tokens"] == want["usage"].prompt_tokens
    finally:
        server.stop()
