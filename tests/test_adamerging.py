"""AdaMerging / AdaMerging++ (learned coefficients): objectives against hand computations, gradients against finite
differences, the functional merge against the saved one, recipes that re-run bit for bit, and refusals."""

from __future__ import annotations

import pytest
import torch
from transformers import CLIPVisionModel

import hf_mloss
from hf_mloss import MergeConfig
from hf_mloss.engine.kernel import StackedTarget
from hf_mloss.engine.objectives import (
    ObjectiveInputs,
    ScoredUnitStack,
    differentiable_outputs,
    get_objective,
)
from hf_mloss.errors import InvalidParameterError
from hf_mloss.loading.model_inputs import spread_sample
from hf_mloss.merging import learned
from hf_mloss.methods.adamerging import combine

SEED, SAMPLES, BATCH = 0, 8, 4


@pytest.fixture(scope="module")
def pixels() -> torch.Tensor:
    return torch.randn(SAMPLES, 3, 32, 32, generator=torch.Generator().manual_seed(5))


@pytest.fixture(scope="module")
def heads() -> list[torch.nn.Linear]:
    torch.manual_seed(7)
    return [torch.nn.Linear(32, 5).requires_grad_(False) for _ in range(3)]


@pytest.fixture(scope="module")
def loaded(tiny_paths):
    base, models = tiny_paths
    return (CLIPVisionModel.from_pretrained(base).eval(),
            [CLIPVisionModel.from_pretrained(m).eval() for m in models])


def _run(tiny_paths, data, **kwargs):
    base, models = tiny_paths
    options = {"method": "adamerging", "data": data, "progress": False, "steps": 1, "batch_size": BATCH,
               "max_samples": SAMPLES, **kwargs}
    return hf_mloss.merge(base, models, options.pop("method"), **options)


def _first_batch(pixels: torch.Tensor) -> torch.Tensor:
    """The batch the first step trains on (one seeded shuffle, the seeded batch order)."""
    pool = spread_sample(pixels, SAMPLES, SEED)
    batches = learned.sample_batches(len(pool), BATCH, SEED)
    return pool[batches[learned.batch_schedule(len(batches), 1, SEED)[0]]]


def _init_merge(loaded, init: float = 0.3) -> CLIPVisionModel:
    """θ₀ + init·Σ_p τ_p, tensor by tensor, in float64 sums (the hand computation of the first step's merge)."""
    base, experts = loaded
    merged = CLIPVisionModel(base.config).eval()
    state = {}
    for key, value in base.state_dict().items():
        tau = sum(e.state_dict()[key].double() - value.double() for e in experts)
        state[key] = (value.double() + init * tau).float()
    merged.load_state_dict(state)
    return merged


@torch.no_grad()
def _pooled(model, batch):
    return model(pixel_values=batch).pooler_output


# ------------------------------------------------------------------------------- objectives, by hand
def test_entropy_is_the_papers_sum_over_task_heads(tiny_paths, loaded, pixels, heads, records):
    _run(tiny_paths, pixels, heads=heads, objective="entropy", share="all")
    features = _pooled(_init_merge(loaded), _first_batch(pixels))
    expected = 0.0
    for head in heads:
        probs = torch.softmax(head(features).double(), -1)
        expected += float(-(probs * torch.log(probs + 1e-8)).sum(-1).mean())
    assert records[0].trace[0] == pytest.approx(expected, rel=1e-5)


def test_output_gap_without_heads_is_the_feature_ensemble_gap(tiny_paths, loaded, pixels, records):
    _run(tiny_paths, pixels, objective="output_gap")
    batch = _first_batch(pixels)
    merged = _pooled(_init_merge(loaded), batch).double()
    ensemble = sum(_pooled(e, batch).double() for e in loaded[1]) / 3
    expected = float((merged - ensemble).norm(dim=-1).sum() / ensemble.norm(dim=-1).sum())
    assert records[0].trace[0] == pytest.approx(expected, rel=1e-5)


def test_output_gap_with_heads_is_the_kl_from_each_routed_expert(tiny_paths, loaded, pixels, heads, records):
    _run(tiny_paths, pixels, heads=heads, objective="output_gap", share="all")
    batch = _first_batch(pixels)
    merged = _pooled(_init_merge(loaded), batch)
    expected = 0.0
    for head, expert in zip(heads, loaded[1]):
        log_e = torch.log_softmax(head(_pooled(expert, batch)).double(), -1)
        log_m = torch.log_softmax(head(merged).double(), -1)
        expected += float((log_e.exp() * (log_e - log_m)).sum(-1).mean())
    assert records[0].trace[0] == pytest.approx(expected, rel=1e-4)


