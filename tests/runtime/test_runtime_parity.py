"""ParaDecode == ar == Hugging Face greedy, token for token, on every family and on stories260K.

Every combination the runtime offers, one test each: both CPU backends (torch, onnxruntime); overlaps
streams, batched and both; thresholds 0 (every token exits, and untrained heads make nearly every one
roll back: the stress test of pending layers and rollback), 0.5, and never; K = 1 and K = 8
(tests/parity.py: SETTINGS). Each (family, backend) model is loaded once per module (`loaded`), and
each reference (Hugging Face greedy, ar) is decoded once and shared by the settings compared with it.
"""

import pytest
import torch

from paradecode.runtime import NEVER, Tracing, load
from tests.conftest import Cache
from tests.parity import OVERLAPS, SETTINGS, assert_same_tokens, export_scorer, hf_scorer
from tests.tiny_models import HELDOUT_CONFIGS, TINY_CONFIGS, hf_greedy, tiny_model

PROMPTS = {"p5x20": (5, 20), "p11x40": (11, 40)}  # (prompt length, new tokens); the exports hold 64 positions
BACKENDS = ("onnxruntime", "torch")
STORIES_TEXTS = ("Once upon a time, there was a dog", "The little bird", "Tom and Sue went to the park. They")
STORIES_NEW_TOKENS = 48


