"""`paradecode-export`: slice a Hugging Face decoder-only LM into per-layer and exit-head ONNX graphs.

The heavy dependencies (transformers, onnx, onnxruntime, TensorRT) are imported where they are
used, so importing this package stays cheap.
"""
