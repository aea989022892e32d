"""Lossless sampling: ar and ParaDecode samples follow exactly the target distribution.

The exact distribution of the first new tokens is enumerated from the export's own final-layer
probabilities (temperature, top-k and top-p applied as runtime/sampling.py does), and samples are
compared with it by a G-test (the log-likelihood ratio test of goodness of fit).
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from paradecode.graphs.errors import UserInputError
from paradecode.runtime import GenerationConfig, load
from paradecode.runtime.sampling import SamplingParams, distribution
from paradecode.tools.parity_report import teacher_forced

pytestmark = pytest.mark.timeout(900)

ALPHA = 0.001  # reject the sampler only when the data are this unlikely under the exact distribution
SAMPLES = 3000
NEW_TOKENS = 3  # the second new token is the first that an exit or a lookup can propose
PARAMS = SamplingParams(temperature=1.0, top_k=5, top_p=0.95)


def final_distributions(model, sequence: list[int], params: SamplingParams) -> torch.Tensor:
    """The target distribution after every position of `sequence`, from the export's own subgraphs."""
    logits = teacher_forced(model, sequence)["logits"][0]
    return torch.stack([distribution(row, params) for row in logits])


def exact_distribution(model, prompt: list[int], params: SamplingParams) -> dict[tuple[int, ...], float]:
    """P(first NEW_TOKENS tokens) by enumeration: P(x1) P(x2 | x1) ..."""
    outcomes = {(): 1.0}
    for _ in range(NEW_TOKENS):
        grown = {}
        for prefix, mass in outcomes.items():
            p = final_distributions(model, prompt + list(prefix), params)[-1]
            for token in torch.nonzero(p).reshape(-1).tolist():
                grown[(*prefix, token)] = mass * float(p[token])
        outcomes = grown
    return outcomes


def g_test(counts: dict[tuple, int], expected: dict[tuple, float]) -> tuple[float, float, int]:
    """G statistic, its p-value (chi-square, df = bins - 1), and the number of bins. Outcomes expected fewer
    than 5 times are pooled into one bin, as the chi-square approximation needs; an observed outcome of
    probability 0 fails outright."""
    total = sum(counts.values())
    impossible = [o for o in counts if expected.get(o, 0.0) == 0.0]
    assert not impossible, f"sampled outcomes of probability 0: {impossible[:5]}"
    bins_observed, bins_expected, pool_observed, pool_expected = [], [], 0, 0.0
    for outcome, probability in expected.items():
        if probability * total >= 5:
            bins_observed.append(counts.get(outcome, 0))
            bins_expected.append(probability * total)
        else:
            pool_observed += counts.get(outcome, 0)
            pool_expected += probability * total
    if pool_expected > 0:
        bins_observed.append(pool_observed)
        bins_expected.append(pool_expected)
    observed = np.array(bins_observed, dtype=np.float64)
    wanted = np.array(bins_expected, dtype=np.float64)
    nonzero = observed > 0
    g = 2.0 * float(np.sum(observed[nonzero] * np.log(observed[nonzero] / wanted[nonzero])))
    df = len(observed) - 1
    p_value = float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64), torch.tensor(g / 2.0)))
    return g, p_value, len(observed)


