"""Held-out models of every family (other shapes and options than the development set): exported,
then decoded with ar and ParaDecode in every mode, token for token equal to Hugging Face greedy.

Each held-out model is built and exported once per module and loaded once per (family, backend);
every setting (tests/parity.py: SETTINGS) is a test of its own.
"""

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from paradecode.export.config import ExportConfig
from paradecode.export.pipeline import export_model
from paradecode.runtime import load
from tests.conftest import Cache
from tests.parity import SETTINGS, assert_same_tokens, hf_scorer
from tests.tiny_models import HELDOUT_CONFIGS, TINY_CONFIGS, hf_greedy, tiny_model

BACKENDS = ("onnxruntime", "torch")
NEW_TOKENS = 50


@dataclass
class Heldout:
    model: torch.nn.Module  # the Hugging Face model: the reference
    folder: Path  # its export
    result: object  # the ExportResult
    prompt: list[int]
    expected: list[int]  # Hugging Face greedy continuation of `prompt`


@pytest.fixture(scope="module")
def heldout(tmp_path_factory) -> Cache:
    """family -> its held-out model, exported (max_seq_len 64, no trained heads), with its HF reference."""

    def build(family: str) -> Heldout:
        folder = tmp_path_factory.mktemp(f"heldout-{family}")
        model = tiny_model(family, seed=1, configs=HELDOUT_CONFIGS)
        model.save_pretrained(folder / "model")
        result = export_model(ExportConfig(model=str(folder / "model"), output=folder / "export", max_seq_len=64))
        generator = torch.Generator().manual_seed(3)
        prompt = torch.randint(0, model.config.vocab_size, (7,), generator=generator).tolist()
        return Heldout(model, folder / "export", result, prompt, hf_greedy(model, prompt, NEW_TOKENS))

    return Cache(build)


@pytest.fixture(scope="module")
def heldout_loaded(heldout):
    """(family, backend) -> the held-out export loaded on that backend, closed when the module ends."""
    models = Cache(lambda key: load(heldout[key[0]].folder, backend=key[1]))
    yield models
    for model in models.values():
        model.close()


def test_every_family_has_a_heldout_model():
    assert set(HELDOUT_CONFIGS) == set(TINY_CONFIGS)


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(HELDOUT_CONFIGS))
def test_heldout_export_passes_validation(family, heldout):
    checklist = heldout[family].result.checklist
    assert not checklist.failed, checklist.lines()


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("family", sorted(HELDOUT_CONFIGS))
def test_heldout_ar_equals_transformers(family, backend, heldout, heldout_loaded):
    case = heldout[family]
    ar = heldout_loaded[family, backend].generate(
        prompt_ids=case.prompt, max_new_tokens=NEW_TOKENS, mode="ar", ignore_eos=True
    )
    what = f"held-out {family}/{backend} ar vs HF"
    assert_same_tokens(ar.token_ids, case.expected, what, prompt=case.prompt, score=hf_scorer(case.model))


@pytest.mark.slow
@pytest.mark.parametrize(("threshold", "overlap", "k"), SETTINGS)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("family", sorted(HELDOUT_CONFIGS))
def test_heldout_paradecode_equals_transformers(family, backend, threshold, overlap, k, heldout, heldout_loaded):
    case = heldout[family]
    ours = heldout_loaded[family, backend].generate(
        prompt_ids=case.prompt,
        max_new_tokens=NEW_TOKENS,
        thresholds=threshold,
        overlap=overlap,
        max_unverified=k,
        ignore_eos=True,
    )
    what = f"held-out {family}/{backend} {threshold}/{overlap}/K={k} vs HF"
    assert_same_tokens(ours.token_ids, case.expected, what, prompt=case.prompt, score=hf_scorer(case.model))
