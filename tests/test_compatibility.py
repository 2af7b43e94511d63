"""The compatibility report: every subset it scores equals a direct ``score()`` of that subset; baselines against
brute force; the report's outputs; the CLI; Hub ids and local folders."""

from __future__ import annotations

import hashlib
import itertools
import json
import shutil

import pytest
import torch
import transformers
import yaml
from safetensors.torch import load_file

import hf_mloss
from hf_mloss.cli import main
from hf_mloss.api import compatibility
from hf_mloss.engine.compatibility import CompatibilityReport, standard_subsets, subset_matrix
from hf_mloss.loading.data import load_pixel_values
from hf_mloss.methods.ops import trim_tensor
from hf_mloss.engine.score import MLossAccumulator
from examples.tiny import make_tiny_setup, tiny_processor

NUM = 8


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    """A tiny base and 4 fine-tunes (so leave-one-out sets have 3 models)."""
    base, models = make_tiny_setup(tmp_path_factory.mktemp("four"), q=4, seed=3)
    return str(base), [str(m) for m in models]


@pytest.fixture(scope="module")
def pixels(image_folder):
    values, _ = load_pixel_values(str(image_folder), tiny_processor(), num_samples=NUM)
    return values


@pytest.fixture(scope="module")
def report(four, pixels) -> CompatibilityReport:
    base, models = four
    return compatibility(base, models, pixels, batch_size=3, subsets=[[0, 2]], per_node=True, output_gap=True,
                         progress=False)


