"""RegMean and RegMean++ against brute-force references built from each model's own forward.

The references never use the block walk: a forward hook on every linear of a block collects its inputs (real tokens
only), the Grams are formed in float64 and the closed form is solved with ``torch.linalg.solve`` (an input feature
that is 0 wherever counted gets the weighted average's column, the rest solved without it). For RegMean++ the
reference runs a whole model whose blocks before ``l`` are already merged and whose block ``l`` is model p's: its
block ``l`` then sees exactly the inputs the merged prefix gives it.
"""

from __future__ import annotations

import copy
import warnings

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
def _batch(kind: str, side: str = "right", sequences=SEQUENCES) -> dict[str, torch.Tensor]:
    width = max(map(len, sequences))
    ids = torch.full((len(sequences), width), PAD)
    mask = torch.zeros_like(ids)
    for row, seq in enumerate(sequences):
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
        live = gram_sum.diagonal() != 0
        solved = sum(a * block.get_submodule(path).weight.detach().double().T for a, block in zip(alpha, blocks))
        solved[live] = torch.linalg.solve(gram_sum[live][:, live], target[live])
        out[path] = solved.T
    return out


def _average(models, alpha) -> dict[str, torch.Tensor]:
    states = [m.state_dict() for m in models]
    return {k: sum(a * s[k].double() for a, s in zip(alpha, states)) for k in states[0]}


def reference(models, batch, *, plusplus: bool, ratio: float = 0.95, weights=None) -> dict[str, torch.Tensor]:
    """RegMean (``plusplus=False``) or RegMean++ of ``models`` on ``batch`` (or, a list, each model on its own
    batch): the merged state dict (float64)."""
    batches = batch if isinstance(batch, list) else [batch] * len(models)
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
            for block, own in zip(blocks, batches):
                hybrid = copy.deepcopy(merged)
                adapter.layers(hybrid)[layer].load_state_dict(block.state_dict())
                inputs.append(_block_inputs(hybrid, layer, own))
        else:
            inputs = [_block_inputs(m, layer, own) for m, own in zip(models, batches)]
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
        value = value.detach()
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


# ------------------------------------------------------------------------------------- each model's own data
@pytest.mark.parametrize("method", ["regmean", "regmean_plusplus"])
def test_each_model_on_its_own_images_equals_the_hooks_on_its_own_data(tiny_paths, method):
    """Model p's Grams by forward hooks on its own images only (sets of 5, 3 and 7: each Gram the mean over its own
    positions), solved as the papers do; the library given each model its own data gives the same merge."""
    base, models = tiny_paths
    generator = torch.Generator().manual_seed(7)
    own = [torch.randn(n, 3, 32, 32, generator=generator) for n in (5, 3, 7)]
    loaded = [AutoModel.from_pretrained(m).eval() for m in models]
    expected = reference(loaded, [{"pixel_values": x} for x in own], plusplus=method == "regmean_plusplus",
                         weights=[2.0, 1.0, 1.0])
    entries = [{"model": m, "data": x, "weight": w} for m, x, w in zip(models, own, [2.0, 1.0, 1.0])]
    result = hf_mloss.merge(base, entries, method, batch_size=2, progress=False)
    assert_matches(result, expected)
    pooled = reference(loaded, {"pixel_values": torch.cat(own)}, plusplus=method == "regmean_plusplus",
                       weights=[2.0, 1.0, 1.0])  # the same images as one pool: another merge
    key = "encoder.layers.1.mlp.fc2.weight"
    assert float((pooled[key] - expected[key]).norm() / expected[key].norm()) > 1e-3


@pytest.mark.parametrize("method", ["regmean", "regmean_plusplus"])
def test_each_decoder_on_its_own_texts_counts_its_real_tokens(decoder, method):
    """Texts of unequal lengths, padded: each model's Grams hold its own texts' real tokens, averaged over them."""
    base, models = decoder
    loaded = [AutoModelForCausalLM.from_pretrained(m).eval() for m in models]
    split = [SEQUENCES[:3], SEQUENCES[3:]]
    expected = reference(loaded, [_batch("decoder", sequences=part) for part in split],
                         plusplus=method == "regmean_plusplus", ratio=0.5)
    texts = [[" ".join(f"w{i - 4}" for i in seq) for seq in part] for part in split]
    result = hf_mloss.merge(str(base), [{"model": str(m), "data": t} for m, t in zip(models, texts)], method,
                            batch_size=2, reduce_non_diagonal_ratio=0.5, progress=False)
    assert_matches(result, expected)


