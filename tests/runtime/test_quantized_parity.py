"""ParaDecode == ar, token for token, on quantized exports of every family: a tiny GGUF's own blocks (every kept
block type at once) and onnxruntime's int4/int8 blocks of its weights, every overlap, threshold and unverified
window (tests/parity.py: SETTINGS), with float activations, int8 ones in the heads only (`gguf-int8-heads`) and
everywhere (`gguf-int8`, the default: tests/runtime/test_exact_calls.py asserts ParaDecode's tokens equal ar's there
with no near-tie allowance; where the row form could not make calls alike, a near tie may differ: these tiny models
have none, and any would be reported with its margin).

Greedy here; sampling on a quantized export is in tests/runtime/test_sampling.py (its `int4-weights` cases), and
float activations against transformers on the dequantized model in tests/export/test_quantized.py.
"""

import pytest

from paradecode.runtime import NEVER, load
from tests.conftest import Cache
from tests.parity import SETTINGS, assert_same_tokens, export_scorer
from tests.tiny_models import TINY_CONFIGS

pytestmark = pytest.mark.slow
SOURCES = ("gguf", "gguf-int8-heads", "gguf-int8", "int4", "int8")
PROMPT = [5, 17, 42, 9, 3, 61, 8]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def models(quantized_exports):
    """(family, source) -> the quantized export loaded with onnxruntime, once per module."""
    loaded = Cache(lambda key: load(quantized_exports[key][0]))
    yield loaded
    for model in loaded.values():
        model.close()


@pytest.fixture(scope="module")
def ar_outputs(models) -> Cache:
    return Cache(
        lambda key: models[key].generate(prompt_ids=PROMPT, max_new_tokens=NEW_TOKENS, mode="ar", ignore_eos=True)
    )


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("family", sorted(TINY_CONFIGS))
def test_quantized_ar_is_not_degenerate(family, source, ar_outputs):
    """The comparisons below mean something only if the model's greedy output varies."""
    tokens = ar_outputs[family, source].token_ids
    assert len(tokens) == NEW_TOKENS and len(set(tokens)) > 3, tokens


@pytest.mark.parametrize(("threshold", "overlap", "k"), SETTINGS)
@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("family", sorted(TINY_CONFIGS))
def test_paradecode_equals_ar_on_quantized_exports(family, source, threshold, overlap, k, models, ar_outputs):
    model = models[family, source]
    result = model.generate(
        prompt_ids=PROMPT,
        max_new_tokens=NEW_TOKENS,
        thresholds=threshold,
        overlap=overlap,
        max_unverified=k,
        ignore_eos=True,
    )
    what = f"{family}/{source} paradecode threshold={threshold} overlap={overlap} K={k} vs ar"
    expected = ar_outputs[family, source].token_ids
    assert_same_tokens(result.token_ids, expected, what, prompt=PROMPT, score=export_scorer(model))
    if threshold == NEVER:  # prompt lookup (on by default) still proposes, and may roll back
        assert not result.stats.exits_per_layer, what
    if threshold == 0.0:
        assert sum(result.stats.exits_per_layer.values()) > 0, f"{what}: no exits {result.stats}"
