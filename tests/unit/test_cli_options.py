"""`runtime serve`'s options: every default is the config field's (one source), and the names vLLM users type parse
to the same settings as ours."""

from __future__ import annotations

import click
import pytest

from runtime.cli import main, serve
from runtime.config import CacheConfig, OrtConfig, SchedulerConfig, ServerConfig


def parse(*args: str) -> dict:
    """`runtime serve ARGS` parsed under `runtime`'s own context, as the command line does (a context without it
    gave click's cached help option only --help, and `serve --help` tests run after this one lost -h)."""
    parent = click.Context(main, info_name="runtime", **main.context_settings)
    return serve.make_context("serve", list(args), parent=parent).params


def test_defaults_are_the_config_fields():
    p, sched, cache, server = parse(), SchedulerConfig(), CacheConfig(), ServerConfig()
    assert (p["max_num_seqs"], p["max_waiting"], p["token_budget"], p["prefill_chunk"], p["mixed_step_ratio"]) == \
        (sched.max_num_seqs, sched.max_waiting, sched.token_budget, sched.prefill_chunk, sched.mixed_step_ratio)
    assert (p["prefix_caching"], p["retained_slots"]) == (cache.enable_prefix_cache, cache.retained_slots)
    assert (p["host"], p["grpc_port"], p["http_port"], p["request_timeout"], p["max_body_bytes"], p["grace"],
            p["priority_floor"]) == (server.host, server.grpc_port, server.http_port, server.request_timeout_s,
                                     server.max_body_bytes, server.grace_s, server.priority_floor)
    assert (p["threads"], p["spin"], p["huge_pages"]) == (OrtConfig().threads, OrtConfig().spin, OrtConfig().huge_pages)
    assert parse("--no-huge-pages")["huge_pages"] is False
    assert sched.max_waiting == 64        # was 64 on the command line and 256 in the engine's config


def test_vllm_names_are_aliases():
    assert parse("--max-num-batched-tokens", "2048")["token_budget"] == parse("--token-budget", "2048")["token_budget"] == 2048
    assert parse("--no-enable-prefix-caching")["prefix_caching"] is False
    assert parse("--no-prefix-cache")["prefix_caching"] is False
    assert parse("--enable-prefix-caching")["prefix_caching"] is True
    assert parse("--port", "8123")["http_port"] == 8123
    assert parse("--served-model-name", "m")["served_model_name"] == "m"
    assert parse("--disable-log-requests", "--log-level", "warning")["log_level"] == "warning"


def test_a_queue_of_no_requests_is_refused_at_start():
    """Every request waits in the queue until a step admits it: --max-waiting 0 refused every request (429)."""
    with pytest.raises(ValueError, match="max_waiting must be ≥ 1"):
        SchedulerConfig(max_waiting=0)
    assert SchedulerConfig(max_waiting=1).max_waiting == 1