def test_a_model_without_data_of_its_own_reads_the_shared_data(tiny_paths, pixels):
    base, models = tiny_paths
    own = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(8))
    loaded = [AutoModel.from_pretrained(m).eval() for m in models]
    batches = [{"pixel_values": own}, {"pixel_values": pixels}, {"pixel_values": pixels}]
    expected = reference(loaded, batches, plusplus=True)
    result = hf_mloss.merge(base, [{"model": models[0], "data": own}, *models[1:]], "regmean_plusplus", data=pixels,
                            batch_size=4, progress=False)
    assert_matches(result, expected)


def test_lam_scales_the_merged_task_vector(tiny_paths, pixels):
    """θ₀ + λ·(θ_RegMean − θ₀) for every tensor, the solve at λ = 1 (RegMean++'s prefix is the published merge)."""
    base, models = tiny_paths
    published = hf_mloss.merge(base, models, "regmean_plusplus", data=pixels, progress=False).model.state_dict()
    scaled = hf_mloss.merge(base, models, "regmean_plusplus", data=pixels, lam=1.5, progress=False)
    theta0 = AutoModel.from_pretrained(base).state_dict()
    for key, value in published.items():
        expected = theta0[key] + 1.5 * (value - theta0[key])
        torch.testing.assert_close(scaled.model.state_dict()[key], expected, rtol=1e-5, atol=1e-6)
    assert "scaled by λ = 1.5" in scaled.method_description and scaled.config.parameters == {"lam": 1.5}


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


def _dead_unit_models(root) -> tuple[str, list[str], list]:
    """A tiny CLIP base and two fine-tunes whose MLP unit 0 never fires (quick_gelu(-1e4) is exactly 0): fc2's input
    feature 0 is 0 at every position, in every block."""
    base = testing.make_base(0)
    tuned = [testing.make_finetune(base, i) for i in range(2)]
    for model in (base, *tuned):
        with torch.no_grad():
            for layer in model.encoder.layers:
                layer.mlp.fc1.weight[0].zero_()
                layer.mlp.fc1.bias[0] = -1e4
    folders = [testing.save_model(m, root / name) for m, name in zip((base, *tuned), ("base", "ft0", "ft1"))]
    return str(folders[0]), [str(f) for f in folders[1:]], tuned


@pytest.mark.parametrize("method", ["regmean", "regmean_plusplus"])
def test_a_dead_input_feature_gets_the_weighted_average_column(tmp_path, pixels, method):
    """No position reaches the feature, so the data leaves its column free: it is the weighted average's (as every
    tensor the data does not reach), not 0; the other columns are the least-squares solve without it."""
    base, models, tuned = _dead_unit_models(tmp_path)
    weights = [2.0, 1.0]
    result = hf_mloss.merge(base, models, method, data=pixels, weights=weights, progress=False)
    for layer in range(2):
        got = result.model.encoder.layers[layer].mlp.fc2.weight[:, 0].detach().double()
        average = sum(w / 3 * m.encoder.layers[layer].mlp.fc2.weight[:, 0].detach().double()
                      for w, m in zip(weights, tuned))
        assert float(average.norm()) > 0.1
        torch.testing.assert_close(got, average, rtol=0, atol=1e-6)
    loaded = [AutoModel.from_pretrained(m).eval() for m in models]
    expected = reference(loaded, {"pixel_values": pixels}, plusplus=method == "regmean_plusplus", weights=weights)
    assert_matches(result, expected)
    zero = hf_mloss.merge(base, models, method, data=pixels, weights=weights, reduce_non_diagonal_ratio=0.0,
                          progress=False)  # r = 0: Σ α G[j, j] W[:, j] / Σ α G[j, j] is 0 / 0 there
    torch.testing.assert_close(zero.model.encoder.layers[0].mlp.fc2.weight[:, 0].detach().double(),
                               sum(w / 3 * m.encoder.layers[0].mlp.fc2.weight[:, 0].detach().double()
                                   for w, m in zip(weights, tuned)), rtol=0, atol=1e-6)


