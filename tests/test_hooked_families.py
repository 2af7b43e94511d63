"""Scoring any text decoder or encoder of a common MLP shape (hf_mloss.adapters.hooked): Gemma 2/3, Phi-3's fused
gate_up_proj, GPT-2's Conv1D, GPT-J, GPT-NeoX, Olmo, ModernBERT's fused GLU.

For each shape: the block walk reproduces the model's own forward block by block on padded batches; the own-prefix
node M-Loss equals a brute force computed from forward hooks on each model's own forward (the unit's pre-activations
split as the MLP splits them); M-TIES merges, and the merged folder loads with its Auto class and runs.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers import AutoModel, AutoModelForCausalLM

import hf_mloss
from examples import tiny as testing
from hf_mloss.adapters import adapter_for

VOCAB = 64
SMALL = dict(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1, max_position_embeddings=64, bos_token_id=1, eos_token_id=2, pad_token_id=3)
FAMILIES = {
    "gemma2": lambda: transformers.Gemma2ForCausalLM(transformers.Gemma2Config(**SMALL, head_dim=8, sliding_window=4)),
    "gemma3_text": lambda: transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**SMALL, head_dim=8,
                                                                                        sliding_window=4)),
    "phi3": lambda: transformers.Phi3ForCausalLM(transformers.Phi3Config(**{**SMALL, "num_key_value_heads": 2})),
    "gpt2": lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=16, n_layer=2, n_head=2, n_positions=32, bos_token_id=1, eos_token_id=2)),
    "gptj": lambda: transformers.GPTJForCausalLM(transformers.GPTJConfig(
        vocab_size=VOCAB, n_embd=16, n_layer=2, n_head=2, n_positions=32, rotary_dim=4, bos_token_id=1,
        eos_token_id=2)),
    "gpt_neox": lambda: transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        max_position_embeddings=64, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)),
    "olmo": lambda: transformers.OlmoForCausalLM(transformers.OlmoConfig(**SMALL)),
    "modernbert": lambda: transformers.ModernBertModel(transformers.ModernBertConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        max_position_embeddings=64, pad_token_id=3, bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2,
        global_attn_every_n_layers=2, local_attention=4)),
}
SEQUENCES = [[5, 9, 13, 21, 8, 40], [7, 7, 30], [11, 4, 52, 19, 23, 6, 44, 17]]
TEXTS = [" ".join(f"w{i - 4}" for i in seq) for seq in SEQUENCES]


def _batch() -> dict[str, torch.Tensor]:
    return testing.right_padded(SEQUENCES)


@pytest.fixture(scope="module", params=list(FAMILIES))
def saved(request, tmp_path_factory):
    torch.manual_seed(0)
    base = FAMILIES[request.param]().eval()
    folders = testing.save_with_finetunes(base, tmp_path_factory.mktemp(request.param), 2,
                                          tokenizer=testing.word_tokenizer(VOCAB), scale=5e-2)
    return request.param, folders


def _load(folder):
    config = transformers.AutoConfig.from_pretrained(folder)
    auto = AutoModel if config.model_type == "modernbert" else AutoModelForCausalLM
    return auto.from_pretrained(folder).eval()


def test_the_hooked_adapter_takes_the_families_without_their_own(saved):
    name, (base, _) = saved
    adapter = adapter_for(transformers.AutoConfig.from_pretrained(base))
    expected = "llama" if name == "gemma2" else "hooked"  # Gemma 2 has a dedicated adapter
    assert type(adapter).__name__ == {"hooked": "HookedAdapter", "llama": "LlamaAdapter"}[expected]
    assert adapter.scorable and adapter.activation_name() != "unknown"


def test_the_walk_reproduces_the_models_own_forward(saved):
    name, (base, _) = saved
    model = _load(base)
    adapter = adapter_for(model.config)
    batch = _batch()
    with torch.no_grad():
        reference = model(**batch, output_hidden_states=True).hidden_states
        hidden, context = adapter.embed(model, batch)
        blocks = adapter.layers(model)
        for layer, block in enumerate(blocks):
            residual, u = adapter.forward_to_target(block, hidden, context)
            hidden = adapter.forward_from_target(block, residual, u, context)
            if layer + 1 < len(blocks):  # the last hidden state has the model's final norm applied
                mask = context.mask
                torch.testing.assert_close(hidden[mask], reference[layer + 1][mask], rtol=1e-5, atol=1e-6)


def _brute_force_nodes(models, batch, unit, activation) -> dict[int, torch.Tensor]:
    """Node M-Loss (abs, own prefix, equal weights) per block from hooks on each model's own forward."""
    per_model = []
    mask = batch["attention_mask"].bool()
    for model in models:
        outputs: dict[int, dict[str, torch.Tensor]] = {}
        handles = []
        for layer, block in enumerate(adapter_for(model.config).layers(model)):
            for role, path in (("gate", unit.gate), ("up", unit.up)):
                if path:
                    handles.append(block.get_submodule(path).register_forward_hook(
                        lambda m, a, out, layer=layer, role=role: outputs.setdefault(layer, {}).__setitem__(
                            role, out[mask].double())))
        with torch.no_grad():
            model(**batch)
        for handle in handles:
            handle.remove()
        per_model.append(outputs)
    out = {}
    for layer in per_model[0]:
        gates, ups = [], []
        for outputs in per_model:
            gate, up = unit.split(outputs[layer]["gate"], outputs[layer].get("up"))
            gates.append(gate)
            ups.append(up)
        a, b = torch.stack(gates), torch.stack(ups) if unit.gated else None
        merged = activation(a.mean(0)) * (b.mean(0) if b is not None else 1)
        ensemble = (activation(a) * (b if b is not None else 1)).mean(0)
        out[layer] = (merged - ensemble).abs().mean(0)
    return out


