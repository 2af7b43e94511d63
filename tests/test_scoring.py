"""The M-Loss scorer against brute force: full forwards of each model with hooks on fc1."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import CLIPVisionModel

import hf_mloss
from hf_mloss.loading.data import load_pixel_values
from hf_mloss.methods.ops import elect_and_merge, trim_rows, trim_tensor
from hf_mloss.engine.score import MLossAccumulator, node_gap
from examples.tiny import tiny_processor

NUM = 8


@pytest.fixture(scope="module")
def pixels(image_folder):
    values, _ = load_pixel_values(str(image_folder), tiny_processor(), num_samples=NUM)
    return values


@pytest.fixture(scope="module")
def loaded(tiny_paths):
    base, models = tiny_paths
    return CLIPVisionModel.from_pretrained(base).eval(), [CLIPVisionModel.from_pretrained(m).eval() for m in models]


def fc1_io(model, pixels, layer):
    """(input, output) of block ``layer``'s fc1 in a full forward of ``model``."""
    captured = {}
    hook = model.encoder.layers[layer].mlp.fc1.register_forward_hook(
        lambda m, i, o: captured.update(u=i[0].detach(), h=o.detach()))
    with torch.no_grad():
        model(pixel_values=pixels)
    hook.remove()
    return captured["u"], captured["h"]


def brute_force(h_list, act, reduction="abs", eps=1e-4):
    """Reference M-Loss from q pre-activation tensors ``[B, T, n]`` (plain loops over models, float64)."""
    q = len(h_list)
    h = [x.double().reshape(-1, x.shape[-1]) for x in h_list]
    mixed = act(sum(x / q for x in h))
    g = mixed - sum(act(x) / q for x in h)
    node = (g.abs() if reduction == "abs" else g**2).mean(0)
    node_norm = (g.abs() / (mixed.abs() + eps)).mean(0)
    layer = g.norm(dim=1).mean()
    layer_norm = (g.norm(dim=1) / (mixed.norm(dim=1) + eps)).mean()
    return node, node_norm, layer, layer_norm


@pytest.mark.parametrize("prefix", ["own", "base"])
@pytest.mark.parametrize("reduction", ["abs", "sq"])
def test_scorer_matches_brute_force(tiny_paths, loaded, pixels, prefix, reduction):
    base_dir, model_dirs = tiny_paths
    base, models = loaded
    report = hf_mloss.score(base_dir, model_dirs, pixels, prefix=prefix, reduction=reduction, batch_size=3,
                            progress=False)
    act = models[0].encoder.layers[0].mlp.activation_fn
    assert report.activation == "quick_gelu" and report.num_positions == NUM * 17
    for layer in range(2):
        if prefix == "own":
            hs = [fc1_io(m, pixels, layer)[1] for m in models]
        else:
            u, _ = fc1_io(base, pixels, layer)
            hs = [m.encoder.layers[layer].mlp.fc1(u).detach() for m in models]
        node, node_norm, layer_loss, layer_norm = brute_force(hs, act, reduction)
        name = f"encoder.layers.{layer}.mlp.fc1"
        torch.testing.assert_close(report.node[name].double(), node, rtol=1e-4, atol=1e-7)
        torch.testing.assert_close(report.node_normalized[name].double(), node_norm, rtol=1e-4, atol=1e-7)
        assert report.layer[name] == pytest.approx(float(layer_loss), rel=1e-4)
        assert report.layer_normalized[name] == pytest.approx(float(layer_norm), rel=1e-4)