def _solve_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if "Gram matrices" in str(w.message)]


@pytest.mark.parametrize("method", ["regmean", "regmean_plusplus"])
def test_singular_grams_at_ratio_one_warn_once_naming_the_layers(tiny_paths, pixels, method):
    """r = 1 on one image (17 positions for 32- and 64-wide inputs) or on identical black images (inputs that span
    few directions): one warning per merge, naming the first layers, their counts and what to do; the card says it
    too. r < 1 keeps every solve well-posed, and enough varied data needs no warning."""
    base, models = tiny_paths
    one = pixels[:1]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = hf_mloss.merge(base, models, method, data=one, reduce_non_diagonal_ratio=1.0, progress=False)
    (message,) = _solve_warnings(caught)
    assert message.startswith(f"{'RegMean++' if method == 'regmean_plusplus' else 'RegMean'} with "
                              "reduce_non_diagonal_ratio=1: the data leaves 8 of the Gram matrices")
    assert "encoder.layers.0.self_attn.q_proj (and k_proj, v_proj, same input): 17 position(s) counted for 32 " \
           "input features" in message
    assert "and 6 more" in message and "below 1 (fusion-bench's 0.95)" in message
    assert message in result.method_description  # on the card
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hf_mloss.merge(base, models, method, data=torch.zeros(4, 3, 32, 32), reduce_non_diagonal_ratio=1.0,
                       progress=False)
    (message,) = _solve_warnings(caught)
    assert "encoder.layers.0.mlp.fc2: numerically rank-deficient, 68 position(s) counted for 64 input features" \
        in message
    for data, ratio in ((one, 0.95), (pixels, 1.0)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            hf_mloss.merge(base, models, method, data=data, reduce_non_diagonal_ratio=ratio, progress=False)
        assert not _solve_warnings(caught), (len(data), ratio)


def test_prefix_merged_scoring_of_a_regmean_recipe_is_refused_before_any_work(tiny_paths, pixels, monkeypatch):
    """RegMean computes no M-Loss: ``score: {prefix: merged}`` names the methods whose merged prefix it scores
    instead of failing on score options pushed into RegMean's parameters."""
    from hf_mloss.merging import driver
    from hf_mloss.spec.options import ScoringOptions

    def no_work(*args, **kwargs):
        raise AssertionError("a merge was started")

    monkeypatch.setattr(driver, "run_merge", no_work)
    base, models = tiny_paths
    config = hf_mloss.MergeConfig.from_kwargs(base, models, "regmean", data=pixels,
                                              score=ScoringOptions(prefix="merged"))
    for run in (lambda: hf_mloss.run_score(config, progress=False),
                lambda: hf_mloss.score(base, models, pixels, prefix="merged", method="regmean_plusplus",
                                       progress=False)):
        with pytest.raises(hf_mloss.InvalidParameterError, match=r"prefix='merged' .*\(m_ties, m_dare\).*"
                                                                 r"'regmean(_plusplus)?'") as caught:
            run()
        assert "reduction" not in str(caught.value)


def test_a_feature_one_process_never_reaches_is_solved_from_the_others_share(monkeypatch):
    """Data-parallel: each process keeps the average's rows only for the features its own share never reaches.
    After the sums are reduced, a feature another share reaches is solved as by one process over all the data, and
    one no share reaches gets the weighted average's column."""
    from hf_mloss.engine import gram

    generator = torch.Generator().manual_seed(0)
    linears = [{"fc": torch.nn.Linear(4, 3)} for _ in range(2)]
    alpha = [0.75, 0.25]
    shares = [torch.randn(6, 4, generator=generator, dtype=torch.float64) for _ in range(2)]
    shares[0][:, :2] = 0  # this process's share never reaches features 0 and 1
    shares[1][:, 0] = 0  # nor this one's feature 0
    models = [torch.randn(4, 4, generator=generator, dtype=torch.float64) for _ in range(2)]  # per-model mixing

    def regression(shares_) -> gram.BlockRegression:
        out = gram.BlockRegression(0.9)
        for p, a in enumerate(alpha):
            x = torch.cat([s @ torch.diag(models[p].diagonal()) for s in shares_])  # each model's own inputs
            out.fold({"fc": x.T @ x}, linears[p], a, {"fc": len(x)})
        return out

    single = regression(shares)
    single.reduce_across_processes()
    expected = single.solve()["fc"]
    parts = [regression([s]) for s in shares]
    monkeypatch.setattr(gram, "reduce_sums", lambda *tensors: [t.clone() for t in tensors])
    parts[1].reduce_across_processes()
    other = [parts[1].gram_sums["fc"].matrix(), parts[1].targets["fc"], torch.tensor([6.0], dtype=torch.float64)]
    monkeypatch.setattr(gram, "reduce_sums", lambda *tensors: [t + o for t, o in zip(tensors, other)])
    parts[0].reduce_across_processes()
    assert len(parts[0].unreached["fc"][0]) == 2 and parts[0].positions == {"fc": 12}
    got = parts[0].solve()["fc"]
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)
    average = sum(a * m["fc"].weight.detach().double() for a, m in zip(alpha, linears))
    torch.testing.assert_close(got[:, 0], average[:, 0], rtol=0, atol=1e-12)
    assert not torch.allclose(got[:, 1], average[:, 1])


