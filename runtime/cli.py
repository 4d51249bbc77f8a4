"""`runtime`: run Quicksilver engines."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import click

from . import __version__
from .config import CacheConfig, SchedulerConfig, ServerConfig

# Every default below is the config field's (one source); the names vLLM and llama.cpp users type are aliases.
SCHED, CACHE, SERVER = SchedulerConfig(), CacheConfig(), ServerConfig()


def unescape(text: str) -> str:
    """A command-line string with \\n, \\t, \\r and \\\\ read as the characters they name (a shell passes
    `--stop '\\n'` as a backslash and an n, which no output contains)."""
    return re.sub(r"\\([ntr\\])", lambda m: {"n": "\n", "t": "\t", "r": "\r", "\\": "\\"}[m.group(1)], text)


def fail(message: str) -> None:
    click.echo(f"error: {message}", err=True)
    sys.exit(2)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="quicksilver runtime")
def main() -> None:
    """Run Quicksilver engine artifacts built by `compile build`."""


@main.command()
@click.argument("args", nargs=-1, required=True, metavar="[ENGINE] PROMPT")
@click.option("--max-tokens", type=int, default=128, show_default=True, help="Most tokens to generate.")
@click.option("--temperature", type=float, default=None, help="0 is greedy. [default: the model's, else 0]")
@click.option("--top-k", type=int, default=None, help="0 disables. [default: the model's, else 0]")
@click.option("--top-p", type=float, default=None, help="[default: the model's, else 1]")
@click.option("--min-p", type=float, default=None, help="[default: the model's, else 0]")
@click.option("--repetition-penalty", type=float, default=None,
              help="[default: the model's, else 1] (The model's: its generation_config.json.)")
@click.option("--seed", type=int, default=None, help="Makes sampling reproducible.")
@click.option("--stop", multiple=True, callback=lambda _c, _p, v: tuple(unescape(s) for s in v),
              help="Stop string (repeatable; \\n, \\t, \\r and \\\\ are read as escapes, as in C); not included "
                   "in the output.")
@click.option("--threads", type=click.IntRange(1), default=None, show_default="min(2, cores)",
              help="ONNX Runtime intra-op threads.")
@click.option("--draft", type=click.Path(path_type=Path), default=None, help="Draft engine for speculative decoding.")
@click.option("--speculation", type=click.Choice(["auto", "draft", "ngram", "off"]), default="auto", show_default=True,
              help="auto: the draft if given, else off; draft: --draft or the bundled draft.")
@click.option("--device", type=click.Choice(["cuda", "cpu"]), default=None, show_default="cuda if PyTorch sees a GPU",
              help="Where a --target cuda engine runs: cuda (PyTorch GEMMs + plugins/cuda kernels + CUDA graphs; "
                   "pip install '.[cuda]') or cpu (the same forward on PyTorch CPU tensors).")
@click.option("--server", default=None, metavar="HOST[:PORT]",
              help="Stream from a running `runtime serve` over gRPC instead (port default 50051).")
@click.option("--api-key", envvar="QUICKSILVER_API_KEY", default=None, help="Bearer token for --server.")
@click.option("--tls-ca", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="PEM certificate(s) to trust: connect to --server over TLS.")
@click.option("--stats/--no-stats", default=True, show_default=True, help="Print TTFT, TPOT and cached tokens to stderr.")
def generate(args: tuple[str, ...], max_tokens: int, temperature: float | None, top_k: int | None, top_p: float | None,
             min_p: float | None, repetition_penalty: float | None, seed: int | None, stop: tuple[str, ...], threads: int | None, draft: Path | None,
             speculation: str, device: str | None, server: str | None, api_key: str | None, tls_ca: Path | None,
             stats: bool) -> None:
    """Stream a completion of PROMPT from a local engine (default: the bundled target; --speculation draft adds the
    bundled draft).
    Sampling options left out take the model's own defaults (its generation_config.json), else greedy."""
    from artifact.errors import QuicksilverError

    from .config import CacheConfig, CudaConfig, EngineConfig, OrtConfig, SchedulerConfig
    from .bundled import engine_dir
    from .engine import Engine
    from .request import InvalidRequest, SamplingParams

    if len(args) > 2:
        fail("expected [ENGINE] PROMPT (quote the prompt)")
    if len(args) == 1 and Path(args[0]).is_dir():
        fail(f"the prompt is missing ({args[0]} is a folder, not a prompt): runtime generate [ENGINE] PROMPT")
    local = [name for name, given in (("ENGINE", len(args) == 2), ("--draft", draft is not None),
                                      ("--threads", threads is not None), ("--speculation", speculation != "auto"),
                                      ("--device", device is not None))
             if given]
    if server and local:
        fail(f"--server streams from the server's engine; {', '.join(local)} apply to a local engine only")
    if tls_ca and not server:
        fail("--tls-ca applies to --server only")
    given = {k: v for k, v in dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                                   repetition_penalty=repetition_penalty).items() if v is not None}
    if server:        # what is left out, the server decides
        sampling = dict(max_tokens=max_tokens, stop=list(stop), **given, **({"seed": seed} if seed is not None else {}))
        return _generate_remote(server, api_key, tls_ca, args[-1], sampling, stats)
    try:
        engine_path = Path(args[0]) if len(args) == 2 else engine_dir("target")
        draft, method = _speculation(draft, speculation)
        params = SamplingParams.from_options(given, max_tokens=max_tokens, seed=seed, stop=stop)   # the engine fills the rest
        # One request per process: a prefix cache could never be hit, so it reserves no memory.
        engine = Engine(engine_path, EngineConfig(SchedulerConfig(max_num_seqs=1), CacheConfig(enable_prefix_cache=False),
                                                  draft=draft, speculation=method, ort=OrtConfig(threads=threads),
                                                  cuda=CudaConfig(device=device)))
        engine.add_request(args[-1], params)
    except (QuicksilverError, InvalidRequest, FileNotFoundError, ValueError) as e:
        fail(str(e))
    click.echo(args[-1], nl=False)
    while engine.has_work():
        for out in engine.step():
            click.echo(out.text, nl=False)
            if out.finished:
                click.echo()
                u = out.usage
                if stats:
                    _print_stats(u.prompt_tokens, u.cached_tokens, u.completion_tokens, out.finish_reason, u.ttft_s,
                                 u.tpot_s, u.spec_proposed, u.spec_accepted)