def power_of_the_test(expected: dict[tuple, float], shift: float, runs: int = 400, seed: int = 0) -> float:
    """How often the G-test rejects samples of a distribution that moves `shift` of the mass from the most to
    the least likely pooled bin (a small, realistic defect), by simulation."""
    rng = np.random.default_rng(seed)
    outcomes = sorted(expected, key=expected.get)
    probabilities = np.array([expected[o] for o in outcomes])
    wrong = probabilities.copy()
    moved = min(shift, wrong[-1])
    wrong[-1] -= moved
    wrong[len(wrong) // 2] += moved
    rejections = 0
    for _ in range(runs):
        draws = rng.multinomial(SAMPLES, wrong)
        counts = {o: int(c) for o, c in zip(outcomes, draws) if c}
        rejections += g_test(counts, expected)[1] < ALPHA
    return rejections / runs


@pytest.fixture(scope="module", params=["float", "int4"], ids=["float-weights", "int4-weights"])
def sampled(model_dirs, tmp_path_factory, request):
    """A tiny llama exported with random trained exit heads over a reduced vocabulary, with float weights or
    int4 ones (the default activations: int8 in the heads), a prompt holding every token of the vocabulary once
    (so prompt lookup finds every new token in it and proposes what followed), and the exact distribution of
    the first NEW_TOKENS new tokens, from that export's own subgraphs.

    Its own export, not `exports["llama"]`: that prompt (99 tokens) needs max_seq_len 128, not 64."""
    from paradecode.export.config import ExportConfig
    from paradecode.export.pipeline import export_model
    from tests.tiny_models import save_random_heads

    folder = tmp_path_factory.mktemp(f"sampling-{request.param}")
    heads = save_random_heads(model_dirs["llama"], folder / "heads.safetensors")
    config = ExportConfig(
        model=str(model_dirs["llama"]), output=folder / "export", heads=heads, max_seq_len=128, weights=request.param
    )
    export_model(config)
    model = load(folder / "export")
    vocab = model.manifest.spec.vocab_size
    prompt = [*torch.randperm(vocab, generator=torch.Generator().manual_seed(0)).tolist(), 3, 14]
    yield model, prompt, exact_distribution(model, prompt, PARAMS)
    model.close()


def sample_counts(model, prompt, **settings) -> dict[tuple[int, ...], int]:
    counts: dict[tuple[int, ...], int] = {}
    for seed in range(SAMPLES):
        result = model.generate(
            prompt_ids=prompt,
            max_new_tokens=NEW_TOKENS,
            temperature=PARAMS.temperature,
            top_k=PARAMS.top_k,
            top_p=PARAMS.top_p,
            seed=seed,
            ignore_eos=True,
            **settings,
        )
        outcome = tuple(result.token_ids)
        counts[outcome] = counts.get(outcome, 0) + 1
    return counts


@pytest.mark.slow
@pytest.mark.parametrize(
    "settings",
    [
        {"mode": "ar"},
        {"thresholds": 0.0, "overlap": "batched"},
        {"thresholds": 0.0, "overlap": "streams"},
        {"thresholds": 0.0, "overlap": "both"},
        {"thresholds": 0.0, "overlap": "batched", "lookup_tokens": 3, "lookup_min_ngram": 1},
    ],
    ids=["ar", "batched", "streams", "both", "exits+lookup"],
)
def test_samples_follow_the_exact_distribution(sampled, settings):
    """G-test of SAMPLES samples of the first NEW_TOKENS tokens against their exact distribution at ALPHA.

    Thresholds 0 make every token the exit heads see exit early (the heads are random: most are rejected
    and resampled), so acceptance, residual resampling and rollback all run many times. The test's power,
    estimated by simulation in `test_the_g_test_has_power` for the same bins and sample size: it rejects a
    sampler that moves 3% of the probability mass between two outcomes in at least 90% of runs.
    """
    model, prompt, expected = sampled
    counts = sample_counts(model, prompt, **settings)
    if "lookup_tokens" in settings:  # every new token occurs in the prompt: lookup proposes at every chance
        probe = model.generate(prompt_ids=prompt, max_new_tokens=NEW_TOKENS, temperature=1.0, seed=0, **settings)
        assert probe.stats.lookup_proposed > 0, probe.stats
    g, p_value, bins = g_test(counts, expected)
    print(f"{settings}: G = {g:.1f} over {bins} bins, p = {p_value:.3g}")
    assert p_value >= ALPHA, (
        f"{settings}: the samples do not follow the exact distribution (G {g:.1f}, p {p_value:.2g})"
    )


@pytest.mark.slow
def test_the_g_test_has_power(sampled):
    _, _, expected = sampled
    power = power_of_the_test(expected, shift=0.03)
    print(f"power against a 3% mass shift: {power:.2f}")
    assert power >= 0.9


def test_a_seed_reproduces_a_run_in_every_mode(sampled):
    model, prompt, _ = sampled
    for settings in ({"mode": "ar"}, {"thresholds": 0.0, "overlap": "both"}, {"thresholds": 0.3, "overlap": "streams"}):
        runs = [
            model.generate(prompt_ids=prompt, max_new_tokens=12, temperature=0.9, seed=7, ignore_eos=True, **settings)
            for _ in range(3)
        ]
        assert runs[0].token_ids == runs[1].token_ids == runs[2].token_ids, settings
        assert runs[0].stats.seed == 7


def test_without_proposals_paradecode_draws_what_ar_draws(sampled):
    model, prompt, _ = sampled
    ar = model.generate(prompt_ids=prompt, max_new_tokens=12, mode="ar", temperature=0.8, seed=3, ignore_eos=True)
    ours = model.generate(
        prompt_ids=prompt, max_new_tokens=12, thresholds=float("inf"), temperature=0.8, seed=3, ignore_eos=True
    )
    assert ours.token_ids == ar.token_ids


def test_an_unseeded_run_records_its_seed(sampled):
    model, prompt, _ = sampled
    first = model.generate(prompt_ids=prompt, max_new_tokens=6, temperature=1.0, ignore_eos=True)
    again = model.generate(prompt_ids=prompt, max_new_tokens=6, temperature=1.0, seed=first.stats.seed, ignore_eos=True)
    assert first.stats.seed is not None and again.token_ids == first.token_ids


@pytest.mark.parametrize("settings", [{"temperature": 0.0}, {"temperature": 0.7, "top_k": 1}])
def test_temperature_zero_and_top_k_one_are_greedy(sampled, settings):
    model, prompt, _ = sampled
    greedy = model.generate(prompt_ids=prompt, max_new_tokens=10, mode="ar", ignore_eos=True)
    for extra in ({"mode": "ar"}, {"thresholds": 0.0, "overlap": "both"}):
        result = model.generate(prompt_ids=prompt, max_new_tokens=10, seed=1, ignore_eos=True, **settings, **extra)
        assert result.token_ids == greedy.token_ids, (settings, extra)


TINY_TEMPERATURES = (1e-320, 1e-308, 1e-300, 1e-30)  # 1e-320 is subnormal; logits over the first two overflow


@pytest.mark.parametrize("temperature", TINY_TEMPERATURES)
def test_a_temperature_too_small_to_divide_by_is_greedy(sampled, temperature):
    """The API accepts any temperature in [0, 2]; one near 0 behaves as its limit, the greedy token, in plain
    decoding and in ParaDecode with exits at every token and lookup proposing at every chance."""
    model, prompt, _ = sampled
    greedy = model.generate(prompt_ids=prompt, max_new_tokens=10, mode="ar", ignore_eos=True)
    for extra in ({"mode": "ar"}, {"thresholds": 0.0, "overlap": "both", "lookup_tokens": 3, "lookup_min_ngram": 1}):
        for seed in (1, 2):
            result = model.generate(
                prompt_ids=prompt, max_new_tokens=10, temperature=temperature, seed=seed, ignore_eos=True, **extra
            )
            assert result.token_ids == greedy.token_ids, (temperature, seed, extra)


def test_distribution_at_a_tiny_temperature_is_one_hot_at_the_argmax():
    logits = torch.tensor([3.0, 19.5, -7.0, 19.25, 0.0])
    for temperature in TINY_TEMPERATURES:
        p = distribution(logits, SamplingParams(temperature=temperature, top_k=3, top_p=0.9))
        assert p.tolist() == [0.0, 1.0, 0.0, 0.0, 0.0], temperature
        p = distribution(logits - 40, SamplingParams(temperature=temperature))  # every score overflows to -inf
        assert p.tolist() == [0.0, 1.0, 0.0, 0.0, 0.0], temperature
    normal = distribution(logits, SamplingParams(temperature=0.5))
    assert torch.equal(normal, torch.softmax(logits.double() / 0.5, 0))  # the usual path is untouched


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"temperature": -0.5}, "temperature must be >= 0"),
        ({"temperature": float("nan")}, "temperature must be a number"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
        ({"top_k": -1}, "top_k must be a non-negative integer"),
        ({"top_k": 2.5}, "top_k must be a non-negative integer"),
        ({"seed": -3}, "seed must be >= 0"),
        ({"seed": "7"}, "seed must be an integer"),
    ],
)
def test_bad_sampling_values(settings, message):
    with pytest.raises(UserInputError, match=message):
        GenerationConfig(**settings)


