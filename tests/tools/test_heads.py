"""Exit heads (paradecode.tools.heads): distillation on tiny models, the heads file through export and the
runtime, threshold calibration, the exit-layer search against an exhaustive one, and the cost model."""

import itertools
import json
import time

import pytest
import torch

from paradecode.export.families import family_for
from paradecode.export.heads import check_heads, load_heads
from paradecode.graphs.errors import UserInputError
from paradecode.runtime import load
from paradecode.tools import train_heads
from paradecode.tools.heads.calibration import calibrate
from paradecode.tools.heads.cost import CostModel
from paradecode.tools.heads.data import collect, greedy_sequences, split_held_out
from paradecode.tools.heads.training import Unembedding
from paradecode.tools.heads.training import train_heads as train
from tests.tiny_models import tiny_model


@pytest.fixture(scope="module")
def trained(model_dirs, tmp_path_factory):
    """Heads for the tiny llama (4 layers) after layers 1 and 2, trained on its own greedy text."""
    out = tmp_path_factory.mktemp("heads") / "heads.safetensors"
    assert (
        train_heads.main(
            [
                str(model_dirs["llama"]),
                "--exit-layers",
                "1,2",
                "-o",
                str(out),
                "--steps",
                "150",
                "--new-tokens",
                "48",
                "--use-all-exits",
                "--target-agreement",
                "0.8",
            ]
        )
        == 0
    )
    transforms, metadata, _ = load_heads(out)
    return out, transforms, metadata


def test_training_raises_agreement_at_every_exit_layer(trained):
    _, transforms, metadata = trained
    assert sorted(transforms) == [1, 2] and transforms[1].shape == (48, 48)
    for layer, row in metadata["agreement"].items():
        print(f"layer {layer}: untrained {row['untrained']:.3f} -> trained {row['trained']:.3f}")
        assert row["trained"] > row["untrained"] + 0.1, (layer, row)
    assert not torch.allclose(transforms[1], torch.eye(48))


def test_training_reports_decreasing_loss_and_leaves_the_model_unchanged():
    model = tiny_model("qwen3")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    prompts = [[i, i + 1, i + 2] for i in range(0, 40, 4)]
    features = collect(model, greedy_sequences(model, prompts, 24), (1, 2))
    held_out = split_held_out(features, 0.2, seed=0)
    unembedding = Unembedding.of(model, family_for("qwen3"))
    _, history = train(unembedding, features, held_out, steps=100, lr=1e-2, batch=256, log_every=25)
    losses = [h["loss"] for h in history if "loss" in h]
    print(f"loss {losses}, agreement at layer 2 {[h['agreement_2'] for h in history]}")
    assert losses[-1] < 0.7 * losses[0], losses
    assert history[-1]["agreement_2"] > history[0]["agreement_2"], history
    changed = [k for k, v in model.state_dict().items() if not torch.equal(v, before[k])]
    assert not changed, f"training heads changed the model's own weights: {changed}"


def test_heads_file_round_trips_through_export_and_runtime(trained, model_dirs, tmp_path):
    from paradecode.export.config import ExportConfig
    from paradecode.export.pipeline import export_model
    from paradecode.graphs.manifest import read_manifest

    heads, _, metadata = trained
    out = tmp_path / "export"
    result = export_model(ExportConfig(model=str(model_dirs["llama"]), output=out, heads=heads, max_seq_len=64))
    assert not result.checklist.failed, result.checklist.lines()
    manifest = read_manifest(out)
    assert manifest.head_kind == "trained" and manifest.exit_layers == (1, 2)
    for layer in (1, 2):
        calibrated = metadata["calibration"]["thresholds"][str(layer)]
        assert manifest.thresholds[layer] == (calibrated if calibrated is not None else float("inf"))
    assert manifest.calibration["agreement"] == metadata["agreement"]
    import onnx

    graph = onnx.load(str(out / "onnx" / "exit_1.onnx"))
    assert sum(n.op_type == "MatMul" for n in graph.graph.node) == 2, "the exit head applies its transform"
    with load(out) as model:
        ar = model.generate(prompt_ids=[5, 6, 7], max_new_tokens=30, mode="ar", ignore_eos=True)
        for overlap in ("batched", "both"):
            ours = model.generate(prompt_ids=[5, 6, 7], max_new_tokens=30, overlap=overlap, ignore_eos=True)
            assert ours.token_ids == ar.token_ids
            forced = model.generate(
                prompt_ids=[5, 6, 7], max_new_tokens=30, overlap=overlap, thresholds=0.0, ignore_eos=True
            )
            assert forced.token_ids == ar.token_ids