def _print_stats(prompt, cached, completion, finish, ttft_s, tpot_s, proposed=0, accepted=0) -> None:
    tpot = f"{tpot_s * 1e3:.2f} ms ({1 / tpot_s:.0f} tok/s)" if tpot_s else "n/a"
    spec = f", speculation {accepted}/{proposed} accepted" if proposed else ""
    click.echo(f"[{prompt} prompt tokens ({cached} cached), {completion} generated, finish: {finish}; "
               f"TTFT {ttft_s * 1e3:.1f} ms, TPOT {tpot}{spec}]", err=True)


def _speculation(draft: Path | None, method: str) -> tuple[Path | None, str | None]:
    """Resolve --draft/--speculation: auto uses a given draft, else none; draft without --draft uses the bundled
    one. (auto no longer picks the bundled draft: measured at the API it lost — conc 1 decode 1.01x, TTFT 1.31x,
    conc 4 aggregate 0.87x of speculation off, tools/results/serve_bundled_spec_on_off_retrained.json.)"""
    from .bundled import engine_dir

    if method == "off":
        return None, None
    if method == "ngram":
        return None, "ngram"
    if draft is None and method == "draft":
        draft = engine_dir("draft")
    return (draft, "draft") if draft is not None else (None, None)


def _generate_remote(server: str, api_key: str | None, tls_ca: Path | None, prompt: str, sampling: dict,
                     stats: bool) -> None:
    import grpc

    from .client import Client

    echoed = False          # the prompt is printed once the server answers: an error alone is one line
    try:
        with Client(server, api_key, tls_ca) as client:
            for msg in client.generate(prompt, **sampling):
                if not echoed:
                    click.echo(prompt, nl=False)
                    echoed = True
                click.echo(msg.text, nl=False)
                if msg.finish_reason:
                    click.echo()
                    u = msg.usage
                    if stats:
                        _print_stats(u.prompt_tokens, u.cached_tokens, u.completion_tokens, msg.finish_reason,
                                     u.ttft_ms / 1e3, u.tpot_ms / 1e3, u.spec_proposed_tokens, u.spec_accepted_tokens)
    except grpc.RpcError as e:
        if echoed:
            click.echo()
        fail(f"{server}: {e.code().name}: {e.details()}")


