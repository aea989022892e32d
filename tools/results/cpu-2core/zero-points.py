"""Whether Q4_1's per-block minima could go inside onnxruntime's quantized product (op-table.md, 2026-11-28).

    python tools/results/cpu-2core/zero-points.py

Q4_1 stores a block as w = d * q + m (q in 0..15, d and m half floats). `MatMulNBits` computes
w = scale * (q - zero_point): an integer zero point cannot hold -m / d, a float zero point can (to a float's
rounding). This times one `MatMulNBits` (block 32, int8 activations, 2 threads, one row, its weights hot in cache)
without zero points, with packed 4-bit zero points and with float ones, on SmolLM2's layer shapes: median
microseconds a call over 200 calls.
"""

import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

SHAPES = ((576, 960), (576, 576), (576, 3072), (1536, 576))  # (K, N): q/k/v, o, gate/up, down
rng = np.random.default_rng(0)


def product(k: int, n: int, zero_points: str) -> bytes:
    blocks = k // 32
    weights = [
        numpy_helper.from_array(rng.integers(0, 256, size=(n, blocks, 16), dtype=np.uint8), "q"),
        numpy_helper.from_array(rng.random((n, blocks), dtype=np.float32) * 0.01, "scales"),
    ]
    if zero_points == "4-bit":
        weights.append(numpy_helper.from_array(rng.integers(0, 256, size=(n, (blocks + 1) // 2), dtype=np.uint8), "z"))
    if zero_points == "float":
        weights.append(numpy_helper.from_array(rng.random((n, blocks), dtype=np.float32) * 15, "z"))
    node = helper.make_node(
        "MatMulNBits",
        ["x", *(w.name for w in weights)],
        ["y"],
        domain="com.microsoft",
        K=k,
        N=n,
        bits=4,
        block_size=32,
        accuracy_level=4,
    )
    graph = helper.make_graph(
        [node],
        "product",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "T", k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, "T", n])],
        weights,
    )
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets).SerializeToString()


def microseconds(k: int, n: int, zero_points: str) -> float:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    session = ort.InferenceSession(product(k, n, zero_points), options, providers=["CPUExecutionProvider"])
    x = rng.standard_normal((1, 1, k), dtype=np.float32)
    times = []
    for _ in range(200):
        began = time.perf_counter()
        session.run(None, {"x": x})
        times.append(time.perf_counter() - began)
    return float(np.median(times[5:]) * 1e6)


def main() -> None:
    print(f"onnxruntime {ort.__version__}\n\n| K x N | no zero points | 4-bit zero points | float zero points |")
    print("| --- | ---: | ---: | ---: |")
    for k, n in SHAPES:
        cells = [f"{microseconds(k, n, kind):.0f}" for kind in ("none", "4-bit", "float")]
        print(f"| {k} x {n} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
