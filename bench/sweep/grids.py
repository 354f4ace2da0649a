"""Grid definitions: which servers `vllm bench sweep serve` starts (strategy x memory budget) and which benchmark
points it runs against each (workload x concurrency, or x arrival rate for the bursty workload).

- `cpu-ci`: one point (reconstruct, chat, concurrency 2) on the fixture: the CI test's grid.
- `cpu`: the reduced CPU grid on the fixture, committed under bench/results/sweeps/cpu (2 cores: ~15 minutes).
- `cpu-dummy`: the 27B grid's model path (27B vocabulary, dummy weights) on a CPU-sized shape, two points.
- `h200-27b`: Qwen3.5-27B's shape with dummy weights and synthetic acceptance on one H200, through
  ../shared/tools/gpu-vllm (see `bench/sweep/README.md` for the device commands).
- `h200-27b-core`: the same servers on one workload (chat) at concurrency 1, 8, 64, 256: a server per 10-minute
  device call, the whole grid within one session's device time.
- `h200-a3b`: Qwen3.5-35B-A3B's shape (MoE, dummy weights, synthetic acceptance) on one H200 at KV-cache budgets
  where store_all's concurrency binds (`bench.sweep.capacity` computes where, `bench/sweep/README.md` has the table);
  decode-heavy and chat workloads at concurrency 1 to 512. `h200-a3b-core`: its speculative strategies at the budget
  where store_all binds and reconstruct does not, split over two device calls with `--only` and `--points`.
- `h200-a10b-16l`: the same at Qwen3.5-122B-A10B's layer on 16 of its 48 layers (GDN states twice the A3B's),
  budgets 32 and 16 GiB.

Memory budget: on CUDA `--gpu-memory-utilization`; on CPU the KV-cache bytes. vLLM's CPU platform turns
`VLLM_CPU_KVCACHE_SPACE` (whole GiB) into `kv_cache_memory_bytes`; the fixture's state is so small that it binds
only at a few MiB, so the CPU grid sets `--kv-cache-memory-bytes` directly (a serve parameter, so one sweep
covers every budget; the env variable would need one sweep per budget and would override it).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace

from bench.sweep.workloads import WORKLOADS, LengthProfile, workload_axis

STRATEGIES = ("no_spec", "store_all", "reconstruct")
MiB = 1 << 20
GiB = 1 << 30


@dataclass(frozen=True)
class Budget:
    name: str  # how tables and plots label it
    serve_params: dict  # `vllm serve` flags, as sweep serve-params keys
    note: str


@dataclass(frozen=True)
class Grid:
    name: str
    description: str
    model: str  # bench.sweep.models.prepare_model name
    max_model_len: int
    budgets: tuple[Budget, ...]
    concurrencies: tuple[int, ...]
    request_rates: tuple[float, ...]  # the bursty workload's axis (requests/s)
    burstiness: float  # gamma shape of the bursty arrivals (1 = Poisson, < 1 = burstier)
    lengths: LengthProfile
    workloads: tuple[str, ...] = WORKLOADS
    strategies: tuple[str, ...] = STRATEGIES
    num_speculative_tokens: int = 3
    # Prompts per point: enough to keep `concurrency` requests in flight for a while, within [min, max].
    prompts_per_slot: float = 2.0
    min_prompts: int = 8
    max_prompts: int = 512
    # The bursty workload's prompts per point: rate x this many seconds of arrivals, within [min, max].
    arrival_seconds: float = 30.0
    serve_flags: tuple[str, ...] = ()
    speculative_extra: dict = field(default_factory=dict)  # e.g. synthetic acceptance on dummy weights
    env: dict = field(default_factory=dict)
    bench_flags: tuple[str, ...] = ()
    # Where the benchmark's own settings differ from a deployment, said beside every figure.
    labels: tuple[str, ...] = ()

    def speculative_config(self, strategy: str) -> dict | None:
        if strategy == "no_spec":
            return None
        if strategy not in STRATEGIES:
            raise ValueError(f"unknown strategy {strategy!r}")
        return {"method": "mtp", "num_speculative_tokens": self.num_speculative_tokens,
                "mamba_state_commit": strategy, **self.speculative_extra}  # fmt: skip

    def serve_params(self) -> list[dict]:
        """One record per server: `vllm bench sweep serve --serve-params` (a list of dicts)."""
        records = []
        for budget in self.budgets:
            for strategy in self.strategies:
                record = {"_benchmark_name": f"{strategy}-{budget.name}", **budget.serve_params}
                spec = self.speculative_config(strategy)
                if spec is not None:
                    record["speculative_config"] = spec
                records.append(record)
        return records

    def num_prompts_for_concurrency(self, concurrency: int) -> int:
        return int(min(max(math.ceil(self.prompts_per_slot * concurrency), self.min_prompts), self.max_prompts))

    def num_prompts_for_rate(self, rate: float) -> int:
        return int(min(max(math.ceil(rate * self.arrival_seconds), self.min_prompts), self.max_prompts))

    @property
    def num_points(self) -> int:
        per_server = sum(len(self.concurrencies) if workload_axis(w) == "concurrency" else len(self.request_rates)
                         for w in self.workloads)  # fmt: skip
        return len(self.budgets) * len(self.strategies) * per_server

    def bench_params(self, workload_data: dict) -> list[dict]:
        """One record per benchmark point: `--bench-params`. Keys become `vllm bench serve` flags, except
        `workload`, which bench.sweep.point records in the result."""
        records = []
        cap = max(self.concurrencies)
        for name in self.workloads:
            data = workload_data[name]
            if data.axis == "concurrency":
                for c in self.concurrencies:
                    records.append({"_benchmark_name": f"{name}-c{c}", "workload": name, **data.bench_params,
                                    "max_concurrency": c, "request_rate": "inf",
                                    "num_prompts": self.num_prompts_for_concurrency(c)})  # fmt: skip
            else:
                for rate in self.request_rates:
                    # Arrivals, not a fixed concurrency, load the server; the cap is the grid's largest one.
                    records.append({"_benchmark_name": f"{name}-r{rate:g}", "workload": name, **data.bench_params,
                                    "max_concurrency": cap, "request_rate": rate, "burstiness": self.burstiness,
                                    "num_prompts": self.num_prompts_for_rate(rate)})  # fmt: skip
        return records


# The fixture on CPU (max_model_len 512). Lengths keep a point to seconds on 2 cores.
CPU_LENGTHS = LengthProfile(
    chat_input=48, chat_output=32,
    mixed_short_input=32, mixed_long_input=160, mixed_output=32,
    balanced=48,
    generation_heavy_input=16, generation_heavy_output=64,
    summarize_heavy_input=192, summarize_heavy_output=12,
    bursty_input=48, bursty_output=32,
    max_total=480,
)  # fmt: skip
CPU_SERVE_FLAGS = ("--dtype", "bfloat16", "--enforce-eager", "--no-enable-prefix-caching", "--max-model-len", "512",
                   "--seed", "0")  # fmt: skip
# Greedy, fixed output lengths: the fixture's MTP head drafts its target's greedy bigram.
BENCH_FLAGS = ("--temperature", "0", "--ignore-eos", "--seed", "0")
CPU_LABELS = ("CPU (vllm-cpu 0.32, 2 shared cores), fixture model, eager, prefix caching off",)

# KV-cache bytes on the fixture (k = 3), vLLM's capacity in requests of 512 tokens (measured, bench/results/
# sweeps/cpu): 6 MiB holds 2.4 store_all, 6.0 reconstruct and 9.6 no-speculation requests, so concurrency 8
# and above queues; 1 GiB (VLLM_CPU_KVCACHE_SPACE=1) holds 409.6 / 1024 / 1638.4: nothing binds.
CPU_BUDGETS = (
    Budget("kv6MiB", {"kv_cache_memory_bytes": 6 * MiB},
           "memory binds: vLLM's capacity 2.4 store_all / 6.0 reconstruct / 9.6 no-spec requests of 512 tokens"),
    Budget("kv1GiB", {"kv_cache_memory_bytes": 1 * GiB}, "memory does not bind (= VLLM_CPU_KVCACHE_SPACE=1)"),
)


def without_flag(flags: tuple[str, ...], name: str) -> tuple[str, ...]:
    """`flags` without the option `name` and its value."""
    index = flags.index(name)
    return flags[:index] + flags[index + 2 :]


GRIDS = {
    "cpu-ci": Grid(
        name="cpu-ci",
        description="one point end to end: reconstruct, chat, concurrency 2, fixture on CPU",
        model="fixture-tiny",
        max_model_len=512,
        budgets=(CPU_BUDGETS[1],),
        strategies=("reconstruct",),
        workloads=("chat",),
        concurrencies=(2,),
        request_rates=(),
        burstiness=0.5,
        lengths=CPU_LENGTHS,
        min_prompts=4,
        serve_flags=CPU_SERVE_FLAGS,
        bench_flags=BENCH_FLAGS,
        labels=CPU_LABELS,
    ),
    "cpu": Grid(
        name="cpu",
        description="reduced CPU grid: fixture, 3 strategies x 2 KV budgets x 6 workloads, concurrency 1/8/32",
        model="fixture-tiny",
        max_model_len=512,
        budgets=CPU_BUDGETS,
        concurrencies=(1, 8, 32),
        request_rates=(2.0, 8.0),
        burstiness=0.5,
        lengths=CPU_LENGTHS,
        prompts_per_slot=1.0,
        min_prompts=4,
        max_prompts=32,
        arrival_seconds=4.0,
        serve_flags=CPU_SERVE_FLAGS,
        bench_flags=BENCH_FLAGS,
        labels=CPU_LABELS,
    ),
    # The 27B grid's own pieces (config, word-level tokenizer with the 27B vocabulary, dummy weights) on a
    # CPU-sized shape: a check before device time is spent. Not synthetic acceptance: vLLM's CPU sampler refuses
    # it ("Synthetic acceptance not supported with CPU sampling"), so drafts of dummy weights are mostly rejected.
    "cpu-dummy": Grid(
        name="cpu-dummy",
        description="the h200-27b grid's model path on CPU: 27B vocabulary, small layers, dummy weights; "
                    "store_all and reconstruct, chat, concurrency 2",
        model="qwen35-27b-vocab-small",
        max_model_len=512,
        budgets=(CPU_BUDGETS[1],),
        strategies=("store_all", "reconstruct"),
        workloads=("chat",),
        concurrencies=(2,),
        request_rates=(),
        burstiness=0.5,
        lengths=CPU_LENGTHS,
        min_prompts=4,
        serve_flags=CPU_SERVE_FLAGS,
        bench_flags=BENCH_FLAGS,
        labels=("CPU, 27B vocabulary on small layers, dummy weights",),
    ),
    # The same check for the A3B grid's model path: the MoE config class and architecture (Qwen3_5MoeForCausalLM,
    # its Qwen3_5MoeMTP drafter) at a CPU size.
    "cpu-dummy-a3b": Grid(
        name="cpu-dummy-a3b",
        description="the h200-a3b grid's model path on CPU: MoE shape with the 248,320 vocabulary, small layers, "
                    "dummy weights; store_all and reconstruct, chat, concurrency 2",
        model="qwen35-a3b-vocab-small",
        max_model_len=512,
        budgets=(CPU_BUDGETS[1],),
        strategies=("store_all", "reconstruct"),
        workloads=("chat",),
        concurrencies=(2,),
        request_rates=(),
        burstiness=0.5,
        lengths=CPU_LENGTHS,
        min_prompts=4,
        serve_flags=CPU_SERVE_FLAGS,
        bench_flags=BENCH_FLAGS,
        labels=("CPU, the A3B vocabulary and MoE layers at a small size, dummy weights",),
    ),
    "h200-27b": Grid(
        name="h200-27b",
        description="Qwen3.5-27B shape, dummy weights, synthetic acceptance 2.8 of 4, one H200",
        model="qwen35-27b",
        max_model_len=4096,
        # 27B bf16 weights take ~51 GiB of the H200's 139 GiB. At 0.9 store_all holds ~90 requests (600 MiB of
        # fp32 GDN state each at k = 3) and reconstruct ~224 (150 MiB): memory binds only at 128 and 256. At
        # 0.6 (~27 GiB of KV) store_all binds from ~40 requests, reconstruct from ~150.
        budgets=(
            Budget("gmu0.6", {"gpu_memory_utilization": 0.6}, "memory binds from concurrency ~32-64 (store_all)"),
            Budget("gmu0.9", {"gpu_memory_utilization": 0.9}, "memory binds only at 128-256 (store_all)"),
        ),
        concurrencies=(1, 8, 32, 64, 128, 256),
        request_rates=(4.0, 8.0, 16.0, 32.0, 64.0),
        burstiness=0.5,
        # Outputs of a few hundred tokens: a single-stream 27B decodes ~100 tokens/s, so the low-concurrency
        # points set the grid's length (device calls are 10 minutes, a session's device time 30).
        lengths=LengthProfile(
            chat_input=256, chat_output=192,
            mixed_short_input=128, mixed_long_input=1536, mixed_output=192,
            balanced=256,
            generation_heavy_input=64, generation_heavy_output=512,
            summarize_heavy_input=2048, summarize_heavy_output=64,
            bursty_input=512, bursty_output=192,
            max_total=4096,
            samples=1024,
        ),  # fmt: skip
        prompts_per_slot=2.0,
        min_prompts=8,
        max_prompts=512,
        arrival_seconds=8.0,
        serve_flags=("--dtype", "bfloat16", "--no-enable-prefix-caching",
                     "--max-model-len", "4096", "--seed", "0", "--mamba-ssm-cache-dtype", "float32",
                     # What ../shared/tools/gpu-vllm carries: Triton attention, no FlashInfer.
                     "--attention-backend", "TRITON_ATTN", "--gdn-prefill-backend", "triton",
                     # The grid's largest concurrency. vllm serve's H200 default (1024) exceeds reconstruct's Mamba
                     # blocks at gmu 0.6 (496), which vLLM refuses under FULL decode graphs (its issue 34094).
                     "--max-num-seqs", "256"),  # fmt: skip
        # Both strategies accept the same drafts at the same rate; correctness is measured on the fixture.
        speculative_extra={"rejection_sample_method": "synthetic", "synthetic_acceptance_length": 2.8,
                           "attention_backend": "TRITON_ATTN"},  # fmt: skip
        env={"VLLM_USE_V2_MODEL_RUNNER": "0", "VLLM_USE_FLASHINFER_SAMPLER": "0"},
        bench_flags=BENCH_FLAGS,
        labels=("H200 through ../shared/tools/gpu-vllm: vLLM 0.32 default compilation with its compiled ops, "
                "Triton attention (FlashAttention/FlashInfer absent), dummy weights, synthetic acceptance",),
    ),
}
# What one session's device time holds (a server per call): the speculative strategies, both budgets, chat only.
GRIDS["h200-27b-core"] = replace(
    GRIDS["h200-27b"], name="h200-27b-core",
    description="h200-27b on chat at concurrency 1/8/64/256, store_all and reconstruct: a server per device call",
    workloads=("chat",), strategies=("store_all", "reconstruct"), concurrencies=(1, 8, 64, 256), request_rates=(),
)

# Qwen3.5-35B-A3B (bench.sweep.models.QWEN35_35B_A3B, ~66 GiB of bf16 weights). KV-cache budgets as vLLM's
# kv_cache_memory_bytes: exact, so vLLM's capacity is known before the run (`python3 -m bench.sweep.capacity
# qwen35-35b-a3b --kv-gib 16 52 --max-model-len 1024`). Every request of these lengths fits one attention block
# (1,072 tokens store_all, 1,184 reconstruct), so it holds 3 GDN groups x (1 + k) blocks + 1 under store_all and
# 3 + 1 under reconstruct. 52 GiB is about what gmu 0.9 leaves beside the weights and start-up peak. The capacity
# is computed with prefix caching off; with it on (the grid's setting) vLLM reports less (align mode's extra GDN page
# per request and group) but admits as many requests of these lengths, which never leave their first block
# (bench/results/sweeps/h200-a3b-default: 54 and 160 running at 16 GiB, as without caching).
A3B_MAX_MODEL_LEN = 1024
A3B_BUDGETS = (
    Budget("kv52GiB", {"kv_cache_memory_bytes": 52 * GiB},
           "store_all binds (177.8 requests), reconstruct does not below 512 (523.2; no speculation 645.2)"),
    Budget("kv16GiB", {"kv_cache_memory_bytes": 16 * GiB},
           "both bind: store_all 54.7 requests, reconstruct 161.0 (no speculation 198.5)"),
)
# A decode batch of c requests is (1 + k) c tokens; vLLM's default capture sizes stop at 512 tokens (128 requests)
# for k = 3, so without these the grid's 256 and 512 would decode outside CUDA graphs.
A3B_CAPTURE_REQUESTS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 448, 512)
GRIDS["h200-a3b"] = Grid(
    name="h200-a3b",
    description="Qwen3.5-35B-A3B shape (MoE), dummy weights, synthetic acceptance 2.8 of 4, one H200, KV budgets "
                "where store_all binds",
    model="qwen35-35b-a3b",
    max_model_len=A3B_MAX_MODEL_LEN,
    budgets=A3B_BUDGETS,
    workloads=("generation_heavy", "chat"),
    concurrencies=(1, 8, 32, 64, 128, 256, 512),
    request_rates=(),
    burstiness=0.5,
    lengths=LengthProfile(
        chat_input=256, chat_output=192,
        mixed_short_input=128, mixed_long_input=512, mixed_output=192,
        balanced=256,
        generation_heavy_input=64, generation_heavy_output=640,
        summarize_heavy_input=640, summarize_heavy_output=64,
        bursty_input=256, bursty_output=192,
        max_total=A3B_MAX_MODEL_LEN,
        samples=1024,
    ),  # fmt: skip
    prompts_per_slot=1.5,
    min_prompts=8,
    max_prompts=768,
    # Prefix caching at vLLM's default (on), as users run; the workloads' prompts share no prefix.
    serve_flags=("--dtype", "bfloat16",
                 "--max-model-len", str(A3B_MAX_MODEL_LEN), "--seed", "0", "--mamba-ssm-cache-dtype", "float32",
                 "--attention-backend", "TRITON_ATTN", "--gdn-prefill-backend", "triton",
                 # every budget's reconstruct and store_all hold at least this many GDN blocks (vLLM's FULL-graph
                 # start-up check: max_num_seqs <= Mamba blocks)
                 "--max-num-seqs", "512",
                 "--compilation-config", json.dumps({"cudagraph_capture_sizes": [4 * r for r in A3B_CAPTURE_REQUESTS]}),
                 ),  # fmt: skip
    speculative_extra={"rejection_sample_method": "synthetic", "synthetic_acceptance_length": 2.8,
                       "attention_backend": "TRITON_ATTN"},  # fmt: skip
    # The runner vLLM picks, as users run: Model Runner V2 for both strategies' MTP chains.
    env={"VLLM_USE_FLASHINFER_SAMPLER": "0"},
    bench_flags=BENCH_FLAGS,
    labels=("H200 through ../shared/tools/gpu-vllm: vLLM 0.32 default compilation with its compiled ops, "
            "Triton attention, the runner vLLM picks (V2), prefix caching on (vLLM's default), capture sizes up to "
            "512 requests, dummy weights, synthetic acceptance",),
)
# Qwen3.5-122B-A10B's layer on 16 of its 48 layers (bench.sweep.models.QWEN35_122B_A10B_16L, ~82 GiB of bf16
# weights with its MTP layer): the A3B grid's workloads, lengths and flags at this shape. A GDN state is twice the
# A3B's (64 value heads: 4 MiB fp32 per layer), 12 GDN layers a request. `python3 -m bench.sweep.capacity
# qwen35-122b-a10b-16l --kv-gib 16 32 --max-model-len 1024`: each request holds one attention block and 3 GDN
# groups x (1 + k) blocks + 1 under store_all, 3 + 1 under reconstruct, as at the A3B shape.
A10B_BUDGETS = (
    Budget("kv32GiB", {"kv_cache_memory_bytes": 32 * GiB},
           "store_all binds (121.2 requests), reconstruct at 512 only (364.0; no speculation 500.2)"),
    Budget("kv16GiB", {"kv_cache_memory_bytes": 16 * GiB},
           "both bind: store_all 60.6 requests, reconstruct 182.0 (no speculation 250.0)"),
)
GRIDS["h200-a10b-16l"] = replace(
    GRIDS["h200-a3b"], name="h200-a10b-16l",
    description="Qwen3.5-122B-A10B's layer on 16 layers (MoE), dummy weights, synthetic acceptance 2.8 of 4, one "
                "H200, KV budgets where store_all binds",
    model="qwen35-122b-a10b-16l", budgets=A10B_BUDGETS,
)
# What two device calls hold: store_all and reconstruct where only store_all binds. Call 1 runs the decisive points
# (`--points generation_heavy-c512 generation_heavy-c256`), call 2 the rest of the decode-heavy concurrencies.
GRIDS["h200-a3b-core"] = replace(
    GRIDS["h200-a3b"], name="h200-a3b-core",
    description="h200-a3b's store_all and reconstruct at kv52GiB (store_all binds, reconstruct does not)",
    strategies=("store_all", "reconstruct"), budgets=A3B_BUDGETS[:1],
)
# The A3B shape's memory-bound point in one device call (issue 51), on the attention backend vLLM picks (FLASH_ATTN on
# Hopper, as users run: no --attention-backend, and the drafter's left to vLLM too) and, for issue 52's comparison,
# on TRITON_ATTN for both strategies: at kv16GiB both strategies bind (store_all 54.7 requests, reconstruct 161.0), and
# concurrency 256 holds every request either can admit waiting behind it. Both workloads (decode-heavy, chat) against
# each strategy's server: 2 servers x 2 points a call, the starts warm when an earlier call of the session on the same
# machine compiled them (`--model-dir` shared: the model's path is part of vLLM's torch.compile cache key).
GRIDS["h200-a3b-16g-triton"] = replace(
    GRIDS["h200-a3b"], name="h200-a3b-16g-triton",
    description="h200-a3b's memory-bound point: kv16GiB, store_all and reconstruct, decode-heavy and chat at "
                "concurrency 256, TRITON_ATTN",
    strategies=("store_all", "reconstruct"), budgets=A3B_BUDGETS[1:], concurrencies=(256,),
)
GRIDS["h200-a3b-16g"] = replace(
    GRIDS["h200-a3b-16g-triton"], name="h200-a3b-16g",
    description="h200-a3b's memory-bound point: kv16GiB, store_all and reconstruct, decode-heavy and chat at "
                "concurrency 256, the attention backend vLLM picks",
    serve_flags=without_flag(GRIDS["h200-a3b"].serve_flags, "--attention-backend"),
    speculative_extra={k: v for k, v in GRIDS["h200-a3b"].speculative_extra.items() if k != "attention_backend"},
    labels=("H200 through ../shared/tools/gpu-vllm: vLLM 0.32 default compilation with its compiled ops, the "
            "attention backend vLLM picks (FLASH_ATTN with FlashAttention 3 on Hopper), the runner vLLM picks (V2), "
            "prefix caching on (vLLM's default), dummy weights, synthetic acceptance",),
)
# Qwen3-Next-80B-A3B's layer on 20 of its 48 layers (bench.sweep.models.QWEN3_NEXT_80B_A3B_20L, 66-67 GiB of bf16
# weights with its MTP layer, as the A3B shape): the A3B grid's workloads, lengths and flags, the fp32 GDN state
# included (a Qwen3-Next checkpoint names no state dtype, so without the flag vLLM would keep it in bf16). A request
# holds half the A3B's state (15 GDN and 5 attention layers against 30 and 10), so the budgets that bind as the A3B
# grid's do are about half theirs: `python3 -m bench.sweep.capacity qwen3-next-80b-a3b-20l --kv-gib 8 26
# --max-model-len 1024` (each request one attention block and 3 GDN groups x (1 + k) blocks + 1 under store_all,
# 3 + 1 under reconstruct).
NEXT_BUDGETS = (
    Budget("kv26GiB", {"kv_cache_memory_bytes": 26 * GiB},
           "store_all binds (163.0 requests), reconstruct at 512 only (479.5; no speculation 645.2)"),
    Budget("kv8GiB", {"kv_cache_memory_bytes": 8 * GiB},
           "both bind: store_all 50.2 requests, reconstruct 147.5 (no speculation 198.5)"),
)
GRIDS["h200-next-a3b-20l"] = replace(
    GRIDS["h200-a3b"], name="h200-next-a3b-20l",
    description="Qwen3-Next-80B-A3B's layer on 20 layers (MoE, interleaved GDN projections), dummy weights, "
                "synthetic acceptance 2.8 of 4, one H200, KV budgets where store_all binds",
    model="qwen3-next-80b-a3b-20l", budgets=NEXT_BUDGETS,
)
