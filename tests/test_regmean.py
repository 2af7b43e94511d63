"""RegMean and RegMean++ against brute-force references built from each model's own forward.

The references never use the block walk: a forward hook on every linear of a block collects its inputs (real tokens
only), the Grams are formed in float64 and the closed form is solved with ``torch.linalg.solve``. For RegMean++ the
reference runs a whole model whose blocks before ``l`` are already merged and whose block ``l`` is model p's: its
block ``l`` then sees exactly the inputs the merged prefix gives it.
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from transformers import AutoModel, AutoModelForCausalLM

import hf_mloss
from examples import tiny as testing
from hf_mloss.adapters import adapter_for

VOCAB = 64
PAD = 3
SEQUENCES = [[5, 9, 13, 21, 8, 40], [7, 7, 30], [11, 4, 52, 19, 23, 6, 44, 17], [33]]
TEXTS = [" ".join(f"w{i - 4}" for i in seq) for seq in SEQUENCES]


# ------------------------------------------------------------------------------------------------- references
def _batch(kind: str, side: str = "right") -> dict[str, torch.Tensor]:
    width = max(map(len, SEQUENCES))
    ids = torch.full((len(SEQUENCES), width), PAD)
    mask = torch.zeros_like(ids)
    for row, seq in enumerate(SEQUENCES):
        cols = slice(width - len(seq), width) if side == "left" else slice(0, len(seq))
        ids[row, cols], mask[row, cols] = torch.tensor(seq), 1
    batch = {"input_ids": ids, "attention_mask": mask}
    if kind == "decoder":
        batch["position_ids"] = (mask.cumsum(-1) - 1).clamp(min=0)
    return batch


def _forward(model, batch) -> None:
    with torch.no_grad():
        model(**batch)


def _block_inputs(model, layer: int, batch) -> dict[str, torch.Tensor]:
    """Every linear of block ``layer``: its inputs at the counted positions (float64 rows), by path."""
    block = adapter_for(model.config).layers(model)[layer]
    mask = batch.get("attention_mask")
    captured, handles = {}, []
    for path, module in block.named_modules():
        if isinstance(module, torch.nn.Linear):
            def hook(m, args, path=path):
                x = args[0].detach()
                rows = x[mask.bool()] if mask is not None and x.shape[:2] == mask.shape else x.reshape(-1, x.shape[-1])
                captured[path] = rows.double()
            handles.append(module.register_forward_pre_hook(hook))
    _forward(model, batch)
    for handle in handles:
        handle.remove()
    return captured


def _solve(inputs: list[dict[str, torch.Tensor]], blocks: list[torch.nn.Module], alpha: torch.Tensor,
           ratio: float) -> dict[str, torch.Tensor]:
    out = {}
    for path in inputs[0]:
        gram_sum, target = 0, 0
        for x, block, a in zip(inputs, blocks, alpha):
            gram = x[path].T @ x[path] / len(x[path])
            reduced = ratio * gram + (1 - ratio) * torch.diag(gram.diagonal())
            gram_sum = gram_sum + a * reduced
            target = target + a * reduced @ block.get_submodule(path).weight.double().T
        out[path] = torch.linalg.solve(gram_sum, target).T
    return out


def _average(models, alpha) -> dict[str, torch.Tensor]:
    states = [m.state_dict() for m in models]
    return {k: sum(a * s[k].double() for a, s in zip(alpha, states)) for k in states[0]}


def reference(models, batch, *, plusplus: bool, ratio: float = 0.95, weights=None) -> dict[str, torch.Tensor]:
    """RegMean (``plusplus=False``) or RegMean++ of ``models`` on ``batch``: the merged state dict (float64)."""
    alpha = torch.tensor(weights or [1.0] * len(models), dtype=torch.float64)
    alpha = alpha / alpha.sum()
    adapter = adapter_for(models[0].config)
    merged_state = _average(models, alpha)
    merged = copy.deepcopy(models[0])
    merged.load_state_dict({k: v.float() for k, v in merged_state.items()})
    for layer in range(adapter.num_layers):
        blocks = [adapter.layers(m)[layer] for m in models]
        if plusplus:  # model p's block `layer` under the merged blocks before it
            inputs = []
            for block in blocks:
                hybrid = copy.deepcopy(merged)
                adapter.layers(hybrid)[layer].load_state_dict(block.state_dict())
                inputs.append(_block_inputs(hybrid, layer, batch))
        else:
            inputs = [_block_inputs(m, layer, batch) for m in models]
        solved = _solve(inputs, blocks, alpha, ratio)
        with torch.no_grad():
            for path, weight in solved.items():
                adapter.layers(merged)[layer].get_submodule(path).weight.copy_(weight.float())
        prefix = _module_prefix(merged, adapter.layers(merged)[layer])
        merged_state.update({f"{prefix}{path}.weight": w for path, w in solved.items()})
    return merged_state


def _module_prefix(model, block) -> str:
    return next(f"{name}." for name, module in model.named_modules() if module is block)


def assert_matches(result, expected: dict[str, torch.Tensor], *, rtol: float = 1e-5):
    ours = result.model.state_dict()
    assert set(expected) <= set(ours)
    for key, value in expected.items():
        error = float((ours[key].detach().double() - value).norm() / value.norm().clamp_min(1e-30))
        assert error < rtol, (key, error)


# --------------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def decoder(tmp_path_factory):
    torch.manual_seed(0)
    base = testing.tiny_decoder("llama")
    return testing.save_with_finetunes(base, tmp_path_factory.mktemp("llama"), 2,
                                       tokenizer=testing.word_tokenizer(VOCAB), scale=5e-2)


@pytest.fixture(scope="module")
def encoder(tmp_path_factory):
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, max_position_embeddings=64, pad_token_id=PAD)
    return testing.save_with_finetunes(transformers.BertModel(config).eval(), tmp_path_factory.mktemp("bert"), 2,
                                       tokenizer=testing.word_tokenizer(VOCAB), scale=5e-2)


@pytest.fixture(scope="module")
def pixels():
    return torch.randn(6, 3, 32, 32, generator=torch.Generator().manual_seed(1))


# ------------------------------------------------------------------------------------------------------ tests
@pytest.mark.parametrize("method", ["regmean", "regmean_plusplus"])
def test_clip_towers_equal_the_brute_force(tiny_paths, pixels, method):
    base, models = tiny_paths
    loaded = [AutoModel.from_pretrained(m).eval() for m in models]
    expected = reference(loaded, {"pixel_values": pixels}, plusplus=method == "regmean_plusplus",
                         weights=[2.0, 1.0, 1.0])
    result = hf_mloss.merge(base, models, method, data=pixels, weights=[2.0, 1.0, 1.0], batch_size=4,
                            progress=False)
    assert_matches(result, expected)
    assert result.config.method == method and result.config.parameters == {}


@pytest.mark.parametrize("method", ["regmean", "regmean_plusplus"])
def test_a_llama_merge_counts_real_tokens_only(decoder, method):
    """Padded batches of unequal texts: the Grams hold the real tokens only, whatever the padding side."""
    base, models = decoder
    loaded = [AutoModelForCausalLM.from_pretrained(m).eval() for m in models]
    plus = method == "regmean_plusplus"
    expected = reference(loaded, _batch("decoder"), plusplus=plus, ratio=0.5)
    left = reference(loaded, _batch("decoder", "left"), plusplus=plus, ratio=0.5)
    for key in expected:
        torch.testing.assert_close(left[key], expected[key], rtol=1e-6, atol=1e-9)
    result = hf_mloss.merge(str(base), [str(m) for m in models], method, data=TEXTS, batch_size=3,
                            reduce_non_diagonal_ratio=0.5, progress=False)
    assert_matches(result, expected)
    generated = result.model.generate(torch.tensor([[1, 5, 9]]), max_new_tokens=3, do_sample=False)
    assert generated.shape == (1, 6)


@pytest.mark.parametrize("method", ["regmean", "regmean_plusplus"])
def test_a_bert_merge_equals_the_brute_force(encoder, method):
    base, models = encoder
    loaded = [AutoModel.from_pretrained(m).eval() for m in models]
    expected = reference(loaded, _batch("encoder"), plusplus=method == "regmean_plusplus")
    result = hf_mloss.merge(str(base), [str(m) for m in models], method, data=TEXTS, batch_size=2, progress=False)
    assert_matches(result, expected)


def test_ratio_zero_is_a_per_input_feature_weighted_average(tiny_paths, pixels):
    """r = 0 keeps only the Grams' diagonals: column j of W* is Σ_p α_p G_p[j, j] W_p[:, j] / Σ_p α_p G_p[j, j]."""
    base, models = tiny_paths
    loaded = [AutoModel.from_pretrained(m).eval() for m in models]
    inputs = [_block_inputs(m, 0, {"pixel_values": pixels}) for m in loaded]
    result = hf_mloss.merge(base, models, "regmean", data=pixels, reduce_non_diagonal_ratio=0.0, progress=False)
    for path in ("mlp.fc1", "self_attn.out_proj"):
        diag = torch.stack([(x[path] ** 2).sum(0) for x in inputs])  # [q, in]
        weights = torch.stack([m.encoder.layers[0].get_submodule(path).weight.double() for m in loaded])
        expected = (diag[:, None, :] * weights).sum(0) / diag.sum(0)
        got = result.model.state_dict()[f"encoder.layers.0.{path}.weight"].double()
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-7)


