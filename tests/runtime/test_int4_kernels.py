"""torch's int4 kernels on an export's 4-bit weights (runtime/backends/int4_kernels.py), on the CPU kernel.

The CUDA kernel is tested in tests/runtime/test_gpu.py."""

import logging

import pytest
import torch

from paradecode.graphs.errors import UserInputError
from paradecode.graphs.quantization_manifest import WeightFormat
from paradecode.graphs.quantized_weights import QuantizedWeight, pack
from paradecode.runtime import load, row_exactness
from paradecode.runtime.backends import int4_kernels
from paradecode.runtime.backends.int4_kernels import Int4Linear, fits
from tests.parity import OVERLAPS, assert_same_tokens, export_scorer

PROMPT = [3, 1, 4, 1, 5]
NEW_TOKENS = 24


def random_weight(n: int, k: int, *, block: int = 32, zero_points: bool = False, mins: bool = True, seed: int = 0):
    """A random 4-bit weight in the stored form: GGUF Q4_1's (scale and min) or the quantizer's (zero points)."""
    generator = torch.Generator().manual_seed(seed)
    blocks = -(-k // block)
    values = torch.randint(0, 16, (n, blocks, block), generator=generator, dtype=torch.uint8)
    fmt = WeightFormat(
        source="int4" if zero_points else "Q4_1",
        bits=4,
        block_size=block,
        shape=(n, k),
        scales="float16",
        zero_points=zero_points,
        mins="float16" if mins else None,
    )
    parts = {
        "qweight": pack(values, 4),
        "scales": (torch.rand(n, blocks, generator=generator) * 0.02).half(),
    }
    if zero_points:
        zeros = torch.randint(0, 16, (n, blocks + blocks % 2), generator=generator, dtype=torch.uint8)
        parts["zero_points"] = pack(zeros, 4)
    if mins:
        parts["mins"] = (torch.randn(n, blocks, generator=generator) * 0.05).half()
    return QuantizedWeight(fmt, **parts)


@pytest.mark.parametrize("form", ["Q4_1", "zero points", "Q4_0"])
def test_an_int4_product_is_the_dequantized_product_and_rows_do_not_mix(form):
    """The 4-bit product equals the dequantized weight's product to float32 rounding, and a row's bits are the
    same alone, among 3 and among 8 (what ParaDecode's verification needs)."""
    weight = random_weight(64, 96, zero_points=form == "zero points", mins=form == "Q4_1")
    bias = torch.randn(64)
    linear = Int4Linear(weight, bias, torch.float32, torch.device("cpu"))
    rows = torch.randn(8, 96)
    want = torch.nn.functional.linear(rows, weight.dequantize(), bias)
    got = linear(rows)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    alone = torch.cat([linear(rows[i : i + 1]) for i in range(8)])
    print(f"{form}: largest difference from the dequantized product {(got - want).abs().max().item():.2e}")
    assert torch.equal(got, alone)
    assert torch.equal(linear(rows[:3]), got[:3])
    assert linear(rows.reshape(2, 4, 96)).shape == (2, 4, 64)


def test_only_weights_the_kernels_take_fit():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert fits(random_weight(64, 96), cpu) and fits(random_weight(64, 96), cuda)
    assert fits(random_weight(24, 96), cuda) and not fits(random_weight(24, 96), cpu)  # the CPU packer: N % 16
    assert not fits(random_weight(60, 96), cuda)  # N not a multiple of 8
    assert not fits(random_weight(64, 80, block=16), cpu)  # blocks of 16
    assert not fits(random_weight(64, 100), cpu)  # K not whole blocks
    eight = random_weight(64, 96)
    eight_bit = WeightFormat(**{**eight.format.__dict__, "bits": 8, "source": "Q8_0"})
    blocks = torch.zeros(64, 3, 32, dtype=torch.uint8)
    assert not fits(QuantizedWeight(eight_bit, blocks, eight.scales, None, eight.mins), cpu)
    with pytest.raises(ValueError, match="do not take a weight"):
        Int4Linear(random_weight(24, 96), None, torch.float32, cpu)


def test_int4_kernels_decode_a_gguf_export_and_paradecode_keeps_their_output(quantized_exports, monkeypatch):
    """A tiny GGUF export's 4-bit layers read by the CPU int4 kernel: its other weights stay dequantized, plain
    decoding gives the dequantized reference's tokens (the tiny model's margins are wide), the backend's row form
    is probed on this machine, and ParaDecode (every token exiting, every overlap) gives exactly plain decoding's
    tokens."""
    folder, _, _ = quantized_exports["llama", "gguf"]
    probed = []
    probe = row_exactness.probe
    monkeypatch.setattr(row_exactness, "probe", lambda backend: probed.append(backend.name) or probe(backend))
    with load(folder, backend="torch", int4_kernels=True) as model, load(folder, backend="torch") as reference:
        replaced = model.backend.int4.replaced
        formats = model.backend.manifest.quantization.weights
        four_bit = {name for name, fmt in formats.items() if fmt.bits == 4 and fmt.block_size == 32}
        assert replaced == {name for name in four_bit if name.startswith("layers.")}
        assert replaced and reference.backend.int4 is None  # off by default
        assert model.backend.probes_rows and not reference.backend.probes_rows
        assert model.backend.row_form is not None, "no row form keeps a position's bits with int4 kernels here"
        assert probed == ["torch"]  # the int4 model's form was probed, the dequantized reference's not
        ar = model.generate(prompt_ids=PROMPT, max_new_tokens=NEW_TOKENS, mode="ar", ignore_eos=True).token_ids
        expected = reference.generate(prompt_ids=PROMPT, max_new_tokens=NEW_TOKENS, mode="ar", ignore_eos=True)
        score = export_scorer(reference)
        assert_same_tokens(ar, expected.token_ids, "int4 kernels vs dequantized", prompt=PROMPT, score=score)
        for overlap in OVERLAPS:
            ours = model.generate(
                prompt_ids=PROMPT, max_new_tokens=NEW_TOKENS, thresholds=0.0, overlap=overlap, ignore_eos=True
            )
            assert ours.token_ids == ar, f"int4 kernels {overlap}: {ours.token_ids} against ar's {ar}"


def test_a_shape_whose_product_disagrees_stays_dequantized(quantized_exports, monkeypatch, caplog):
    folder, _, _ = quantized_exports["llama", "gguf"]
    monkeypatch.setattr(int4_kernels, "_agrees", lambda *args: False)
    with caplog.at_level(logging.WARNING), load(folder, backend="torch", int4_kernels=True) as model:
        assert model.backend.int4.replaced == set() and not model.backend.probes_rows
        assert not any(isinstance(m, Int4Linear) for module in model.backend.modules.values() for m in module.modules())
    assert "disagrees with the dequantized weights" in caplog.text
    assert "no weight of this export is read by them" in caplog.text


def test_int4_kernels_are_refused_where_they_cannot_run(quantized_exports):
    folder, _, _ = quantized_exports["llama", "gguf"]
    with pytest.raises(UserInputError, match="int4_kernels reads 4-bit weights with torch's int4 kernels"):
        load(folder, backend="onnxruntime", int4_kernels=True)
    with pytest.raises(UserInputError, match="int4_kernels must be True or False, got 'yes'"):
        load(folder, backend="torch", int4_kernels="yes")
    assert "takes float32, bfloat16 or float16" in int4_kernels.unavailable(torch.device("cpu"), torch.int8)
