"""AdaRank over TSV-M / Iso-C / CART (learned singular-component masks): masks ≡ 1 give the data-free merges bit for
bit, gradients through the masks against finite differences, the recipe re-run bit for bit, a learned merge that lowers
its objective, and refusals."""

from __future__ import annotations

import pytest
import torch
from transformers import CLIPVisionModel

import hf_mloss
from hf_mloss import MergeConfig
from hf_mloss.engine.objectives import ObjectiveInputs, differentiable_outputs, get_objective
from hf_mloss.errors import InvalidParameterError
from hf_mloss.loading.model_inputs import spread_sample
from hf_mloss.merging import learned
from hf_mloss.methods import get_method
from hf_mloss.methods.adarank import Components, masked_matrix, straight_through
from hf_mloss.methods.base import MergeContext
from hf_mloss.methods.iso import iso_c_matrix
from hf_mloss.methods.tsv import tsv_merge_matrix

SEED, SAMPLES, BATCH = 0, 8, 4
PAIRS = [("adarank_tsv", "tsv_m"), ("adarank_iso", "iso_c"), ("adarank_cart", "cart")]


@pytest.fixture(scope="module")
def pixels() -> torch.Tensor:
    return torch.randn(SAMPLES, 3, 32, 32, generator=torch.Generator().manual_seed(5))


def _run(tiny_paths, data, method="adarank_tsv", **kwargs):
    base, models = tiny_paths
    options = {"data": data, "progress": False, "steps": 1, "batch_size": BATCH, "max_samples": SAMPLES,
               "objective": "output_gap", **kwargs}
    return hf_mloss.merge(base, models, method, **options)


def _components(method: str, taus: torch.Tensor, **params) -> Components | torch.Tensor:
    ctx = MergeContext(params=get_method(method).make_params(**params), weights=torch.ones(len(taus)))
    return get_method(method).components(taus, ctx.params)


