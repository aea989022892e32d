"""Host work per token against a minimal loop: an export's plain decoding through the runtime beside the least a
program can do with the same graphs (onnxruntime only: embed, the segments, the final head, the KV caches bound in
place as the runtime binds them, the same session options), alternated in one process.

    python tools/results/cpu-2core/minimal-loop.py EXPORT [--prompt 300] [--tokens 64] [--rounds 7]

The prompt is `--prompt` random token ids (the same for both); each round decodes `--tokens` tokens with each and
times every token after the prefill (a token's wall time: its embed, segments and final calls). Both decode the
same tokens (checked). The minimal loop's cache has as many slots as the runtime's grows to for that span (its
granule of 64), so both attend over the same slots. Prints ms per token: per round the mean over its tokens (the
runtime's decoding time over its tokens after the prefill, the loop's token times), then
the median over rounds with min and max, and the runtime's ratio to the loop.
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
from paradecode.runtime.kvcache import GRANULE


class MinimalLoop:
    def __init__(self, export: Path, slots: int, threads: int):
        manifest = json.loads((export / "manifest.json").read_text())
        spec, subgraphs = manifest["spec"], {s["name"]: s for s in manifest["subgraphs"]}
        self.segments = sorted((s["layer"], s["last"]) for s in subgraphs.values() if s["kind"] == "segment")
        options = ort.SessionOptions()
        options.intra_op_num_threads, options.inter_op_num_threads, options.log_severity_level = threads, 1, 3
        options.add_session_config_entry("session.intra_op.allow_spinning", "1")
        options.add_session_config_entry("session.force_spinning_stop", "1")
        names = ["embed", "final"] + [f"segment_{a}_{b}" for a, b in self.segments]
        self.sessions = {
            n: ort.InferenceSession(str(export / subgraphs[n]["onnx"]), options, providers=["CPUExecutionProvider"])
            for n in names
        }
        shape = (1, spec["num_kv_heads"], slots, spec["head_dim"])
        self.caches = {
            layer: tuple(ort.OrtValue.ortvalue_from_numpy(np.zeros(shape, np.float32)) for _ in range(2))
            for layer in range(1, spec["num_layers"] + 1)
        }

    def run(self, name: str, feeds: dict, layers=()) -> dict:
        session = self.sessions[name]
        binding = session.io_binding()
        for key, value in feeds.items():
            binding.bind_cpu_input(key, value)
        outputs = [o.name for o in session.get_outputs() if not o.name.startswith("present_")]
        for output in outputs:
            binding.bind_output(output)
        for layer in layers:
            key, value = self.caches[layer]
            binding.bind_ortvalue_input(f"past_key.{layer}", key)
            binding.bind_ortvalue_input(f"past_value.{layer}", value)
            binding.bind_ortvalue_output(f"present_key.{layer}", key)
            binding.bind_ortvalue_output(f"present_value.{layer}", value)
        session.run_with_iobinding(binding)
        return dict(zip(outputs, [v.numpy() for v in binding.get_outputs()[: len(outputs)]]))

    def forward(self, ids: list[int], start: int) -> int:
        positions = (start + np.arange(len(ids)))[None].astype(np.int64)
        feeds = {"input_ids": np.array([ids], np.int64), "positions": positions}
        wanted = {i.name for i in self.sessions["embed"].get_inputs()}  # positions where they are learned
        hidden = self.run("embed", {k: v for k, v in feeds.items() if k in wanted})["hidden"]
        for a, b in self.segments:
            feeds = {"hidden": hidden, "positions": positions}
            hidden = self.run(f"segment_{a}_{b}", feeds, range(a, b + 1))["hidden_out"]
        return int(self.run("final", {"hidden": hidden[:, -1:]})["token"][0, 0])

    def decode(self, prompt: list[int], tokens: int) -> tuple[list[int], list[float]]:
        token, out, times = self.forward(prompt, 0), [], []
        out.append(token)
        for position in range(len(prompt), len(prompt) + tokens - 1):
            began = time.perf_counter()
            token = self.forward([token], position)
            times.append(time.perf_counter() - began)
            out.append(token)
        return out, times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("export", type=Path)
    parser.add_argument("--prompt", type=int, default=300)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    model = load(args.export)
    prompt = np.random.default_rng(0).integers(100, model.manifest.spec.vocab_size, args.prompt).tolist()
    slots = -(-(args.prompt + args.tokens) // GRANULE) * GRANULE
    loop = MinimalLoop(args.export, slots, model.backend.threads)
    settings = dict(prompt_ids=prompt, max_new_tokens=args.tokens, mode="ar", ignore_eos=True)
    want = model.generate(**settings).token_ids
    assert loop.decode(prompt, args.tokens)[0] == want, "the minimal loop decodes other tokens than the runtime"
    ours, minimal = [], []
    for _ in range(args.rounds):
        result = model.generate(**settings)
        decode = result.stats.seconds - result.stats.prefill_seconds
        ours.append(decode / (args.tokens - 1) * 1e3)
        minimal.append(statistics.fmean(loop.decode(prompt, args.tokens)[1]) * 1e3)
    print(f"{args.export}: prompt {args.prompt} tokens, {args.tokens} decoded, {args.rounds} rounds alternated")
    for name, values in (("runtime ar", ours), ("minimal loop", minimal)):
        print(f"{name:14s} ms/token {statistics.median(values):.2f} (min {min(values):.2f}, max {max(values):.2f})")
    ratios = [a / b for a, b in zip(ours, minimal)]
    print(f"runtime / loop {statistics.median(ratios):.3f}x (min {min(ratios):.3f}, max {max(ratios):.3f})")


if __name__ == "__main__":
    main()
