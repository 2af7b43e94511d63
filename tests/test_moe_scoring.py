"""Gated node M-Loss per MoE expert (hf_mloss.adapters.experts, hf_mloss.engine.experts; docs/mloss.md).

On tiny Mixtral, Qwen2-MoE (a shared expert, a dense block), Qwen3-MoE and OLMoE fine-tunes: each expert's node and
the block's layer M-Loss equal a brute force computed from hooks on each model's own forward, with the routing read
from the router logits as the transformers module computes it (softmax, top-k, renormalised where the family does),
for the own and the base prefix; padding never counts; an expert no token is routed to is reported as such (NaN
nodes, no value, its status), never as 0. M-TIES trims each expert's rows and columns at its nodes' keep ratios
(checked against an independent merge) and its output loads with nothing missing; the compatibility report's pairs
equal a direct score of each pair; label-free selection runs; RegMean refuses.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import transformers
from torch import nn
from transformers import AutoModelForCausalLM

import hf_mloss
from examples import tiny as testing
from hf_mloss.adapters import adapter_for

VOCAB = 64
SMALL = dict(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
             max_position_embeddings=64, bos_token_id=1, eos_token_id=2, pad_token_id=3)
FAMILIES = {
    "mixtral": lambda: transformers.MixtralForCausalLM(transformers.MixtralConfig(
        **SMALL, intermediate_size=12, num_local_experts=5, num_experts_per_tok=2)),
    "qwen2_moe": lambda: transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
        **SMALL, intermediate_size=20, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
        shared_expert_intermediate_size=12, decoder_sparse_step=1, mlp_only_layers=[1])),
    "qwen3_moe": lambda: transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        **SMALL, head_dim=8, intermediate_size=20, num_experts=3, num_experts_per_tok=2, moe_intermediate_size=4,
        decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True)),
    "olmoe": lambda: transformers.OlmoeForCausalLM(transformers.OlmoeConfig(
        **SMALL, intermediate_size=8, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True)),
}
SEQUENCES = [[5, 9, 13, 21, 8, 40], [7, 7, 30], [11, 4, 52, 19, 23, 6, 44, 17]]
TEXTS = [" ".join(f"w{i - 4}" for i in seq) for seq in SEQUENCES]
TOKENS = sum(map(len, SEQUENCES))


def _rig_router(model) -> None:
    """Mixtral's block 0 routes no token to expert 4: its router rows are v, −v, w, −w and 0, so one of the first
    two logits and one of the next two are ≥ 0 at every token and top-2 never picks the zero row."""
    generator = torch.Generator().manual_seed(7)
    v, w = torch.randn(2, model.config.hidden_size, generator=generator)
    with torch.no_grad():
        model.model.layers[0].mlp.gate.weight.copy_(torch.stack([v, -v, w, -w, torch.zeros_like(v)]))


def _save(family: str, root, q: int):
    torch.manual_seed(0)
    base = FAMILIES[family]().eval()
    models = [base, *[testing.perturbed(base, i, 5e-2) for i in range(q)]]
    folders = []
    for i, model in enumerate(models):
        if family == "mixtral":
            _rig_router(model)
        folder = root / ("base" if i == 0 else f"ft{i}")
        model.save_pretrained(folder)
        testing.word_tokenizer(VOCAB).save_pretrained(folder)
        folders.append(str(folder))
    return folders[0], folders[1:]


@pytest.fixture(scope="module", params=list(FAMILIES))
def saved(request, tmp_path_factory):
    return request.param, *_save(request.param, tmp_path_factory.mktemp(request.param), 2)


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    return _save("mixtral", tmp_path_factory.mktemp("mixtral3"), 3)


def _batch() -> dict[str, torch.Tensor]:
    return testing.right_padded(SEQUENCES)


# ------------------------------------------------------------------------------------------------- brute force
def _records(model) -> dict[int, dict[str, torch.Tensor]]:
    """Per block, from hooks on the model's own forward over the padded batch: the MLP's input ``u`` and the router
    logits at the real positions (float64)."""
    batch = _batch()
    mask = batch["attention_mask"].bool()
    records: dict[int, dict[str, torch.Tensor]] = {}
    handles = []
    for layer, block in enumerate(model.model.layers):
        records[layer] = {}
        handles.append(block.mlp.register_forward_pre_hook(
            lambda m, args, layer=layer: records[layer].__setitem__("u", args[0][mask].double())))
        router = getattr(block.mlp, "gate", None)
        if router is not None and not isinstance(router, nn.Linear):
            handles.append(router.register_forward_hook(lambda m, args, out, layer=layer: records[layer].__setitem__(
                "logits", out[0].reshape(*mask.shape, -1)[mask].double())))
    with torch.no_grad():
        model(**batch)
    for handle in handles:
        handle.remove()
    return records


def _routed_parts(prefix_model, record) -> list[tuple[str, torch.Tensor]]:
    """``(label, weight of the part at each real position)`` of one block as the transformers module computes them:
    softmax of the router logits, top-k, renormalised over the k (Mixtral always, others where norm_topk_prob); the
    shared expert's sigmoid gate; 1 for a dense MLP."""
    mlp = prefix_model.model.layers[record["layer"]].mlp
    if "logits" not in record:
        return [("mlp", torch.ones(len(record["u"]), dtype=torch.float64))]
    config = prefix_model.config
    probs = torch.softmax(record["logits"], dim=-1)
    top, index = probs.topk(config.num_experts_per_tok, dim=-1)
    if config.model_type == "mixtral" or config.norm_topk_prob:
        top = top / top.sum(-1, keepdim=True)
    weights = torch.zeros_like(probs).scatter(1, index, top)
    out = [(f"experts.{e}", weights[:, e]) for e in range(weights.shape[1])]
    if hasattr(mlp, "shared_expert"):
        gate = mlp.shared_expert_gate.weight.detach().double()
        out.append(("shared_expert", torch.sigmoid(record["u"] @ gate.T)[:, 0]))
    return out