def _priority_keys(values: tuple[str, ...]) -> tuple[tuple[str, int], ...]:
    """--priority-key TOKEN:FLOOR values → ((token, floor), ...); a usage error names a malformed one."""
    keys = []
    for value in values:
        token, _, floor = value.rpartition(":")
        try:
            keys.append((token, int(floor)))
        except ValueError:
            raise click.BadParameter(f"{value!r} is not TOKEN:FLOOR (FLOOR an integer)", param_hint="--priority-key")
    return tuple(keys)


def _cache_settings(on: bool, threshold: float | None, verify: float | None, ttl: float, size: int):
    from .server.semantic_cache import DEFAULT_THRESHOLD, VERIFY_THRESHOLD, CacheSettings

    if not on:
        if threshold is not None or verify is not None:
            fail("--semantic-cache-threshold and --semantic-cache-verify-threshold apply with --semantic-cache")
        return None
    return CacheSettings(threshold=DEFAULT_THRESHOLD if threshold is None else threshold,
                         verify_threshold=VERIFY_THRESHOLD if verify is None else verify, ttl_s=ttl, max_entries=size)


def _cluster(replicas: int | None, threads: int | None, routing: str, address: str | None):
    from .config import ClusterConfig

    if replicas is None:
        if address is not None:
            fail("--ray-address applies with --replicas N")
        return None
    import importlib.util

    if importlib.util.find_spec("ray") is None or importlib.util.find_spec("ray.serve") is None:
        fail("--replicas runs the engines on Ray Serve, which is not installed: pip install '.[cluster]' "
             "(or pip install 'ray[serve]')")
    return ClusterConfig(replicas, threads or 1, routing, address)


def _models(values: tuple[str, ...]) -> dict[str, Path]:
    """--model NAME=ENGINE values → {name: engine folder}; a usage error names a malformed or repeated one."""
    models: dict[str, Path] = {}
    for value in values:
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise click.BadParameter(f"{value!r} is not NAME=ENGINE", param_hint="--model")
        if name in models:
            raise click.BadParameter(f"model name {name!r} is given twice", param_hint="--model")
        models[name] = Path(path)
    return models


class GroupedOptions(click.Command):
    """A command whose --help lists its options in sections (vLLM's and llama.cpp's servers group theirs too)."""

    def __init__(self, *args, sections: dict[str, tuple[str, ...]], **kwargs):
        super().__init__(*args, **kwargs)
        self.sections = sections

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = {p.name: p.get_help_record(ctx) for p in self.get_params(ctx) if isinstance(p, click.Option)}
        rows = {name: row for name, row in rows.items() if row is not None}
        listed = set()
        for title, names in self.sections.items():
            with formatter.section(title):
                formatter.write_dl([rows[n] for n in names if n in rows])
            listed.update(names)
        rest = [row for name, row in rows.items() if name not in listed]
        if rest:
            with formatter.section("Other options"):
                formatter.write_dl(rest)