def test_non_linear_tensors_are_averaged_and_frozen_blocks_kept(tmp_path, pixels):
    """Biases and norms: the weighted average; a block no fine-tune changed is the base's, bit for bit."""
    base = testing.make_base(0)
    folders = [testing.save_model(base, tmp_path / "base")]
    for i in range(2):
        tuned = testing.make_finetune(base, i)
        with torch.no_grad():  # block 0 and the embeddings frozen, as in fine-tunes of the upper blocks
            for key, value in base.state_dict().items():
                if not key.startswith("encoder.layers.1."):
                    tuned.state_dict()[key].copy_(value)
        folders.append(testing.save_model(tuned, tmp_path / f"ft{i}"))
    for method in ("regmean", "regmean_plusplus"):
        result = hf_mloss.merge(str(folders[0]), [str(f) for f in folders[1:]], method, data=pixels,
                                progress=False)
        merged, reference_state = result.model.state_dict(), base.state_dict()
        for key, value in reference_state.items():
            if not key.startswith("encoder.layers.1."):
                assert torch.equal(merged[key], value), key
        tuned = [AutoModel.from_pretrained(f).state_dict() for f in folders[1:]]
        bias = "encoder.layers.1.mlp.fc1.bias"
        torch.testing.assert_close(merged[bias], (tuned[0][bias] + tuned[1][bias]) / 2)


def test_the_card_and_recipe_say_what_ran(tiny_paths, image_folder, tmp_path):
    """The card names the method and what the data set; the saved recipe re-runs to the same bits."""
    base, models = tiny_paths
    result = hf_mloss.merge(base, models, "regmean_plusplus", data=str(image_folder), progress=False)
    result.save_pretrained(tmp_path / "out")
    card = (tmp_path / "out" / "README.md").read_text()
    assert "RegMean++" in card and "Gram matrices" in card and "2508.03121" in card
    again = hf_mloss.run(str(tmp_path / "out"), progress=False)
    for key, value in result.model.state_dict().items():
        assert torch.equal(again.model.state_dict()[key], value), key


def test_ratio_out_of_range_is_refused_before_any_work(tiny_paths, pixels):
    base, models = tiny_paths
    with pytest.raises(hf_mloss.InvalidParameterError, match="reduce_non_diagonal_ratio"):
        hf_mloss.merge(base, models, "regmean", data=pixels, reduce_non_diagonal_ratio=1.5, progress=False)
    with pytest.raises(hf_mloss.DataError, match="data"):
        hf_mloss.merge(base, models, "regmean_plusplus", progress=False)