def _rows(model, layer: int, label: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The gate and up rows of one part, from the model's own parameters."""
    mlp = model.model.layers[layer].mlp
    if label.startswith("experts."):
        fused = mlp.experts.gate_up_proj[int(label.split(".")[1])].detach().double()
        return fused[: fused.shape[0] // 2], fused[fused.shape[0] // 2:]
    module = mlp if label == "mlp" else mlp.shared_expert
    return module.gate_proj.weight.detach().double(), module.up_proj.weight.detach().double()


def _brute_force(models, prefix_models) -> dict[int, dict[str, object]]:
    """Per block: the node vector (parts concatenated; NaN for a part no token reaches), the block's layer M-Loss
    Σ w‖g‖₂ / Σ w and the tokens of each part, with equal weights. Model p's pre-activations come from
    ``prefix_models[p]``'s MLP input and the part weight of a position is the mean of the prefix models' weights."""
    records = []
    for prefix in prefix_models:
        record = _records(prefix)
        for layer in record:
            record[layer]["layer"] = layer
        records.append(record)
    out = {}
    for layer in records[0]:
        parts = [_routed_parts(prefix, record[layer]) for prefix, record in zip(prefix_models, records)]
        nodes, tokens, gap_mass, mass = [], [], 0.0, 0.0
        for j, (label, _) in enumerate(parts[0]):
            weight = torch.stack([p[j][1] for p in parts]).mean(0)
            routed = weight > 0
            gates, ups = [], []
            for model, record in zip(models, records):
                gate, up = _rows(model, layer, label)
                u = record[layer]["u"][routed]
                gates.append(u @ gate.T)
                ups.append(u @ up.T)
            a, b = torch.stack(gates), torch.stack(ups)
            g = nn.functional.silu(a.mean(0)) * b.mean(0) - (nn.functional.silu(a) * b).mean(0)
            w = weight[routed]
            tokens.append(int(routed.sum()))
            if w.numel() == 0:
                nodes.append(torch.full((gate.shape[0],), math.nan, dtype=torch.float64))
                continue
            nodes.append((w[:, None] * g.abs()).sum(0) / w.sum())
            gap_mass += float((w * g.norm(dim=-1)).sum())
            mass += float(w.sum())
        out[layer] = {"node": torch.cat(nodes), "layer": gap_mass / mass, "tokens": tokens}
    return out


def _load(folder):
    return AutoModelForCausalLM.from_pretrained(folder).eval()


@pytest.mark.parametrize("prefix", ["own", "base"])
def test_mloss_per_expert_equals_a_brute_force(saved, prefix):
    family, base, models = saved
    loaded = [_load(m) for m in models]
    prefixes = loaded if prefix == "own" else [_load(base)] * len(loaded)
    expected = _brute_force(loaded, prefixes)
    adapter = adapter_for(loaded[0].config)
    assert type(adapter).__name__ == "MoeAdapter" and adapter.scorable
    report = hf_mloss.score(base, models, data=TEXTS, num_samples=3, prefix=prefix, batch_size=2, progress=False)
    assert report.num_positions == TOKENS  # padding never counts
    for layer, want in expected.items():
        name = adapter.target_name(layer)
        assert name == f"model.layers.{layer}.mlp"
        torch.testing.assert_close(report.node[name].double(), want["node"], rtol=1e-4, atol=1e-7, equal_nan=True)
        assert report.layer[name] == pytest.approx(want["layer"], rel=1e-4)
        assert [part["tokens"] for part in report.parts[name]] == want["tokens"]
        if prefix == "base" and len(want["tokens"]) > 1:  # every real token reaches k experts (and the shared one)
            k = loaded[0].config.num_experts_per_tok
            routed = [p["tokens"] for p in report.parts[name] if p["part"].startswith("experts.")]
            assert sum(routed) == k * TOKENS


def test_the_layout_of_each_family(saved):
    family, base, _ = saved
    adapter = adapter_for(transformers.AutoConfig.from_pretrained(base))
    labels = [[part.label for part in adapter.parts(layer)] for layer in range(adapter.num_layers)]
    expected = {"mixtral": [[f"experts.{e}" for e in range(5)]] * 2,
                "qwen2_moe": [["experts.0", "experts.1", "experts.2", "experts.3", "shared_expert"], ["mlp"]],
                "qwen3_moe": [["experts.0", "experts.1", "experts.2"]] * 2,
                "olmoe": [[f"experts.{e}" for e in range(4)]] * 2}[family]
    assert labels == expected


def test_fused_experts_are_read_straight_into_place_with_the_assembled_bits(saved):
    """``CheckpointStore.read_into`` reads each per-expert tensor of a fused parameter straight into its place in the
    buffer (where transformers' converter stacks and concatenates it): the bits of the assembled tensor, into a
    buffer of the stored dtype or converted on the way."""
    from hf_mloss.loading.hub import resolve_model
    from hf_mloss.loading.store import CheckpointStore

    family, _, models = saved
    store = CheckpointStore(resolve_model(models[0]), adapter_for(transformers.AutoConfig.from_pretrained(models[0])))
    fused = [name for name in store.shapes if name.endswith(("gate_up_proj", "down_proj")) and ".experts." in name]
    assert fused
    for name in fused:
        whole = store.get(name)
        for dtype in (whole.dtype, torch.bfloat16):
            out = torch.full(whole.shape, float("nan"), dtype=dtype)
            assert store.read_into(name, out) is out and torch.equal(out, whole.to(dtype)), (name, dtype)
        assert store._placements[name][0] is not None, name  # read in place, not assembled first


def test_an_expert_no_token_reaches_is_reported_as_such(mixtral, tmp_path):
    base, models = mixtral
    report = hf_mloss.score(base, models[:2], data=TEXTS, num_samples=3, prefix="own", progress=False)
    name = "model.layers.0.mlp"
    unrouted = report.parts[name][4]
    assert unrouted["part"] == "experts.4" and unrouted["tokens"] == 0 and unrouted["weight"] == 0.0
    assert unrouted["status"] == "no token routed to it" and unrouted["mloss"] is None
    start, stop = unrouted["nodes"]
    assert report.node[name][start:stop].isnan().all() and not report.node[name][:start].isnan().any()
    assert all(part["tokens"] > 0 for part in report.parts["model.layers.1.mlp"])
    assert "experts.4" in report.summary() and "no token routed to it" in report.summary()
    text = json.loads(report.to_json(per_row=True))
    assert text["node"][name][start:stop] == [None] * (stop - start)
    report.save(tmp_path)
    again = hf_mloss.MLossReport.load(tmp_path)
    assert again.parts == report.parts and again.node[name][start:stop].isnan().all()


def _ties(taus: torch.Tensor) -> torch.Tensor:
    """TIES's elect and disjoint mean with equal weights (an exact-zero sum elects +)."""
    sign = torch.where(taus.sum(0) >= 0, 1.0, -1.0).to(taus)
    agree = (torch.sign(taus) == sign) & (taus != 0)
    count = agree.sum(0)
    return torch.where(count > 0, (taus * agree).sum(0) / count.clamp_min(1), torch.zeros_like(taus[0]))


def _trim_slices(tau: torch.Tensor, keep: torch.Tensor, dim: int) -> torch.Tensor:
    """Slice i of ``tau`` along ``dim`` keeps its floor(length · keep_i) largest |τ| (ties at the threshold kept)."""
    out = tau.clone()
    moved = out.movedim(dim, 0)
    for i, slice_ in enumerate(moved):
        count = int(math.floor(float(keep[i]) * slice_.numel()))
        if count <= 0:
            slice_.zero_()
        elif count < slice_.numel():
            threshold = slice_.abs().flatten().topk(count).values[-1]
            slice_[slice_.abs() < threshold] = 0
    return out


def test_m_ties_trims_each_expert_at_its_nodes_keep_ratios_and_loads(mixtral, tmp_path):
    base, models = mixtral
    k, e = 0.5, 0.1
    result = hf_mloss.merge(base, models[:2], "m_ties", data=TEXTS, num_samples=3, k=k, e=e, progress=False)
    report = result.report
    assert set(report.keep_ratios) == {"model.layers.0.mlp", "model.layers.1.mlp"}
    keep0 = report.keep_ratios["model.layers.0.mlp"].double()
    start, stop = report.parts["model.layers.0.mlp"][4]["nodes"]  # expert 4: no token, no ranking
    torch.testing.assert_close(keep0[start:stop], torch.full((stop - start,), k - e / 2, dtype=torch.float64))
    measured = torch.cat([keep0[:start], keep0[stop:]])
    assert measured.max() == pytest.approx(k) and measured.min() == pytest.approx(k - e)
    node = report.node["model.layers.0.mlp"][:start]
    assert int(node.argmin()) == int(measured.argmax()) and int(node.argmax()) == int(measured.argmin())

    state = result.model.state_dict()
    loaded = [_load(m).state_dict() for m in (base, *models[:2])]
    for layer in range(2):
        keep = report.keep_ratios[f"model.layers.{layer}.mlp"].double().view(5, -1)  # [experts, I]
        for name, dim, tiles in (("gate_up_proj", 0, 2), ("down_proj", 1, 1)):
            key = f"model.layers.{layer}.mlp.experts.{name}"
            taus = torch.stack([m[key] - loaded[0][key] for m in loaded[1:]]).double()
            trimmed = torch.stack([torch.stack([_trim_slices(tau[x], keep[x].repeat(tiles), dim)
                                                for x in range(5)]) for tau in taus])
            torch.testing.assert_close(state[key].double(), loaded[0][key].double() + _ties(trimmed), rtol=0,
                                       atol=1e-6)
    result.save_pretrained(tmp_path / "out")
    model, info = AutoModelForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not any(info.values()), info
    with torch.no_grad():
        assert torch.isfinite(model(**_batch()).logits).all()


def test_m_ties_with_e_0_is_ties_per_tensor_bit_for_bit(saved):
    family, base, models = saved
    ours = hf_mloss.merge(base, models, "m_ties", data=TEXTS, num_samples=3, k=0.4, e=0.0,
                          progress=False).model.state_dict()
    ties = hf_mloss.merge(base, models, "ties", k=0.4, scope="tensor", progress=False).model.state_dict()
    assert all(torch.equal(ours[key], ties[key]) for key in ties)


def test_compatibility_pairs_equal_a_direct_score_of_each_pair(mixtral, tmp_path):
    """Each pair's routing weights differ (own prefix: the mean of its two members' own weights), each pair's number
    is a direct score of that pair; an expert no token reaches has NaN nodes in every subset and the report saves."""
    base, models = mixtral
    compat = hf_mloss.compatibility(base, models, data=TEXTS, num_samples=3, per_node=True, progress=False)
    matrix = compat.matrix()
    for i, j in ((0, 1), (0, 2), (1, 2)):
        direct = hf_mloss.score(base, [models[i], models[j]], data=TEXTS, num_samples=3, prefix="own",
                                progress=False)
        assert float(matrix[i, j]) == pytest.approx(sum(direct.layer.values()) / len(direct.layer), rel=1e-5)
        row = compat.subsets.index((i, j))
        torch.testing.assert_close(compat.node["model.layers.0.mlp"][row].double(),
                                   direct.node["model.layers.0.mlp"].double(), rtol=1e-5, atol=1e-8, equal_nan=True)
    start, stop = direct.parts["model.layers.0.mlp"][4]["nodes"]
    assert compat.node["model.layers.0.mlp"][:, start:stop].isnan().all()
    compat.save(tmp_path / "compat")


def test_label_free_selection_runs_on_an_moe(mixtral):
    base, models = mixtral
    for method, criterion in (("m_ties", "mloss"), ("ties", "output")):
        result = hf_mloss.merge(base, models[:2], method, data=TEXTS, num_samples=3, select="unlabeled",
                                criterion=criterion, grid={"k": [0.3, 0.6], "lam": [0.5, 1.0]}, progress=False)
        values = [c[criterion] for c in result.config.select.candidates]
        assert len(values) == 4 and all(math.isfinite(v) and v > 0 for v in values)


def test_regmean_refuses_an_moe_naming_what_works(mixtral):
    from hf_mloss.errors import UnsupportedModelError

    base, models = mixtral
    with pytest.raises(UnsupportedModelError, match="m_ties / m_dare, compatibility"):
        hf_mloss.merge(base, models[:2], "regmean", data=TEXTS, num_samples=3, progress=False)


def test_a_bare_moe_model_is_scored_under_its_own_names(tmp_path):
    """A ``MixtralModel`` (no LM head) names its blocks ``layers.N``: the unit, the groups and the report follow."""
    torch.manual_seed(0)
    base = transformers.MixtralModel(FAMILIES["mixtral"]().config).eval()
    folder, models = testing.save_with_finetunes(base, tmp_path, 2, tokenizer=testing.word_tokenizer(VOCAB),
                                                 scale=5e-2)
    result = hf_mloss.merge(str(folder), [str(m) for m in models], "m_ties", data=TEXTS, num_samples=3,
                            prefix="base", progress=False)
    assert list(result.report.layer) == ["layers.0.mlp", "layers.1.mlp"]
    assert len(result.report.keep_ratios["layers.0.mlp"]) == 5 * 12