def test_disagreement_is_the_cross_entropy_against_routed_experts_top_classes(tiny_paths, loaded, pixels, heads,
                                                                               records):
    _run(tiny_paths, pixels, heads=heads, objective="disagreement", share="auto")
    batch = _first_batch(pixels)
    base, experts = loaded
    # routing as selection: argmax_p ‖f_p − f_0‖ / mean over the samples of ‖f_p − f_0‖ (over every sample)
    pool = spread_sample(pixels, SAMPLES, SEED)
    moves = torch.stack([(_pooled(e, pool) - _pooled(base, pool)).norm(dim=-1) for e in experts])
    owner_all = (moves / moves.mean(1, keepdim=True)).argmax(0)
    batches = learned.sample_batches(SAMPLES, BATCH, SEED)
    index = batches[learned.batch_schedule(len(batches), 1, SEED)[0]]
    owner = owner_all[index]
    merged = _pooled(_init_merge(loaded), batch)
    expected = 0.0
    for p in owner.unique().tolist():
        rows = owner == p
        labels = heads[p](_pooled(experts[p], batch)[rows]).argmax(-1)
        expected += float(torch.nn.functional.cross_entropy(heads[p](merged[rows]).double(), labels))
    assert records[0].trace[0] == pytest.approx(expected, rel=1e-5)


def test_mloss_is_the_summed_normalised_layer_mloss_of_the_scoring_kernel(tiny_paths, loaded, pixels, records):
    """The objective, computed with gradients, equals the engine's scoring kernel on the merge's own inputs."""
    _run(tiny_paths, pixels, objective="mloss")
    merged = _init_merge(loaded)
    inputs: dict[int, torch.Tensor] = {}
    handles = [layer.mlp.fc1.register_forward_hook(lambda m, a, o, i=i: inputs.__setitem__(i, a[0]))
               for i, layer in enumerate(merged.encoder.layers)]
    _pooled(merged, _first_batch(pixels))
    for handle in handles:
        handle.remove()
    expected = 0.0
    alpha = torch.full((1, 3), 1 / 3)
    for i, layer in enumerate(merged.encoder.layers):
        stores = [_Store(e) for e in loaded[1]]
        target = StackedTarget(stores, f"encoder.layers.{i}.mlp.fc1", mix=alpha, activation=layer.mlp.activation_fn)
        with torch.no_grad():
            sums = target.sums(inputs[i], per_node=False, merged=layer.mlp.fc1)
        expected += float(sums.layer[1, 0] / sums.count)
    assert records[0].trace[0] == pytest.approx(expected, rel=1e-5)


class _Store:
    """A loaded model read as the scorer reads a checkpoint (canonical names without ``vision_model.``)."""

    reads_rows = False

    def __init__(self, model):
        self.state = {k.removeprefix("vision_model."): v for k, v in model.state_dict().items()}
        self.shapes = {name: tuple(t.shape) for name, t in self.state.items()}

    def get_float(self, name, device="cpu"):
        return self.state[name].float().to(device)

    def __contains__(self, name):
        return name in self.state


