import numpy as np, onnxruntime as ort, time, sys
from onnx import helper, TensorProto, numpy_helper
K, N, bs = 576, 3072, 32
rng = np.random.default_rng(0)
def model(zp, acc, M):
    nb = K // bs
    w = rng.integers(0, 255, size=(N, nb, bs // 2), dtype=np.uint8)
    sc = rng.random((N * nb,), dtype=np.float32) * 0.01
    inits = [numpy_helper.from_array(w, "w"), numpy_helper.from_array(sc, "s")]
    ins = ["x", "w", "s"]
    if zp:
        z = np.full((N * ((nb + 1) // 2),), 0x88, np.uint8); inits.append(numpy_helper.from_array(z, "z")); ins.append("z")
    node = helper.make_node("MatMulNBits", ins, ["y"], domain="com.microsoft", K=K, N=N, bits=4, block_size=bs, accuracy_level=acc)
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, M, K])], [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, M, N])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]).SerializeToString()
for zp in (False, True):
  for acc in (4,):
    for threads in (1, 2):
        o = ort.SessionOptions(); o.intra_op_num_threads = threads
        o.add_session_config_entry("session.intra_op.allow_spinning", "1")
        s = ort.InferenceSession(model(zp, acc, 1), o)
        x = rng.random((1, 1, K), dtype=np.float32)
        for _ in range(200): s.run(None, {"x": x})
        t = time.perf_counter(); n = 2000
        for _ in range(n): s.run(None, {"x": x})
        print(f"zp={zp} acc={acc} threads={threads}: {(time.perf_counter()-t)/n*1e6:.1f} us/call")