SERVE_SECTIONS = {
    "Model": ("draft", "speculation", "models", "served_model_name", "chat_template", "device", "cuda_graphs"),
    "Scheduling": ("max_num_seqs", "max_waiting", "token_budget", "prefill_chunk", "mixed_step_ratio",
                   "max_burst_stall", "threads", "spin", "huge_pages"),
    "KV cache": ("max_model_len", "kv_budget_mib", "prefix_caching", "retained_slots", "prefix_reserve_mib",
                 "kv_huge_pages"),
    "Server": ("host", "grpc_port", "http_port", "request_timeout", "max_body_bytes", "max_tokens_limit", "grace",
               "otlp_endpoint", "disable_log_requests", "log_level"),
    "Security and tenants": ("api_key", "tls_cert", "tls_key", "priority_floor", "priority_keys", "tenants_file"),
    "Routing and cluster": ("route_file", "replicas", "replica_routing", "ray_address"),
    "Semantic cache": ("semantic_cache", "semantic_cache_threshold", "semantic_cache_verify_threshold",
                       "semantic_cache_ttl", "semantic_cache_size"),
}


@main.command(cls=GroupedOptions, sections=SERVE_SECTIONS)
@click.argument("engine", required=False, type=click.Path(path_type=Path))
@click.option("--draft", type=click.Path(path_type=Path), default=None, help="Draft engine for speculative decoding.")
@click.option("--speculation", type=click.Choice(["auto", "draft", "ngram", "off"]), default="auto", show_default=True,
              help="auto: the draft if given, else off; draft: --draft or the bundled draft.")
@click.option("--host", default=SERVER.host, show_default=True, help="Interface to listen on (loopback by default).")
@click.option("--grpc-port", type=click.IntRange(-1, 65535), default=SERVER.grpc_port, show_default=True,
              help="gRPC port (0: any free port; -1: no gRPC).")
@click.option("--http-port", "--port", "http_port", type=click.IntRange(-1, 65535), default=SERVER.http_port,
              show_default=True, help="HTTP port (0: any free port; -1: no HTTP).")
@click.option("--max-num-seqs", type=int, default=SCHED.max_num_seqs, show_default=True, help="Most sequences running at once (each reserves address space for a whole context; memory follows its tokens).")
@click.option("--max-waiting", type=int, default=SCHED.max_waiting, show_default=True, help="Queued requests before shedding (429).")
@click.option("--token-budget", "--max-num-batched-tokens", "token_budget", type=int, default=SCHED.token_budget,
              show_default=True,
              help="Most tokens computed per engine step (a burst of prompts is computed in one step up to this).")
@click.option("--prefill-chunk", type=int, default=SCHED.prefill_chunk, show_default=True,
              help="Most prompt tokens a sequence gets per step while as many streams decode.")
@click.option("--mixed-step-ratio", type=click.FloatRange(1.0), default=SCHED.mixed_step_ratio,
              show_default=True,
              help="A step with prompt slices beside decodes costs at most this many decode-only steps, or what its "
                   "first 16-token slices cost where that is more (lower: "
                   "shorter stalls of running streams, slower first tokens for prompts arriving among them; inf: "
                   "fixed slices of --prefill-chunk).")
@click.option("--max-burst-stall", "max_burst_stall", type=click.FloatRange(0.0, min_open=True),
              default=SCHED.max_burst_stall_s, show_default=True, metavar="SECONDS",
              help="Prompts at least half as many as the streams decoding are computed whole, one stall of the "
                   "streams, only while that stall (at the prompt tokens' measured cost) stays within this; longer "
                   "ones go in slices beside the decodes (inf: always whole: faster first tokens for the prompts, "
                   "one long pause for the streams).")
@click.option("--max-model-len", type=int, default=None, help="Context per sequence [default: the engine's].")
@click.option("--kv-budget-mib", type=int, default=None, help="KV memory resident at most: running sequences' tokens + the prefix cache (30 %) [default: 25% of RAM, ≤ 8 GiB].")
@click.option("--enable-prefix-caching/--no-enable-prefix-caching", "--prefix-cache/--no-prefix-cache",
              "prefix_caching", default=CACHE.enable_prefix_cache, show_default=True,
              help="Automatic prefix caching (vLLM's names, or --no-prefix-cache).")