# ------------------------------------------------------------------------------- gradients
@pytest.mark.parametrize("objective", ["entropy", "output_gap", "disagreement", "mloss"])
def test_gradients_match_finite_differences(loaded, pixels, heads, objective):
    """d objective / d λ by autograd through functional_call, against central differences, in float64."""
    base, experts = loaded
    base = CLIPVisionModel(base.config).double().eval()
    base.load_state_dict(loaded[0].state_dict())
    names = [k for k, v in base.named_parameters()]
    taus = {k: torch.stack([e.state_dict()[k].double() - loaded[0].state_dict()[k].double() for e in experts])
            for k in names}
    bases = {k: v.detach().clone() for k, v in base.named_parameters()}
    group = {k: (0 if ".layers.1." in k else 1) for k in names}
    rule = learned_rule(base)
    forward = learned._Forward(base, lambda model, batch: differentiable_outputs(rule, model, batch))
    batch = {"pixel_values": pixels[:2].double()}
    double_heads = [torch.nn.Linear(32, 5).double().requires_grad_(False) for _ in heads]
    for mine, theirs in zip(double_heads, heads):
        mine.load_state_dict(theirs.state_dict())
    setup = ObjectiveInputs(rule=rule, heads=None if objective in ("output_gap", "mloss") else double_heads,
                            alpha=torch.full((3,), 1 / 3, dtype=torch.float64))
    with torch.no_grad():
        outputs = [torch.func.functional_call(forward, {f"tower.{k}": bases[k] + taus[k][p] for k in names}, (batch,))
                   for p in range(3)]
    handles = []
    if objective == "mloss":
        for i, layer in enumerate(base.encoder.layers):
            key = f"encoder.layers.{i}.mlp.fc1"
            stack = ScoredUnitStack(
                weight=torch.stack([e.state_dict()[f"{key}.weight"].double() for e in experts]),
                bias=torch.stack([e.state_dict()[f"{key}.bias"].double() for e in experts]),
                activation=layer.mlp.activation_fn)
            handles += stack.hooks(layer.mlp.fc1, None)
            setup.units.append(stack)
    owner = torch.tensor([0, 2])

    def value(coefficients: torch.Tensor) -> torch.Tensor:
        params = {f"tower.{k}": combine(bases[k], taus[k], coefficients[group[k]]) for k in names}
        merged = torch.func.functional_call(forward, params, (batch,))
        return get_objective(objective).value(setup, merged, batch, outputs, owner)

    coefficients = torch.full((2, 3), 0.3, dtype=torch.float64) + 0.05 * torch.randn(
        2, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    try:  # central differences of every coefficient against autograd's gradient
        assert torch.autograd.gradcheck(value, (coefficients.requires_grad_(),), eps=1e-6, atol=1e-6, rtol=1e-4,
                                        check_undefined_grad=False)
    finally:
        for handle in handles:
            handle.remove()


def learned_rule(model):
    from hf_mloss.adapters.registry import adapter_for

    return adapter_for(model.config).output_rule(model)


# ------------------------------------------------------------------------------- the merge and its recipe
def test_saved_merge_equals_the_functional_merge_at_the_learned_coefficients(tiny_paths, loaded, pixels):
    result = _run(tiny_paths, pixels, objective="output_gap", steps=3, granularity="block")
    rows = {row[0]: torch.tensor(row[1:]) for row in result.config.parameters["coefficients"]}
    assert set(rows) == {"embeddings", "block.0", "block.1", "tail"}
    assert any(not torch.allclose(v, torch.full((3,), 0.3)) for v in rows.values())  # training moved them
    base, experts = loaded
    groups = {0: "block.0", 1: "block.1"}
    saved = result.model.state_dict()
    params = {}
    for key, value in base.state_dict().items():
        canonical = key.removeprefix("vision_model.")
        layer = next((i for i in groups if f"encoder.layers.{i}." in canonical), None)
        label = groups[layer] if layer is not None else "embeddings" if "embeddings" in canonical or \
            "pre_layrnorm" in canonical else "tail"
        taus = torch.stack([e.state_dict()[key] - value for e in experts])
        params[key] = combine(value, taus, rows[label])
        hand = value.double() + sum(c * t.double() for c, t in zip(rows[label].double(), taus))
        assert torch.allclose(saved[key].double(), hand, atol=1e-6), key
    with torch.no_grad():
        functional = torch.func.functional_call(base, params, (), {"pixel_values": pixels}).pooler_output
        assert torch.equal(functional, result.model(pixel_values=pixels).pooler_output)


def test_recipe_reruns_bit_for_bit_without_training_and_relearn_trains_again(tiny_paths, image_folder, heads,
                                                                            tmp_path, monkeypatch):
    first = _run(tiny_paths, str(image_folder), heads=heads, objective="entropy", steps=2)
    first.save_pretrained(tmp_path / "merged")
    card = (tmp_path / "merged" / "README.md").read_text()
    assert "39 groups x 3 models (learned; in hf_mloss_config.yaml)" in card and "s per step, peak RSS" in card
    config = MergeConfig.from_pretrained(tmp_path / "merged")
    assert config.parameters["heads"] == [{"in_memory": "Linear"}] * 3
    calls = []
    original = learned._learn
    monkeypatch.setattr(learned, "_learn", lambda *a, **k: calls.append(1) or original(*a, **k))
    again = hf_mloss.run(config, progress=False)
    assert calls == []
    for key, value in first.model.state_dict().items():
        assert torch.equal(value, again.model.state_dict()[key]), key
    assert again.config.parameters["coefficients"] == first.config.parameters["coefficients"]

    with pytest.raises(InvalidParameterError, match="passed from Python"):
        config.replace(parameters={**config.parameters, "relearn": True})
    relearned = hf_mloss.run(config.replace(parameters={**config.parameters, "relearn": True, "heads": heads}),
                             progress=False)
    assert calls == [1]
    assert relearned.config.parameters["coefficients"] == first.config.parameters["coefficients"]  # same data, seed
    assert "relearn" not in relearned.config.parameters


def test_adamerging_ties_scales_trimmed_sign_elected_task_vectors(tiny_paths, loaded, pixels):
    k = 0.3
    result = _run(tiny_paths, pixels, method="adamerging_ties", objective="output_gap", granularity="task", k=k)
    (label, *values), = result.config.parameters["coefficients"]
    assert label == "all"
    base, experts = loaded
    keys = list(base.state_dict())
    taus = [{key: e.state_dict()[key] - base.state_dict()[key] for key in keys} for e in experts]
    total = sum(v.numel() for v in base.state_dict().values())
    kept = int(total * k)
    trimmed = []
    for tau in taus:
        flat = torch.cat([t.abs().flatten() for t in tau.values()])
        threshold = flat.kthvalue(total - kept + 1).values
        trimmed.append({key: torch.where(t.abs() >= threshold, t, torch.zeros_like(t)) for key, t in tau.items()})
    for key in keys:
        stack = torch.stack([t[key] for t in trimmed])
        sign = torch.sign(stack.sum(0))
        sign[sign == 0] = 1
        agreeing = stack * (torch.sign(stack) == sign)
        hand = base.state_dict()[key].double() + sum(c * a.double() for c, a in zip(values, agreeing))
        assert torch.allclose(result.model.state_dict()[key].double(), hand, atol=1e-6), key


def test_causal_lm_objectives_need_no_heads(tmp_path):
    from examples.tiny import save_with_finetunes, tiny_decoder, word_tokenizer

    base, models = save_with_finetunes(tiny_decoder("llama"), tmp_path, 2, tokenizer=word_tokenizer(64))
    texts = [" ".join(f"w{(i * 7 + j) % 60}" for j in range(5 + i % 4)) for i in range(8)]
    for objective in ("entropy", "output_gap", "disagreement", "mloss"):
        result = hf_mloss.merge(str(base), [str(m) for m in models], "adamerging", data=texts, progress=False,
                                steps=2, batch_size=4, objective=objective, granularity="block")
        assert len(result.config.parameters["coefficients"]) == 4  # embeddings, 2 blocks, tail


# ------------------------------------------------------------------------------- refusals
@pytest.mark.parametrize(("kwargs", "match"), [
    ({"objective": "entropy"}, "needs one classification head per model"),
    ({"objective": "disagreement"}, "needs one classification head per model"),
    ({"objective": "entropyy"}, "Unknown objective 'entropyy'"),
    ({"steps": 0}, "steps"),
    ({"lr": 0.0}, "lr"),
    ({"batch_size": 100_000}, "batch_size"),
    ({"max_samples": 0}, "max_samples"),
    ({"granularity": "row"}, "granularity"),
    ({"coefficients": [["all", 0.3, "x", 0.3]]}, r"coefficients\[0\]"),
    ({"coefficients": [["all", 0.3, 0.3]]}, "do not fit these models"),
])
def test_refusals(tiny_paths, pixels, kwargs, match):
    with pytest.raises(InvalidParameterError, match=match):
        _run(tiny_paths, pixels, **kwargs)


def test_refuses_selection(tiny_paths, pixels):
    with pytest.raises(InvalidParameterError, match="learns its coefficients"):
        _run(tiny_paths, pixels, select="unlabeled", grid={"init": [0.2, 0.3]})


def test_refuses_heads_where_the_objective_reads_no_classes(tiny_paths, pixels, heads):
    with pytest.raises(InvalidParameterError, match="remove heads"):
        _run(tiny_paths, pixels, heads=heads, objective="mloss")
    with pytest.raises(InvalidParameterError, match="got 2 for 3 models"):
        _run(tiny_paths, pixels, heads=heads[:2], objective="entropy")


def test_dinov2_with_the_suites_prototype_heads(tmp_path):
    """The suites' call: a DINOv2 encoder, frozen prototype heads (objects with ``.logits``), pixel tensors."""
    from transformers import Dinov2Config, Dinov2Model

    from benchmarks.suites.training import TaskHead
    from examples.tiny import save_with_finetunes

    torch.manual_seed(0)
    config = Dinov2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, mlp_ratio=2, image_size=32,
                          patch_size=8)
    base, models = save_with_finetunes(Dinov2Model(config).eval(), tmp_path, 2)
    heads = [TaskHead(weight=torch.nn.functional.normalize(torch.randn(4, 32), dim=-1), scale=10.0) for _ in models]
    pixels = torch.randn(8, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    result = hf_mloss.merge(str(base), [str(m) for m in models], "adamerging", data=pixels, heads=heads,
                            objective="entropy", steps=3, batch_size=4, lr=1e-2, progress=False)
    assert isinstance(result.model, Dinov2Model)
    values = torch.tensor([row[1:] for row in result.config.parameters["coefficients"]])
    assert values.shape[1] == 2 and not torch.allclose(values, torch.full_like(values, 0.3))
    assert "Coefficients learned on unlabeled data: 3 Adam steps" in result.method_description


def test_yaml_recipe_with_head_files(tiny_paths, image_folder, heads, tmp_path):
    """A recipe file names its heads as safetensors files (`weight`, `bias`); they are recorded as given."""
    from safetensors.torch import save_file

    files = []
    for i, head in enumerate(heads):
        files.append(str(tmp_path / f"head{i}.safetensors"))
        save_file({"weight": head.weight.contiguous(), "bias": head.bias.contiguous()}, files[-1])
    base, models = tiny_paths
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"base: {base}\nmodels: {models}\nmethod: adamerging\ndata: {image_folder}\nbatch_size: 4\n"
                      f"parameters: {{objective: entropy, steps: 2, max_samples: 8, heads: {files}}}\n")
    from_files = hf_mloss.run(MergeConfig.from_yaml(recipe), progress=False)
    from_modules = _run(tiny_paths, str(image_folder), heads=heads, objective="entropy", steps=2)
    assert from_files.config.parameters["heads"] == files
    # the same heads, read two ways: the same coefficients up to float rounding (the ops may differ in their last
    # bits between a module and the head built from its file, and on other CPUs' kernels)
    ours = {row[0]: row[1:] for row in from_files.config.parameters["coefficients"]}
    theirs = {row[0]: row[1:] for row in from_modules.config.parameters["coefficients"]}
    assert ours.keys() == theirs.keys()
    for group, values in ours.items():
        assert values == pytest.approx(theirs[group], rel=1e-5, abs=1e-7), group


