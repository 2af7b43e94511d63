"""A family is one adapter class and one registry line: a custom gated-MLP ``PreTrainedModel`` defined here.

The model (``model_type="hf_mloss_test_gated"``) has token embeddings, blocks that mix tokens without attention
(LayerNorm + a masked causal mean + a linear) and a gated MLP (``gate_proj``, ``up_proj``, ``down_proj``, SiLU), and a
final norm. Base and fine-tunes are saved with ``save_pretrained``; its adapter is registered in the test, then:
(a) every data-free method merges it and the output reloads; (b) M-TIES trims each node's group (gate row i, up row
i, down column i) at the node's keep ratio; (c) ``hf_mloss.score`` equals a brute-force gated gap from forward hooks.
Parts that need the M-Loss engine for gated units (the gated kernel, the walk with a per-batch context, text data)
are skipped until it is there.
"""

from __future__ import annotations

import functools
import math
import threading
import re
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from transformers import AutoConfig, PretrainedConfig, PreTrainedModel

import hf_mloss
from hf_mloss.adapters import ModelAdapter, register_adapter
from hf_mloss.methods import MERGE_METHODS
from hf_mloss.methods import ops as ops_module
from examples.tiny import save_with_finetunes, word_tokenizer

from hf_mloss.adapters.base import BlockContext, ScoredUnit

MODEL_TYPE = "hf_mloss_test_gated"
Q = 3
TEXTS = [" ".join(f"w{(7 * i + 3 * j) % 60}" for j in range(3 + i % 5)) for i in range(12)]


# --------------------------------------------------------------------------------------------------------------------
# The custom model (what a user would have in their own code)
# --------------------------------------------------------------------------------------------------------------------


class GatedTestConfig(PretrainedConfig):
    model_type = MODEL_TYPE

    def __init__(self, vocab_size: int = 64, hidden_size: int = 16, intermediate_size: int = 24,
                 num_hidden_layers: int = 3, hidden_act: str = "silu", **kwargs: Any) -> None:
        self.vocab_size, self.hidden_size, self.intermediate_size = vocab_size, hidden_size, intermediate_size
        self.num_hidden_layers, self.hidden_act = num_hidden_layers, hidden_act
        super().__init__(**{"pad_token_id": 3, **kwargs})