# ------------------------------------------------------------------------------- few positions: Grams as rows
@pytest.mark.parametrize("ratio", [0.0, 0.5, 0.95, 1 - 1e-4])
@pytest.mark.parametrize("mean", [False, True])
def test_grams_held_as_rows_solve_as_their_matrices_do(ratio, mean):
    """Woodbury's solve from the rows (m = 15 positions, 48 input features) equals the matrix's Cholesky solve, for
    pooled sums and for per-model means, down to r = 1 − 1e-4 (the route's limit)."""
    from hf_mloss.engine import gram

    generator = torch.Generator().manual_seed(3)
    linears = [{"fc": torch.nn.Linear(48, 5)} for _ in range(2)]
    inputs = [torch.randn(n, 48, generator=generator, dtype=torch.float64) for n in (6, 9)]

    def solved(row_limit: float) -> tuple[torch.Tensor, bool]:
        regression = gram.BlockRegression(ratio, mean=mean)
        for x, layer, a in zip(inputs, linears, (0.7, 0.3)):
            held = gram.InputGram(48, row_limit=row_limit, dtype=torch.float64, device="cpu")
            held.add(x[:4])
            held.add(x[4:])
            regression.fold({"fc": held}, layer, a, {"fc": len(x)})
        regression.reduce_across_processes()
        factored = regression.gram_sums["fc"].factored
        return regression.solve()["fc"], factored

    rows, factored = solved(float("inf"))
    matrix, dense = solved(0)
    assert factored and not dense
    torch.testing.assert_close(rows, matrix, rtol=1e-9, atol=1e-12)


def test_processes_holding_rows_reduce_their_matrices(monkeypatch):
    """Data-parallel: each process's rows are turned into its Gram sum before the reduction (rows do not add up),
    and the reduced system solves as one process holding every row."""
    from hf_mloss.engine import gram

    generator = torch.Generator().manual_seed(5)
    linears = [{"fc": torch.nn.Linear(40, 3)} for _ in range(2)]
    shares = [torch.randn(7, 40, generator=generator, dtype=torch.float64) for _ in range(2)]

    def regression(parts) -> gram.BlockRegression:
        out = gram.BlockRegression(0.9)
        for layer, a in zip(linears, (0.6, 0.4)):
            held = gram.InputGram(40, row_limit=float("inf"), dtype=torch.float64, device="cpu")
            for part in parts:
                held.add(part)
            out.fold({"fc": held}, layer, a, {"fc": sum(len(p) for p in parts)})
        return out

    single = regression(shares)
    assert single.gram_sums["fc"].factored
    expected = single.solve()["fc"]
    first, second = regression(shares[:1]), regression(shares[1:])
    monkeypatch.setattr(gram, "several_processes", lambda: True)
    monkeypatch.setattr(gram, "reduce_sums", lambda *tensors: [t.clone() for t in tensors])
    second.reduce_across_processes()
    other = [second.gram_sums["fc"].matrix(), second.targets["fc"], torch.tensor([7.0], dtype=torch.float64)]
    monkeypatch.setattr(gram, "reduce_sums", lambda *tensors: [t + o for t, o in zip(tensors, other)])
    first.reduce_across_processes()
    assert not first.gram_sums["fc"].factored and first.positions == {"fc": 14}
    torch.testing.assert_close(first.solve()["fc"], expected, rtol=1e-10, atol=1e-12)


