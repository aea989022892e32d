"""onnxruntime values sharing a CPU tensor's memory: one helper for the exporter's validation and
the runtime's onnxruntime backend. onnxruntime and onnx are imported when it is first called, so
importing this module needs torch only.
"""

from __future__ import annotations

import torch


def ort_value(tensor: torch.Tensor):
    """An `onnxruntime.OrtValue` over the memory of a contiguous CPU tensor (bfloat16 included: numpy
    has no bfloat16, so its bits travel as int16 with the ONNX element type set explicitly)."""
    import onnxruntime as ort

    if tensor.dtype == torch.bfloat16:
        from onnx import TensorProto

        return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(tensor.view(torch.int16).numpy(), TensorProto.BFLOAT16)
    return ort.OrtValue.ortvalue_from_numpy(tensor.numpy())