def test_merged_prefix_matches_manual_layerwise_merge(tiny_paths, loaded, pixels):
    """prefix="merged": block l is scored on the output of the already merged blocks < l (paper Algorithm 1)."""
    base_dir, model_dirs = tiny_paths
    base, models = loaded
    k, e = 0.3, 0.2
    result = hf_mloss.merge(base_dir, model_dirs, "m_ties", data=pixels, k=k, e=e, batch_size=4, progress=False)
    report = result.report
    # manual: merge everything but fc1 per tensor, then fc1 of each block from scores taken on that prefix (its
    # bias entry i kept iff it reaches the threshold of row i of the same task vector: the node's group)
    manual = copy.deepcopy(base)
    state = {n: t for n, t in manual.state_dict().items()}
    sources = [m.state_dict() for m in models]
    alpha = torch.full((3,), 1 / 3)
    with torch.no_grad():
        for name, tensor in state.items():
            if not tensor.is_floating_point() or name.endswith(("mlp.fc1.weight", "mlp.fc1.bias")):
                continue
            taus = [trim_tensor(s[name] - tensor, k) for s in sources]
            tensor.copy_(tensor + elect_and_merge(taus, alpha))
        act = models[0].encoder.layers[0].mlp.activation_fn
        for layer in range(2):
            u, _ = fc1_io(manual, pixels, layer)
            fc1 = f"encoder.layers.{layer}.mlp.fc1"
            hs = [torch.nn.functional.linear(u, s[fc1 + ".weight"], s[fc1 + ".bias"]) for s in sources]
            node = brute_force(hs, act)[0]
            torch.testing.assert_close(report.node[fc1].double(), node, rtol=1e-4, atol=1e-7)
            ranks = torch.empty(node.numel()); ranks[node.argsort(stable=True)] = torch.arange(node.numel()).float()
            keep = k - e * ranks / (node.numel() - 1)
            torch.testing.assert_close(report.keep_ratios[fc1], keep, rtol=0, atol=1e-6)
            base_w, base_b = state[fc1 + ".weight"], state[fc1 + ".bias"]
            taus = [trim_rows(s[fc1 + ".weight"] - base_w, report.keep_ratios[fc1]) for s in sources]
            counts = (report.keep_ratios[fc1].double() * base_w.shape[1]).floor().long()
            rows = torch.arange(len(counts))
            thresholds = [tau.abs().sort(1, descending=True).values[rows, counts - 1]
                          for tau in taus]  # the counts-th largest |τ| of each row (all counts > 0 here)
            assert bool((counts > 0).all() and (counts < base_w.shape[1]).all())
            bias_taus = [torch.where((s[fc1 + ".bias"] - base_b).abs() >= t, s[fc1 + ".bias"] - base_b, 0.0)
                         for s, t in zip(sources, thresholds)]
            base_w.copy_(base_w + elect_and_merge(taus, alpha))
            base_b.copy_(base_b + elect_and_merge(bias_taus, alpha))
    for name, tensor in result.model.state_dict().items():
        torch.testing.assert_close(tensor, state[name], rtol=0, atol=1e-6, msg=name)


def test_identical_sources_have_zero_mloss_and_unchanged_merge(tiny_paths, pixels):
    base_dir, model_dirs = tiny_paths
    same = [model_dirs[0]] * 3
    report = hf_mloss.score(base_dir, same, pixels, prefix="base", progress=False)
    assert all(v < 1e-6 for v in report.layer.values())
    assert all(float(t.abs().max()) < 1e-6 for t in report.node.values())
    result = hf_mloss.merge(base_dir, same, "m_ties", data=pixels, k=1.0, e=0.5, progress=False)
    reference = CLIPVisionModel.from_pretrained(model_dirs[0]).state_dict()
    for name, tensor in result.model.state_dict().items():
        if name.endswith(("fc1.weight", "fc1.bias")):  # node groups keep k - e·rank; with k=1 the lowest-loss keep all
            continue
        torch.testing.assert_close(tensor, reference[name], rtol=0, atol=1e-6, msg=name)


def test_scoring_is_deterministic_and_batch_size_independent(tiny_paths, pixels):
    base_dir, model_dirs = tiny_paths
    a = hf_mloss.score(base_dir, model_dirs, pixels, prefix="base", batch_size=2, progress=False)
    b = hf_mloss.score(base_dir, model_dirs, pixels, prefix="base", batch_size=8, progress=False)
    for name in a.layers:
        torch.testing.assert_close(a.node[name], b.node[name], rtol=1e-5, atol=1e-8)