def test_a_gram_past_its_row_limit_becomes_its_matrix():
    from hf_mloss.engine import gram

    x = torch.randn(16, 12, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    held = gram.InputGram(12, row_limit=10, dtype=torch.float64, device="cpu")
    held.add(x[:8])
    assert held.factored and held.count == 8
    torch.testing.assert_close(held.diagonal(), (x[:8] ** 2).sum(0))
    held.add(x[8:])
    assert not held.factored
    torch.testing.assert_close(held.matrix(), x.T @ x, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("device, capability, product", [
    ("cpu", None, torch.float64), ("cuda:0", (9, 0), torch.float64), ("cuda", (8, 0), torch.float64),
    ("cuda:1", (8, 9), torch.float32), ("cuda", (12, 0), torch.float32), ("mps", None, torch.float32)])
def test_gram_products_are_float64_where_float64_runs_at_least_half_rate(monkeypatch, device, capability, product):
    from hf_mloss.engine import gram

    asked = []
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: asked.append(d) or capability)
    assert gram.gram_dtypes(device) == (product, torch.float32 if device == "mps" else torch.float64)
    assert asked == ([torch.device(device)] if device.startswith("cuda") else [])  # the device the run is on


@pytest.fixture(scope="module", params=[64, 128])
def wide_decoder(request, tmp_path_factory):
    """A decoder whose layers have more input features than the texts have tokens: 128 wide, every Gram is held as
    rows; 64 wide, the attention and MLP inputs become matrices partway (18 tokens past 16 rows) and the down
    projection's stay rows."""
    hidden = request.param
    base = testing.tiny_decoder("llama", hidden_size=hidden, intermediate_size=2 * hidden, seed=1)
    return testing.save_with_finetunes(base, tmp_path_factory.mktemp(f"llama{hidden}"), 2,
                                       tokenizer=testing.word_tokenizer(VOCAB), scale=5e-2)


@pytest.mark.parametrize("own", [False, True], ids=["pooled", "own"])
@pytest.mark.parametrize("method", ["regmean", "regmean_plusplus"])
def test_grams_held_as_rows_give_the_brute_force_merge(wide_decoder, method, own, monkeypatch):
    """With fewer tokens than input features the Grams are kept as rows and solved by Woodbury's identity (counted
    here); the merge equals the brute force's, pooled and with each model's own texts."""
    from hf_mloss.engine import gram

    built = {"rows": 0}
    original = gram._RowSolver.__init__

    def counted(self, *args, **kwargs):
        built["rows"] += 1
        original(self, *args, **kwargs)

    monkeypatch.setattr(gram._RowSolver, "__init__", counted)
    base, models = wide_decoder
    loaded = [AutoModelForCausalLM.from_pretrained(m).eval() for m in models]
    plus = method == "regmean_plusplus"
    if own:
        split = [SEQUENCES[:3], SEQUENCES[3:]]
        expected = reference(loaded, [_batch("decoder", sequences=part) for part in split], plusplus=plus)
        texts = [[" ".join(f"w{i - 4}" for i in seq) for seq in part] for part in split]
        result = hf_mloss.merge(str(base), [{"model": str(m), "data": t} for m, t in zip(models, texts)], method,
                                batch_size=2, progress=False)
    else:
        expected = reference(loaded, _batch("decoder"), plusplus=plus)
        result = hf_mloss.merge(str(base), [str(m) for m in models], method, data=TEXTS, batch_size=3,
                                progress=False)
    assert built["rows"] > 0
    assert_matches(result, expected)
