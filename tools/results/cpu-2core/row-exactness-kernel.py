"""How onnxruntime's MatMulNBits computes a row alone and among others (tools/results/cpu-2core/row-exactness.md).

    python tools/results/cpu-2core/row-exactness-kernel.py
    qemu-x86_64 -cpu EPYC-Rome .venv/bin/python tools/results/cpu-2core/row-exactness-kernel.py   # AVX2, no AVX-512

One 576 x 1536 product, block 32, random weights and scales, for 4- and 8-bit weights, float (`accuracy_level` 0)
and int8 (4) activations, with and without zero points, on 1 and 2 threads: the largest difference between rows
computed alone and the same rows in one call of M rows, and between the first row of calls of two and the same rows
in one call of eight. Then, for 4-bit weights with int8 activations, calls of 2, 8, 17 and 700 rows on 1 and 2
threads against one call of 700 on one thread.
"""

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

K, N, BLOCK = 576, 1536, 32
rng = np.random.default_rng(0)


def product(accuracy: int, zero_points: bool, bits: int) -> bytes:
    blocks = K // BLOCK
    weights = rng.integers(0, 256, (N, blocks, BLOCK * bits // 8), dtype=np.uint8)
    scales = (rng.random(N * blocks, dtype=np.float32) * 0.02).astype(np.float32)
    initializers = [numpy_helper.from_array(weights, "q"), numpy_helper.from_array(scales, "s")]
    inputs = ["x", "q", "s"]
    if zero_points:
        count = N * ((blocks + 1) // 2) if bits == 4 else N * blocks
        initializers.append(numpy_helper.from_array(rng.integers(0, 256, count, dtype=np.uint8), "z"))
        inputs.append("z")
    node = helper.make_node(
        "MatMulNBits", inputs, ["y"], domain="com.microsoft", K=K, N=N, bits=bits, block_size=BLOCK,
        accuracy_level=accuracy,
    )  # fmt: skip
    graph = helper.make_graph(
        [node],
        "product",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", K])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["M", N])],
        initializers,
    )
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=10).SerializeToString()


def session(model: bytes, threads: int) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    return ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])


x = rng.standard_normal((700, K), dtype=np.float32)
for bits in (4, 8):
    for accuracy in (0, 4):
        for zero_points in (False, True):
            model = product(accuracy, zero_points, bits)
            for threads in (1, 2):
                run = session(model, threads).run
                alone = np.concatenate([run(None, {"x": x[i : i + 1]})[0] for i in range(8)])
                diffs = [f"M{m}:{np.abs(run(None, {'x': x[:m]})[0] - alone[:m]).max():.1e}" for m in (2, 3, 4, 6, 8)]
                pairs = np.concatenate([run(None, {"x": x[i : i + 2]})[0][:1] for i in range(7)])
                eight = np.abs(pairs - run(None, {"x": x[:8]})[0][:7]).max()
                print(f"bits {bits} accuracy {accuracy} zero points {int(zero_points)} threads {threads}:", *diffs,
                      f"| first of two against eight: {eight:.1e}")  # fmt: skip
for zero_points in (False, True):
    model = product(4, zero_points, 4)
    reference = session(model, 1).run(None, {"x": x})[0]
    found = {
        (threads, m): float(np.abs(session(model, threads).run(None, {"x": x[:m]})[0] - reference[:m]).max())
        for threads in (1, 2)
        for m in (2, 8, 17, 700)
    }
    print(f"4-bit, int8 activations, zero points {int(zero_points)}: (threads, M) -> max |diff| {found}")