def test_own_prefix_mloss_equals_a_brute_force(saved):
    name, (base, models) = saved
    loaded = [_load(m) for m in models]
    adapter = adapter_for(loaded[0].config)
    activation = adapter.activation(loaded[0])
    expected = _brute_force_nodes(loaded, _batch(), adapter.unit, lambda x: activation(x.float()).double())
    report = hf_mloss.score(str(base), [str(m) for m in models], data=TEXTS, prefix="own", progress=False)
    assert report.num_positions == sum(map(len, SEQUENCES))
    for layer, nodes in expected.items():
        got = report.node[adapter.target_name(layer)].double()
        torch.testing.assert_close(got, nodes, rtol=1e-4, atol=1e-7)


def test_m_ties_merges_and_the_output_loads_and_runs(saved, tmp_path):
    name, (base, models) = saved
    result = hf_mloss.merge(str(base), [str(m) for m in models], "m_ties", data=TEXTS, k=0.5, e=0.1,
                            progress=False)
    assert result.report.computed and len(result.report.keep_ratios) == 2
    result.save_pretrained(tmp_path / "out")
    config = transformers.AutoConfig.from_pretrained(tmp_path / "out")
    auto = AutoModel if config.model_type == "modernbert" else AutoModelForCausalLM
    model, info = auto.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not any(info.values()), info
    with torch.no_grad():
        model(**_batch())


def test_regmean_solves_gpt2_conv1d_layers_in_their_own_layout(tmp_path):
    """GPT-2's Conv1D layers store [in, out]: with r = 0 the merge of ``mlp.c_fc`` is, row j of the stored weight,
    Σ_p G_p[j, j] W_p[j, :] / Σ_p G_p[j, j] (G_p[j, j]: the sum of squares of input feature j on the real tokens)."""
    torch.manual_seed(0)
    base = FAMILIES["gpt2"]().eval()
    base_dir, models = testing.save_with_finetunes(base, tmp_path, 2, tokenizer=testing.word_tokenizer(VOCAB),
                                                   scale=5e-2)
    result = hf_mloss.merge(str(base_dir), [str(m) for m in models], "regmean", data=TEXTS, batch_size=2,
                            reduce_non_diagonal_ratio=0.0, progress=False)
    batch, loaded = _batch(), [_load(m) for m in models]
    diagonals, weights = [], []
    for model in loaded:
        captured = {}
        block = model.transformer.h[0]
        handle = block.mlp.c_fc.register_forward_pre_hook(lambda m, args: captured.setdefault("x", args[0]))
        with torch.no_grad():
            model(**batch)
        handle.remove()
        rows = captured["x"][batch["attention_mask"].bool()].double()
        diagonals.append((rows ** 2).sum(0))
        weights.append(block.mlp.c_fc.weight.double())  # [in, out]
    d = torch.stack(diagonals)
    expected = (d[:, :, None] * torch.stack(weights)).sum(0) / d.sum(0)[:, None]
    got = result.model.state_dict()["transformer.h.0.mlp.c_fc.weight"].double()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-7)
