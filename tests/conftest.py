"""Shared fixtures: tiny random models of every family, their exports, and the real stories260K.

Tiny models are built in-process from configs (tests/tiny_models.py) once per session, and so are the
exports the tests share: `exports` and `identity_exports` (per family) and `stories_export`. A test
that needs an export configured otherwise makes its own and says why in its docstring. `loaded` holds
the tiny exports loaded once per (family, backend) for a module's tests that only decode with them.
Tests that need TensorRT or a GPU carry the `tensorrt` / `gpu` markers and skip here with the reason.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from tests.tiny_models import TINY_CONFIGS, save_random_heads, save_tiny_model, save_untrained_draft_head

REPO = Path(__file__).resolve().parents[1]
STORIES = Path(os.environ.get("PARADECODE_STORIES260K", REPO.parent / "shared" / "models" / "stories260K"))
EXPORT_SEQ_LEN = 64


def tensorrt_missing() -> str | None:
    try:
        import tensorrt  # noqa: F401
    except ImportError as err:
        return f"TensorRT is not installed ({err})"
    if not torch.cuda.is_available():
        return "no CUDA GPU is visible to torch"
    return None


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--order",
        default="default",
        metavar="default|reverse|shuffle:SEED",
        help="run the tests in collection order (default, what CI runs), reversed, or shuffled by SEED (the modules, "
        "and the tests within each module): a check that no test depends on what ran before it",
    )


def order_option(config: pytest.Config) -> tuple[str, int | None]:
    """(kind, seed) of --order; a bad value is a usage error."""
    value = config.getoption("--order")
    kind, _, seed = value.partition(":")
    if kind in ("default", "reverse") and not seed:
        return kind, None
    if kind == "shuffle" and seed.isdigit():
        return kind, int(seed)
    raise pytest.UsageError(f"--order {value!r}: expected default, reverse or shuffle:SEED (SEED an integer)")


def pytest_report_header(config: pytest.Config) -> str:
    kind, seed = order_option(config)
    again = f" (seed {seed}: --order shuffle:{seed} runs it again)" if seed is not None else ""
    return f"paradecode test order: {kind}{again}"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """--order: the modules reversed or shuffled, and the tests within each module alike, each module's tests kept
    together (its module-scoped fixtures are made once, as in the default order)."""
    import random

    kind, seed = order_option(config)
    if kind == "default":
        return
    modules: dict[str, list[pytest.Item]] = {}
    for item in items:
        modules.setdefault(item.nodeid.split("::")[0], []).append(item)
    groups = list(modules.values())
    if kind == "reverse":
        order = [list(reversed(group)) for group in reversed(groups)]
    else:
        shuffle = random.Random(seed).shuffle
        shuffle(groups)
        order = []
        for group in groups:
            shuffle(group)
            order.append(group)
    items[:] = [item for group in order for item in group]


def pytest_configure(config: pytest.Config) -> None:
    """The tests keep what the runtime caches per user (runtime/row_exactness.py's verdicts, Inductor's compiled
    graphs) in a folder of their own, removed at the end, so they neither read a user's caches nor add to them."""
    import tempfile

    folder = tempfile.mkdtemp(prefix="paradecode-tests-cache-")
    config.add_cleanup(lambda: shutil.rmtree(folder, ignore_errors=True))
    os.environ["XDG_CACHE_HOME"] = folder
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(folder, "inductor")  # compiled graphs too


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("tensorrt") and (reason := tensorrt_missing()):
        pytest.skip(f"needs TensorRT and a GPU: {reason}")
    if item.get_closest_marker("gpu") and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU: torch.cuda.is_available() is False")


@pytest.fixture(scope="session")
def stories_dir() -> Path:
    if not (STORIES / "hf" / "config.json").is_file():
        pytest.skip(f"stories260K not found at {STORIES} (set PARADECODE_STORIES260K to its folder)")
    return STORIES


class Cache(dict):
    """A session-wide cache whose values are built on first use."""

    def __init__(self, build):
        super().__init__()
        self.build = build

    def __missing__(self, key):
        self[key] = value = self.build(key)
        return value


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory) -> Cache:
    """family -> a folder holding that family's tiny random model (save_pretrained)."""

    def build(family: str) -> Path:
        folder = tmp_path_factory.mktemp(f"model-{family}")
        save_tiny_model(family, folder)
        return folder

    return Cache(build)


# the families whose `exports` draft head reads three layers' outputs (EAGLE-3's fusion): Gemma 3's sandwich norms,
# Mistral's sliding window (with the side lanes' tests), GPT-2's learned positions
DRAFT_FEATURE_FAMILIES = ("gemma3", "mistral", "gpt2")