@click.option("--retained-slots", type=click.IntRange(0), default=CACHE.retained_slots, show_default=True,
              help="Finished sequences whose KV stays in place, beyond --max-num-seqs, so that a follow-up extending "
                   "one (a chat's next turn) computes only its new tokens; their memory is given back first when "
                   "running sequences or the prefix cache want it.")
@click.option("--prefix-reserve-mib", type=click.IntRange(0), default=CACHE.prefix_reserve_bytes >> 20,
              show_default=True,
              help="Prefix-cache memory made resident ahead while the server is idle (within the prefix cache's "
                   "share of --kv-budget-mib), so that caching a burst of prompts does not fault pages in between "
                   "two decode steps; 0: as needed.")
@click.option("--kv-huge-pages/--no-kv-huge-pages", default=CACHE.kv_huge_pages, show_default=True,
              help="cpu engines: a sequence past 1/8 of a 2 MiB page of KV rows a head (1-2k tokens on Qwen shapes) "
                   "grows by whole transparent huge pages: decode steps at 2k-8k tokens ~2-4 % faster (attention "
                   "reads its context without TLB walks), up to 2 MiB a head a layer more memory a sequence, and "
                   "each huge page costs ~5-8 ms to populate on a VM whose host reclaims freed huge pages (free page "
                   "reporting) — so off unless the host gives them cheaply.")
@click.option("--threads", type=click.IntRange(1), default=None, show_default="min(2, cores)",
              help="ONNX Runtime intra-op threads.")
@click.option("--spin/--no-spin", default=True, show_default=True,
              help="ONNX Runtime threads spin between ops and for 2 ms after each step, then sleep: ~25 % faster "
                   "decoding while requests run, nothing spent idle. --no-spin: sleep between ops.")
@click.option("--huge-pages/--no-huge-pages", default=True, show_default=True,
              help="cpu engines: read the weights our ops compute with onto transparent huge pages where the kernel "
                   "offers them (faster decoding: each step streams every weight). --no-huge-pages: map them from the "
                   "engine's file (processes serving one engine then share its page cache).")
@click.option("--api-key", envvar="QUICKSILVER_API_KEY", default=None, help="Require this bearer token (env QUICKSILVER_API_KEY).")
@click.option("--tls-cert", type=click.Path(path_type=Path), default=None, help="PEM certificate: serve gRPC and HTTP over TLS.")
@click.option("--tls-key", type=click.Path(path_type=Path), default=None, help="PEM private key for --tls-cert.")
@click.option("--served-model-name", default=None, help="Model id clients use [default: the engine folder's name].")
@click.option("--request-timeout", type=float, default=SERVER.request_timeout_s, show_default=True,
              help="Seconds any request may take.")
@click.option("--max-body-bytes", type=int, default=SERVER.max_body_bytes, show_default=True,
              help="Largest request body / message.")
@click.option("--max-tokens-limit", type=click.IntRange(1), default=None, show_default="the context length",
              help="Largest max_tokens a request may ask for.")
@click.option("--grace", type=float, default=SERVER.grace_s, show_default=True, help="Seconds in-flight requests get on SIGTERM.")
@click.option("--priority-floor", type=click.IntRange(-100, 100), default=SERVER.priority_floor, show_default=True,
              help="Most urgent priority a caller may request (lower is more urgent; requests range over -100..100); "
                   "more urgent requests are refused (400 / INVALID_ARGUMENT); a request naming none runs at "
                   "max(0, floor).")
@click.option("--priority-key", "priority_keys", multiple=True, metavar="TOKEN:FLOOR",
              help="A bearer token whose callers may request priorities down to FLOOR instead of --priority-floor "
                   "(repeatable; it also authenticates where --api-key is required).")