def test_heads_of_another_model_or_shape_are_refused(trained, model_dirs):
    from paradecode.export.source import resolve_model

    path, transforms, metadata = trained
    llama = tiny_model("llama")
    spec = family_for("llama").spec(llama.config, llama)
    other = resolve_model(str(model_dirs["qwen2"])).identity()
    with pytest.raises(UserInputError, match="trained for another model"):
        check_heads(path, transforms, metadata, spec=spec, model=other, exit_layers=None)
    own = resolve_model(str(model_dirs["llama"])).identity()
    assert check_heads(path, transforms, metadata, spec=spec, model=own, exit_layers=None) == (1, 2)
    with pytest.raises(UserInputError, match=r"layers \[3\].*heads for layers \[1, 2\]"):
        check_heads(path, transforms, metadata, spec=spec, model=own, exit_layers=(1, 3))
    with pytest.raises(UserInputError, match=r"shape \(32, 32\), expected \(48, 48\)"):
        check_heads(path, {1: torch.eye(32)}, metadata, spec=spec, model=own, exit_layers=None)


def test_heads_cli_errors(model_dirs, tmp_path, capsys):
    out = tmp_path / "heads.safetensors"
    assert train_heads.main([str(model_dirs["llama"]), "--exit-layers", "4", "-o", str(out)]) == 2
    assert "1..3" in capsys.readouterr().err
    out.write_text("keep")
    assert train_heads.main([str(model_dirs["llama"]), "-o", str(out)]) == 2
    assert "--force" in capsys.readouterr().err and out.read_text() == "keep"
    assert train_heads.main([str(model_dirs["llama"]), "-o", str(tmp_path / "h"), "--prompts", "missing.txt"]) == 2
    assert "no tokenizer" in capsys.readouterr().err  # the tiny model has no tokenizer to read prompts with
    assert train_heads.main([str(model_dirs["llama"]), "-o", str(tmp_path / "h"), "--head-cost", "-1"]) == 2
    assert "head must be a finite number of layer-times >= 0, got -1.0 (--head-cost)" in capsys.readouterr().err
    assert not (tmp_path / "h").exists()


def synthetic(n=2000, seed=0):
    """Layer 2: confident and right above 0.8, unreliable below; layer 3: always right above 0.3."""
    g = torch.Generator().manual_seed(seed)
    conf2 = torch.rand(n, generator=g)
    agree2 = torch.where(conf2 >= 0.8, torch.rand(n, generator=g) < 0.98, torch.rand(n, generator=g) < 0.4)
    conf3 = torch.rand(n, generator=g)
    agree3 = torch.where(conf3 >= 0.3, torch.ones(n, dtype=torch.bool), torch.rand(n, generator=g) < 0.5)
    return {2: conf2, 3: conf3}, {2: agree2, 3: agree3}


def test_calibration_finds_the_lowest_threshold_meeting_the_target():
    confidence, agree = synthetic()
    result = calibrate(confidence, agree, target=0.95)
    t2, t3 = result["thresholds"]["2"], result["thresholds"]["3"]
    assert 0.7 <= t2 <= 0.82 and 0.2 <= t3 <= 0.32, result["thresholds"]
    for layer in ("2", "3"):
        row = result["layers"][layer]
        assert row["precision"] >= 0.95
        kept = confidence[int(layer)] >= row["threshold"]
        assert float(agree[int(layer)][kept].float().mean()) >= 0.95
    never = calibrate({1: torch.rand(500)}, {1: torch.zeros(500, dtype=torch.bool)}, target=0.95)
    assert never["thresholds"] == {"1": None} and never["layers"]["1"]["exit_rate"] == 0.0