# ------------------------------------------------------------------------------------ masks ≡ 1 = the data-free merge
@pytest.mark.parametrize("zero_task", [False, True])
def test_all_kept_components_are_the_data_free_matrices_bit_for_bit(zero_task):
    g = torch.Generator().manual_seed(3)
    taus = torch.randn(3, 12, 9, generator=g)
    if zero_task:  # a task that left the matrix unchanged has no components (no mask row of its own)
        taus[1] = 0
    tsv = _components("adarank_tsv", taus)
    active = [0, 2] if zero_task else [0, 1, 2]  # k = floor(rank / tasks that changed it) = 9 // 2 or 9 // 3
    assert tsv.rows == [(t, i * (9 // len(active)), 9 // len(active)) for i, t in enumerate(active)]
    assert torch.equal(masked_matrix(tsv, torch.ones(tsv.count)), tsv_merge_matrix(taus, None))
    iso = _components("adarank_iso", taus)
    assert torch.equal(masked_matrix(iso, torch.ones(iso.count)), iso_c_matrix(taus.sum(0)))
    # a dropped component removes exactly its rank-one term
    mask = torch.ones(tsv.count)
    mask[4] = 0
    term = torch.outer(tsv.left[:, 4], tsv.right[4]) * tsv.scale[4]
    torch.testing.assert_close(masked_matrix(tsv, mask), tsv_merge_matrix(taus, None) - term, atol=1e-5, rtol=0)


@pytest.mark.parametrize("method", ["adarank_tsv", "adarank_iso", "adarank_cart"])
def test_the_saved_merge_from_recorded_masks_is_the_functional_merge_bit_for_bit(method):
    """Random logits: the training's merged tensor, the masks it records, and the merge from those records."""
    from hf_mloss.methods.adarank import MASK_STATE

    g = torch.Generator().manual_seed(4)
    base = torch.randn(12, 9, generator=g)
    sources = [base + 0.1 * torch.randn(12, 9, generator=g) for _ in range(3)]
    sources[1] = base.clone()  # model 1 left the matrix unchanged: no components of its own
    rule = get_method(method)
    params = rule.make_params(objective="output_gap")
    ctx = MergeContext(params=params, weights=torch.ones(3))
    part = rule.functional_part("w", base, sources, ctx)
    layout = rule.layout({"w": part}, None, ctx)
    logits = torch.randn(layout.count, generator=g)
    functional = rule.functional_tensor(base, part, logits, params)
    recorded = rule.use_trained(ctx, layout, logits)["masks"]
    (name, *rows), = recorded
    assert name == "w" and len(rows) == (1 if method == "adarank_iso" else 3)
    assert sum(len(r) for r in rows) == int((logits <= 0).sum()) > 0
    if method == "adarank_tsv":  # (CART centres it: model 1's matrix is −τ̄, with components of its own)
        assert rows[1] == []
    fresh = MergeContext(params=rule.make_params(objective="output_gap", masks=recorded), weights=torch.ones(3))
    rule.use_recorded(fresh, ["w"], None, 3)
    assert fresh.state[MASK_STATE] == {"w": rows}
    assert torch.equal(rule.merge_tensor("w", base, sources, fresh), functional)


def test_cart_components_are_the_centred_truncations_around_the_average_bit_for_bit():
    """adarank_cart's parts: per matrix the kept components of every centred task matrix (k per task) and τ̄ as the
    offset, so masks ≡ 1 merge to cart's matrix bit for bit; a tensor that is not a matrix is the average, unscaled,
    with no coefficient under learn_lam; a dropped component removes its rank-one term from the low-rank part only."""
    from hf_mloss.methods.adarank import LAM_STATE

    g = torch.Generator().manual_seed(8)
    base, bias = torch.randn(12, 9, generator=g), torch.randn(12, generator=g)
    sources = [base + 0.1 * torch.randn(12, 9, generator=g) for _ in range(3)]
    sources[1] = base.clone()  # unchanged: centred, it is −τ̄ and keeps components of its own
    biases = [bias + 0.1 * torch.randn(12, generator=g) for _ in range(3)]
    rule, cart = get_method("adarank_cart"), get_method("cart")
    params = rule.make_params(objective="output_gap", lam=1.7, fraction=0.25)
    ctx = MergeContext(params=params, weights=torch.ones(3))
    part = rule.functional_part("w", base, sources, ctx)
    assert part.rows == [(0, 0, 2), (1, 2, 2), (2, 4, 2)]  # k = floor(9 · 0.25) = 2 per task
    torch.testing.assert_close(part.offset, torch.stack(sources).sub(base).mean(0), rtol=0, atol=0)
    data_free = MergeContext(params=cart.make_params(lam=1.7, fraction=0.25), weights=torch.ones(3))
    full = rule.functional_tensor(base, part, torch.ones(part.count), params)
    assert torch.equal(full, cart.merge_tensor("w", base, sources, data_free))
    logits = torch.ones(part.count)
    logits[3] = -1.0
    term = 1.7 * part.scale[3] * torch.outer(part.left[:, 3], part.right[3])
    torch.testing.assert_close(rule.functional_tensor(base, part, logits, params), full - term, atol=1e-6, rtol=0)
    rest = rule.functional_part("b", bias, biases, ctx)
    assert torch.equal(rule.functional_tensor(bias, rest, None, params),
                       cart.merge_tensor("b", bias, biases, data_free))
    learning = rule.make_params(objective="output_gap", learn_lam=True, lam=1.7, fraction=0.25)
    lctx = MergeContext(params=learning, weights=torch.ones(3))
    layout = rule.layout({"w": part, "b": rest}, None, lctx)
    assert layout.slots["b"] is None and layout.slots["w"] == slice(0, part.count + 3)
    values = torch.cat([torch.ones(part.count), torch.tensor([0.5, 1.0, 2.0])])
    recorded = rule.use_trained(lctx, layout, values)
    assert recorded["coefficients"] == [["w", 0.5, 1.0, 2.0]]
    fresh = MergeContext(params=rule.make_params(objective="output_gap", learn_lam=True, lam=1.7, fraction=0.25,
                                                 **recorded), weights=torch.ones(3))
    rule.use_recorded(fresh, ["w", "b"], None, 3)  # the bias learns none: not missing
    assert set(fresh.state[LAM_STATE]) == {"w"}
    assert torch.equal(rule.merge_tensor("w", base, sources, fresh),
                       rule.functional_tensor(base, part, values, learning))
    assert torch.equal(rule.merge_tensor("b", bias, biases, fresh), cart.merge_tensor("b", bias, biases, data_free))
    assert "calibrate" not in params.to_dict()  # the learned merge takes no calibration


@pytest.mark.parametrize("method", ["adarank_tsv", "adarank_iso"])
def test_learned_coefficients_scale_their_components_and_the_recorded_ones_merge_bit_for_bit(method):
    """learn_lam: each matrix's slot holds its masks then its λ (TSV-M: one per model, Iso-C: one), starting at
    lam; the merged matrix is θ₀ + Σ_c λ(c)·m_c·σ_c u_c v_cᵀ by hand; a bias learns one λ; the recorded masks and
    coefficients merge to the training's bits."""
    from hf_mloss.methods.adarank import LAM_STATE

    g = torch.Generator().manual_seed(6)
    base, bias = torch.randn(12, 9, generator=g), torch.randn(12, generator=g)
    sources = [base + 0.1 * torch.randn(12, 9, generator=g) for _ in range(3)]
    biases = [bias + 0.1 * torch.randn(12, generator=g) for _ in range(3)]
    rule = get_method(method)
    params = rule.make_params(objective="output_gap", learn_lam=True, lam=0.7)
    ctx = MergeContext(params=params, weights=torch.ones(3))
    parts = {"w": rule.functional_part("w", base, sources, ctx), "b": rule.functional_part("b", bias, biases, ctx)}
    layout = rule.layout(parts, None, ctx)
    part, lams = parts["w"], 3 if method == "adarank_tsv" else 1
    assert layout.slots["w"] == slice(0, part.count + lams) and layout.slots["b"] == slice(part.count + lams,
                                                                                         part.count + lams + 1)
    assert torch.equal(layout.initial[part.count:], torch.full((lams + 1,), 0.7))
    values = torch.cat([torch.randn(part.count, generator=g), torch.tensor([0.5, 1.5, 2.5][:lams] + [1.25])])
    functional = {n: rule.functional_tensor(b, parts[n], values[layout.slots[n]], params)
                  for n, b in (("w", base), ("b", bias))}
    kept = (values[:part.count] > 0).float()
    owner = [max(model, 0) for model, _, count in part.rows for _ in range(count)]
    by_hand = base + sum(values[part.count + owner[c]] * kept[c] * (part.scale if part.scale.dim() == 0
                                                                    else part.scale[c])
                         * torch.outer(part.left[:, c], part.right[c]) for c in range(part.count))
    torch.testing.assert_close(functional["w"], by_hand, atol=1e-5, rtol=0)
    torch.testing.assert_close(functional["b"], bias + 1.25 * torch.stack(biases).sub(bias).mean(0))
    recorded = rule.use_trained(ctx, layout, values)
    assert recorded["coefficients"] == [["w", *values[part.count:part.count + lams].tolist()], ["b", 1.25]]
    fresh = MergeContext(params=rule.make_params(objective="output_gap", learn_lam=True, **recorded),
                         weights=torch.ones(3))
    assert not fresh.params.learns
    rule.use_recorded(fresh, ["w", "b"], None, 3)
    assert set(fresh.state[LAM_STATE]) == {"w", "b"}
    assert torch.equal(rule.merge_tensor("w", base, sources, fresh), functional["w"])
    assert torch.equal(rule.merge_tensor("b", bias, biases, fresh), functional["b"])
    with pytest.raises(InvalidParameterError, match="do not fit these models"):
        rule.use_recorded(fresh, ["w", "b", "c"], None, 3)
    wrong = MergeContext(params=rule.make_params(objective="output_gap", learn_lam=True, masks=recorded["masks"],
                                                 coefficients=[["w", 1.0, 2.0, 3.0, 4.0], ["b", 1.0]]),
                         weights=torch.ones(3))
    rule.use_recorded(wrong, ["w", "b"], None, 3)
    with pytest.raises(InvalidParameterError, match="4 values"):
        rule.merge_tensor("w", base, sources, wrong)


def test_learned_coefficients_can_raise_the_merge_and_rerun_bit_for_bit(tiny_paths, image_folder, records):
    """A learn_lam run records a λ for every changed tensor, moves them off lam, and its recipe re-runs without
    training to the same bits; coefficients without learn_lam are refused."""
    first = _run(tiny_paths, str(image_folder), "adarank_tsv", steps=12, lr=0.05, learn_lam=True)
    assert records[0].trace[-1] < records[0].trace[0]
    coefficients = first.config.parameters["coefficients"]
    changed = {n for n, v in first.model.state_dict().items()}
    assert coefficients and {row[0] for row in coefficients} <= changed
    assert any(v != 1.0 for row in coefficients for v in row[1:])
    again = hf_mloss.run(first.config, progress=False)
    assert len(records) == 1  # recorded masks and coefficients: no training
    for key, value in first.model.state_dict().items():
        assert torch.equal(value, again.model.state_dict()[key]), key
    with pytest.raises(InvalidParameterError, match="learn_lam=True"):
        _run(tiny_paths, str(image_folder), "adarank_tsv", coefficients=coefficients)


@pytest.mark.parametrize(("method", "reference"), PAIRS)
def test_recorded_empty_masks_and_the_first_step_are_the_data_free_merge(tiny_paths, pixels, records, method,
                                                                        reference):
    base, models = tiny_paths
    data_free = hf_mloss.merge(base, models, reference, progress=False)
    kept = _run(tiny_paths, pixels, method, masks=[])
    assert records == []  # recorded masks: no training
    for key, value in data_free.model.state_dict().items():
        assert torch.equal(value, kept.model.state_dict()[key]), key
    # the functional merge at the initial logits (every component kept) is the data-free model: same objective
    with pytest.warns(UserWarning, match="in steps=1 at lr=0.01 no mask can leave mask_init"):  # one step: said
        _run(tiny_paths, pixels, method)
    pool = spread_sample(pixels, SAMPLES, SEED)
    batches = learned.sample_batches(len(pool), BATCH, SEED)
    batch = pool[batches[learned.batch_schedule(len(batches), 1, SEED)[0]]]
    experts = [CLIPVisionModel.from_pretrained(m).eval() for m in models]
    with torch.no_grad():
        merged = data_free.model(pixel_values=batch).pooler_output.double()
        ensemble = sum(e(pixel_values=batch).pooler_output.double() for e in experts) / 3
    expected = float((merged - ensemble).norm(dim=-1).sum() / ensemble.norm(dim=-1).sum())
    assert records[0].trace[0] == pytest.approx(expected, rel=1e-5)


# ----------------------------------------------------------------------------------------------------- gradients
def test_gradients_through_the_masks_match_finite_differences(tiny_paths, pixels):
    """d objective / d m (the continuous mask of every component of a matrix) by autograd through
    functional_call, against central differences in float64; the logits get it times sigmoid'(l/T)/T."""
    from hf_mloss.adapters.registry import adapter_for

    base_path, models = tiny_paths
    base = CLIPVisionModel.from_pretrained(base_path).double().eval()
    experts = [CLIPVisionModel.from_pretrained(m).double().eval() for m in models]
    state = base.state_dict()
    names = ["encoder.layers.1.mlp.fc1.weight"]
    parts = {n: _components("adarank_tsv", torch.stack([e.state_dict()[n] - state[n] for e in experts]),
                            fraction=0.125) for n in names}  # 4 components per task: 12 masks
    sizes = [parts[n].count for n in names]
    rule = adapter_for(base.config).output_rule(base)
    forward = learned._Forward(base, lambda model, batch: differentiable_outputs(rule, model, batch))
    batch = {"pixel_values": pixels[:2].double()}
    with torch.no_grad():
        outputs = [torch.func.functional_call(forward, {f"tower.{k}": v for k, v in e.state_dict().items()},
                                              (batch,)) for e in experts]
    setup = ObjectiveInputs(rule=rule, heads=None, alpha=torch.full((3,), 1 / 3, dtype=torch.float64))

    def value(mask: torch.Tensor) -> torch.Tensor:
        params = {f"tower.{n}": state[n] + masked_matrix(parts[n], m) for n, m in zip(names, mask.split(sizes))}
        merged = torch.func.functional_call(forward, params, (batch,))
        return get_objective("output_gap").value(setup, merged, batch, outputs, None)

    mask = torch.ones(sum(sizes), dtype=torch.float64)
    mask[::3] = 0.0  # some components dropped: the gradient is taken at a hard mask, as in training
    assert torch.autograd.gradcheck(value, (mask.clone().requires_grad_(),), eps=1e-6, atol=1e-7, rtol=1e-4)

    logits = torch.where(mask > 0, 0.3, -0.2).double().requires_grad_()
    hard = straight_through(logits, 10.0)
    assert torch.equal(hard.detach(), mask)  # the forward pass is exactly the hard mask
    value(hard).backward()
    m = mask.clone().requires_grad_()
    value(m).backward()
    slope = torch.sigmoid(logits.detach() / 10) * (1 - torch.sigmoid(logits.detach() / 10)) / 10
    torch.testing.assert_close(logits.grad, m.grad * slope, rtol=1e-10, atol=1e-14)


# ------------------------------------------------------------------------------------------ training and the recipe
def test_learned_masks_lower_the_objective_and_the_recipe_reruns_bit_for_bit(tiny_paths, image_folder, records,
                                                                              tmp_path):
    first = _run(tiny_paths, str(image_folder), "adarank_tsv", steps=12, lr=0.05)
    trace = records[0].trace
    assert trace[-1] < trace[0] and min(trace) < 0.8 * trace[0]  # the masks moved the merge towards the ensemble
    masks = first.config.parameters["masks"]
    assert masks and all(len(row) == 4 for row in masks)  # [tensor, dropped of each of the 3 models]
    assert "Component masks learned on unlabeled data: 12 Adam steps" in first.method_description
    first.save_pretrained(tmp_path / "merged")
    card = (tmp_path / "merged" / "README.md").read_text()
    dropped = sum(len(d) for row in masks for d in row[1:])
    assert f"{dropped} components dropped in {len(masks)} matrices" in card and "peak RSS" in card

    config = MergeConfig.from_pretrained(tmp_path / "merged")
    again = hf_mloss.run(config, progress=False)
    assert len(records) == 1  # no training
    for key, value in first.model.state_dict().items():
        assert torch.equal(value, again.model.state_dict()[key]), key
    relearned = hf_mloss.run(config.replace(parameters={**config.parameters, "relearn": True}), progress=False)
    assert len(records) == 2 and relearned.config.parameters["masks"] == masks  # same data and seed
    assert "relearn" not in relearned.config.parameters


def test_iso_learns_one_mask_per_component_of_the_sum(tiny_paths, pixels, records):
    result = _run(tiny_paths, pixels, "adarank_iso", steps=12, lr=0.05)
    assert records[0].trace[-1] < records[0].trace[0]
    masks = result.config.parameters["masks"]
    assert masks and all(len(row) == 2 for row in masks)


# ----------------------------------------------------------------------------------------------------- refusals
@pytest.mark.parametrize(("kwargs", "match"), [
    ({"masks": [["x", [1, "a"]]]}, r"masks\[0\]"),
    ({"masks": [["x", [1]], ["x", [2]]]}, "twice"),
    ({"masks": [["nope.weight", [0], [], []]]}, "do not change"),
    ({"masks": [["encoder.layers.0.mlp.fc1.weight", [0]]]}, "1 lists, 3 expected"),
    ({"masks": [["encoder.layers.0.mlp.fc1.weight", [99], [], []]]}, "drop component 99 of model 0"),
    ({"fraction": 0.5}, "at most 1/q"),
    ({"mask_init": 0.0}, "mask_init"),
    ({"temperature": -1.0}, "temperature"),
    ({"objective": "entropy"}, "needs one classification head per model"),
])
def test_refusals(tiny_paths, pixels, kwargs, match):
    with pytest.raises(InvalidParameterError, match=match):
        _run(tiny_paths, pixels, **kwargs)


# ------------------------------------------------------------------------- the steps that cannot drop a mask (issue 57)
def test_the_data_free_steps_are_9_at_the_defaults_and_bound_torchs_adam():
    """No gradient sequence moves a value farther in n Adam steps than lr·Σ_{t≤n} adam_step_bound(t): checked on
    torch's Adam with constant gradients, a burst after silence, the Cauchy–Schwarz maximiser (gradients growing as
    (β₂/β₁)^i) and random ones."""
    import math

    from hf_mloss.methods.adarank import adam_step_bound, data_free_steps

    assert data_free_steps(0.1, 1e-2) == 9 and data_free_steps(0.1, 1e-3) == 70
    assert adam_step_bound(1) == 1.0 and 9.12 < sum(adam_step_bound(t) for t in range(1, 10)) < 9.13
    generator = torch.Generator().manual_seed(0)
    sequences = {"constant": [1.0] * 12, "burst": [0.0] * 8 + [1e3] * 4,
                 "maximiser": [(0.999 / 0.9) ** i for i in range(12)],
                 "random": torch.randn(12, generator=generator).abs().tolist()}
    for name, grads in sequences.items():
        value = torch.nn.Parameter(torch.zeros((), dtype=torch.float64))
        optimizer = torch.optim.Adam([value], lr=1e-2)
        reach = 0.0
        for t, g in enumerate(grads, 1):
            value.grad = torch.tensor(-g, dtype=torch.float64)  # every step pushes the same way
            optimizer.step()
            reach += adam_step_bound(t)
            assert float(value.detach()) <= 1e-2 * reach * (1 + 1e-12), (name, t)
        assert name != "constant" or math.isclose(float(value.detach()), 0.12, rel_tol=1e-6)


def test_nine_steps_at_the_defaults_are_the_data_free_merge_and_say_so(tiny_paths, pixels, records):
    """The documented boundary: at lr 1e-2 and mask_init 0.1, 9 steps cannot drop a component (the merge is
    TSV-M's, bit for bit, and a warning says so); 10 steps may, and do not warn."""
    base, models = tiny_paths
    with pytest.warns(UserWarning, match=r"adarank_tsv: in steps=9 at lr=0.01 no mask can leave mask_init=0.1"):
        nine = _run(tiny_paths, pixels, "adarank_tsv", steps=9, lr=1e-2)
    assert nine.config.parameters["masks"] == [] and len(records[0].trace) == 9
    data_free = hf_mloss.merge(base, models, "tsv_m", progress=False)
    for key, value in data_free.model.state_dict().items():
        assert torch.equal(value, nine.model.state_dict()[key]), key
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="adarank")
        _run(tiny_paths, pixels, "adarank_tsv", steps=10, lr=1e-2)
