"""What a pass over every layer and the final head costs at a batch's shapes: B rows of T positions each, the
calls a batch step makes (embed, the segments, the final head at every position), onnxruntime only, the
runtime's session options and threads, the caches bound in place at a fixed number of slots.

    python tools/results/cpu-2core/batch-call-costs.py EXPORT [--slots 256] [--rounds 15]

A batch step of B rows, each with k lookup proposals, is one such pass at T = k + 1: it yields B tokens plus the
accepted proposals. So T positions pay where the accepted proposals per row exceed cost(B, T) / cost(B, 1) - 1.
Prints, per (B, T), the median ms of a pass over rounds (min, max) and its ratio to T = 1 at the same B.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort

from paradecode.runtime import load


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("export", type=Path)
    parser.add_argument("--slots", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    with load(args.export) as model:
        threads = model.backend.threads
    manifest = json.loads((args.export / "manifest.json").read_text())
    spec, subgraphs = manifest["spec"], {s["name"]: s for s in manifest["subgraphs"]}
    segments = sorted((s["layer"], s["last"]) for s in subgraphs.values() if s["kind"] == "segment")
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads, options.log_severity_level = threads, 1, 3
    options.add_session_config_entry("session.intra_op.allow_spinning", "1")
    options.add_session_config_entry("session.force_spinning_stop", "1")
    names = ["embed", "final"] + [f"segment_{a}_{b}" for a, b in segments]
    sessions = {
        n: ort.InferenceSession(str(args.export / subgraphs[n]["onnx"]), options, providers=["CPUExecutionProvider"])
        for n in names
    }
    rng = np.random.default_rng(0)
    shapes = [(b, t) for b in (1, 8) for t in (1, 2, 4, 6)]
    caches = {}
    for b in (1, 8):
        shape = (b, spec["num_kv_heads"], args.slots, spec["head_dim"])
        caches[b] = {
            layer: [ort.OrtValue.ortvalue_from_numpy(rng.standard_normal(shape).astype(np.float32)) for _ in range(2)]
            for layer in range(1, spec["num_layers"] + 1)
        }

    def run(name: str, feeds: dict, batch: int, layers=()) -> dict:
        session = sessions[name]
        binding = session.io_binding()
        for key, value in feeds.items():
            binding.bind_cpu_input(key, value)
        outputs = [o.name for o in session.get_outputs() if not o.name.startswith("present_")]
        for output in outputs:
            binding.bind_output(output)
        for layer in layers:
            key, value = caches[batch][layer]
            binding.bind_ortvalue_input(f"past_key.{layer}", key)
            binding.bind_ortvalue_input(f"past_value.{layer}", value)
            binding.bind_ortvalue_output(f"present_key.{layer}", key)
            binding.bind_ortvalue_output(f"present_value.{layer}", value)
        session.run_with_iobinding(binding)
        return dict(zip(outputs, [v.numpy() for v in binding.get_outputs()[: len(outputs)]]))

    def one_pass(batch: int, tokens: int) -> float:
        start = args.slots // 2  # the positions' place in the cache: half of it is the past
        positions = np.tile(start + np.arange(tokens), (batch, 1)).astype(np.int64)
        ids = rng.integers(100, spec["vocab_size"], (batch, tokens)).astype(np.int64)
        began = time.perf_counter()
        wanted = {i.name for i in sessions["embed"].get_inputs()}
        hidden = run(
            "embed", {k: v for k, v in {"input_ids": ids, "positions": positions}.items() if k in wanted}, batch
        )
        hidden = hidden["hidden"]
        for a, b in segments:
            hidden = run(f"segment_{a}_{b}", {"hidden": hidden, "positions": positions}, batch, range(a, b + 1))
            hidden = hidden["hidden_out"]
        run("final", {"hidden": hidden}, batch)
        return time.perf_counter() - began

    times = {shape: [] for shape in shapes}
    for shape in shapes:
        one_pass(*shape)  # warm-up: sessions, arenas
    for _ in range(args.rounds):
        for shape in shapes:
            times[shape].append(one_pass(*shape) * 1e3)
    print(f"{args.export}: {threads} thread(s), cache of {args.slots} slots, {args.rounds} rounds alternated")
    print("| rows B | positions a row T | ms a pass | min | max | x T = 1 |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for b, t in shapes:
        median = statistics.median(times[(b, t)])
        base = statistics.median(times[(b, 1)])
        print(
            f"| {b} | {t} | {median:.2f} | {min(times[(b, t)]):.2f} | {max(times[(b, t)]):.2f} | {median / base:.2f} |"
        )


if __name__ == "__main__":
    main()
