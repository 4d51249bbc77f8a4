"""EngineConfig: what every backend shares (scheduler, cache, speculation) and one config per backend kind (ONNX
Runtime sessions, the cuda backend), validated, one dataclass per concern."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path



def available_memory_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30


@dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding: the most guesses a step verifies per sequence, and the adaptive controller's priors."""

    max_gamma: int = 6
    adaptive: bool = True           # False: always speculate max_gamma tokens (for tests and benchmarks)
    prior_acceptance: float = 0.7
    prior_tokens: float = 8.0       # a request's α counts the engine's recent α as this many tried guesses
    memory: float = 0.8             # weight of a request's earlier guesses each round (recent rounds count most)

    def __post_init__(self):
        if not 1 <= self.max_gamma <= 16:
            raise ValueError("max_gamma must be in [1, 16]")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 16            # running sequences (one KV slot each)
    token_budget: int = 4096          # tokens computed per step (decodes + guesses + prompt chunks): a burst of
                                      # prompts is computed in one step up to this
    prefill_chunk: int = 256          # most tokens one prompt gets per step beside decodes, and the length up
                                      # to which a prompt counts as short (long ones sit out while it prefills)
    max_waiting: int = 64             # queued requests beyond which submit refuses (backpressure: 429)
    mixed_step_ratio: float = 2.0     # a step carrying prompt slices beside decodes may cost this many decode-only
                                      # steps (the slices shrink to fit, ≥ 16 tokens; where 16 already cost more,
                                      # what they cost is held, see Scheduler.observe); inf: fixed slices
    max_burst_stall_s: float = 1.0    # a burst of prompts beside decoding streams is computed whole (one stall)
                                      # only while that stall, at the prompt tokens' measured cost, stays within
                                      # this; a longer one goes in slices (inf: whole, whatever it costs)

    def __post_init__(self):
        if self.max_num_seqs < 1 or self.token_budget < self.max_num_seqs + 1:
            raise ValueError("need max_num_seqs ≥ 1 and token_budget > max_num_seqs")
        if self.prefill_chunk < 1:
            raise ValueError("prefill_chunk must be ≥ 1")
        if self.prefill_chunk > self.token_budget:      # a step never computes more than its budget
            object.__setattr__(self, "prefill_chunk", self.token_budget)
        if self.max_waiting < 1:            # every request waits in the queue until a step admits it
            raise ValueError("max_waiting must be ≥ 1 (every request is queued before a step admits it)")
        if not self.mixed_step_ratio >= 1.0:
            raise ValueError("mixed_step_ratio must be ≥ 1 (inf: fixed chunks)")
        if not self.max_burst_stall_s > 0:
            raise ValueError("max_burst_stall_s must be > 0 (inf: bursts always whole)")


