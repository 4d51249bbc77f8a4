"""The Grafana dashboard (tools/grafana/quicksilver.json) queries only metrics and labels the server exports."""

import json
import re
from pathlib import Path

from runtime.metrics import PROMPT_BUCKETS, Metrics, prompt_bucket
from runtime.outputs import Usage

DASHBOARD = Path(__file__).resolve().parents[2] / "tools" / "grafana" / "quicksilver.json"


def test_prompt_buckets_are_bounded_and_ordered():
    assert [prompt_bucket(n) for n in (1, 128, 129, 512, 513, 2048, 2049, 8192, 8193, 10**6)] == \
        ["0-128", "0-128", "129-512", "129-512", "513-2048", "513-2048", "2049-8192", "2049-8192", "8193+", "8193+"]
    assert len(PROMPT_BUCKETS) + 1 == 5


def test_every_dashboard_query_names_an_exported_metric_and_label():
    m = Metrics()
    m.on_finish("stop", Usage(300, 0, 5, queue_wait_s=0.01, ttft_s=0.1, tpot_s=0.02, e2e_s=0.2))
    m.observe_itl(0.02, 1, 300)
    m.on_error("overloaded")
    exported = m.render().decode()
    names = set(re.findall(r"^(quicksilver_\w+?)(?:\{| )", exported, re.M))
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    used = {n for e in exprs for n in re.findall(r"quicksilver_\w+", e)}
    assert used and used <= names, used - names
    assert 'prompt_tokens="129-512"' in exported
    bucket_values = next(v for v in dash["templating"]["list"] if v["name"] == "prompt_tokens")["query"].split(",")
    assert bucket_values == [name for _, name in PROMPT_BUCKETS] + ["8193+"]
    titles = {p["title"] for p in dash["panels"]}
    assert {"Time to first token", "Time per output token", "Inter-token latency", "Queue time", "KV cache",
            "Prefix-cache hit rate", "Speculation"} <= titles
