"""The runtime's machine-dependent defaults, one row each, with the measurement that chose it.

A default that depends on the machine (the overlap `auto` means, threads per call, whether exit heads are called
beside lookup, whether speculation adapts) is a row of `DEFAULTS`: where it applies, its value, and the files under
`tools/results/` whose measurements chose it. The functions below are what the runtime reads; each says which rows
it implements, and `tests/runtime/test_policy.py` checks that they agree with the rows and that every cited file
exists. A new measurement that changes a default changes its row here, and the function with it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Default:
    setting: str
    where: str
    value: str
    evidence: tuple[str, ...]  # paths under tools/results/
    why: str


DEFAULTS = (
    Default(
        "overlap auto",
        "cpu",
        "batched",
        ("cpu-2core/bench-demo.md",),
        "batched 1.32x of ar on the demo model, both 1.28x, streams 1.22x (a 2-core CPU)",
    ),
    Default(
        "overlap auto",
        "cuda",
        "batched",
        ("NVIDIA-H100-80GB-HBM3/char-0.5b-compiled.json", "NVIDIA-H200/char-0.5b-segments.json"),
        "the controlled characterisations on an H100 and an H200 found batched ahead of streams and both at every "
        "acceptance (at acceptance 1 on the H200: batched 1.97x, both 1.50x, streams 1.01x)",
    ),
    Default(
        "onnxruntime threads per call",
        "the layer graphs' calls of up to 16 positions, int8 activations",
        "1",
        ("cpu-2core/bench-smollm2-peers.md", "cpu-2core/op-table.md", "cpu-2core/position-costs.md"),
        "SmolLM2 plain decoding 138.4 tokens/s with layers on 1 thread and heads on 2, 130.8 all on 1, 122.8 all on "
        "2; two threads per call 0.85x and 0.91x in the operator table's A/B; a segment at 6 positions 5.7-6.9 ms "
        "inside decoding on two threads, 6.0-6.8 on one (an AVX-512 VNNI CPU; an AVX2 one measured the other way: "
        "34.5 tokens/s on one thread, 42.5 on two, issue 33)",
    ),
    Default(
        "onnxruntime threads per call",
        "the layer graphs' calls of more than 16 positions (prefills), int8 activations",
        "every core, through a second session",
        ("cpu-2core/prefill-threads.md",),
        "a prefill 0.160-0.165 s against 0.299-0.304 s, decoding's speed unchanged (36 interleaved runs each way)",
    ),
    Default(
        "onnxruntime threads per call",
        "every other graph (float activations; heads; the embedding)",
        "every core",
        ("cpu-2core/bench-smollm2-peers.md",),
        "float activations 97.2 tokens/s all on 2 against 92.5 with layers on 1; float weights 60.9 against 55.9; "
        "a head's one large product splits well everywhere",
    ),
    Default(
        "exit heads with the export's thresholds, batched",
        "cpu, greedy, lookup on",
        "not called (lookup alone)",
        (
            "cpu-2core/bench-smollm2-int8-exact-s6-peers.md",
            "cpu-2core/bench-smollm2-int8-exact-s7-peers.md",
            "cpu-2core/bench-smollm2-default-export-s7.md",
        ),
        "exits + lookup within 2% of lookup alone in six interleaved runs, with a worse worst category in five and a "
        "worse p95 token latency in each; 0.97x against 1.00x on the default export",
    ),
    Default(
        "exit heads with the export's thresholds, batched",
        "cpu, sampling",
        "not called (lookup alone)",
        ("cpu-2core/bench-smollm2-int8-exact-sampling-suffix-t0.7.md",),
        "at T 0.7, exits + lookup 0.97x of ar sampling, lookup alone 1.06x",
    ),
    Default(
        "exit heads with the export's thresholds, batched",
        "cuda",
        "not called (lookup alone)",
        (
            "NVIDIA-H100-80GB-HBM3/bench-smollm2-method-compiled.json",
            "NVIDIA-H100-80GB-HBM3/bench-smollm2-method-eager.json",
        ),
        "SmolLM2's real weights and shipped heads on an H100: exits + lookup 0.87x of ar compiled, lookup alone "
        "1.03x; exits lost in every category compiled and in five of six eager",
    ),
    Default(
        "adaptive speculation",
        "cpu, greedy, the export's thresholds, batched, lookup off",
        "on",
        ("cpu-2core/bench-smollm2-adaptive.md",),
        "exits alone on SmolLM2's default export: 0.97x of ar adapting, 0.90x not (exits called while they pay)",
    ),
    Default(
        "adaptive speculation",
        "elsewhere (cuda: a call's host time is not its cost; sampling: a seed must reproduce its sequence)",
        "off",
        ("NVIDIA-H100-80GB-HBM3/bench-smollm2-method-adaptive.json",),
        "forced on with CUDA, adaptive passed up most exits and still ran at 0.94x of ar",
    ),
)


def auto_overlap(device: str) -> str:
    """The overlap `auto` means on `device` ("cpu", "cuda"): the "overlap auto" rows."""
    return "batched"


def onnxruntime_threads(int8_activations: bool, cores: int) -> dict[str, int]:
    """Threads per call by graph part ("layers": the layer graphs' decoding calls, "prefill": their calls of more
    than 16 positions, onnxruntime_backend's BOUND_TOKENS; "heads": every other graph): the "onnxruntime threads per
    call" rows."""
    return {"layers": 1 if int8_activations else cores, "prefill": cores, "heads": cores}


def skips_exits(device: str, overlap: str, temperature: float, lookup_tokens: int) -> bool:
    """Whether the export's thresholds call no exit head (lookup still proposes), for a request that left
    `adaptive` and thresholds to the defaults, in the resolved `overlap`: the "exit heads" rows."""
    if overlap != "batched":
        return False
    return device == "cuda" or temperature != 0 or lookup_tokens > 0


def adapts(device: str, overlap: str, temperature: float, lookup_tokens: int) -> bool:
    """Whether speculation adapts to measured costs and acceptance, for a request that left `adaptive` and thresholds
    to the defaults: the "adaptive speculation" rows (lookup alone, as measured, does not adapt)."""
    greedy_cpu = temperature == 0 and device == "cpu" and overlap == "batched"
    return greedy_cpu and not skips_exits(device, overlap, temperature, lookup_tokens)
