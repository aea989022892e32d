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
        "lookup",
        "every device",
        "5 tokens, matches of 2 to 16, proposals as long as the match",
        ("cpu-2core/lookup-tuning.md", "cpu-2core/lookup-replay-heads.json"),
        "5 tokens the fastest of 0/3/5/8 with SmolLM2's trained heads on the tuning prompts (1.10x / 1.33x / 1.43x / "
        "1.44x of ar; 8 proposed no more, K being 5); matches up to 16 long with proposals as long as the match beat "
        "3-grams proposed whole, replayed on SmolLM2's outputs for 105 tuning prompts (tools/lab/lookup_replay.py)",
    ),
    Default(
        "shared lookup",
        "every device",
        "off",
        ("cpu-2core/repeated-workload-smollm2-int8-exact-shared-suffix.md",),
        "measured only on a repeated workload so far",
    ),
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
        "cpu",
        "every core",
        ("cpu-2core/thread-pools.md",),
        "SmolLM2 on the eval prompts, alternated processes: plain decoding 1.10x and 1.19x the earlier pools (layer "
        "graphs of int8 exports on 1 thread, the rest on every core, idle threads sleeping) on the exact int8 and the "
        "default export, ParaDecode 1.08x and 1.20x; pools that slept between operators had made a second thread "
        "lose (0.85x and 0.91x, cpu-2core/op-table.md), pools that kept spinning after their call far slower (0.63x, "
        "cpu-2core/position-costs.md)",
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
        "ParaDecode, every position alone",
        "batched",
        "plain decoding",
        ("cpu-2core/bench-smollm2-default-s12-adaptive-lookup.md",),
        "SmolLM2's default export, where a position's bits need a call of its own: lookup alone 0.83x of ar, adapting "
        "0.81x (its cost model learns no price for a further position, which here is a whole pass); on one lane "
        "nothing a verification shares can pay",
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
        "cpu, greedy, the export's thresholds, batched, the draft head asked (draft_tokens > 0), lookup on or off",
        "on",
        ("cpu-2core/draft-features-600-smollm2.md",),
        "SmolLM2's 600-step draft head: lookup with one guess 1.17x of ar adapting, 1.13x not; with chains of 3 "
        "1.11x against 0.96x (adapting sizes the chains); lookup alone 1.10x either way",
    ),
    Default(
        "adaptive speculation",
        "elsewhere (cuda: a call's host time is not its cost; sampling, or lookup on without the draft head: exits "
        "not called, lookup alone measured not to gain from adapting)",
        "off",
        ("NVIDIA-H100-80GB-HBM3/bench-smollm2-method-adaptive.json",),
        "forced on with CUDA, adaptive passed up most exits and still ran at 0.94x of ar",
    ),
)


def auto_overlap(device: str) -> str:
    """The overlap `auto` means on `device` ("cpu", "cuda"): the "overlap auto" rows."""
    return "batched"


def onnxruntime_threads(cores: int) -> int:
    """onnxruntime threads per call on a CPU, for a machine of `cores` cores: the "onnxruntime threads per call" row
    (a pool per session that spins while its call runs: onnxruntime_backend's THREADS)."""
    return cores


def decodes_plainly(alone: bool, overlap: str) -> bool:
    """Whether ParaDecode with the default speculation decodes as plain decoding, where the machine's row form runs
    every position in a call of its own (`alone`, runtime/row_exactness.py) in the resolved `overlap`: the
    "ParaDecode, every position alone" rows."""
    return alone and overlap == "batched"


def skips_exits(device: str, overlap: str, temperature: float, lookup_tokens: int) -> bool:
    """Whether the export's thresholds call no exit head (lookup still proposes), for a request that left
    `adaptive` and thresholds to the defaults, in the resolved `overlap`: the "exit heads" rows."""
    if overlap != "batched":
        return False
    return device == "cuda" or temperature != 0 or lookup_tokens > 0


def adapts(device: str, overlap: str, temperature: float, lookup_tokens: int, draft_tokens: int = 0) -> bool:
    """Whether speculation adapts to measured costs and acceptance, for a request that left `adaptive` and thresholds
    to the defaults: the "adaptive speculation" rows (lookup alone, as measured, does not adapt; with the draft head
    asked it does)."""
    greedy_cpu = temperature == 0 and device == "cpu" and overlap == "batched"
    return greedy_cpu and (draft_tokens > 0 or not skips_exits(device, overlap, temperature, lookup_tokens))