def test_imagefolder_and_in_memory_dataset_give_the_same_report(tiny_paths, image_folder):
    import datasets

    base_dir, model_dirs = tiny_paths
    files = sorted(image_folder.rglob("*.png"))
    in_memory = datasets.Dataset.from_dict({"image": [str(f) for f in files]}).cast_column("image", datasets.Image())
    folder = datasets.load_dataset("imagefolder", data_dir=str(image_folder), split="train")
    # same images in the same order: read both sources without shuffling differences by taking all of them
    a = hf_mloss.score(base_dir, model_dirs, folder, num_samples=len(files), prefix="base", progress=False)
    b = hf_mloss.score(base_dir, model_dirs, in_memory, num_samples=len(files), prefix="base", progress=False)
    c = hf_mloss.score(base_dir, model_dirs, str(image_folder), num_samples=len(files), prefix="base", progress=False)
    for name in a.layers:  # the mean over all images does not depend on their order
        torch.testing.assert_close(a.node[name], b.node[name], rtol=1e-5, atol=1e-8)
        torch.testing.assert_close(a.node[name], c.node[name], rtol=1e-5, atol=1e-8)


def test_bf16_compute_is_close_to_fp32(tiny_paths, pixels, monkeypatch):
    base_dir, model_dirs = tiny_paths
    from hf_mloss.engine import score as scoring

    # the bf16 numerics on any CPU: on one without bf16 instructions the scorer would fall back to float32 (tested
    # below); bf16 still computes correctly there, only slower
    monkeypatch.setattr(scoring, "native_cpu_bf16", lambda: True)
    fp32 = hf_mloss.score(base_dir, model_dirs, pixels, prefix="base", progress=False)
    bf16 = hf_mloss.score(base_dir, model_dirs, pixels, prefix="base", compute_dtype="bfloat16", progress=False)
    assert bf16.compute_dtype == "bfloat16"
    for name in fp32.layers:
        assert bf16.layer[name] == pytest.approx(fp32.layer[name], rel=0.2)


def test_activation_override_and_few_layers(tiny_paths, pixels):
    base_dir, model_dirs = tiny_paths
    report = hf_mloss.score(base_dir, model_dirs, pixels, prefix="base", activation="gelu_pytorch_tanh",
                            layers=[1], progress=False)
    assert report.activation == "gelu_pytorch_tanh" and report.layers == ["encoder.layers.1.mlp.fc1"]


def test_accumulator_sums_match_single_pass():
    torch.manual_seed(0)
    h = torch.randn(50, 3, 7)
    alpha = torch.tensor([0.2, 0.3, 0.5])
    act = torch.nn.functional.gelu
    whole = MLossAccumulator(7)
    whole.add(h, alpha, act)
    parts = MLossAccumulator(7)
    for chunk in h.split(13):
        parts.add(chunk, alpha, act)
    a, b = whole.scores(), parts.scores()
    for field in ("node", "node_normalized", "node_ratio"):
        torch.testing.assert_close(getattr(a, field), getattr(b, field))
    for field in ("layer", "layer_normalized", "layer_ratio"):
        assert getattr(a, field) == pytest.approx(getattr(b, field), rel=1e-9)
    g, merged = node_gap(h, alpha, act)
    torch.testing.assert_close(g, act((h * alpha[:, None]).sum(1)) - (act(h) * alpha[:, None]).sum(1))


def test_report_round_trip(tmp_path, tiny_paths, pixels):
    base_dir, model_dirs = tiny_paths
    report = hf_mloss.score(base_dir, model_dirs, pixels, prefix="base", progress=False)
    report.save(tmp_path)
    back = hf_mloss.MLossReport.load(tmp_path)
    assert back.layer == report.layer and back.prefix == "base"
    for name in report.layers:
        assert torch.equal(back.node[name], report.node[name])
    assert "encoder.layers.1.mlp.fc1" in report.summary()
    assert report.to_dict(per_row=True)["node"]["encoder.layers.0.mlp.fc1"]


def test_bf16_falls_back_to_float32_without_cpu_support(tiny_paths, pixels, monkeypatch):
    from hf_mloss.engine import score as scoring

    monkeypatch.setattr(scoring, "native_cpu_bf16", lambda: False)
    base_dir, model_dirs = tiny_paths
    with pytest.warns(UserWarning, match="no bf16 instructions"):
        report = hf_mloss.score(base_dir, model_dirs, pixels, prefix="base", compute_dtype="bfloat16", progress=False)
    assert report.compute_dtype == "float32"


