"""What Q4_1's minima cost a token, and what the ways around them would: SmolLM2's 120 quantized products of a token
(30 layers of q/k/v fused, o, gate/up fused, down; random weights of the real shapes, each product's output feeding
the next), one onnxruntime graph per weight form, timed alternated in one process.

    python tools/results/cpu-2core/minima-forms.py [--threads 1] [--positions 1] [--rounds 7]

The forms (every product a `MatMulNBits` with block 32 and int8 activations, `accuracy_level` 4, as our exports):

- `q4_1`: 4-bit values without zero points, plus the minima as our exports compute them (export/
  quantized_products.py): the input's block sums (Reshape, ReduceSum) times the float minima [K/32, N], added;
- `q4_1, 8-bit minima`: the minima product as an 8-bit `MatMulNBits` (a quarter of the bytes; not exact);
- `q4_1, sums from the product`: the block sums as 18 or 48 more output columns of the 4-bit product (exact 0/1
  weights), then the minima product (one Split instead of Reshape + ReduceSum);
- `4-bit, zero points`: uint8 zero points, which onnxruntime folds into the product at no cost: Q4_1's w = d q + m only
  where -m/d is an integer, so a rounding of every block's minimum (a ceiling, not Q4_1);
- `8-bit, zero points`: every Q4_1 block re-stored as 8-bit values with a zero point (w = (d/17)(q8 - z8), exact
  but for -17 m/d rounded to an integer: at most d/34 off);
- `no minima`: the 4-bit product alone (a ceiling: other weights).

With one thread the clock is the process's CPU time (what a call costs, whatever else the machine runs); with more,
wall time. Prints per form the median ms of a token over rounds, with min and max.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]  # (K, N): q/k/v, o, gate/up, down
LAYERS, BLOCK = 30, 32
FORMS = ("q4_1", "q4_1, 8-bit minima", "q4_1, sums from the product", "4-bit, zero points", "8-bit, zero points")
FORMS += ("no minima",)


class Graph:
    def __init__(self, rng: np.random.Generator):
        self.rng, self.nodes, self.inits = rng, [], []

    def const(self, name: str, value: np.ndarray) -> str:
        self.inits.append(numpy_helper.from_array(value, name))
        return name

    def node(self, op: str, inputs: list[str], out: str, **attrs) -> str:
        domain = "com.microsoft" if op == "MatMulNBits" else ""
        self.nodes.append(helper.make_node(op, inputs, [out], domain=domain, **attrs))
        return out

    def weights(self, p: str, k: int, n: int, bits: int) -> list[str]:
        blocks = -(-k // BLOCK)
        q = self.rng.integers(0, 2**bits, (n, blocks, BLOCK)).astype(np.uint8)
        if bits == 4:
            q = q[..., 0::2] | (q[..., 1::2] << 4)
        scales = (self.rng.random((n, blocks)) * 0.01 + 0.001).astype(np.float32)
        return [self.const(p + "q", q), self.const(p + "s", scales)]

    def zero_points(self, p: str, k: int, n: int, bits: int) -> str:
        zp = self.rng.integers(0, 2**bits, (n, k // BLOCK)).astype(np.uint8)
        if bits == 4:
            zp = np.pad(zp, ((0, 0), (0, zp.shape[1] % 2)))
            zp = zp[:, 0::2] | (zp[:, 1::2] << 4)
        return self.const(p + "z", zp)

    def product(self, x: str, p: str, k: int, n: int, bits: int = 4, zp: bool = False) -> str:
        inputs = [x, *self.weights(p, k, n, bits)] + ([self.zero_points(p, k, n, bits)] if zp else [])
        attrs = dict(K=k, N=n, bits=bits, block_size=BLOCK, accuracy_level=4)
        return self.node("MatMulNBits", inputs, p + "y", **attrs)

    def block_sums(self, x: str, p: str, k: int) -> str:
        shape = self.const(p + "shape", np.array([-1, k // BLOCK, BLOCK], np.int64))
        blocked = self.node("Reshape", [x, shape], p + "blocked")
        axis = self.const(p + "axis", np.array([2], np.int64))
        return self.node("ReduceSum", [blocked, axis], p + "sums", keepdims=0)

    def corrected(self, form: str, x: str, p: str, k: int, n: int) -> str:
        blocks = k // BLOCK
        if form == "4-bit, zero points":
            return self.product(x, p, k, n, zp=True)
        if form == "8-bit, zero points":
            return self.product(x, p, k, n, bits=8, zp=True)
        if form == "no minima":
            return self.product(x, p, k, n)
        if form == "q4_1, sums from the product":
            both = self.product(x, p, k, n + blocks)
            split = self.const(p + "split", np.array([n, blocks], np.int64))
            self.nodes.append(helper.make_node("Split", [both, split], [p + "main", p + "sums"], axis=-1))
            product, sums = p + "main", p + "sums"
        else:
            product, sums = self.product(x, p, k, n), self.block_sums(x, p, k)
        if form == "q4_1, 8-bit minima":
            correction = self.product(sums, p + "m", blocks, n, bits=8)
        else:
            minima = (self.rng.standard_normal((blocks, n)) * 0.01).astype(np.float32)
            correction = self.node("MatMul", [sums, self.const(p + "minima", minima)], p + "correction")
        return self.node("Add", [product, correction], p + "out")

    def model(self, form: str, positions: int) -> bytes:
        x = "x"
        for layer in range(LAYERS):
            for j, (k, n) in enumerate(SHAPES):
                p = f"l{layer}_{j}_"
                y = self.corrected(form, x, p, k, n)
                following = SHAPES[(j + 1) % len(SHAPES)][0]  # the next product's input: this output's first columns
                ends = [self.const(p + v, np.array([e], np.int64)) for v, e in (("from", 0), ("to", following))]
                x = self.node("Slice", [y, *ends, self.const(p + "ax", np.array([1], np.int64))], p + "next")
        self.node("Identity", [x], "y")
        graph = helper.make_graph(
            self.nodes,
            "products",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [positions, SHAPES[0][0]])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
            self.inits,
        )
        opsets = [helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
        model = helper.make_model(graph, opset_imports=opsets)
        model.ir_version = 10
        return model.SerializeToString()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--positions", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.log_severity_level = args.threads, 3
    options.add_session_config_entry("session.intra_op.allow_spinning", "1" if args.threads > 1 else "0")
    sessions = {
        form: ort.InferenceSession(Graph(np.random.default_rng(0)).model(form, args.positions), options)
        for form in FORMS
    }
    x = {"x": np.random.default_rng(1).standard_normal((args.positions, SHAPES[0][0])).astype(np.float32)}
    clock = time.process_time if args.threads == 1 else time.perf_counter
    for session in sessions.values():
        for _ in range(20):
            session.run(None, x)
    times: dict[str, list[float]] = {form: [] for form in FORMS}
    for _ in range(args.rounds):
        for form, session in sessions.items():
            began = clock()
            for _ in range(50):
                session.run(None, x)
            times[form].append((clock() - began) / 50 * 1e3)
    print(f"{args.threads} thread(s), {args.positions} position(s) a call, {args.rounds} rounds alternated")
    print("| form | ms a token | min | max |\n| --- | ---: | ---: | ---: |")
    for form, values in times.items():
        print(f"| {form} | {statistics.median(values):.2f} | {min(values):.2f} | {max(values):.2f} |")


if __name__ == "__main__":
    main()
