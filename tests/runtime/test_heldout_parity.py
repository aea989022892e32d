"""Held-out models of every family (other shapes and options than the development set): exported,
then decoded with ar and ParaDecode in every mode, token for token equal to Hugging Face greedy."""

import itertools

import pytest
import torch

from paradecode.export.config import ExportConfig
from paradecode.export.pipeline import export_model
from paradecode.runtime import NEVER, load
from tests.parity import assert_same_tokens, hf_scorer
from tests.tiny_models import HELDOUT_CONFIGS, TINY_CONFIGS, tiny_model

SETTINGS = list(itertools.product((0.0, 0.5, NEVER), ("streams", "batched", "both"), (1, 8)))


def test_every_family_has_a_heldout_model():
    assert set(HELDOUT_CONFIGS) == set(TINY_CONFIGS)


@pytest.mark.parametrize("family", sorted(HELDOUT_CONFIGS))
def test_heldout_family(family, tmp_path):
    model = tiny_model(family, seed=1, configs=HELDOUT_CONFIGS)
    model.save_pretrained(tmp_path / "model")
    result = export_model(ExportConfig(model=str(tmp_path / "model"), output=tmp_path / "export", max_seq_len=64))
    assert not result.checklist.failed, result.checklist.lines()
    prompt = torch.randint(0, model.config.vocab_size, (7,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.no_grad():
        expected = model.generate(
            torch.tensor([prompt]), max_new_tokens=50, do_sample=False, eos_token_id=None, pad_token_id=0
        )[0, len(prompt) :].tolist()
    for backend in ("onnxruntime", "torch"):
        with load(tmp_path / "export", backend=backend) as runtime:
            ar = runtime.generate(prompt_ids=prompt, max_new_tokens=50, mode="ar", ignore_eos=True)
            score = hf_scorer(model)
            assert_same_tokens(
                ar.token_ids, expected, f"held-out {family}/{backend} ar vs HF", prompt=prompt, score=score
            )
            for threshold, overlap, k in SETTINGS:
                ours = runtime.generate(
                    prompt_ids=prompt,
                    max_new_tokens=50,
                    thresholds=threshold,
                    overlap=overlap,
                    max_unverified=k,
                    ignore_eos=True,
                )
                what = f"held-out {family}/{backend} {threshold}/{overlap}/K={k} vs HF"
                assert_same_tokens(ours.token_ids, expected, what, prompt=prompt, score=score)