def test_cost_model_selects_the_subset_expected_to_be_fastest():
    confidence, agree = synthetic()
    cheap = calibrate(confidence, agree, 0.95, CostModel(num_layers=8, head=0.1))
    assert cheap["expected_speedup"] > 1 and cheap["subsets"][0]["layers"] == cheap["selected_layers"]
    speedups = [s["speedup"] for s in cheap["subsets"]]
    assert speedups == sorted(speedups, reverse=True)
    unused = [layer for layer in ("2", "3") if int(layer) not in cheap["selected_layers"]]
    assert all(cheap["thresholds"][layer] is None for layer in unused)
    hopeless = calibrate(confidence, agree, 0.95, CostModel(num_layers=4, head=5.0))
    assert hopeless["selected_layers"] == [] and all(v is None for v in hopeless["thresholds"].values())
    json.dumps(cheap)  # stored in the heads file's metadata


def test_heads_saved_beside_the_model_do_not_change_its_identity(trained, model_dirs, tmp_path):
    """A heads file written into the model's own folder is not one of the model's weight files."""
    import shutil

    from paradecode.export.source import resolve_model

    folder = tmp_path / "model"
    shutil.copytree(model_dirs["llama"], folder)
    before = resolve_model(str(folder)).identity()["weights_sha256"]
    shutil.copy(trained[0], folder / "heads.safetensors")
    assert resolve_model(str(folder)).identity()["weights_sha256"] == before == trained[2]["base_weights_sha256"]


def cascade_data(exit_layers, num_layers, positions, seed):
    """Heads whose confidence grows with depth and falls with a per-position difficulty shared by all
    layers (an easy token is easy everywhere), and whose agreement grows with confidence."""
    g = torch.Generator().manual_seed(seed)
    difficulty = torch.rand(positions, generator=g)
    confidence, agree = {}, {}
    for e in exit_layers:
        confidence[e] = torch.sigmoid(8 * (e / num_layers - difficulty) + torch.randn(positions, generator=g))
        agree[e] = torch.rand(positions, generator=g) < confidence[e] ** 0.3
    return confidence, agree


def exhaustive(cost, confidence, agree, thresholds):
    """The reference: every non-empty subset of the thresholded layers, the fastest if it beats plain decoding."""
    best, best_speedup = [], 1.0
    for size in range(1, len(thresholds) + 1):
        for subset in itertools.combinations(sorted(thresholds), size):
            speedup = cost.ar() / cost.paradecode(subset, confidence, agree, thresholds)
            if speedup > best_speedup:
                best, best_speedup = list(subset), speedup
    return best, best_speedup


def test_layer_selection_matches_the_exhaustive_search_on_small_cases():
    """3 and 4 exit layers (where the beam keeps every set of two), and 5 and 6 (where it does not)."""
    mismatches, proper = [], 0
    for count in (3, 4, 5, 6):
        for seed in range(8):
            num_layers = count + 2 + seed % 4
            exit_layers = sorted(torch.randperm(num_layers - 1, generator=torch.Generator().manual_seed(seed))[:count])
            exit_layers = [int(e) + 1 for e in exit_layers]
            confidence, agree = cascade_data(exit_layers, num_layers, 1500, seed)
            cost = CostModel(num_layers, head=(0.05, 0.3, 1.0, 2.0)[seed % 4], merge=(0.0, 0.1, 0.3)[seed % 3])
            target = (0.8, 0.9, 0.95)[seed % 3]
            thresholds = {int(e): t for e, t in calibrate(confidence, agree, target)["thresholds"].items() if t}
            expected, expected_speedup = exhaustive(cost, confidence, agree, thresholds)
            result = calibrate(confidence, agree, target, cost)
            proper += 0 < len(expected) < len(thresholds)
            if result["selected_layers"] != expected:
                mismatches.append((count, seed, result["selected_layers"], expected))
            elif expected:
                assert result["expected_speedup"] == pytest.approx(expected_speedup, abs=1e-4)
    assert not mismatches, f"(exit layers, seed, selected, exhaustive): {mismatches}"
    assert proper >= 8, f"only {proper} cases select a proper subset: the comparison would prove little"


