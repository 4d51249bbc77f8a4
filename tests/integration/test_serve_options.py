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


def test_serve_help_lists_every_option_once_in_its_section():
    import click
    from click.testing import CliRunner

    from runtime.cli import SERVE_SECTIONS, main

    out = CliRunner().invoke(main, ["serve", "--help"], terminal_width=200).output
    titles = [line[:-1] for line in out.splitlines() if line.endswith(":") and not line.startswith(" ")]
    assert titles == list(SERVE_SECTIONS) + ["Other options"], titles          # the rest: --help alone
    assert out.split("Other options:")[1].split() == ["-h,", "--help", "Show", "this", "message", "and", "exit."]
    params = [p for p in main.commands["serve"].params if isinstance(p, click.Option)]
    for p in params:
        flag = p.opts[0]
        assert sum(line.split()[0].rstrip(",") == flag for line in out.splitlines()
                   if line.startswith("  -")) == 1, flag                  # an option's row, not help text
    named = [n for names in SERVE_SECTIONS.values() for n in names]
    assert sorted(named) == sorted(set(named)) and set(named) <= {p.name for p in params}