@click.option("--tenants", "tenants_file", type=click.Path(path_type=Path), default=None, metavar="FILE",
              help='API keys of named tenants with their own limits, as JSON: {"tenants": [{"name", "key", '
                   '"requests_per_minute", "tokens_per_minute", "max_concurrency", "priority_floor"}]}. Over a limit: '
                   "429 / RESOURCE_EXHAUSTED with Retry-After. Requires a key on every request.")
@click.option("--otlp-endpoint", default=None, metavar="URL",
              help="Trace every request with OpenTelemetry and export the spans over OTLP/gRPC to this collector "
                   "(e.g. http://127.0.0.1:4317; needs pip install '.[tracing]'). W3C traceparent headers / gRPC "
                   "metadata make the request span a child of the caller's.")
@click.option("--model", "models", multiple=True, metavar="NAME=ENGINE",
              help="Host another engine beside ENGINE under this model name (repeatable; no speculation, the same "
                   "limits). Requests pick a model by name; \"model\": \"auto\" is routed by --route.")
@click.option("--route", "route_file", type=click.Path(path_type=Path), default=None, metavar="FILE",
              help='Policy for "model": "auto", as JSON: {"auto": [{"model", "max_prompt_tokens", "max_tokens"}, ...] '
                   '(first rule that holds), "fallback": {"large": "small"} (taken when the chosen model has '
                   '"saturated_waiting" requests queued, default its --max-waiting, instead of shedding)}.')
@click.option("--replicas", type=click.IntRange(1), default=None, metavar="N",
              help="Run N replicas of the engine on Ray Serve (pip install '.[cluster]'), each with --threads ONNX "
                   "Runtime threads (default 1), behind the same HTTP and gRPC API; a conversation's next turn goes to "
                   "the replica that holds its history (unless it is saturated), new prompts to the least cached.")
@click.option("--replica-routing", type=click.Choice(["prefix", "round-robin"]), default="prefix", show_default=True,
              help="With --replicas: prefix-aware routing, or plain round robin (for comparison).")
@click.option("--ray-address", default=None, metavar="ADDRESS",
              help="With --replicas: join this Ray cluster (auto, or ray://HEAD:10001) instead of starting Ray here; "
                   "the engine folder must be at the same path on every node.")
@click.option("--semantic-cache", is_flag=True,
              help="Answer repeated and near-duplicate requests (HTTP and gRPC) from earlier answers (greedy, n=1, "
                   "or \"semantic_cache\": true); needs pip install '.[semantic-cache]'.")
@click.option("--semantic-cache-threshold", type=click.FloatRange(0, 1, min_open=True), default=None,
              show_default="0.80", help="Cosine similarity of two questions' embeddings that makes an earlier one a "
                                        "candidate (the near-miss rules and the verifier decide).")
@click.option("--semantic-cache-verify-threshold", type=click.FloatRange(0, 1), default=None, show_default="0.2",
              help="The verifier's probability that two questions ask the same thing that serves a candidate.")
@click.option("--semantic-cache-ttl", type=click.FloatRange(0, min_open=True), default=600.0, show_default=True,
              help="Seconds an answer is kept.")
@click.option("--semantic-cache-size", type=click.IntRange(1), default=10_000, show_default=True,
              help="Most answers kept (least recently used go first).")
@click.option("--device", type=click.Choice(["cuda", "cpu"]), default=None, show_default="cuda if PyTorch sees a GPU",
              help="Where a --target cuda engine runs: cuda (PyTorch GEMMs + plugins/cuda kernels + CUDA graphs; "
                   "pip install '.[cuda]') or cpu (the same forward on PyTorch CPU tensors).")
@click.option("--chat-template", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="A Jinja chat template file for /v1/chat/completions [default: each model's own, else a plain "
                   "transcript].")
@click.option("--disable-log-requests", is_flag=True, help="No log line per request (vLLM's name).")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="info",
              show_default=True, help="The server's log level.")
@click.option("--cuda-graphs/--no-cuda-graphs", default=True, show_default=True,
              help="--device cuda: replay decode steps as CUDA graphs captured at start (one per batch size bucket).")
