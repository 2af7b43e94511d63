"""Vocabulary merges (``tokenizer_source``, mergekit's ``tokenizer:`` section): the output tokenizer, every input's
embedding and LM-head rows aligned to it by mergekit's rules, checked row by row on tiny saved decoders; the merge
saved with its tokenizer and loaded back through transformers. Parity with ``mergekit-yaml`` is in test_peers.py.

The inputs: a base of 64 word tokens and three fine-tunes of it. A adds the chat token ``<|im_start|>`` (special) and
``apple``; B adds ``apple`` alone (at another id); C keeps only 60 of the words (``w56``..``w59`` lack rows).
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

import hf_mloss
from hf_mloss import MergeConfig
from hf_mloss.errors import ConfigError, IncompatibleCheckpointsError, InvalidParameterError

EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"
W = (1.0, 0.5, 2.0)  # task arithmetic weights of A, B, C (lam 1)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    from examples.tiny import save_finetune_with_tokens, tiny_decoder, word_tokenizer

    root = tmp_path_factory.mktemp("vocab")
    base = tiny_decoder("llama")
    base.save_pretrained(root / "base")
    word_tokenizer().save_pretrained(root / "base")
    a = save_finetune_with_tokens(base, root / "a", 0, tokens=("apple",), special=("<|im_start|>",))
    b = save_finetune_with_tokens(base, root / "b", 1, tokens=("apple",))
    c = save_finetune_with_tokens(base, root / "c", 2, words=60)
    return str(root / "base"), [str(a), str(b), str(c)]


def rows(folder: str) -> dict[str, dict[str, torch.Tensor]]:
    """{tensor: {token: row}} of a saved model, through its own tokenizer."""
    state = load_file(f"{folder}/model.safetensors")
    vocab = AutoTokenizer.from_pretrained(folder).get_vocab()
    return {name: {t: state[name][i] for t, i in vocab.items() if i < state[name].shape[0]}
            for name in (EMBED, HEAD) if name in state}


def task_arithmetic(base_row, rows_, weights=W) -> torch.Tensor:
    return base_row + sum(w * (r - base_row) for w, r in zip(weights, rows_))


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.allclose(a, b, atol=1e-6, rtol=0)


def test_union_aligns_rows_by_mergekits_rules_and_saves_a_working_tokenizer(inputs, tmp_path):
    base, models = inputs
    result = hf_mloss.merge(base, models, "task_arithmetic", weights=list(W), lam=1.0, tokenizer_source="union",
                            progress=False)
    folder = result.save_pretrained(tmp_path / "merged")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    vocab = tokenizer.get_vocab()
    assert len(vocab) == 66 and vocab["apple"] == 64 and vocab["<|im_start|>"] == 65  # A's, in A's order
    assert tokenizer.convert_ids_to_tokens(tokenizer("<|im_start|> w7 apple")["input_ids"]) == \
        ["<|im_start|>", "w7", "apple"]
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert model.config.vocab_size == 66 and model.get_input_embeddings().weight.shape == (66, 32)
    out = rows(str(folder))
    b0, (a, b, c) = rows(base), [rows(m) for m in models]
    for name in (EMBED, HEAD):
        # present everywhere: the method's merge of the inputs' own rows
        assert close(out[name]["w7"], task_arithmetic(b0[name]["w7"], [a[name]["w7"], b[name]["w7"], c[name]["w7"]]))
        # only in A: A's row for every model that lacks it, so the merge gives A's row
        assert close(out[name]["<|im_start|>"], a[name]["<|im_start|>"])
        # in A and B, not in the base: the others take the mean of A's and B's rows
        mean = (a[name]["apple"] + b[name]["apple"]) / 2
        assert close(out[name]["apple"], task_arithmetic(mean, [a[name]["apple"], b[name]["apple"], mean]))
        # in the base, not in C: C takes the base's row
        assert "w57" not in c[name]
        assert close(out[name]["w57"], task_arithmetic(b0[name]["w57"], [a[name]["w57"], b[name]["w57"],
                                                                          b0[name]["w57"]]))
    ids = tokenizer("<|im_start|> w3 apple", return_tensors="pt")["input_ids"]
    generated = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=3)
    assert generated.shape == (1, 7) and int(generated.max()) < 66
    # the recorded recipe re-runs to the same weights
    again = hf_mloss.run(MergeConfig.from_pretrained(folder), progress=False)
    assert again.config.tokenizer_source == "union"
    assert torch.equal(again.model.state_dict()[EMBED], result.model.state_dict()[EMBED])


def test_without_a_base_model_the_models_mean_replaces_the_base_row(inputs):
    """mergekit `linear` has no base_model: a token some models lack takes the mean of the models that have it."""
    _, models = inputs
    config = MergeConfig.from_dict({"merge_method": "linear", "tokenizer_source": "union", "dtype": "float32",
                                    "models": [{"model": m, "parameters": {"weight": 1.0}} for m in models]})
    merged = hf_mloss.run(config, progress=False).model.state_dict()
    a, b, _ = [rows(m) for m in models]
    vocab = AutoTokenizer.from_pretrained(models[0]).get_vocab()  # A's tokenizer leads: the config's first model
    mean = (a[EMBED]["w57"] + b[EMBED]["w57"]) / 2
    assert close(merged[EMBED][vocab["w57"]], (a[EMBED]["w57"] + b[EMBED]["w57"] + mean) / 3)
    assert close(merged[EMBED][vocab["<|im_start|>"]], a[EMBED]["<|im_start|>"])


def test_base_and_model_sources(inputs, tmp_path):
    base, models = inputs
    b0, (a, b, _) = rows(base), [rows(m) for m in models]
    # base: the base's 64 tokens; the tokens the models added are dropped, C's missing words take the base's rows
    result = hf_mloss.merge(base, models, "task_arithmetic", weights=list(W), lam=1.0, tokenizer_source="base",
                            progress=False)
    folder = result.save_pretrained(tmp_path / "base-vocab")
    assert AutoTokenizer.from_pretrained(folder).get_vocab() == AutoTokenizer.from_pretrained(base).get_vocab()
    out = rows(str(folder))
    assert load_file(f"{folder}/model.safetensors")[EMBED].shape == (64, 32)
    assert close(out[EMBED]["w57"], task_arithmetic(b0[EMBED]["w57"], [a[EMBED]["w57"], b[EMBED]["w57"],
                                                                        b0[EMBED]["w57"]]))
    # a model's vocabulary (mergekit YAML, older mergekit's `model:` spelling): B's ids, B's tokens
    config = MergeConfig.from_dict({"merge_method": "task_arithmetic", "base_model": base, "dtype": "float32",
                                    "tokenizer_source": f"model:{models[1]}",
                                    "models": [{"model": m, "parameters": {"weight": w}} for m, w in zip(models, W)]})
    assert config.tokenizer_source == 2
    folder = hf_mloss.run(config, progress=False).save_pretrained(tmp_path / "b-vocab")
    assert AutoTokenizer.from_pretrained(folder).get_vocab() == AutoTokenizer.from_pretrained(models[1]).get_vocab()
    out = rows(str(folder))
    mean = (a[HEAD]["apple"] + b[HEAD]["apple"]) / 2
    assert "<|im_start|>" not in out[HEAD]
    assert close(out[HEAD]["apple"], task_arithmetic(mean, [a[HEAD]["apple"], b[HEAD]["apple"], mean]))


def test_tokens_section_overrides_the_fallback_adds_tokens_and_pads(inputs):
    base, models = inputs
    b0, (a, b, c) = rows(base), [rows(m) for m in models]
    config = MergeConfig.from_dict({
        "merge_method": "task_arithmetic", "base_model": base, "dtype": "float32",
        "models": [{"model": m, "parameters": {"weight": w}} for m, w in zip(models, W)],
        "tokenizer": {"source": "union", "pad_to_multiple_of": 8, "tokens": {
            "<|im_start|>": {"source": {"kind": "zero"}},                      # the models lacking it: zeros
            "apple": {"source": {"kind": "model_token", "model": models[1], "token": "w5"}, "force": True},
            "<|new|>": {"source": {"kind": "zero"}},                           # added to the vocabulary
            "w9": {"source": models[2]},                                       # everyone has it: own rows
        }}})
    merged = hf_mloss.run(config, progress=False)
    vocab = merged.tokenizer.get_vocab()
    state = merged.model.state_dict()
    assert len(vocab) == 67 and vocab["<|new|>"] == 66 and state[EMBED].shape == (72, 32)
    assert merged.model.config.vocab_size == 72
    assert close(state[EMBED][vocab["<|im_start|>"]], W[0] * a[EMBED]["<|im_start|>"])
    assert close(state[EMBED][vocab["apple"]], b[EMBED]["w5"])  # forced on every model, the base included
    assert close(state[EMBED][vocab["<|new|>"]], torch.zeros(32))
    assert close(state[EMBED][vocab["w9"]], task_arithmetic(b0[EMBED]["w9"], [a[EMBED]["w9"], b[EMBED]["w9"],
                                                                              c[EMBED]["w9"]]))
    # padding rows: each model's mean row, so (task arithmetic being linear) the mean of the merged rows
    for name in (EMBED, HEAD):
        assert close(state[name][67:], state[name][:67].mean(0).expand(5, -1))


def test_passthrough_gives_a_token_its_model_lacks_zeros(inputs):
    """A passthrough reads each tensor from one model (embeddings: the first slice's, head: the last slice's), so a
    token that model lacks has no row to take: zeros, as mergekit writes them."""
    _, (a_dir, b_dir, _) = inputs
    config = MergeConfig.from_dict({"merge_method": "passthrough", "dtype": "float32", "tokenizer_source": "union",
                                    "slices": [{"sources": [{"model": a_dir, "layer_range": [0, 2]}]},
                                               {"sources": [{"model": b_dir, "layer_range": [1, 2]}]}]})
    merged = hf_mloss.run(config, progress=False)
    state, vocab = merged.model.state_dict(), merged.tokenizer.get_vocab()
    a, b = rows(a_dir), rows(b_dir)
    assert torch.equal(state[EMBED][vocab["<|im_start|>"]], a[EMBED]["<|im_start|>"])
    assert torch.equal(state[EMBED][vocab["apple"]], a[EMBED]["apple"])
    assert torch.equal(state[HEAD][vocab["apple"]], b[HEAD]["apple"])
    assert torch.equal(state[HEAD][vocab["<|im_start|>"]], torch.zeros(32))  # B lacks it


def test_tied_embeddings_stay_tied(tmp_path):
    from examples.tiny import save_finetune_with_tokens, tiny_decoder, word_tokenizer

    base = tiny_decoder("qwen2", tie=True)
    base.save_pretrained(tmp_path / "base")
    word_tokenizer().save_pretrained(tmp_path / "base")
    a = save_finetune_with_tokens(base, tmp_path / "a", 0, special=("<|im_end|>",))
    b = save_finetune_with_tokens(base, tmp_path / "b", 1, tokens=("pear", "plum"))
    folder = hf_mloss.merge(str(tmp_path / "base"), [str(a), str(b)], "ties", k=0.5, tokenizer_source="union",
                            progress=False).save_pretrained(tmp_path / "merged")
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert model.config.tie_word_embeddings and model.config.vocab_size == 67
    assert model.lm_head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    assert HEAD not in load_file(f"{folder}/model.safetensors")
    assert close(model.get_input_embeddings().weight[64], rows(str(a))[EMBED]["<|im_end|>"])
    assert model.generate(torch.tensor([[64, 65, 66]]), max_new_tokens=3, do_sample=False).shape == (1, 6)


def test_bad_vocabulary_inputs_are_refused_before_any_write(inputs, tmp_path):
    from hf_mloss.cli import main

    base, models = inputs
    with pytest.raises(InvalidParameterError, match="must be union, base or a model of the merge"):
        MergeConfig(base=base, models=models, method="ties", tokenizer_source="org/not-merged")
    with pytest.raises(InvalidParameterError, match="data-free merge"):
        MergeConfig(base=base, models=models, method="ties", tokenizer_source="union", output="adapter")
    with pytest.raises(ConfigError, match="not one of the merge's models"):
        MergeConfig.from_dict({"merge_method": "ties", "base_model": base, "tokenizer": {"tokens": {
            "x": {"source": "./elsewhere"}}}, "models": [{"model": models[0], "parameters": {"weight": 1.0}}]})
    loaded = AutoModelForCausalLM.from_pretrained(models[0])
    with pytest.raises(InvalidParameterError, match="is a loaded model; pass model folders"):
        hf_mloss.merge(base, [loaded, models[1]], "ties", tokenizer_source="union", progress=False)
    no_tokenizer = tmp_path / "no-tokenizer"
    AutoModelForCausalLM.from_pretrained(models[1]).save_pretrained(no_tokenizer)
    recipe = tmp_path / "recipe.yml"
    recipe.write_text(f"merge_method: ties\nbase_model: {base}\ntokenizer_source: union\nmodels:\n"
                      f"  - {{model: {models[0]}, parameters: {{weight: 1, density: 0.5}}}}\n"
                      f"  - {{model: {no_tokenizer}, parameters: {{weight: 1, density: 0.5}}}}\n")
    with pytest.raises(IncompatibleCheckpointsError, match="the one of 'no-tokenizer' cannot be loaded .*no tokenizer files"):
        hf_mloss.run(MergeConfig.from_yaml(recipe), progress=False)
    assert main(["merge", str(recipe), str(tmp_path / "out")]) != 0
    assert not (tmp_path / "out").exists()
    lacking = {"base": base, "models": models, "method": "task_arithmetic", "parameters": {"lam": 1.0},
               "tokenizer_source": {"source": "union", "tokens": {"<|im_start|>": {"source": 2}}}}
    with pytest.raises(InvalidParameterError, match=r"from .*b.*, whose tokenizer has no such token"):
        hf_mloss.run(MergeConfig(**lacking), progress=False)
    with pytest.raises(InvalidParameterError, match="has no source"):
        hf_mloss.run(MergeConfig(**{**lacking, "tokenizer_source": {"tokens": {"<|im_start|>": None}}}),
                     progress=False)


def test_refusing_differing_vocabularies_advises_only_what_the_run_accepts(inputs):
    """Without tokenizer_source, fine-tunes whose vocabulary differs are refused. A data-free merge is told to pass
    tokenizer_source='union'; a data-guided one, for which the config refuses tokenizer_source, is told that it cannot
    merge them and what can, so following the advice never loops back to a refusal."""
    base, models = inputs
    texts = ["w1 w2 w3 w4", "w5 w6 w7"]
    with pytest.raises(IncompatibleCheckpointsError, match=r"Pass tokenizer_source='union' \(YAML"):
        hf_mloss.merge(base, models[:2], "ties", progress=False)
    for method, pretty in (("regmean", "RegMean"), ("regmean_plusplus", "RegMean++"), ("m_ties", "M-TIES")):
        for folders in (models[:2], models[2:]):  # added tokens (the tokenizers differ), 60 rows (the shapes do)
            with pytest.raises(IncompatibleCheckpointsError) as caught:
                hf_mloss.merge(base, folders, method, data=texts, progress=False)
            message = str(caught.value)
            assert f"{pretty} cannot merge fine-tunes whose vocabularies differ" in message, message
            assert "Merge them with a data-free method (e.g. method='task_arithmetic', 'ties' or 'tsv_m') and " \
                   "tokenizer_source='union'" in message and "Pass tokenizer_source" not in message
    with pytest.raises(InvalidParameterError, match="data-free merge"):  # what the old advice led to
        hf_mloss.merge(base, models[:2], "regmean", data=texts, tokenizer_source="union", progress=False)