def test_coefficients_no_output_depends_on_are_not_trained(tiny_paths, image_folder, heads):
    """The attention key bias shifts every score of a query alike, which the softmax ignores: its coefficients'
    gradient is exactly zero, so they are not trained (Adam would turn float noise into steps of ±lr, a value that
    depends on the CPU's kernels); the card names them. Every other coefficient moves."""
    result = _run(tiny_paths, str(image_folder), heads=heads, objective="entropy", steps=3, lr=0.05)
    rows = {row[0]: row[1:] for row in result.config.parameters["coefficients"]}
    keys = [g for g in rows if g.endswith("self_attn.k_proj.bias")]
    assert len(keys) == 2  # one per block of the tiny CLIP
    for group, values in rows.items():
        if group in keys:
            assert values == [float(torch.tensor(0.3))] * len(values), group  # the float32 start
    assert any(v != 0.3 for g, values in rows.items() if g not in keys for v in values)
    assert "encoder.layers.0.self_attn.k_proj.bias" in result.method_description
    assert "their gradient is exactly zero" in result.method_description


def test_the_builtin_objective_names_are_the_registered_ones():
    """`hf-mloss methods` checks a default objective without importing the registry (which imports torch)."""
    from hf_mloss.engine.objectives import OBJECTIVES
    from hf_mloss.methods.adamerging import BUILTIN_OBJECTIVES

    assert set(BUILTIN_OBJECTIVES) <= set(OBJECTIVES)


def test_a_registered_objective_is_accepted_without_the_methods_importing_the_registry():
    """The registry (engine) tells the learned methods' parameters (methods, a layer below) each name it adds."""
    from hf_mloss.engine.objectives import OBJECTIVES, Objective, register_objective
    from hf_mloss.methods.adamerging import OBJECTIVE_NAMES, AdaMergingParams

    with pytest.raises(InvalidParameterError, match="Unknown objective 'custom_gap'.*available"):
        AdaMergingParams(objective="custom_gap")

    class Custom(Objective):
        name, description = "custom_gap", "a test objective"

    register_objective(Custom())
    try:
        assert AdaMergingParams(objective="custom_gap").objective == "custom_gap"
    finally:
        OBJECTIVES.pop("custom_gap")
        OBJECTIVE_NAMES.discard("custom_gap")