@pytest.fixture(scope="session")
def exports(tmp_path_factory, model_dirs) -> Cache:
    """family -> (export folder, ExportResult) of that family's tiny model with every kind of graph: random
    trained exit heads over a reduced vocabulary at every intermediate layer, fused layer+exit graphs, logits, an
    untrained draft head over a reduced vocabulary (reading three layers' outputs in DRAFT_FEATURE_FAMILIES, the last
    layer's alone in the others)."""
    from paradecode.export.config import ExportConfig
    from paradecode.export.pipeline import export_model

    def build(family: str):
        folder = tmp_path_factory.mktemp(f"export-{family}")
        heads = save_random_heads(model_dirs[family], folder / "heads.safetensors")
        features = family in DRAFT_FEATURE_FAMILIES
        draft = save_untrained_draft_head(model_dirs[family], folder / "draft.safetensors", features=features)
        result = export_model(
            ExportConfig(
                model=str(model_dirs[family]),
                output=folder / "export",
                heads=heads,
                draft_head=draft,
                max_seq_len=EXPORT_SEQ_LEN,
                with_logits=True,
                fused_exits=True,
            )
        )
        return folder / "export", result

    return Cache(build)


@pytest.fixture(scope="session")
def identity_exports(tmp_path_factory, model_dirs) -> Cache:
    """family -> (export folder, ExportResult) without trained heads: exit layers use the final head."""
    from paradecode.export.config import ExportConfig
    from paradecode.export.pipeline import export_model

    def build(family: str):
        out = tmp_path_factory.mktemp(f"identity-{family}") / "export"
        return out, export_model(ExportConfig(model=str(model_dirs[family]), output=out, max_seq_len=EXPORT_SEQ_LEN))

    return Cache(build)


# A tiny GGUF of each family with every kept block type at once, one per matrix kind (GPT-2 has fused QKV and
# no gate: it holds five of them), the unembedding untied and Q6_K where the family's file has one.
MIXED_BLOCKS = {
    "token_embd": "Q8_0",
    "attn_q": "Q4_0",
    "attn_k": "Q4_1",
    "attn_v": "Q5_0",
    "attn_qkv": "Q4_1",
    "attn_output": "Q5_1",
    "ffn_gate": "Q4_K",
    "ffn_up": "Q5_K",
    "ffn_down": "Q6_K",
    "output": "Q6_K",
}
QUANTIZED_SOURCES = ("gguf", "gguf-int8-heads", "gguf-int8", "int4", "int8")


@pytest.fixture(scope="session")
def quantized_exports(tmp_path_factory) -> Cache:
    """(family, source) -> (export folder, ExportResult, GGUF file) of a tiny GGUF of `family` in MIXED_BLOCKS,
    exported with its blocks kept (`gguf`: --weights auto; `gguf-int8-heads` / `gguf-int8`: the same with int8
    activations in the heads / everywhere) or its
    dequantized weights quantized again by onnxruntime's quantizer (`int4` / `int8`). The GGUF fixtures, not the
    tiny float models: their greedy output varies (several of the tiny float models repeat one token whatever
    the prompt). Like `exports`: random trained heads over a reduced vocabulary, fused layer+exit graphs,
    logits, an untrained draft head; float activations (not the default) but for the `gguf-int8*` sources."""
    from paradecode.export.config import ExportConfig
    from paradecode.export.pipeline import export_model
    from tests.tiny_gguf import write_tiny_gguf

    def build(key):
        family, source = key
        folder = tmp_path_factory.mktemp(f"quantized-{family}-{source}")
        model = folder / f"tiny-{family}.gguf"
        write_tiny_gguf(model, family=family, block_types=MIXED_BLOCKS, tied=False)
        heads = save_random_heads(model, folder / "heads.safetensors")
        config = ExportConfig(
            model=str(model),
            output=folder / "export",
            heads=heads,
            draft_head=save_untrained_draft_head(model, folder / "draft.safetensors"),
            max_seq_len=EXPORT_SEQ_LEN,
            with_logits=True,
            fused_exits=True,
            weights="auto" if source.startswith("gguf") else source,
            activations={"gguf-int8-heads": "int8-heads", "gguf-int8": "int8"}.get(source, "float"),
        )
        return folder / "export", export_model(config), model

    return Cache(build)


@pytest.fixture(scope="session")
def stories_export(stories_dir, tmp_path_factory):
    """(export folder, ExportResult) of stories260K with the default settings (max_seq_len 512, logits, no
    trained heads: exit layers use the final head). Shared by every test that decodes stories260K; tests
    only read it."""
    from paradecode.export.config import ExportConfig
    from paradecode.export.pipeline import export_model

    out = tmp_path_factory.mktemp("stories") / "export"
    return out, export_model(ExportConfig(model=str(stories_dir / "hf"), output=out))


@pytest.fixture(scope="module")
def loaded(exports):
    """(family, backend) -> the `exports` model of `family` loaded on the CPU `backend`, once per test module;
    closed when the module ends. Only for tests that decode with it: one that changes the model (closes it,
    patches its backend) loads its own."""
    from paradecode.runtime import load

    models = Cache(lambda key: load(exports[key[0]][0], backend=key[1]))
    yield models
    for model in models.values():
        model.close()


@pytest.fixture(params=sorted(TINY_CONFIGS))
def family(request) -> str:
    return request.param