class GatedMLP(nn.Module):
    def __init__(self, config: GatedTestConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class MixingBlock(nn.Module):
    """Token mixing without attention: each position adds a linear map of the mean of the (normed) positions up to
    it, padding excluded; then a gated MLP."""

    def __init__(self, config: GatedTestConfig) -> None:
        super().__init__()
        self.mix_norm = nn.LayerNorm(config.hidden_size)
        self.mix = nn.Linear(config.hidden_size, config.hidden_size)
        self.mlp_norm = nn.LayerNorm(config.hidden_size)
        self.mlp = GatedMLP(config)

    def mix_tokens(self, hidden: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        x = self.mix_norm(hidden)
        keep = torch.ones(hidden.shape[:2], device=hidden.device) if mask is None else mask.to(hidden.dtype)
        keep = keep.unsqueeze(-1)
        mean = (x * keep).cumsum(1) / keep.cumsum(1).clamp_min(1.0)
        return hidden + self.mix(mean)

    def forward(self, hidden: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        hidden = self.mix_tokens(hidden, mask)
        return hidden + self.mlp(self.mlp_norm(hidden))


class GatedTestModel(PreTrainedModel):
    config_class = GatedTestConfig
    base_model_prefix = "model"

    def __init__(self, config: GatedTestConfig) -> None:
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(MixingBlock(config) for _ in range(config.num_hidden_layers))
        self.norm = nn.LayerNorm(config.hidden_size)
        self.post_init()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        for block in self.layers:
            hidden = block(hidden, attention_mask)
        return self.norm(hidden)


AutoConfig.register(MODEL_TYPE, GatedTestConfig, exist_ok=True)  # a transformers custom model's usual registration


# --------------------------------------------------------------------------------------------------------------------
# Its hf_mloss adapter: one class and one line
# --------------------------------------------------------------------------------------------------------------------


class GatedTestAdapter(ModelAdapter):
    name = MODEL_TYPE
    model_types = (MODEL_TYPE,)
    model_class = GatedTestModel
    modality = "text"
    input_names = ("input_ids", "attention_mask")
    pipeline_tag = "feature-extraction"
    layer_pattern = re.compile(r"layers\.(\d+)\.")
    unit = ScoredUnit(gate="mlp.gate_proj", up="mlp.up_proj", down="mlp.down_proj")
    target_suffix = "mlp.gate_proj"  # = unit.gate

    def canonical_key(self, key: str) -> str | None:
        return key

    def is_embedding(self, name: str) -> bool:
        return name.startswith("embed_tokens.")

    def layer_prefix(self, layer: int) -> str:
        return f"layers.{layer}."

    def layers(self, model: PreTrainedModel) -> list[nn.Module]:
        return list(model.layers)

    def embed(self, model, batch):
        return model.embed_tokens(batch["input_ids"]), BlockContext(mask=batch["attention_mask"].bool())

    def forward_to_target(self, layer, hidden, context):
        residual = layer.mix_tokens(hidden, context.mask)
        return residual, layer.mlp_norm(residual)

    def forward_from_target(self, layer, residual, target_input, context):
        return residual + layer.mlp(target_input)


register_adapter(GatedTestAdapter)


# --------------------------------------------------------------------------------------------------------------------
# Fixtures and references
# --------------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def family(tmp_path_factory) -> tuple[str, list[str]]:
    torch.manual_seed(0)
    base = GatedTestModel(GatedTestConfig()).eval()
    base_dir, ft_dirs = save_with_finetunes(base, tmp_path_factory.mktemp("gated"), q=Q, tokenizer=word_tokenizer())
    return str(base_dir), [str(d) for d in ft_dirs]


def load_sd(folder: str) -> dict[str, torch.Tensor]:
    return load_file(f"{folder}/model.safetensors")


def group_members(layer: int) -> list[tuple[str, int]]:
    prefix = f"layers.{layer}.mlp."
    return [(f"{prefix}gate_proj.weight", 0), (f"{prefix}up_proj.weight", 0), (f"{prefix}down_proj.weight", 1)]


def top_m(values: np.ndarray, m: int) -> np.ndarray:
    """Keep the m largest |values| (argsort: exactly m on distinct magnitudes)."""
    out = np.zeros_like(values)
    if m > 0:
        index = np.argsort(-np.abs(values), kind="stable")[:m]
        out[index] = values[index]
    return out


def ref_group_merge(base: dict, fts: list[dict], keep: dict[int, np.ndarray], *, k: float) -> dict[str, np.ndarray]:
    """M-TIES reference (float64 over the float32 task vectors): each node's gate row, up row and down column keep
    floor(len·keep_i) entries; every other tensor is trimmed per tensor at k; elect + disjoint mean (uniform α)."""
    slices = {name: (dim, layer) for layer in keep for name, dim in group_members(layer)}
    out = {}
    for name, base_tensor in base.items():
        taus = np.stack([(ft[name].float() - base_tensor.float()).double().numpy() for ft in fts])
        trimmed = []
        for tau in taus:
            if name in slices:
                dim, layer = slices[name]
                view = tau if dim == 0 else tau.T
                length = view.shape[1]
                t = np.stack([top_m(view[i], math.floor(length * float(keep[layer][i]))) for i in range(len(view))])
                trimmed.append(t if dim == 0 else t.T)
            else:
                trimmed.append(top_m(tau.reshape(-1), math.floor(tau.size * k)).reshape(tau.shape))
        trimmed = np.stack(trimmed)
        total = trimmed.sum(0)
        sign = np.where(total >= 0, 1.0, -1.0)
        agree = (np.sign(trimmed) == sign) & (trimmed != 0)
        count = agree.sum(0)
        merged = np.where(count > 0, (trimmed * agree).sum(0) / np.maximum(count, 1), 0.0)
        out[name] = base_tensor.double().numpy() + merged
    return out


def spec_keep(scores: torch.Tensor, k: float, e: float) -> np.ndarray:
    """SPEC §2: keep_i = k − e·rank_i/(n−1), ranks ascending and stable."""
    order = np.argsort(scores.double().numpy(), kind="stable")
    ranks = np.empty(len(order))
    ranks[order] = np.arange(len(order))
    return k - e * ranks / (len(order) - 1)


class TrimSpy:
    """Records, per tensor name, every task vector that M-TIES trims slice by slice (after the trim)."""

    def __init__(self, monkeypatch, method_name: str = "m_ties") -> None:
        self.trimmed: dict[str, list[torch.Tensor]] = {}
        self.keeps: dict[str, torch.Tensor] = {}
        method = MERGE_METHODS[method_name]
        merge_tensor, trim_slices_ = method.merge_tensor, ops_module.trim_slices_
        lock = threading.Lock()
        current = threading.local()  # the driver merges tensors on several worker threads at once

        def merge_spy(name, base, sources, ctx):
            current.name = name
            return merge_tensor(name, base, sources, ctx)

        def trim_spy(tau, keep, dim=0, **kwargs):
            out = trim_slices_(tau, keep, dim, **kwargs)
            with lock:
                self.trimmed.setdefault(current.name, []).append(tau.detach().clone())
                self.keeps[current.name] = keep.detach().double().cpu()
            return out

        monkeypatch.setattr(method, "merge_tensor", merge_spy)
        monkeypatch.setattr(ops_module, "trim_slices_", trim_spy)

    def check_group_counts(self, keep: dict[int, np.ndarray], q: int) -> None:
        """Gate row i, up row i and down column i of each trimmed task vector keep exactly floor(len·keep_i)."""
        for layer, ratios in keep.items():
            for name, dim in group_members(layer):
                assert len(self.trimmed[name]) == q, name
                np.testing.assert_allclose(self.keeps[name].numpy(), ratios, rtol=0, atol=1e-12)
                for tau in self.trimmed[name]:
                    length = tau.shape[1 - dim]
                    nonzero = (tau != 0).sum(1 - dim).tolist()
                    assert nonzero == [math.floor(length * float(r)) for r in ratios], (name, nonzero)


def merge_with_scores(base: str, models: list[str], method_name: str, scores: dict[int, torch.Tensor],
                      **params: Any) -> dict[str, torch.Tensor]:
    """A data-guided merge driven by given node scores (the hooks in a merged-prefix pass's order), no data."""
    from hf_mloss.loading.inputs import open_inputs
    from hf_mloss.merging.merger import TensorMerger
    from hf_mloss.methods import MergeContext
    from hf_mloss.engine.score import LayerScores
    from hf_mloss.merging.selection import replay_layerwise

    # data= only satisfies the config's check: the scores are given, nothing is read
    config = hf_mloss.MergeConfig.from_kwargs(base, models, method_name, data=TEXTS, **params)
    method, method_params = config.merge_method(), config.method_params()
    layer_scores = {layer: LayerScores(node=node, node_normalized=node, node_ratio=node, layer=0.0,
                                       layer_normalized=0.0, layer_ratio=0.0) for layer, node in scores.items()}
    with open_inputs(config, needs_data=False, progress=False) as inputs:
        model = inputs.load_output_model("tower", progress=False, dtype=torch.float32)
        ctx = MergeContext(params=method_params, weights=inputs.alpha.float(), seed=config.seed)
        merger = TensorMerger(inputs, method, ctx, model)
        replay_layerwise(merger, method, layer_scores)
        return {name: tensor.detach().clone() for name, tensor in merger.targets.items()}


# --------------------------------------------------------------------------------------------------------------------
# Tests
# --------------------------------------------------------------------------------------------------------------------


def test_registered_family_is_chosen_and_declares_its_node_groups(family) -> None:
    from hf_mloss.adapters import adapter_for, list_adapters

    assert MODEL_TYPE in list_adapters()
    adapter = adapter_for(AutoConfig.from_pretrained(family[0]))
    assert isinstance(adapter, GatedTestAdapter)
    assert adapter.node_groups(1) == group_members(1)
    assert adapter.stage_of("embed_tokens.weight") == -1 and adapter.stage_of("layers.2.mix.bias") == 2
    assert adapter.stage_of("norm.weight") == adapter.num_layers == 3


def test_the_model_ignores_padding_on_either_side(family) -> None:
    """What the brute force below relies on: a padded text gives the unpadded outputs at its real tokens."""
    model = GatedTestModel.from_pretrained(family[1][0]).eval()
    ids = torch.tensor([[5, 6, 7]])
    with torch.no_grad():
        alone = model(ids, attention_mask=torch.ones_like(ids))
        right = model(torch.tensor([[5, 6, 7, 3, 3]]), attention_mask=torch.tensor([[1, 1, 1, 0, 0]]))
        left = model(torch.tensor([[3, 3, 5, 6, 7]]), attention_mask=torch.tensor([[0, 0, 1, 1, 1]]))
    torch.testing.assert_close(right[:, :3], alone)
    torch.testing.assert_close(left[:, 2:], alone)


DATA_FREE_SPECIAL = {"passthrough"}  # re-stacks layer ranges: needs slices=, not models


def data_free_methods() -> list[str]:
    return [name for name in hf_mloss.list_methods()
            if not MERGE_METHODS[name].needs_data and name not in DATA_FREE_SPECIAL]


@pytest.mark.parametrize("method", data_free_methods())
def test_every_data_free_method_merges_and_reloads(family, method, tmp_path, recwarn) -> None:
    from transformers import AutoTokenizer

    base, models = family
    # SLERP, NearSwap, Arcee Fusion: the base and exactly one model; NuSLERP: exactly two
    chosen = models[:1] if method in ("slerp", "nearswap", "arcee_fusion") else models[:2] if method == "nuslerp" \
        else models
    result = hf_mloss.merge(base, chosen, method, progress=False, **({"t": 1e-3} if method == "nearswap" else {}))
    assert isinstance(result.model, GatedTestModel)
    folder = result.save_pretrained(tmp_path / "merged")
    reloaded = GatedTestModel.from_pretrained(folder).eval()
    assert AutoTokenizer.from_pretrained(folder)("w1 w2")["input_ids"] == [5, 6]  # the base's tokenizer, beside it
    assert not [w for w in recwarn if "image processor" in str(w.message)]  # a text family needs none
    merged, again = result.model.state_dict(), reloaded.state_dict()
    assert merged.keys() == again.keys()
    for name, tensor in merged.items():
        assert torch.equal(again[name], tensor), name
    base_sd = load_sd(base)
    if method != "average":  # average over 3 distinct fine-tunes: every tensor moved
        changed = [n for n in merged if not torch.equal(merged[n], base_sd[n])]
        assert changed, f"{method} returned the base unchanged"
    ids = torch.tensor([[4, 5, 6, 3]])
    with torch.no_grad():
        out = reloaded(ids, attention_mask=torch.tensor([[1, 1, 1, 0]]))
    assert out.shape == (1, 4, 16) and torch.isfinite(out).all()


@pytest.mark.parametrize("e", [0.2, 0.0])
def test_m_ties_trims_each_node_group_at_its_keep_ratio(family, monkeypatch, e) -> None:
    """Given node scores (no data): gate row i, up row i and down column i of each task vector keep
    floor(len·keep_i) entries; everything else is the per-tensor trim at k. e = 0: exactly ties(scope="tensor")."""
    base, models = family
    k = 0.5
    generator = torch.Generator().manual_seed(3)
    scores = {layer: torch.rand(24, generator=generator, dtype=torch.float64) for layer in (0, 2)}
    spy = TrimSpy(monkeypatch)
    got = merge_with_scores(base, models, "m_ties", scores, k=k, e=e, layers=[0, 2])
    if e == 0:
        assert spy.trimmed == {}  # the uniform-keep shortcut: every tensor trimmed per tensor
        ties = hf_mloss.merge(base, models, "ties", k=k, scope="tensor", progress=False).model.state_dict()
        for name, tensor in got.items():
            assert torch.equal(tensor, ties[name]), name
        return
    keep = {layer: spec_keep(node, k, e) for layer, node in scores.items()}
    assert float(min(keep[0])) == pytest.approx(k - e) and float(max(keep[0])) == pytest.approx(k)
    spy.check_group_counts(keep, Q)
    assert not any(name.startswith("layers.1.mlp.") and name in spy.trimmed for name in got)  # layer 1: not scored
    expected = ref_group_merge(load_sd(base), [load_sd(m) for m in models], keep, k=k)
    for name, tensor in got.items():
        np.testing.assert_allclose(tensor.double().numpy(), expected[name], rtol=0, atol=1e-6, err_msg=name)


def test_m_dare_trims_node_groups_and_drops_the_rest(family, monkeypatch) -> None:
    base, models = family
    p, e = 0.6, 0.2
    scores = {layer: torch.linspace(0, 1, 24, dtype=torch.float64).flip(0) for layer in range(3)}
    spy = TrimSpy(monkeypatch, "m_dare")
    got = merge_with_scores(base, models, "m_dare", scores, p=p, e=e, seed=1)
    keep = {layer: spec_keep(node, p, e) for layer, node in scores.items()}
    spy.check_group_counts(keep, Q)
    # every other tensor: DARE (keep each entry with probability p, seeded per tensor and source; survivors ×1/p)
    from hf_mloss.methods.ops import tensor_seed

    base_sd, fts = load_sd(base), [load_sd(m) for m in models]
    grouped = {name for layer in keep for name, _ in group_members(layer)}
    for name in sorted(set(got) - grouped):
        taus = []
        for i, ft in enumerate(fts):
            mask = torch.rand(ft[name].shape, generator=torch.Generator().manual_seed(tensor_seed(1, name, i))) < p
            taus.append(np.where(mask.numpy(), (ft[name].float() - base_sd[name].float()).double().numpy(), 0.0) / p)
        taus = np.stack(taus)
        sign = np.where(taus.sum(0) >= 0, 1.0, -1.0)
        agree = (np.sign(taus) == sign) & (taus != 0)
        merged = np.where(agree.any(0), (taus * agree).sum(0) / np.maximum(agree.sum(0), 1), 0.0)
        np.testing.assert_allclose(got[name].double().numpy(), base_sd[name].double().numpy() + merged, rtol=0,
                                   atol=2e-6, err_msg=name)


def test_m_ties_merges_the_family_on_text(family, monkeypatch, tmp_path) -> None:
    base, models = family
    k, e = 0.5, 0.2
    spy = TrimSpy(monkeypatch)
    result = hf_mloss.merge(base, models, "m_ties", k=k, e=e, data=TEXTS, num_samples=len(TEXTS), batch_size=5,
                            progress=False)
    report = result.report
    gates = [f"layers.{layer}.mlp.gate_proj" for layer in range(3)]
    assert set(report.keep_ratios) == set(gates)
    keep = {}
    for layer, name in enumerate(gates):
        keep[layer] = spec_keep(report.node[name], k, e)
        np.testing.assert_allclose(report.keep_ratios[name].double().numpy(), keep[layer], atol=1e-7, rtol=0)
    spy.check_group_counts(keep, Q)
    expected = ref_group_merge(load_sd(base), [load_sd(m) for m in models], keep, k=k)
    for name, tensor in result.model.state_dict().items():
        np.testing.assert_allclose(tensor.double().numpy(), expected[name], rtol=0, atol=1e-6, err_msg=name)
    folder = result.save_pretrained(tmp_path / "merged")
    assert GatedTestModel.from_pretrained(folder) is not None


def brute_force_gated_gap(base: str, models: list[str], layer_count: int) -> dict[str, torch.Tensor]:
    """Mean over every token of every text of |g_i|, g = f(Σα a)·(Σα b) − Σα f(a)·b with each model's own forward
    (prefix "own"), a and b caught by forward hooks on gate_proj and up_proj. The model is padding-invariant, so
    each text runs alone, unpadded."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base)
    fine_tunes = [GatedTestModel.from_pretrained(m).eval() for m in models]
    sums = {layer: torch.zeros(24, dtype=torch.float64) for layer in range(layer_count)}
    positions = 0
    for text in TEXTS:
        ids = torch.tensor([tokenizer(text)["input_ids"]])
        caught: list[dict[str, torch.Tensor]] = []
        for model in fine_tunes:
            seen: dict[str, torch.Tensor] = {}
            def catch(module, args, out, *, key: str, seen: dict = seen) -> None:
                seen[key] = out

            handles = [module.register_forward_hook(functools.partial(catch, key=key))
                       for layer, block in enumerate(model.layers)
                       for key, module in ((f"a{layer}", block.mlp.gate_proj), (f"b{layer}", block.mlp.up_proj))]
            with torch.no_grad():
                model(ids, attention_mask=torch.ones_like(ids))
            for handle in handles:
                handle.remove()
            caught.append(seen)
        positions += ids.shape[1]
        for layer in range(layer_count):
            a = torch.stack([c[f"a{layer}"][0] for c in caught]).double()
            b = torch.stack([c[f"b{layer}"][0] for c in caught]).double()
            merged = nn.functional.silu(a.mean(0)) * b.mean(0)
            ensemble = (nn.functional.silu(a) * b).mean(0)
            sums[layer] += (merged - ensemble).abs().sum(0)
    return {f"layers.{layer}.mlp.gate_proj": total / positions for layer, total in sums.items()}


def test_score_equals_a_brute_force_gated_gap(family) -> None:
    base, models = family
    report = hf_mloss.score(base, models, data=TEXTS, num_samples=len(TEXTS), batch_size=5, progress=False)
    expected = brute_force_gated_gap(base, models, 3)
    assert set(report.node) == set(expected)
    for name, values in expected.items():
        torch.testing.assert_close(report.node[name].double(), values, rtol=1e-4, atol=1e-7)
