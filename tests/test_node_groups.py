"""Node groups: slice-wise trims (rows, columns, bias entries), the adapters' groups, and M-TIES / M-DARE trimming a
node's whole group at its keep ratio (SPEC §1b, §3) — every other tensor exactly as before."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import hf_mloss
from hf_mloss import parallel
from hf_mloss.errors import InvalidParameterError
from hf_mloss.methods.mties import GroupMember, keep_ratios_from_scores, unchanged_anchor_thresholds
from hf_mloss.methods.ops import (
    elect_and_merge,
    trim_entries_,
    trim_rows,
    trim_rows_,
    trim_slices,
    trim_slices_,
    trim_tensor_,
)

INF = float("inf")
IMG = {"num_samples": 8, "batch_size": 4}
FC1 = [f"encoder.layers.{layer}.mlp.fc1" for layer in range(2)]


# --------------------------------------------------------------------------------------------------------------------
# ops: slice-wise trims
# --------------------------------------------------------------------------------------------------------------------


def test_trim_slices_rows_hand_example() -> None:
    tau = torch.tensor([[1.0, -4.0, 2.0], [3.0, 0.5, -6.0]])
    thresholds = torch.empty(2)
    out = trim_slices_(tau.clone(), torch.tensor([0.7, 0.34], dtype=torch.float64), 0, thresholds=thresholds)
    # row 0: m = floor(3·0.7) = 2 → |−4|, |2|; row 1: m = floor(3·0.34) = 1 → |−6|
    assert torch.equal(out, torch.tensor([[0.0, -4.0, 2.0], [0.0, 0.0, -6.0]]))
    assert thresholds.tolist() == [2.0, 6.0]


def test_trim_slices_columns_hand_example() -> None:
    tau = torch.tensor([[1.0, -4.0, 2.0], [3.0, 0.5, -6.0]])
    thresholds = torch.empty(3)
    out = trim_slices_(tau.clone(), torch.tensor([0.5, 1.0, 0.4]), 1, thresholds=thresholds)
    # column 0: m = floor(2·0.5) = 1 → 3; column 1: m = 2 → both; column 2: m = floor(0.8) = 0 → none
    assert torch.equal(out, torch.tensor([[0.0, -4.0, 0.0], [3.0, 0.5, 0.0]]))
    assert thresholds.tolist() == [3.0, -INF, INF]  # −inf: nothing zeroed; +inf: everything zeroed


def test_trim_slices_keeps_ties_at_the_threshold() -> None:
    tau = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    # m = floor(4·0.25) = 1: the 1st largest |τ| is 2, and both ±2 reach it (SPEC §3: ties may keep a few more)
    assert torch.equal(trim_slices(tau, torch.tensor([0.25]), 0), torch.tensor([[2.0, -2.0, 0.0, 0.0]]))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_trim_slices_equals_trim_rows_bit_for_bit(seed) -> None:
    generator = torch.Generator().manual_seed(seed)
    tau = (torch.randn(37, 23, generator=generator) * 4).round() / 4  # many equal magnitudes
    keep = torch.rand(37, generator=generator, dtype=torch.float64)
    keep[:3] = torch.tensor([0.0, 1.0, 0.02], dtype=torch.float64)  # empty, full, and floor(23·0.02) = 0
    assert torch.equal(trim_slices(tau, keep, 0), trim_rows(tau, keep))
    # column i of τ is row i of τᵀ
    keep_cols = torch.rand(23, generator=generator, dtype=torch.float64)
    assert torch.equal(trim_slices(tau, keep_cols, 1), trim_rows(tau.t().contiguous(), keep_cols).t())


def test_trim_slices_over_workers_matches_one_thread() -> None:
    generator = torch.Generator().manual_seed(5)
    tau = torch.randn(640, 512, generator=generator)  # 327,680 entries: split over the workers
    keep = torch.rand(512, generator=generator, dtype=torch.float64)
    alone, alone_thresholds = tau.clone(), torch.empty(512)
    trim_slices_(alone, keep, 1, thresholds=alone_thresholds)
    with parallel.cpu_workers("cpu", threads=3):
        split, split_thresholds = tau.clone(), torch.empty(512)
        trim_slices_(split, keep, 1, thresholds=split_thresholds)
    assert torch.equal(split, alone) and torch.equal(split_thresholds, alone_thresholds)
    counts = (alone != 0).sum(0)
    assert torch.equal(counts, torch.floor(keep * 640).long())


def test_trim_entries_against_thresholds() -> None:
    bias = torch.tensor([0.5, -0.5, 2.0, -3.0])
    out = trim_entries_(bias.clone(), torch.tensor([0.5, 0.6, INF, -INF]))
    assert torch.equal(out, torch.tensor([0.5, 0.0, 0.0, -3.0]))


def test_slice_trims_reject_bad_shapes() -> None:
    with pytest.raises(ValueError, match="one keep ratio per slice"):
        trim_slices(torch.zeros(3, 4), torch.ones(3), 1)
    with pytest.raises(ValueError, match="dim 0 .rows. or 1"):
        trim_slices(torch.zeros(3, 4), torch.ones(3), 2)
    with pytest.raises(ValueError, match="2-D"):
        trim_slices(torch.zeros(4), torch.ones(4), 0)
    with pytest.raises(ValueError, match="one value per slice"):
        trim_slices_(torch.zeros(3, 4), torch.ones(3), 0, thresholds=torch.empty(4))
    with pytest.raises(ValueError, match="one threshold per entry"):
        trim_entries_(torch.zeros(3), torch.zeros(4))


def test_unchanged_anchor_thresholds() -> None:
    """An anchor no source changed has τ = 0: its threshold is 0 where its slice keeps some entries (the bias entry
    is kept whatever it is), +inf where it keeps none."""
    member = GroupMember(torch.tensor([0.05, 0.3, 1.0], dtype=torch.float64), 0, anchor="w", anchor_length=10)
    assert unchanged_anchor_thresholds(member).tolist() == [INF, 0.0, -INF]


# --------------------------------------------------------------------------------------------------------------------
# Adapters: the default groups
# --------------------------------------------------------------------------------------------------------------------


def test_default_node_groups_of_the_vision_families() -> None:
    from transformers import CLIPConfig, Dinov2Config, ViTConfig

    from hf_mloss.adapters import adapter_for, whole_model_adapter
    from examples.tiny import tiny_vision_config

    small = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2}
    clip = adapter_for(tiny_vision_config())
    assert clip.node_groups(1) == [("encoder.layers.1.mlp.fc1.weight", 0), ("encoder.layers.1.mlp.fc1.bias", 0)]
    whole = whole_model_adapter(adapter_for(CLIPConfig(vision_config=tiny_vision_config().to_dict())))
    assert whole.node_groups(0) == [("encoder.layers.0.mlp.fc1.weight", 0), ("encoder.layers.0.mlp.fc1.bias", 0)]
    vit = adapter_for(ViTConfig(**small, intermediate_size=64, image_size=32, patch_size=8))
    assert vit.node_groups(0) == [("layers.0.mlp.fc1.weight", 0), ("layers.0.mlp.fc1.bias", 0)]
    dino = adapter_for(Dinov2Config(**small, mlp_ratio=2, image_size=42, patch_size=7))
    assert dino.node_groups(1) == [("encoder.layer.1.mlp.fc1.weight", 0), ("encoder.layer.1.mlp.fc1.bias", 0)]
    for adapter in (clip, vit, dino):  # every named tensor exists, with one slice per node
        shapes = adapter.expected_shapes()
        nodes = shapes[f"{adapter.target_name(0)}.weight"][0]
        assert all(shapes[name][dim] == nodes for name, dim in adapter.node_groups(0))


# --------------------------------------------------------------------------------------------------------------------
# M-TIES on CLIP: the fc1 bias joins its row's node; everything else stays bit for bit the previous algorithm
# --------------------------------------------------------------------------------------------------------------------


def load_sd(path) -> dict[str, torch.Tensor]:
    return load_file(str(Path(path) / "model.safetensors"))


def previous_m_ties(base, fts, names, keep: dict[str, torch.Tensor], *, k: float, weights: torch.Tensor):
    """The M-TIES of the previous release, with its own primitives: fc1 weights row-trimmed (``trim_rows_``), every
    other tensor — fc1 biases included — trimmed per tensor at k, then sign election + disjoint mean."""
    out = {}
    for name in names:
        taus = torch.stack([ft[name].float() for ft in fts]).sub_(base[name].float())
        module = name.rsplit(".", 1)[0]
        for tau in taus:
            if name.endswith(".weight") and module in keep:
                trim_rows_(tau, keep[module])
            else:
                trim_tensor_(tau, k)
        out[name] = base[name].float() + elect_and_merge(taus, weights)
    return out


@pytest.mark.parametrize("prefix", ["merged", "own"])
def test_clip_m_ties_changes_only_the_fc1_biases(tiny_paths, image_folder, prefix) -> None:
    base_dir, model_dirs = tiny_paths
    k, e = 0.5, 0.1
    result = hf_mloss.merge(base_dir, model_dirs, "m_ties", k=k, e=e, prefix=prefix, data=str(image_folder),
                            progress=False, **IMG)
    got = {name: t for name, t in result.model.state_dict().items()}
    base, fts = load_sd(base_dir), [load_sd(m) for m in model_dirs]
    names = [n for n, t in base.items() if t.is_floating_point()]
    keep = {name: keep_ratios_from_scores(result.report.node[name], k, e) for name in FC1}
    weights = torch.full((3,), 1 / 3, dtype=torch.float64).float()
    previous = previous_m_ties(base, fts, names, keep, k=k, weights=weights)
    biases = {f"{name}.bias" for name in FC1}
    for name in names:
        if name not in biases:
            assert torch.equal(got[name], previous[name]), name
    changed = 0
    for module in FC1:  # bias entry i: kept iff |τ_b[i]| reaches the threshold of row i of the fc1 weight's τ
        weight_taus = torch.stack([ft[f"{module}.weight"] for ft in fts]).sub_(base[f"{module}.weight"])
        bias_taus = torch.stack([ft[f"{module}.bias"] for ft in fts]).sub_(base[f"{module}.bias"])
        for w_tau, b_tau in zip(weight_taus, bias_taus):
            thresholds = torch.empty(len(b_tau))
            trim_slices_(w_tau, keep[module], 0, thresholds=thresholds)
            trim_entries_(b_tau, thresholds)
        expected = base[f"{module}.bias"] + elect_and_merge(bias_taus, weights)
        assert torch.equal(got[f"{module}.bias"], expected), module
        changed += int((expected != previous[f"{module}.bias"]).sum())
    assert changed > 0  # the group rule does differ from the per-tensor trim of the bias


def test_clip_m_ties_e0_still_equals_tensor_ties(tiny_paths, image_folder) -> None:
    base_dir, model_dirs = tiny_paths
    ties = hf_mloss.merge(base_dir, model_dirs, "ties", k=0.3, scope="tensor", progress=False).model.state_dict()
    m = hf_mloss.merge(base_dir, model_dirs, "m_ties", k=0.3, e=0.0, data=str(image_folder), progress=False, **IMG)
    for name, tensor in m.model.state_dict().items():
        assert torch.equal(tensor, ties[name]), name


# --------------------------------------------------------------------------------------------------------------------
# The hooks with given scores: an anchor no source changed, bad declarations
# --------------------------------------------------------------------------------------------------------------------


def merge_with_scores(base, models, method_name, scores, *, adapter_patch=None, **params) -> dict[str, torch.Tensor]:
    """A data-guided merge driven by given node scores (the hooks in a merged-prefix pass's order), no data."""
    from hf_mloss.loading.inputs import open_inputs
    from hf_mloss.merging.merger import TensorMerger
    from hf_mloss.methods import MergeContext
    from hf_mloss.engine.score import LayerScores
    from hf_mloss.merging.selection import replay_layerwise

    config = hf_mloss.MergeConfig.from_kwargs(base, models, method_name, data="unused", **params)
    method, method_params = config.merge_method(), config.method_params()
    layer_scores = {layer: LayerScores(node=node, node_normalized=node, node_ratio=node, layer=0.0,
                                       layer_normalized=0.0, layer_ratio=0.0) for layer, node in scores.items()}
    with open_inputs(config, needs_data=False, progress=False) as inputs:
        if adapter_patch is not None:
            adapter_patch(inputs.adapter)
        model = inputs.load_output_model("tower", progress=False, dtype=torch.float32)
        ctx = MergeContext(params=method_params, weights=inputs.alpha.float(), seed=config.seed)
        merger = TensorMerger(inputs, method, ctx, model)
        replay_layerwise(merger, method, layer_scores)
        return {name: tensor.detach().clone() for name, tensor in merger.targets.items()}


@pytest.fixture(scope="module")
def narrow(tmp_path_factory):
    """CLIP towers with fc1 rows of 8 entries, whose fine-tunes left block 0's fc1 weight as the base's."""
    from examples.tiny import make_base, make_finetune, save_model

    root = tmp_path_factory.mktemp("narrow")
    base = make_base(0, hidden_size=8, intermediate_size=16)
    save_model(base, root / "base")
    folders = []
    for i in range(3):
        ft = make_finetune(base, i, scale=3e-2)
        with torch.no_grad():
            ft.encoder.layers[0].mlp.fc1.weight.copy_(base.encoder.layers[0].mlp.fc1.weight)
        folders.append(str(save_model(ft, root / f"ft{i}")))
    return str(root / "base"), folders


def test_bias_of_an_unchanged_anchor(narrow) -> None:
    """Block 0's fc1 weight is unchanged (copied from the base, never trimmed): bias entry i is kept whole where
    row i would keep some entry (floor(8·keep_i) > 0), dropped where it would keep none."""
    base_dir, model_dirs = narrow
    k, e = 0.3, 0.2  # keep from 0.3 (floor(2.4) = 2 entries) down to 0.1 (floor(0.8) = 0)
    scores = {0: torch.arange(16, dtype=torch.float64), 1: torch.arange(16, dtype=torch.float64).flip(0)}
    got = merge_with_scores(base_dir, model_dirs, "m_ties", scores, k=k, e=e)
    base, fts = load_sd(base_dir), [load_sd(m) for m in model_dirs]
    name = "encoder.layers.0.mlp.fc1.bias"
    keep = keep_ratios_from_scores(scores[0], k, e)
    counts = torch.floor(keep * 8)
    assert 0 < int((counts == 0).sum()) < 16
    taus = torch.stack([ft[name] for ft in fts]).sub_(base[name])
    taus[:, counts == 0] = 0
    expected = base[name] + elect_and_merge(taus, torch.full((3,), 1 / 3, dtype=torch.float64).float())
    assert torch.equal(got[name], expected)
    assert torch.equal(got["encoder.layers.0.mlp.fc1.weight"], base["encoder.layers.0.mlp.fc1.weight"])


@pytest.mark.parametrize("groups, message", [
    ([], "declares no tensor"),
    ([("encoder.layers.{l}.mlp.fc9.weight", 0)], "not a floating-point tensor of block"),
    ([("encoder.layers.{l}.mlp.fc1.bias", 0)], "declares no 2-D tensor"),
    ([("encoder.layers.{l}.mlp.fc1.weight", 2)], r"declares \('encoder.layers.0.mlp.fc1.weight', 2\)"),
    ([("encoder.layers.{l}.mlp.fc1.weight", 0), ("encoder.layers.{l}.mlp.fc1.weight", 0)], "twice"),
    ([("encoder.layers.{l}.mlp.fc1.weight", 1)], "which has 16 nodes"),
])
def test_bad_node_groups_are_refused(narrow, groups, message) -> None:
    base_dir, model_dirs = narrow

    def patch(adapter):
        adapter.node_groups = lambda layer: [(name.format(l=layer), dim) for name, dim in groups]

    scores = {layer: torch.arange(16, dtype=torch.float64) for layer in range(2)}
    with pytest.raises(InvalidParameterError, match=message):
        merge_with_scores(base_dir, model_dirs, "m_ties", scores, adapter_patch=patch, k=0.5, e=0.2)


def test_groups_are_deferred_until_their_scores(narrow, monkeypatch) -> None:
    """Before its scores, a block merges everything but its group; then the 2-D members, then the 1-D ones."""
    from hf_mloss.merging.stages import DriverRun

    calls: list[list[str]] = []
    original = DriverRun.merge

    def spy(self, names):
        calls.append([n for n in names if n not in self.merger.done])
        return original(self, names)

    monkeypatch.setattr(DriverRun, "merge", spy)
    base_dir, model_dirs = narrow
    merge_with_scores(base_dir, model_dirs, "m_ties", {1: torch.arange(16, dtype=torch.float64)}, k=0.5, e=0.2,
                      layers=[1])
    block1 = [i for i, c in enumerate(calls) if any(n.startswith("encoder.layers.1.") for n in c)]
    stage, weight, bias = (calls[i] for i in block1)
    assert "encoder.layers.1.mlp.fc1.weight" not in stage and "encoder.layers.1.mlp.fc1.bias" not in stage
    assert "encoder.layers.1.mlp.fc2.weight" in stage
    assert weight == ["encoder.layers.1.mlp.fc1.weight"] and bias == ["encoder.layers.1.mlp.fc1.bias"]
    block0 = [n for c in calls for n in c if n.startswith("encoder.layers.0.mlp.fc1")]
    assert len(block0) == 2  # an unscored block: merged with its stage


def test_m_dare_trims_the_fc1_bias_with_its_row(tiny_paths) -> None:
    """M-DARE: the fc1 weight rows and bias entries are group-trimmed (no DARE, no rescale), even with e = 0."""
    base_dir, model_dirs = tiny_paths
    scores = {layer: torch.arange(64, dtype=torch.float64) for layer in range(2)}
    got = merge_with_scores(base_dir, model_dirs, "m_dare", scores, p=0.6, e=0.0, seed=2)
    base, fts = load_sd(base_dir), [load_sd(m) for m in model_dirs]
    keep = torch.full((64,), 0.6, dtype=torch.float64)
    weights = torch.full((3,), 1 / 3, dtype=torch.float64).float()
    for module in FC1:
        weight_taus = torch.stack([ft[f"{module}.weight"] for ft in fts]).sub_(base[f"{module}.weight"])
        bias_taus = torch.stack([ft[f"{module}.bias"] for ft in fts]).sub_(base[f"{module}.bias"])
        for w_tau, b_tau in zip(weight_taus, bias_taus):
            thresholds = torch.empty(64)
            trim_slices_(w_tau.clone(), keep, 0, thresholds=thresholds)
            trim_rows_(w_tau, keep)
            assert (w_tau != 0).sum(1).tolist() == [math.floor(32 * 0.6)] * 64
            trim_entries_(b_tau, thresholds)
        assert 0 < int((bias_taus == 0).sum()) < bias_taus.numel()
        assert torch.equal(got[f"{module}.weight"], base[f"{module}.weight"] + elect_and_merge(weight_taus, weights))
        assert torch.equal(got[f"{module}.bias"], base[f"{module}.bias"] + elect_and_merge(bias_taus, weights))