def test_stacked_kernel_matches_accumulator_for_every_fused_activation():
    """The blocked shared-prefix kernel equals MLossAccumulator.add on the same pre-activations, for activations with
    a fused in-place form (quick_gelu via silu, silu, relu, gelu) and without one (tanh-approximated gelu)."""
    from transformers.activations import ACT2FN

    from hf_mloss.engine.kernel import StackedTarget

    torch.manual_seed(0)
    q, n, d = 3, 400, 16  # 400 nodes: three blocks of the CPU kernel (170 nodes each for q = 3)
    # Multiples of 1/8 and 1/16 below 1: every GEMM is exact in float32 whatever its blocking, so both paths see the
    # same pre-activations and only the kernels differ.
    weights = [torch.randint(-8, 9, (n, d)) / 16 for _ in range(q)]
    biases = [torch.randint(-8, 9, (n,)) / 16 for _ in range(q)]
    u = torch.randint(-8, 9, (40, d)) / 8
    alpha = torch.tensor([0.2, 0.3, 0.5])

    class Store(dict):
        reads_rows = False

        @property
        def shapes(self):
            return {name: tuple(t.shape) for name, t in self.items()}

        def get_float(self, name, device="cpu"):
            return self[name]

    sources = [Store({"fc.weight": w, "fc.bias": b}) for w, b in zip(weights, biases)]
    for name in ("quick_gelu", "silu", "relu", "gelu", "gelu_pytorch_tanh"):
        for reduction in ("abs", "sq"):
            act = ACT2FN[name]
            target = StackedTarget(sources, "fc", mix=alpha[None], activation=act, reduction=reduction, eps=1e-4)
            assert len(target.blocks) == 3
            acc = MLossAccumulator(n, reduction=reduction)
            acc.add_sums(target.sums(u))
            ref = MLossAccumulator(n, reduction=reduction)
            ref.add(torch.stack([torch.nn.functional.linear(u, w, b) for w, b in zip(weights, biases)], 1), alpha, act)
            a, b = acc.scores(), ref.scores()
            for field in ("node", "node_normalized", "node_ratio"):
                torch.testing.assert_close(getattr(a, field), getattr(b, field), rtol=1e-4, atol=1e-6, msg=name)
            for field in ("layer", "layer_normalized", "layer_ratio"):
                assert getattr(a, field) == pytest.approx(getattr(b, field), rel=1e-5), (name, field)


@pytest.mark.parametrize("name", ["quick_gelu", "silu", "relu", "gelu", "gelu_pytorch_tanh"])
@pytest.mark.parametrize("reduction", ["abs", "sq"])
def test_own_prefix_kernel_matches_accumulator(name, reduction, monkeypatch):
    """The kernel on given pre-activations (the own-prefix path: activation folded and in place, blocks of
    positions) equals MLossAccumulator.add on the same pre-activations, with uneven blocks."""
    from transformers.activations import ACT2FN

    from hf_mloss.engine import kernel

    monkeypatch.setattr(kernel, "BLOCK_ELEMENTS", 3 * 10 * 7)  # 7 positions per block: 30 = 4 × 7 + 2
    torch.manual_seed(0)
    h = 3 * torch.randn(30, 3, 10)
    alpha = torch.tensor([0.2, 0.3, 0.5])
    act = ACT2FN[name]
    ref = MLossAccumulator(10, reduction=reduction)
    ref.add(h, alpha, act)
    acc = MLossAccumulator(10, reduction=reduction)
    acc.add_preactivations(h.clone(), alpha[None], act)
    a, b = acc.scores(), ref.scores()
    assert acc.count == ref.count == 30
    for field in ("node", "node_normalized", "node_ratio"):
        torch.testing.assert_close(getattr(a, field), getattr(b, field), rtol=1e-5, atol=1e-6, msg=field)
    for field in ("layer", "layer_normalized", "layer_ratio"):
        assert getattr(a, field) == pytest.approx(getattr(b, field), rel=1e-5), field
