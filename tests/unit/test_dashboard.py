"""The Grafana dashboard (tools/grafana/quicksilver.json) queries only metrics and labels the server exports."""

import json
import re
from pathlib import Path

from runtime.metrics import PROMPT_BUCKETS, Metrics, prompt_bucket, render
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
    m.on_semantic_lookup("semantic", 0.004)
    exported = render({"target": m}).decode()
    names = set(re.findall(r"^(quicksilver_\w+?)(?:\{| )", exported, re.M))
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    used = {n for e in exprs for n in re.findall(r"quicksilver_\w+", e)}
    assert used and used <= names, used - names
    unfiltered = [e for e in exprs if re.search(r'quicksilver_\w+(?!\w|\{model_name=~"\$model_name")', e)]
    assert not unfiltered                     # every series is chosen by the dashboard's model variable
    assert 'model_name="target",prompt_tokens="129-512"' in exported
    bucket_values = next(v for v in dash["templating"]["list"] if v["name"] == "prompt_tokens")["query"].split(",")
    assert bucket_values == [name for _, name in PROMPT_BUCKETS] + ["8193+"]
    titles = {p["title"] for p in dash["panels"]}
    assert {"Time to first token", "Time per output token", "Inter-token latency", "Queue time", "KV cache",
            "Prefix-cache hit rate", "Speculation", "Semantic cache"} <= titles


def test_several_models_share_one_family_per_metric_labelled_by_model():
    """Two hosted models: each metric is declared once (Prometheus rejects a repeated family) and every sample
    says whose it is, with the values of that model's own registry."""
    big, small = Metrics(), Metrics()
    big.on_finish("stop", Usage(300, 0, 5, queue_wait_s=0.01, ttft_s=0.1, tpot_s=0.02, e2e_s=0.2))
    small.on_finish("length", Usage(10, 0, 5, queue_wait_s=0.01, ttft_s=0.01, tpot_s=0.01, e2e_s=0.05))
    small.on_finish("length", Usage(10, 0, 5, queue_wait_s=0.01, ttft_s=0.01, tpot_s=0.01, e2e_s=0.05))
    text = render({"big": big, "small": small}).decode()
    assert text.count("# TYPE quicksilver_requests_finished_total counter") == 1
    finished = re.findall(r'^quicksilver_requests_finished_total\{(.*)\} (\S+)$', text, re.M)
    assert sorted(finished) == [('finish_reason="length",model_name="small"', "2.0"),
                                ('finish_reason="stop",model_name="big"', "1.0")]
    counts = re.findall(r'^quicksilver_time_to_first_token_seconds_count\{(.*)\} (\S+)$', text, re.M)
    assert sorted(counts) == [('model_name="big",prompt_tokens="129-512"', "1.0"),
                              ('model_name="small",prompt_tokens="0-128"', "2.0")]