@dataclass(frozen=True)
class CacheConfig:
    max_model_len: int | None = None  # slot capacity in tokens; None: the engine's context length
    block_size: int = 16              # prefix-cache granularity in tokens
    kv_budget_bytes: int | None = None  # slots + prefix cache; None: 25 % of available RAM, at most 8 GiB
                                      # (cuda engines: 85 % of free device memory less the weights, via libqs_cuda)
    prefix_cache_fraction: float = 0.3  # of the budget, for cached blocks
    enable_prefix_cache: bool = True
    retained_slots: int = 32          # finished sequences whose slots keep their KV for a follow-up that extends
                                      # them (next chat turn): no copy, no recomputed partial block. Slots beyond
                                      # max_num_seqs; their memory is given back first whenever it is wanted
    prefix_reserve_bytes: int = 64 << 20   # prefix-cache blocks made resident ahead while the engine is idle
                                      # (cpu: BlockPool.populate_ahead), so a burst's copies find memory faulted in
    kv_huge_pages: bool = False       # cpu: long sequences' slots grow by transparent huge pages (slots.py): faster
                                      # decoding at long context, slower admission where the host reclaims free
                                      # huge pages (a VM with free page reporting), so off unless asked for

    def __post_init__(self):
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError("block_size must be a power of two")
        if self.retained_slots < 0:
            raise ValueError("retained_slots must be >= 0")
        if self.prefix_reserve_bytes < 0:
            raise ValueError("prefix_reserve_bytes must be >= 0")
        if not 0.0 <= self.prefix_cache_fraction < 1.0:
            raise ValueError("prefix_cache_fraction must be in [0, 1)")

    def budget(self) -> int:
        return self.kv_budget_bytes or min(available_memory_bytes() // 4, 8 << 30)


@dataclass(frozen=True)
class OrtConfig:
    """The ONNX Runtime backends' sessions (cpu, paged)."""

    threads: int | None = None        # intra-op threads; None: min(2, cores)
    spin: bool = True                 # threads spin between ops and 2 ms after a run (backends/cpu/runner.SPIN_US)
    huge_pages: bool = True           # cpu: weights read onto transparent huge pages (backends/cpu/weights.py)
    providers: tuple[str, ...] | None = None   # execution providers; None: chosen from the engine's target
    custom_ops_library: str | None = None      # a custom-op library to register (own kernels)


@dataclass(frozen=True)
class CudaConfig:
    """The cuda backend (--target cuda engines on PyTorch GEMMs and plugins/cuda kernels)."""

    device: str | None = None         # "cuda" | "cpu" (the same forward on PyTorch CPU tensors); None: cuda where
                                      # PyTorch sees a GPU, else cpu
    graphs: bool = True               # replay steps as CUDA graphs (one per token bucket)

    def __post_init__(self):
        if self.device not in (None, "cuda", "cpu"):
            raise ValueError(f"device must be cuda or cpu, not {self.device!r}")


@dataclass(frozen=True)
class EngineConfig:
    """What every backend shares, and each backend kind's own options (the others ignore them)."""

    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    spec: SpecConfig = field(default_factory=SpecConfig)
    draft: Path | None = None         # draft engine for speculative decoding
    speculation: str | None = None    # None | "draft" (needs `draft`) | "ngram" (prompt lookup)
    verify_artifact: bool = True
    ort: OrtConfig = field(default_factory=OrtConfig)
    cuda: CudaConfig = field(default_factory=CudaConfig)

    def __post_init__(self):
        if self.speculation not in (None, "draft", "ngram"):
            raise ValueError("speculation must be 'draft', 'ngram' or None")
        if (self.speculation == "draft") != (self.draft is not None):
            raise ValueError("speculation='draft' and a draft engine go together")


@dataclass(frozen=True)
class ClusterConfig:
    """runtime serve --replicas: engine replicas on Ray Serve (runtime.cluster), behind the same API."""

    replicas: int = 2
    threads: int = 1                  # ONNX Runtime threads (and Ray CPUs) per replica
    routing: str = "prefix"           # prefix: prefix-aware (runtime.cluster.routing) | round-robin
    address: str | None = None        # a running Ray cluster ("auto", "ray://head:10001"); None: start Ray here

    def __post_init__(self):
        if self.replicas < 1 or self.threads < 1:
            raise ValueError("--replicas and --threads must be at least 1")
        if self.routing not in ("prefix", "round-robin"):
            raise ValueError(f"routing must be prefix or round-robin, not {self.routing!r}")


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"           # loopback unless told otherwise
    grpc_port: int = 50051            # 0: any free port; -1: no gRPC server
    http_port: int = 8000             # 0: any free port; -1: no HTTP server
    api_key: str | None = None        # bearer token required on gRPC and HTTP (except /health, /metrics)
    tls_cert: Path | None = None
    tls_key: Path | None = None
    model_name: str | None = None     # served model id; None: the engine folder's name
    request_timeout_s: float = 600.0  # upper bound on any request (gRPC deadlines may be shorter)
    max_body_bytes: int = 1 << 20     # HTTP body / gRPC message limit
    max_prompt_tokens: int | None = None   # None: the context length
    max_tokens_limit: int | None = None    # cap on max_tokens; None: the context length
    grace_s: float = 10.0             # graceful shutdown: in-flight requests get this long to finish
    # Priorities: lower is more urgent (engine range [-100, 100]). A caller may ask for `priority_floor` or a larger
    # number; a caller whose bearer token is one of `priority_keys` (token, floor) gets that token's floor instead.
    # Those tokens authenticate too where `api_key` is required.
    priority_floor: int = 0
    priority_keys: tuple[tuple[str, int], ...] = ()
    otlp_endpoint: str | None = None  # OpenTelemetry collector (OTLP/gRPC, e.g. http://127.0.0.1:4317): trace requests
    tenants: tuple = ()               # runtime.server.tenants.Tenant: API keys with their own limits (auth required)
    route: object = None              # runtime.server.router.RoutePolicy for "model": "auto" (None: the first model)
    semantic_cache: object = None     # runtime.server.semantic_cache.CacheSettings: answer near-duplicates
    cluster: ClusterConfig | None = None   # engines as replicas on Ray Serve (runtime serve --replicas)
    chat_template: Path | None = None # a Jinja chat template file for every model (default: each model's own)

    @property
    def requires_auth(self) -> bool:
        return bool(self.api_key or self.tenants)

    def __post_init__(self):
        for floor in (self.priority_floor, *(f for _, f in self.priority_keys)):
            if not -100 <= floor <= 100:
                raise ValueError(f"priority floor {floor} is outside the engine's range [-100, 100]")
        if any(not key for key, _ in self.priority_keys):
            raise ValueError("a priority key must not be empty")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("TLS needs both --tls-cert and --tls-key")
        for path in (self.tls_cert, self.tls_key):
            if path is not None and not Path(path).is_file():
                raise ValueError(f"TLS file not found: {path}")
        if self.request_timeout_s <= 0 or self.grace_s < 0 or self.max_body_bytes < 1024:
            raise ValueError("request_timeout_s > 0, grace_s ≥ 0 and max_body_bytes ≥ 1024 are required")