def assert_matches_score(report: CompatibilityReport, subset, direct) -> None:
    row = report.index(subset)
    for i, name in enumerate(report.layers):
        assert report.values["mloss"][row, i].item() == pytest.approx(direct.layer[name], rel=1e-5, abs=1e-8)
        assert report.values["mloss_normalized"][row, i].item() == pytest.approx(direct.layer_normalized[name],
                                                                                   rel=1e-5, abs=1e-8)
        assert report.values["mloss_ratio"][row, i].item() == pytest.approx(direct.layer_ratio[name], rel=1e-5)
        if report.node:
            assert report.values["node_mloss"][row, i].item() == pytest.approx(
                float(direct.node[name].double().mean()), rel=1e-5, abs=1e-8)
            torch.testing.assert_close(report.node[name][row], direct.node[name], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("activation", [torch.nn.GELU(), transformers.activations.QuickGELUActivation(),
                                        torch.nn.ReLU(), torch.nn.SiLU(), torch.nn.Tanh()],
                         ids=["gelu", "quick_gelu", "relu", "silu", "tanh (no in-place kernel)"])
@pytest.mark.parametrize("reduction", ["abs", "sq"])
def test_subset_accumulator_equals_one_accumulator_per_subset(activation, reduction, monkeypatch) -> None:
    """The batched kernel (activation folded and in place, chunks of positions) gives each subset the sums of a
    plain per-subset accumulation, with uneven chunks and user weights."""
    from hf_mloss.engine import kernel
    from hf_mloss.engine.compatibility import subset_scores

    monkeypatch.setattr(kernel, "ROWS_BLOCK_ELEMENTS", 11 * 11 * 5)  # 11 subsets: 5 positions per chunk: 13 = 2×5 + 3
    torch.manual_seed(0)
    h = 3 * torch.randn(4, 23, 11)
    weights = torch.tensor([1.0, 2.0, 0.5, 1.5])
    subsets = standard_subsets(4)
    assert len(subsets) == 11
    acc = kernel.GapSums(len(subsets), 11, reduction=reduction, per_node=True)
    matrix = subset_matrix(subsets, weights)
    original = h.clone()
    acc.add_preactivations(h[:, :13].clone(), matrix, activation, sources_first=True)
    acc.add_preactivations(h[:, 13:].transpose(0, 1), matrix, activation)  # positions first: copied, not changed
    assert torch.equal(h, original)
    got = subset_scores(acc)
    for row, subset in enumerate(subsets):
        alpha = weights[list(subset)] / weights[list(subset)].sum()
        ref = MLossAccumulator(11, reduction=reduction)
        ref.add(h[list(subset)].transpose(0, 1), alpha, activation)
        want = ref.scores()
        assert got["mloss"][row].item() == pytest.approx(want.layer, rel=1e-5)
        assert got["mloss_normalized"][row].item() == pytest.approx(want.layer_normalized, rel=1e-5)
        assert got["mloss_ratio"][row].item() == pytest.approx(want.layer_ratio, rel=1e-5)
        torch.testing.assert_close(got["node"][row], want.node, rtol=1e-5, atol=1e-6)


def test_subsets_scored(report) -> None:
    q = 4
    pairs = list(itertools.combinations(range(q), 2))
    loo = [tuple(p for p in range(q) if p != i) for i in range(q)]
    assert report.subsets == [*pairs, *loo, (0, 1, 2, 3)]  # the requested [0, 2] is a pair already
    assert standard_subsets(2) == [(0, 1)]
    assert report.values["mloss"].shape == (len(report.subsets), 2) and report.num_positions == NUM * 17


@pytest.mark.parametrize("subset", [(0, 1), (0, 3), (1, 2), (2, 3)])
def test_every_pair_equals_a_direct_score_of_the_pair(four, pixels, report, subset) -> None:
    base, models = four
    direct = hf_mloss.score(base, [models[i] for i in subset], pixels, batch_size=3, progress=False)
    assert_matches_score(report, subset, direct)


@pytest.mark.parametrize("left_out", [0, 2])
def test_leave_one_out_equals_scoring_the_rest(four, pixels, report, left_out) -> None:
    base, models = four
    rest = [p for p in range(4) if p != left_out]
    direct = hf_mloss.score(base, [models[p] for p in rest], pixels, batch_size=3, progress=False)
    assert_matches_score(report, rest, direct)
    row = next(r for r in report.leave_one_out() if r["model"] == report.models[left_out])
    assert row["without"] == pytest.approx(report.score(rest))
    assert row["gain"] == pytest.approx(report.score(range(4)) - report.score(rest))


def test_whole_set_equals_score_of_all(four, pixels, report) -> None:
    base, models = four
    assert_matches_score(report, range(4), hf_mloss.score(base, models, pixels, batch_size=3, progress=False))


def test_weighted_pairs_renormalise_and_sq_reduction(four, pixels) -> None:
    """User weights α give α_i / (α_i + α_j) within a pair; reduction="sq" and a layer subset pass through."""
    base, models = four
    weights = [0.1, 0.2, 0.3, 0.4]
    rep = compatibility(base, models, pixels, weights=weights, reduction="sq", layers=[1], leave_one_out=False,
                        subsets=[["ft1", 2, 3]], baselines=False, per_node=True, progress=False)
    assert rep.layers == ["encoder.layers.1.mlp.fc1"]
    for subset in [(0, 3), (1, 2), (1, 2, 3)]:
        direct = hf_mloss.score(base, [models[i] for i in subset], pixels, weights=[weights[i] for i in subset],
                                reduction="sq", layers=[1], progress=False)
        assert_matches_score(rep, subset, direct)


def task_vectors(base: str, models: list[str]) -> list[dict[str, torch.Tensor]]:
    theta0 = load_file(f"{base}/model.safetensors")
    return [{k: load_file(f"{m}/model.safetensors")[k] - v for k, v in theta0.items() if v.is_floating_point()}
            for m in models]


def test_task_vector_baselines_match_brute_force(four, report) -> None:
    base, models = four
    taus = task_vectors(base, models)
    flat = [torch.cat([t.flatten() for t in tau.values()]).double() for tau in taus]
    for i, j in itertools.combinations(range(4), 2):
        row = report.index((i, j))
        cosine = float(flat[i] @ flat[j] / (flat[i].norm() * flat[j].norm()))
        assert report.baselines["tv_cosine"][row] == pytest.approx(cosine, rel=1e-4, abs=1e-6)
        assert report.baselines["tv_distance"][row] == pytest.approx(float((flat[i] - flat[j]).norm()), rel=1e-5)
        assert report.baselines["tv_norm"][row] == pytest.approx(float(flat[i].norm() + flat[j].norm()), rel=1e-5)
        conflict = overlap = 0
        for name in taus[i]:
            a, b = trim_tensor(taus[i][name].float(), 0.2), trim_tensor(taus[j][name].float(), 0.2)
            both = (a != 0) & (b != 0)
            overlap += int(both.sum())
            conflict += int((both & (a.sign() != b.sign())).sum())
        assert report.baselines["sign_conflict"][row] == pytest.approx(conflict / overlap)
    three = report.index((0, 1, 2))
    pair_rows = [report.index(p) for p in [(0, 1), (0, 2), (1, 2)]]
    expected = sum(report.baselines["tv_cosine"][r] for r in pair_rows) / 3
    assert report.baselines["tv_cosine"][three] == pytest.approx(expected)


def test_output_gap_matches_manual_average_merge(four, pixels, report) -> None:
    from transformers import CLIPVisionModel

    base, models = four
    loaded = [CLIPVisionModel.from_pretrained(m).eval() for m in models]
    merged = CLIPVisionModel.from_pretrained(base).eval()
    merged.load_state_dict({k: (loaded[1].state_dict()[k] + loaded[3].state_dict()[k]) / 2
                            for k in merged.state_dict()})
    with torch.no_grad():
        feats = [m(pixel_values=pixels).pooler_output for m in (loaded[1], loaded[3], merged)]
    ensemble = (feats[0] + feats[1]) / 2
    expected = float((feats[2] - ensemble).norm(dim=-1).sum() / ensemble.norm(dim=-1).sum())
    assert report.score((1, 3), "output_gap") == pytest.approx(expected, rel=1e-4)


def test_report_outputs_round_trip(report, tmp_path) -> None:
    matrix = report.matrix()
    assert torch.isnan(matrix.diagonal()).all() and torch.equal(matrix.nan_to_num(), matrix.T.nan_to_num())
    assert matrix[0, 1] == pytest.approx(report.score((0, 1)))
    assert report.pairs()[0]["mloss"] == pytest.approx(float(matrix.nan_to_num(float("inf")).min()))
    assert report.matrix("tv_cosine")[1, 2] == pytest.approx(report.score((1, 2), "tv_cosine"))
    written = report.save(tmp_path / "compat")
    loaded = CompatibilityReport.load(tmp_path / "compat")
    torch.testing.assert_close(loaded.matrix(), matrix, equal_nan=True)
    assert loaded.baselines == report.baselines and loaded.subsets == report.subsets
    markdown = written["markdown"].read_text()
    assert "| model left out |" in markdown and "output_gap" in markdown
    assert report.models[0] in report.summary() and "Without one model" in report.summary()
    if "heatmap" in written:
        assert written["heatmap"].read_bytes().startswith(b"\x89PNG")
    assert json.loads(written["json"].read_text())["subsets"][0]["models"] == [0, 1]


def test_refusals(four, pixels, report) -> None:
    base, models = four
    with pytest.raises(hf_mloss.InvalidParameterError, match="fewer than 2 distinct"):
        compatibility(base, models, pixels, subsets=[[1, 1]], progress=False)
    with pytest.raises(hf_mloss.InvalidParameterError, match="not one of the models"):
        compatibility(base, models, pixels, subsets=[["nope", 1]], progress=False)
    with pytest.raises(hf_mloss.InvalidParameterError, match="indices run from 0 to 3"):
        compatibility(base, models, pixels, subsets=[[0, 9]], progress=False)
    with pytest.raises(hf_mloss.InvalidParameterError, match="was not scored"):
        report.score((0,))
    config = hf_mloss.MergeConfig.from_kwargs(base, models, data=pixels, score={"prefix": "base"})
    with pytest.raises(hf_mloss.InvalidParameterError, match="prefix='own'"):
        hf_mloss.engine.compatibility.run_compatibility(config, progress=False)


def test_package_attribute_stays_callable_after_the_module_is_imported(four, pixels) -> None:
    import hf_mloss.engine.compatibility as module

    base, models = four
    assert callable(hf_mloss.compatibility) and module.CompatibilityReport is CompatibilityReport
    out = hf_mloss.compatibility(base, models[:2], pixels[:2], baselines=False, progress=False)
    assert out.subsets == [(0, 1)] and out.leave_one_out() == []


# ------------------------------------------------------------------------------------------------------- CLI
def test_cli_score_pairwise_writes_the_report(four, image_folder, tmp_path, capsys) -> None:
    base, models = four
    config = tmp_path / "pairs.yaml"
    config.write_text(yaml.safe_dump({"base": base, "models": models, "data": {"path": str(image_folder),
                                                                              "num_samples": NUM}}))
    out = tmp_path / "out"
    assert main(["score", str(config), "--pairwise", "--subsets", "0,1,2", "--out", str(out), "--json",
                 str(tmp_path / "c.json"), "-q"]) == 0
    printed = capsys.readouterr().out
    assert "Pairwise M-Loss" in printed and "Without one model" in printed
    loaded = CompatibilityReport.load(out)
    assert (0, 1, 2) in loaded.subsets and "sign_conflict" in loaded.baselines
    assert json.loads((tmp_path / "c.json").read_text())["models"] == loaded.models
    assert main(["score", str(config), "--out", str(out)]) == 2
    assert "add --pairwise" in capsys.readouterr().err
    assert main(["score", str(config), "--pairwise", "--subsets", "0,x"]) == 2


# ---------------------------------------------------------------------------------------------------- Hub ids
@pytest.fixture
def hub_ids(four, tmp_path, monkeypatch) -> list[str]:
    """org/base and org/ft0..3 in a pre-seeded offline Hub cache."""
    from huggingface_hub import constants

    base, models = four
    repos = ["org/base", *[f"org/ft{i}" for i in range(4)]]
    for repo, src in zip(repos, [base, *models]):
        storage = tmp_path / "cache" / f"models--{repo.replace('/', '--')}"
        sha = hashlib.sha1(repo.encode()).hexdigest()
        (storage / "refs").mkdir(parents=True)
        (storage / "refs" / "main").write_text(sha)
        shutil.copytree(src, storage / "snapshots" / sha)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return repos


def test_hub_ids_give_the_same_report(hub_ids, pixels, report, image_folder, tmp_path, capsys) -> None:
    rep = compatibility(hub_ids[0], hub_ids[1:], pixels, batch_size=3, subsets=[["org/ft0", "org/ft2"]],
                        progress=False)
    assert rep.models == hub_ids[1:]
    torch.testing.assert_close(rep.values["mloss"], report.values["mloss"])
    config = tmp_path / "hub.yaml"
    config.write_text(yaml.safe_dump({"base": hub_ids[0], "models": hub_ids[1:3],
                                      "data": {"path": str(image_folder), "num_samples": 4}}))
    assert main(["score", str(config), "--pairwise", "-q"]) == 0
    assert "org/ft1" in capsys.readouterr().out


def test_sign_conflicts_count_exactly_the_entries_the_ties_trim_keeps(four) -> None:
    """The sign-conflict baseline uses TIES' own per-tensor trim (methods.ops): its overlap and conflict counts are
    those of the trimmed task vectors, pair by pair."""
    from hf_mloss.engine.compatibility import task_vector_statistics
    from hf_mloss.loading.inputs import open_inputs

    base, models = four
    config = hf_mloss.MergeConfig.from_kwargs(base, models)
    with open_inputs(config, needs_data=False, progress=False) as inputs:
        stats = task_vector_statistics(inputs, k=0.3)
        q = len(inputs.sources)
        overlap = torch.zeros(q, q, dtype=torch.float64)
        conflict = torch.zeros(q, q, dtype=torch.float64)
        for name in inputs.names:
            theta0 = inputs.base.get_float(name)
            signs = [torch.sign(trim_tensor(s.get_float(name) - theta0, 0.3)).flatten() for s in inputs.sources]
            for i, j in itertools.product(range(q), range(q)):
                overlap[i, j] += int(((signs[i] != 0) & (signs[j] != 0)).sum())
                conflict[i, j] += int((signs[i] * signs[j] < 0).sum())
    assert overlap[0, 1] > 0 and conflict[0, 1] > 0
    assert torch.equal(stats["overlap"], overlap) and torch.equal(stats["conflict"], conflict)


def test_task_vector_gram_is_accurate_on_large_tensors(monkeypatch) -> None:
    """The Gram sums of a tensor with millions of entries stay within 1e-5 of ‖τ_i‖‖τ_j‖ of a float64 reference
    (one float32 product over all of them was off by about 1e-4 here), and the trim counts are exact, whole or
    streamed."""
    from types import SimpleNamespace

    from hf_mloss.engine import compatibility as compat
    from hf_mloss.loading.store import TensorStore
    from hf_mloss.methods.ops import keep_count, magnitude_threshold

    class Tensors(TensorStore):
        def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
            self.tensors, self.shapes = tensors, {k: tuple(v.shape) for k, v in tensors.items()}
            self.dtypes = {k: v.dtype for k, v in tensors.items()}

        def get(self, name: str) -> torch.Tensor:
            return self.tensors[name].clone()

    gen = torch.Generator().manual_seed(0)
    shapes = {"big": (1024, 2048), "small": (16, 8), "bias": (7,)}
    base = {k: torch.randn(s, generator=gen) for k, s in shapes.items()}
    shared = {k: torch.randn(s, generator=gen) * 1e-3 for k, s in shapes.items()}  # correlated task vectors
    tuned = [{k: base[k] + shared[k] + torch.randn(s, generator=gen) * 1e-3 * (i + 1) for k, s in shapes.items()}
             for i in range(3)]
    inputs = SimpleNamespace(base=Tensors(base), sources=[Tensors(t) for t in tuned], names=list(shapes),
                             device=torch.device("cpu"))
    gram = torch.zeros(3, 3, dtype=torch.float64)
    overlap, agree = torch.zeros(3, 3, dtype=torch.float64), torch.zeros(3, 3, dtype=torch.float64)
    for name in shapes:
        taus = torch.stack([t[name] - base[name] for t in tuned]).reshape(3, -1)
        gram += taus.double() @ taus.double().T
        count = keep_count(taus.shape[1], 0.2)
        signs = torch.stack([torch.where(tau.abs() >= magnitude_threshold(tau.abs(), count), tau.sign(), 0.0)
                             for tau in taus]).double()
        overlap += signs.abs() @ signs.abs().T
        agree += signs @ signs.T
    norms = gram.diagonal().sqrt()
    for stream_min in (compat.STREAM_MIN_NUMEL, 1):  # whole tensors, then every tensor in row pieces
        monkeypatch.setattr(compat, "STREAM_MIN_NUMEL", stream_min)
        stats = compat.task_vector_statistics(inputs)
        assert ((stats["gram"] - gram).abs() / norms.outer(norms)).max() < 1e-5
        assert torch.equal(stats["overlap"], overlap) and torch.equal(stats["conflict"], (overlap - agree) / 2)


def test_baselines_streamed_in_row_pieces_equal_the_whole_tensor_ones(four, monkeypatch) -> None:
    """Every tensor read in pieces of a few rows (as an LLM's embedding is): the same trim thresholds, hence the same
    overlap and conflict counts, and the same Gram sums up to summation order."""
    from hf_mloss.engine import compatibility as compat
    from hf_mloss.loading.inputs import open_inputs

    base, models = four
    config = hf_mloss.MergeConfig.from_kwargs(base, models)
    with open_inputs(config, needs_data=False, progress=False) as inputs:
        whole = compat.task_vector_statistics(inputs, k=0.3)
        pieces = []
        real_pieces = compat._task_vector_pieces
        monkeypatch.setattr(compat, "_task_vector_pieces", lambda *a: (pieces.append(a[1]), real_pieces(*a))[1])
        monkeypatch.setattr(compat, "STREAM_MIN_NUMEL", 1)
        monkeypatch.setattr(compat, "STREAM_PIECE_NUMEL", 40)
        streamed = compat.task_vector_statistics(inputs, k=0.3)
    assert set(pieces) == {n for n in inputs.names if inputs.base.shapes[n]}  # every tensor with rows, in pieces
    assert torch.equal(streamed["overlap"], whole["overlap"]) and torch.equal(streamed["conflict"], whole["conflict"])
    torch.testing.assert_close(streamed["gram"], whole["gram"], rtol=1e-5, atol=1e-9)


def test_baselines_on_two_workers_equal_the_serial_ones(four, monkeypatch) -> None:
    """The whole tensors' statistics computed on the run's two worker threads (as ``compatibility`` runs them on two
    idle cores): the same trim counts, the same Gram sums up to the last float32 bits of a product, every tensor
    counted once and each thread reading into memory of its own."""
    import threading

    from hf_mloss.engine import compatibility as compat
    from hf_mloss.loading.inputs import open_inputs
    from hf_mloss.parallel import cpu_workers

    base, models = four
    config = hf_mloss.MergeConfig.from_kwargs(base, models)
    with open_inputs(config, needs_data=False, progress=False) as inputs:
        serial = compat.task_vector_statistics(inputs, k=0.3)
        seen: list[tuple[str, str, int]] = []
        real = compat._whole_task_vectors
        monkeypatch.setattr(compat, "_whole_task_vectors", lambda inputs, name, buffer, scratch: (
            seen.append((name, threading.current_thread().name, buffer.data_ptr())),
            real(inputs, name, buffer, scratch))[1])
        with cpu_workers("cpu", threads=2) as workers:
            assert workers.parallel
            parallel = compat.task_vector_statistics(inputs, k=0.3)
    assert sorted(name for name, _, _ in seen) == sorted(inputs.names)
    threads = {thread for _, thread, _ in seen}
    assert threads and all(t.startswith("hf_mloss") for t in threads)  # the pool's threads, not the caller
    memory = {}
    for _, thread, pointer in seen:
        assert memory.setdefault(thread, pointer) == pointer  # one buffer per thread, reused tensor after tensor
    assert len(set(memory.values())) == len(memory)
    assert torch.equal(parallel["overlap"], serial["overlap"]) and torch.equal(parallel["conflict"], serial["conflict"])
    torch.testing.assert_close(parallel["gram"], serial["gram"], rtol=1e-6, atol=1e-12)


def test_model_card_embeds_the_report(four, pixels, report, tmp_path) -> None:
    base, models = four
    result = hf_mloss.merge(base, models, "ties", progress=False)
    result.compatibility = report
    folder = result.save_pretrained(tmp_path / "merged")
    card = (folder / "README.md").read_text()
    assert "## Compatibility of the merged models" in card and "| model left out |" in card
    assert report.models[3] in card and "Computed without labels" in card