def prompt_of(length: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def references() -> Cache:
    """(family, prompt name) -> (prompt ids, Hugging Face greedy continuation)."""

    def build(key):
        family, prompt = key
        length, new_tokens = PROMPTS[prompt]
        model = tiny_model(family)
        ids = prompt_of(length, model.config.vocab_size, seed=length)
        return ids, hf_greedy(model, ids, new_tokens)

    return Cache(build)


@pytest.fixture(scope="module")
def ar_outputs(loaded, references) -> Cache:
    """(family, backend, prompt name) -> the export's own ar decoding of that prompt."""

    def build(key):
        family, backend, prompt = key
        ids, _ = references[family, prompt]
        model = loaded[family, backend]
        return model.generate(prompt_ids=ids, max_new_tokens=PROMPTS[prompt][1], mode="ar", ignore_eos=True).token_ids

    return Cache(build)


@pytest.mark.parametrize("prompt", sorted(PROMPTS))
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("family", sorted(TINY_CONFIGS))
def test_ar_equals_transformers(family, backend, prompt, references, ar_outputs):
    ids, expected = references[family, prompt]
    what = f"{family}/{backend} {prompt} ar vs transformers"
    assert_same_tokens(
        ar_outputs[family, backend, prompt], expected, what, prompt=ids, score=hf_scorer(tiny_model(family))
    )


@pytest.mark.parametrize(("threshold", "overlap", "k"), SETTINGS)
@pytest.mark.parametrize("prompt", sorted(PROMPTS))
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("family", sorted(TINY_CONFIGS))
def test_paradecode_equals_ar(family, backend, prompt, threshold, overlap, k, loaded, references, ar_outputs):
    model = loaded[family, backend]
    ids, _ = references[family, prompt]
    new_tokens = PROMPTS[prompt][1]
    result = model.generate(
        prompt_ids=ids,
        max_new_tokens=new_tokens,
        mode="paradecode",
        thresholds=threshold,
        overlap=overlap,
        max_unverified=k,
        lookup_tokens=0,  # exits alone, so the counts below are theirs (tests/runtime/test_lookup.py mixes both)
        ignore_eos=True,
    )
    what = f"{family}/{backend} {prompt} paradecode threshold={threshold} overlap={overlap} K={k} vs ar"
    expected = ar_outputs[family, backend, prompt]
    assert_same_tokens(result.token_ids, expected, what, prompt=ids, score=export_scorer(model))
    stats = result.stats
    if threshold == NEVER:
        assert not stats.exits_per_layer and stats.rollbacks == 0, what
    if threshold == 0.0:
        # with K = 1 every other token can exit: the next must run to the final layer
        assert sum(stats.exits_per_layer.values()) >= (new_tokens - 1) // 2, f"{what}: too few exits {stats}"
        assert stats.rollbacks + sum(stats.accepted_per_layer.values()) > 0, what


def test_rollback_stress_really_rolls_back(loaded):
    """Untrained heads at threshold 0: most early tokens are wrong, so rollbacks must happen (and parity hold)."""
    model = loaded["llama", "onnxruntime"]
    prompt = [3, 1, 4, 1, 5]
    result = model.generate(
        prompt_ids=prompt, max_new_tokens=40, thresholds=0.0, overlap="both", max_unverified=8, ignore_eos=True
    )
    ar = model.generate(prompt_ids=prompt, max_new_tokens=40, mode="ar", ignore_eos=True)
    assert result.token_ids == ar.token_ids
    assert result.stats.rollbacks >= 10, result.stats
    first = result.stats.mismatches[0]
    assert first.early_token != first.final_token and first.final_margin >= 0


# --- stories260K: the real pretrained Llama -----------------------------------------------------------------


@pytest.fixture(scope="module")
def stories_model(stories_export):
    with load(stories_export[0]) as model:
        yield model


@pytest.fixture(scope="module")
def stories_references(stories_dir, stories_model) -> Cache:
    """text -> (prompt ids, Hugging Face greedy continuation, its scorer) for stories260K."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(stories_dir / "hf")).eval()

    def build(text):
        prompt = stories_model.tokenizer.encode(text)
        return prompt, hf_greedy(hf, prompt, STORIES_NEW_TOKENS), hf_scorer(hf)

    return Cache(build)


@pytest.mark.slow
@pytest.mark.parametrize("overlap", OVERLAPS)
def test_stories260k_cli_prints_the_published_greedy_text(overlap, stories_dir, stories_export, capsys):
    """`paradecode-generate EXPORT --prompt-ids 1 --mode paradecode` prints the published greedy text."""
    from paradecode.runtime import cli

    golden = (stories_dir / "golden_greedy_from_bos.txt").read_text().rstrip("\n")  # 565 characters + newline
    assert len(golden) == 565
    argv = [str(stories_export[0]), "--prompt-ids", "1", "--mode", "paradecode", "--overlap", overlap]
    assert cli.main([*argv, "--max-new-tokens", "260"]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith(golden), f"{overlap}: {printed[:120]!r}"


@pytest.mark.slow
@pytest.mark.parametrize("text", STORIES_TEXTS)
def test_stories260k_ar_equals_transformers(text, stories_model, stories_references):
    prompt, expected, score = stories_references[text]
    ar = stories_model.generate(prompt_ids=prompt, max_new_tokens=STORIES_NEW_TOKENS, mode="ar", ignore_eos=True)
    assert_same_tokens(ar.token_ids, expected, f"stories ar {text!r}", prompt=prompt, score=score)


@pytest.mark.slow
@pytest.mark.parametrize(("threshold", "overlap", "k"), SETTINGS)
@pytest.mark.parametrize("text", STORIES_TEXTS)
def test_stories260k_paradecode_equals_transformers(text, threshold, overlap, k, stories_model, stories_references):
    prompt, expected, score = stories_references[text]
    result = stories_model.generate(
        prompt_ids=prompt,
        max_new_tokens=STORIES_NEW_TOKENS,
        thresholds=threshold,
        overlap=overlap,
        max_unverified=k,
        ignore_eos=True,
    )
    what = f"stories paradecode {text!r} {threshold}/{overlap}/K={k}"
    assert_same_tokens(result.token_ids, expected, what, prompt=prompt, score=score)


# --- fused layer+exit graphs ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_fused_exit_layers_are_used_and_optional(model_dirs, exports, tmp_path):
    """With layer_exit_e graphs the frontier's exit check costs no extra call; without them, separate heads run.

    Makes its own export: the same trained heads as `exports["qwen3"]` but without the fused graphs."""
    from paradecode.export.config import ExportConfig
    from paradecode.export.pipeline import export_model

    fused, _ = exports["qwen3"]
    plain = tmp_path / "plain"
    heads = fused.parent / "heads.safetensors"
    export_model(ExportConfig(model=str(model_dirs["qwen3"]), output=plain, heads=heads, max_seq_len=64))
    prompt = [9, 8, 7, 6]
    for label, folder in (("fused", fused), ("plain", plain)):
        with load(folder) as model:
            ar = model.generate(prompt_ids=prompt, max_new_tokens=30, mode="ar", ignore_eos=True)
            for overlap in OVERLAPS:
                result = model.generate(
                    prompt_ids=prompt,
                    max_new_tokens=30,
                    thresholds=0.5,
                    overlap=overlap,
                    ignore_eos=True,
                    tracing=Tracing(spans=True),
                )
                assert result.token_ids == ar.token_ids, (label, overlap)
                names = {s.name for s in result.timeline.spans}
                fused_calls = any(n.startswith("layer_exit_") for n in names)
                head_calls = any(n.startswith("exit_") for n in names)
                assert (fused_calls, head_calls) == ((True, False) if label == "fused" else (False, True)), (
                    f"{label}/{overlap}: subgraphs called {sorted(names)}"
                )


# --- the portable operators (what TensorRT reads, and the eager ops traced) -------------------------------------

PORTABLE = {
    "gemma3": TINY_CONFIGS["gemma3"],
    "phi3": TINY_CONFIGS["phi3"],
    # head_dim 16 and a window of 4: what the fused path would give onnxruntime's kernel, here in portable operators
    "gemma3-head16": {**HELDOUT_CONFIGS["gemma3"], "sliding_window": 4},
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(PORTABLE))
def test_portable_exports_of_the_newer_families_decode_as_transformers(name, tmp_path):
    """`--ops portable`: the partial and per-layer rotary tables, sandwich norms, embedding scale and logit cap traced
    from the eager ops; ar equals transformers' greedy, ParaDecode (every token exiting) equals ar, on both backends."""
    from paradecode.export.config import ExportConfig
    from paradecode.export.pipeline import export_model

    family = name.split("-")[0]
    model = tiny_model(family, seed=2, configs={family: PORTABLE[name]})
    model.save_pretrained(tmp_path / "model")
    result = export_model(
        ExportConfig(model=str(tmp_path / "model"), output=tmp_path / "export", max_seq_len=64, ops="portable")
    )
    assert result.manifest.ops == "portable"
    prompt = prompt_of(9, model.config.vocab_size, seed=9)
    expected = hf_greedy(model, prompt, 30)
    for backend in BACKENDS:
        with load(tmp_path / "export", backend=backend) as loaded:
            ar = loaded.generate(prompt_ids=prompt, max_new_tokens=30, mode="ar", ignore_eos=True)
            assert_same_tokens(ar.token_ids, expected, f"{name}/{backend} ar", prompt=prompt, score=hf_scorer(model))
            result = loaded.generate(prompt_ids=prompt, max_new_tokens=30, thresholds=0.0, ignore_eos=True)
            what = f"{name}/{backend} paradecode"
            assert_same_tokens(result.token_ids, ar.token_ids, what, prompt=prompt, score=export_scorer(loaded))
