"""A minimal sequential driver over an export's ONNX graphs with onnxruntime (test helper).

It runs embed -> layer_1..L -> final for one chunk of tokens at a time, keeping the fixed-size
caches in numpy buffers that onnxruntime updates in place (the outputs are bound to the inputs'
memory). The real runtime, with lanes and ParaDecode, is `paradecode.runtime`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort

from paradecode.graphs.manifest import read_manifest


class OrtChain:
    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.manifest = read_manifest(folder)
        spec = self.manifest.spec
        self.spec = spec
        options = ort.SessionOptions()
        options.log_severity_level = 3
        self.sessions = {
            s.io.name: ort.InferenceSession(str(self.folder / s.onnx), options, providers=["CPUExecutionProvider"])
            for s in self.manifest.subgraphs
        }
        shape = (1, spec.num_kv_heads, self.manifest.max_seq_len, spec.head_dim)
        self.caches = {
            layer: (np.zeros(shape, np.float32), np.zeros(shape, np.float32)) for layer in range(1, spec.num_layers + 1)
        }

    def run(self, ids: list[int], start: int) -> dict[str, np.ndarray]:
        """Feed `ids` at positions start.. ; return the final head's outputs for them."""
        positions = np.arange(start, start + len(ids), dtype=np.int64)[None]
        feeds = {"input_ids": np.array([ids], dtype=np.int64)}
        if self.spec.positions == "learned":
            feeds["positions"] = positions
        hidden = self.sessions["embed"].run(None, feeds)[0]
        for layer in range(1, self.spec.num_layers + 1):
            session = self.sessions[f"layer_{layer}"]
            key, value = self.caches[layer]
            binding = session.io_binding()
            binding.bind_cpu_input("hidden", hidden)
            binding.bind_cpu_input("positions", positions)
            key_ort, value_ort = ort.OrtValue.ortvalue_from_numpy(key), ort.OrtValue.ortvalue_from_numpy(value)
            binding.bind_ortvalue_input("past_key", key_ort)
            binding.bind_ortvalue_input("past_value", value_ort)
            binding.bind_output("hidden_out")
            binding.bind_ortvalue_output("present_key", key_ort)
            binding.bind_ortvalue_output("present_value", value_ort)
            session.run_with_iobinding(binding)
            hidden = binding.copy_outputs_to_cpu()[0]
        final = self.sessions["final"]
        names = [o.name for o in final.get_outputs()]
        return dict(zip(names, final.run(None, {"hidden": hidden})))

    def greedy(self, prompt: list[int], new_tokens: int) -> tuple[list[int], list[float]]:
        """Greedy continuation of `prompt`; also the top-1/top-2 margin of each chosen token."""
        out = self.run(prompt, 0)
        tokens, margins = [int(out["token"][0, -1])], [float(out["margin"][0, -1])]
        position = len(prompt)
        while len(tokens) < new_tokens:
            out = self.run([tokens[-1]], position)
            position += 1
            tokens.append(int(out["token"][0, -1]))
            margins.append(float(out["margin"][0, -1]))
        return tokens, margins
