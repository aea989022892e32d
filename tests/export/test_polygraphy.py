"""Cross-check with polygraphy: its onnxruntime runner against a small CPU runner of our PyTorch modules.

Polygraphy's own PyTorch runner assumes CUDA (docs/design.md §8), so `TorchRunner` is a minimal
BaseRunner over a subgraph module; `Comparator` runs both on the same feeds and compares every
output with polygraphy's tolerance-based comparison.
"""

import time
from collections import OrderedDict

import pytest
import torch

polygraphy = pytest.importorskip("polygraphy")
from polygraphy.backend.base import BaseRunner  # noqa: E402
from polygraphy.backend.onnxrt import OnnxrtRunner, SessionFromOnnx  # noqa: E402
from polygraphy.common import TensorMetadata  # noqa: E402
from polygraphy.comparator import Comparator, SimpleCompareFunc  # noqa: E402
from polygraphy.datatype import DataType  # noqa: E402

from paradecode.export import validate  # noqa: E402
from paradecode.export.families import family_for  # noqa: E402
from paradecode.graphs.manifest import read_manifest  # noqa: E402
from paradecode.graphs.modules import build_subgraph  # noqa: E402
from tests.tiny_models import tiny_model  # noqa: E402


class TorchRunner(BaseRunner):
    """Runs one subgraph module on the CPU; inputs are copied, since layers write their caches in place."""

    def __init__(self, module, io, name="torch-cpu"):
        super().__init__(name=name, prefix="torch-cpu-runner")
        self.module, self.io = module, io

    def activate_impl(self):
        pass

    def get_input_metadata_impl(self):
        meta = TensorMetadata()
        for t in self.io.inputs:
            meta.add(t.name, dtype=DataType.from_dtype(getattr(torch, t.dtype), "torch"), shape=list(t.shape))
        return meta

    def infer_impl(self, feed_dict):
        start = time.perf_counter()
        inputs = {k: torch.from_numpy(v.copy()) for k, v in feed_dict.items()}
        outputs = validate.run_torch(self.module, self.io, inputs)
        self.inference_time = time.perf_counter() - start  # BaseRunner.last_inference_time() reads this
        return OrderedDict((k, v.numpy()) for k, v in outputs.items())

    def deactivate_impl(self):
        pass


@pytest.mark.parametrize("name", ["embed", "layer_2", "final"])
def test_polygraphy_comparator_agrees(exports, name):
    folder, _ = exports["mistral"]
    manifest = read_manifest(folder)
    sub = manifest.subgraph(name)
    model = tiny_model("mistral")
    weights = family_for("mistral").weights(model, manifest.spec)
    module = build_subgraph(manifest.spec, sub.io, weights, with_logits=True)
    generator = torch.Generator().manual_seed(3)
    feeds = [
        {
            k: v.numpy()
            for k, v in validate.random_inputs(
                sub.io,
                manifest.spec,
                max_seq_len=manifest.max_seq_len,
                max_batch=1,
                tokens=t,
                dtype=torch.float32,
                generator=generator,
            ).items()
        }
        for t in (1, 4, 9)
    ]
    runners = [OnnxrtRunner(SessionFromOnnx(str(folder / sub.onnx))), TorchRunner(module, sub.io)]
    results = Comparator.run(runners, data_loader=feeds)
    accuracy = Comparator.compare_accuracy(results, compare_func=SimpleCompareFunc(atol=1e-4, rtol=1e-3))
    assert bool(accuracy), f"polygraphy found {name} outside atol 1e-4 / rtol 1e-3"
    assert len(results[0][1]) == len(feeds)