def test_layer_search_scales_to_thirty_exit_layers():
    """2^30 subsets would take hours; the search is polynomial (this timer only guards that)."""
    confidence, agree = cascade_data(range(1, 31), num_layers=32, positions=4000, seed=0)
    cost = CostModel(num_layers=32, head=0.02, merge=0.0)
    start = time.perf_counter()
    result = calibrate(confidence, agree, 0.9, cost)
    elapsed = time.perf_counter() - start
    assert elapsed < 1.0, f"calibrating 30 exit layers took {elapsed:.2f} s"
    selected = result["selected_layers"]
    assert len(selected) >= 5, selected  # at this head cost many layers pay: the search went deep
    assert len(result["subsets"]) == 8 and result["subsets"][0]["layers"] == selected
    assert sorted(result["subsets"], key=lambda s: -s["speedup"]) == result["subsets"]
    thresholds = {int(e): t for e, t in calibrate(confidence, agree, 0.9)["thresholds"].items() if t is not None}
    assert {int(e) for e, t in result["thresholds"].items() if t is not None} == set(selected)

    def speedup(layers):
        return cost.ar() / cost.paradecode(tuple(layers), confidence, agree, thresholds)

    assert result["expected_speedup"] == pytest.approx(speedup(selected), abs=1e-4)
    for subset in result["subsets"]:  # the search's own bookkeeping agrees with the cost model, set by set
        assert subset["speedup"] == pytest.approx(speedup(subset["layers"]), abs=1e-4), subset
    for alternative in [sorted(thresholds), *([e] for e in thresholds)]:
        assert speedup(selected) >= speedup(alternative), alternative


def test_cascade_rates_follow_the_runtime():
    """A position exits at the first selected layer whose threshold it reaches, and only there."""
    confidence, agree = cascade_data([2, 4, 6], num_layers=8, positions=2000, seed=3)
    result = calibrate(confidence, agree, 0.9, CostModel(num_layers=8, head=0.1))
    remaining = torch.ones(2000, dtype=torch.bool)
    for e in (2, 4, 6):
        row, threshold = result["layers"][str(e)], result["thresholds"][str(e)]
        exits = remaining & (confidence[e] >= threshold) if threshold is not None else torch.zeros_like(remaining)
        assert row["cascade_exit_rate"] == pytest.approx(float(exits.float().mean()), abs=1e-4), e
        assert row["selected"] == (threshold is not None)
        remaining &= ~exits
    assert sum(result["layers"][str(e)]["cascade_exit_rate"] for e in (2, 4, 6)) > 0.3, result["layers"]


def test_cost_model_charges_every_head_passed_and_every_rollback():
    """Four positions by hand: L = 4, head 0.5, merge 0.1, rollback 4 (the default, L)."""
    cost = CostModel(num_layers=4, head=0.5, merge=0.1)
    confidence = {1: torch.tensor([0.9, 0.9, 0.1, 0.1]), 2: torch.tensor([0.9, 0.1, 0.9, 0.1])}
    agree = {1: torch.tensor([True, False, True, True]), 2: torch.ones(4, dtype=torch.bool)}
    # exits at 1, right: 1 + 0.5 + 0.3; at 1, wrong: the same + 4; at 2 after two heads: 2 + 1 + 0.2;
    # nowhere: 4 layers + 2 exit heads + the final head
    expected = (1.8 + 5.8 + 3.2 + 5.5) / 4
    assert cost.paradecode((1, 2), confidence, agree, {1: 0.5, 2: 0.5}) == pytest.approx(expected)
    assert cost.paradecode((2, 1), confidence, agree, {1: 0.5, 2: 0.5}) == pytest.approx(expected)
    assert cost.ar() == 4.5 and cost.lost == 4
    assert CostModel(num_layers=4, head=0.5, rollback=1.0).lost == 1.0


def test_cost_model_estimate_and_validation():
    llama = tiny_model("llama")
    spec = family_for("llama").spec(llama.config, llama)
    estimate = CostModel.estimate(spec)
    layer = 48 * (2 * 72 + 2 * 24) + 3 * 48 * 80  # q/k/v/o and the gated MLP of the tiny llama
    assert estimate.num_layers == 4 and estimate.head == pytest.approx((97 * 48 + 48 * 48) / layer)
    with pytest.raises(UserInputError, match=r"head must be .* >= 0, got -0.5"):
        CostModel(num_layers=4, head=-0.5)
    with pytest.raises(UserInputError, match="merge must be .* got nan"):
        CostModel(num_layers=4, head=0.5, merge=float("nan"))
    with pytest.raises(UserInputError, match="num_layers >= 1, got 0"):
        CostModel(num_layers=0, head=0.5)