def test_distribution_applies_temperature_then_top_k_then_top_p():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    p = distribution(logits, SamplingParams(temperature=0.5, top_k=3, top_p=0.9))
    reference = torch.softmax(logits.double() / 0.5, 0)
    reference[3:] = 0  # top-k 3
    reference /= reference.sum()
    ordered = torch.sort(reference, descending=True).values
    keep = int((torch.cumsum(ordered, 0) - ordered < 0.9).sum())
    reference[reference < ordered[keep - 1]] = 0  # the smallest set reaching 0.9
    reference /= reference.sum()
    assert torch.allclose(p, reference)


def test_paradecode_draws_what_ar_draws_whatever_it_proposes(sampled):
    """Verification keeps plain sampling's draw at every position (runtime/verification.py): with exits at every
    token and lookup proposing at every chance, in every overlap, a seed gives ar's tokens."""
    model, prompt, _ = sampled
    settings = dict(prompt_ids=prompt, max_new_tokens=12, temperature=0.8, seed=3, ignore_eos=True)
    ar = model.generate(**settings, mode="ar")
    for overlap in ("batched", "streams", "both"):
        ours = model.generate(**settings, thresholds=0.0, overlap=overlap, lookup_tokens=3, lookup_min_ngram=1)
        assert sum(ours.stats.exits_per_layer.values()) + ours.stats.lookup_proposed > 0, overlap
        assert ours.token_ids == ar.token_ids, overlap


@pytest.mark.slow
def test_a_no_logits_export_refuses_to_sample(model_dirs, tmp_path):
    """Its own export: the shared ones keep the logits (with_logits), this one is made without them."""
    from paradecode.export.config import ExportConfig
    from paradecode.export.pipeline import export_model

    out = tmp_path / "greedy-only"
    export_model(ExportConfig(model=str(model_dirs["qwen3"]), output=out, max_seq_len=32, with_logits=False))
    with load(out) as model, pytest.raises(UserInputError, match="no-logits"):
        model.generate(prompt_ids=[1, 2], max_new_tokens=3, temperature=0.7)


def test_every_outcome_enumerated_sums_to_one(sampled):
    _, _, expected = sampled
    assert math.isclose(sum(expected.values()), 1.0, abs_tol=1e-9)
    assert len(expected) <= PARAMS.top_k**NEW_TOKENS and all(len(o) == NEW_TOKENS for o in expected)
    assert list(itertools.islice(expected, 1))