def serve(engine: Path | None, draft: Path | None, speculation: str, host: str, grpc_port: int, http_port: int,
          max_num_seqs: int, max_waiting: int, token_budget: int, prefill_chunk: int, mixed_step_ratio: float,
          max_burst_stall: float, max_model_len: int | None,
          kv_budget_mib: int | None, prefix_caching: bool, retained_slots: int, prefix_reserve_mib: int,
          kv_huge_pages: bool, threads: int | None, spin: bool,
          huge_pages: bool, api_key: str | None,
          tls_cert: Path | None, tls_key: Path | None, served_model_name: str | None, request_timeout: float,
          max_body_bytes: int, max_tokens_limit: int | None, grace: float, priority_floor: int,
          priority_keys: tuple[str, ...], tenants_file: Path | None, otlp_endpoint: str | None,
          models: tuple[str, ...], route_file: Path | None, semantic_cache: bool,
          semantic_cache_threshold: float | None, semantic_cache_verify_threshold: float | None,
          semantic_cache_ttl: float, semantic_cache_size: int,
          replicas: int | None, replica_routing: str, ray_address: str | None, device: str | None,
          chat_template: Path | None, disable_log_requests: bool, log_level: str, cuda_graphs: bool) -> None:
    """Serve ENGINE (default: the bundled target) over gRPC and OpenAI-compatible HTTP, with /metrics.
    With --model, several engines share the server and requests name one, or "auto" (--route)."""
    import logging

    from artifact.errors import QuicksilverError

    from .config import CudaConfig, EngineConfig, OrtConfig
    from .bundled import engine_dir
    from .server.app import run, serve as run_server
    from .server.router import load_policy
    from .server.tenants import load_tenants

    logging.basicConfig(level=getattr(logging, log_level.upper()), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if disable_log_requests:
        logging.getLogger("quicksilver.server.requests").setLevel(logging.WARNING)
    try:
        engine_path = engine or engine_dir("target")
        draft_path, method = _speculation(draft, speculation)
        econf = EngineConfig(SchedulerConfig(max_num_seqs, token_budget, prefill_chunk, max_waiting, mixed_step_ratio,
                                             max_burst_stall),
                             CacheConfig(max_model_len=max_model_len, enable_prefix_cache=prefix_caching,
                                         kv_budget_bytes=kv_budget_mib << 20 if kv_budget_mib else None,
                                         retained_slots=retained_slots, prefix_reserve_bytes=prefix_reserve_mib << 20,
                                         kv_huge_pages=kv_huge_pages),
                             draft=draft_path, speculation=method,
                             ort=OrtConfig(threads=threads, spin=spin, huge_pages=huge_pages),
                             cuda=CudaConfig(device=device, graphs=cuda_graphs))
        sconf = ServerConfig(
            host=host, grpc_port=grpc_port, http_port=http_port, api_key=api_key, tls_cert=tls_cert, tls_key=tls_key,
            model_name=served_model_name, request_timeout_s=request_timeout, max_body_bytes=max_body_bytes,
            max_tokens_limit=max_tokens_limit, grace_s=grace, priority_floor=priority_floor,
            priority_keys=_priority_keys(priority_keys), otlp_endpoint=otlp_endpoint,
            tenants=load_tenants(tenants_file) if tenants_file else (),
            route=load_policy(route_file) if route_file else None,
            semantic_cache=_cache_settings(semantic_cache, semantic_cache_threshold,
                                           semantic_cache_verify_threshold, semantic_cache_ttl, semantic_cache_size),
            cluster=_cluster(replicas, threads, replica_routing, ray_address), chat_template=chat_template)
        if route_file and not models:
            fail("--route chooses between models: add them with --model NAME=ENGINE")
        run(run_server(engine_path, econf, sconf, _models(models)))
    except (QuicksilverError, FileNotFoundError, ValueError, OSError) as e:
        fail(str(e))
