"""``method="auto"``: the merge chosen without labels among methods and their λ.

Each candidate's value must be the one label-free selection gives the same candidate (selection is checked against
hand computations in tests/test_selection.py), the chosen merge must be the lowest one and equal, bit for bit, to
that method merged at that setting, and the record must re-run without choosing again.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import yaml

import hf_mloss
from examples import tiny as testing
from hf_mloss.methods.auto import DEFAULT_CANDIDATES, thinned

GRIDS = {"tsv_m": {"lam": [0.5, 1.0, 2.0]}, "ties": {"k": [0.2], "lam": [0.5, 1.0, 1.5]}, "regmean_plusplus": {}}


def _merge(paths, method, **kwargs):
    base, models = paths
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return hf_mloss.merge(base, models, method, progress=False, **kwargs)


@pytest.fixture(scope="module")
def chosen(tiny_paths, image_folder):
    """Every candidate fitted and compared on the same 12 images (the held-out comparison is tested below)."""
    return _merge(tiny_paths, "auto", data=str(image_folder), candidates=GRIDS, compare_samples=12, held_out=False)


def test_with_a_fitted_candidate_every_candidate_is_compared_on_samples_held_out_of_its_fit(tiny_paths, image_folder):
    """Without cross-fitting, half the pool (up to compare_samples) is held out: the candidates are compared on it,
    RegMean++ is fitted on the rest, and, chosen, fitted again on all of it. Without a fitted candidate nothing is
    held out."""
    from examples.tiny import tiny_processor
    from hf_mloss.loading.data import load_pixel_values
    from hf_mloss.loading.model_inputs import spread_index

    held = _merge(tiny_paths, "auto", data=str(image_folder), candidates=GRIDS, cross_fit=False)
    assert held.config.parameters["compared"] == 6 and held.config.parameters["fitted"] == 6
    pixels, _ = load_pixel_values(str(image_folder), tiny_processor(), num_samples=12)
    compared = pixels[spread_index(12, 6, held.config.seed)]
    scored = held.config.parameters["scored"]
    for name, grid in [("tsv_m", {"lam": [0.5, 1.0, 2.0]}), ("ties", {"k": [0.2], "lam": [0.5, 1.0, 1.5]})]:
        selected = _merge(tiny_paths, name, data=compared, select={"num_samples": 12}, grid=grid)
        theirs = [c["output"] for c in selected.config.select.candidates]
        assert [c["output"] for c in scored if c["method"] == name] == pytest.approx(theirs, rel=1e-6)
    plain = _merge(tiny_paths, "auto", data=str(image_folder), candidates={"tsv_m": {"lam": [0.5, 1.0]}})
    assert plain.config.parameters["compared"] == 12 and "fitted" not in plain.config.parameters


def test_cross_fitted_every_candidate_is_compared_on_all_samples_and_none_on_its_own_fit(tiny_paths, image_folder,
                                                                                        tmp_path):
    """By default (cross_fit) the pool is cut in two halves: RegMean++ is fitted on each and compared on the other,
    TSV-M on both, and each value pools the two halves' (sample, expert) pairs: by hand below, against selection on
    all 12 images for TSV-M, and against RegMean++ merged on one half and compared on the other for RegMean++."""
    from transformers import CLIPVisionModel

    from examples.tiny import tiny_processor
    from hf_mloss.loading.data import load_pixel_values
    from hf_mloss.loading.model_inputs import spread_index

    grids = {"tsv_m": {"lam": [0.5, 1.0]}, "regmean_plusplus": {"lam": [0.5, 1.5]}}
    crossed = _merge(tiny_paths, "auto", data=str(image_folder), candidates=grids, share="all")
    assert crossed.config.parameters["cross_fitted"] is True
    assert crossed.config.parameters["compared"] == 12 and crossed.config.parameters["fitted"] == 6
    scored = crossed.config.parameters["scored"]
    selected = _merge(tiny_paths, "tsv_m", data=str(image_folder), select={"num_samples": 12, "share": "all"},
                      grid=grids["tsv_m"])
    assert [c["output"] for c in scored if c["method"] == "tsv_m"] == pytest.approx(
        [c["output"] for c in selected.config.select.candidates], rel=1e-5)  # other batches, same pairs

    base, models = tiny_paths
    pixels, _ = load_pixel_values(str(image_folder), tiny_processor(), num_samples=12)
    first = torch.zeros(12, dtype=torch.bool)
    first[spread_index(12, 6, crossed.config.seed)] = True
    experts = [CLIPVisionModel.from_pretrained(m).eval() for m in models]

    def distances(fitted_on, compared_on, lam):  # Σ over (sample, expert) of ‖f_m − f_p‖² / ‖f_p‖²
        merged = _merge(tiny_paths, "regmean_plusplus", data=pixels[fitted_on], lam=lam).model
        with torch.no_grad():
            mine = merged(pixel_values=pixels[compared_on]).pooler_output
            theirs = [e(pixel_values=pixels[compared_on]).pooler_output for e in experts]
        return sum(float(((mine - f).square().sum(-1) / f.square().sum(-1)).double().sum()) for f in theirs)

    for candidate in (c for c in scored if c["method"] == "regmean_plusplus"):
        lam = candidate["setting"]["lam"]
        by_hand = (distances(~first, first, lam) + distances(first, ~first, lam)) / (12 * len(models))
        assert candidate["output"] == pytest.approx(by_hand, rel=1e-4)
    card = (crossed.save_pretrained(tmp_path / "out") / "README.md").read_text()
    assert "on each half of the data in turn and compared on the other" in card


def test_every_candidate_is_scored_as_selection_scores_it(tiny_paths, image_folder, chosen):
    scored = chosen.config.parameters["scored"]
    assert [(c["method"], c["setting"]) for c in scored] == [
        ("tsv_m", {"lam": 0.5}), ("tsv_m", {"lam": 1.0}), ("tsv_m", {"lam": 2.0}),
        ("ties", {"k": 0.2, "lam": 0.5}), ("ties", {"k": 0.2, "lam": 1.0}), ("ties", {"k": 0.2, "lam": 1.5}),
        ("regmean_plusplus", {})]
    for name, grid in [("tsv_m", {"lam": [0.5, 1.0, 2.0]}), ("ties", {"k": [0.2], "lam": [0.5, 1.0, 1.5]})]:
        selected = _merge(tiny_paths, name, data=str(image_folder), select={"num_samples": 12}, grid=grid)
        theirs = [c["output"] for c in selected.config.select.candidates]
        ours = [c["output"] for c in scored if c["method"] == name]
        assert ours == pytest.approx(theirs, rel=1e-6)


def test_the_lowest_candidate_is_written_bit_for_bit(tiny_paths, image_folder, chosen):
    scored = chosen.config.parameters["scored"]
    best = min(scored, key=lambda c: c["output"])
    record = chosen.config.parameters["chosen"]
    assert record == {"method": best["method"], "parameters": best["setting"]}
    again = _merge(tiny_paths, best["method"], data=str(image_folder), **best["setting"])
    for key, value in again.model.state_dict().items():
        torch.testing.assert_close(chosen.model.state_dict()[key], value, rtol=2e-6, atol=1e-7)


def test_regmean_plusplus_as_a_candidate_is_the_method_itself(tiny_paths, image_folder):
    """A candidate without a λ axis is merged once, as the method alone merges it."""
    only = _merge(tiny_paths, "auto", data=str(image_folder), candidates={"regmean_plusplus": {}}, compare_samples=12)
    direct = _merge(tiny_paths, "regmean_plusplus", data=str(image_folder))
    assert only.config.parameters["chosen"] == {"method": "regmean_plusplus", "parameters": {}}
    for key, value in direct.model.state_dict().items():
        assert torch.equal(only.model.state_dict()[key], value), key


def test_the_card_states_the_samples_actually_compared(tiny_paths, image_folder, tmp_path):
    """compare_samples (default 32) is an upper bound: with 12 images the candidates are compared on 12, and the
    recipe and card say 12 (issue 74); fewer asked than given, the number asked."""
    for asked, used in [({}, 12), ({"compare_samples": 8}, 8)]:
        result = _merge(tiny_paths, "auto", data=str(image_folder), candidates={"tsv_m": {"lam": [0.5, 1.0]}},
                        **asked)
        assert result.config.parameters["compared"] == used
        card = (result.save_pretrained(tmp_path / str(used)) / "README.md").read_text()
        assert f"on {used} unlabeled images" in card and "on 32 unlabeled" not in card
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            again = hf_mloss.run(str(tmp_path / str(used)), progress=False)  # the recorded choice keeps its count
        assert again.config.parameters["compared"] == used
        said = [str(w.message) for w in caught]  # the recipe's data is there on purpose: no "not read" warning
        assert not any("merges without data" in message for message in said), said


def test_regmean_plusplus_on_its_lam_grid_is_the_method_at_that_lam(tiny_paths, image_folder):
    """RegMean++ among the default candidates is searched on a λ grid: the published merge's task vector, scaled."""
    assert DEFAULT_CANDIDATES["regmean_plusplus"]["lam"] == DEFAULT_CANDIDATES["tsv_m"]["lam"]
    assert "iso_c" in DEFAULT_CANDIDATES
    only = _merge(tiny_paths, "auto", data=str(image_folder), candidates={"regmean_plusplus": {"lam": [0.5, 1.5]}},
                  compare_samples=12)
    chosen = only.config.parameters["chosen"]
    assert chosen["method"] == "regmean_plusplus" and chosen["parameters"]["lam"] in (0.5, 1.5)
    direct = _merge(tiny_paths, "regmean_plusplus", data=str(image_folder), **chosen["parameters"])
    for key, value in direct.model.state_dict().items():
        torch.testing.assert_close(only.model.state_dict()[key], value, rtol=1e-5, atol=1e-6)


def test_the_recorded_choice_reruns_without_choosing(chosen, tmp_path):
    chosen.save_pretrained(tmp_path / "out")
    card = (tmp_path / "out" / "README.md").read_text()
    assert "The merge chosen without labels" in card and "| regmean_plusplus | - |" in card
    assert "M-Loss per layer" in card and "diagnostic" in card  # the chosen merge's distance from the ensemble
    again = hf_mloss.run(str(tmp_path / "out"), progress=False)
    for key, value in chosen.model.state_dict().items():
        assert torch.equal(again.model.state_dict()[key], value), key


def test_a_bf16_decoders_recorded_choice_reruns_with_the_searchs_bits(tmp_path):
    """θ₀ + λ·τ is formed in float32 whether the search writes it or a recipe's re-run does: a bf16 decoder's
    re-run once held the base in bf16 (as a data-free merge does) and wrote other bits."""
    torch.manual_seed(0)
    base, models = testing.save_with_finetunes(testing.tiny_decoder("llama").to(torch.bfloat16), tmp_path / "llama",
                                               2, tokenizer=testing.word_tokenizer(64), scale=5e-2)
    texts = tmp_path / "texts.txt"
    texts.write_text("\n".join(" ".join(f"w{(5 * i + j) % 50}" for j in range(4 + i % 3)) for i in range(6)))
    result = hf_mloss.merge(str(base), [str(m) for m in models], "auto", data={"path": str(texts)}, batch_size=3,
                            candidates={"task_arithmetic": {"lam": [0.7]}}, progress=False)
    assert result.config.parameters["chosen"] == {"method": "task_arithmetic", "parameters": {"lam": 0.7}}
    result.save_pretrained(tmp_path / "out")
    again = hf_mloss.run(str(tmp_path / "out"), progress=False)
    for key, value in result.model.state_dict().items():
        assert value.dtype == torch.bfloat16 and torch.equal(again.model.state_dict()[key], value), key


def test_without_data_it_is_tsv_m_at_its_default_and_says_so(tiny_paths, tmp_path):
    result = _merge(tiny_paths, "auto")
    assert result.config.parameters["chosen"]["method"] == "tsv_m"
    direct = _merge(tiny_paths, "tsv_m")
    for key, value in direct.model.state_dict().items():
        assert torch.equal(result.model.state_dict()[key], value), key
    result.save_pretrained(tmp_path / "out")
    card = (tmp_path / "out" / "README.md").read_text()
    assert "did not compare candidates: no data was given" in card
    assert "@inproceedings{mloss2026" not in card  # no M-Loss was used or measured


def test_budget_thins_the_grids_and_keeps_the_defaults():
    defaults = {"tsv_m": {"lam": 1.0}, "iso_c": {"lam": 1.0}, "iso_cts": {"lam": 1.0}, "ties": {"lam": 1.0},
                "task_arithmetic": {"lam": 0.3}, "regmean_plusplus": {"lam": 1.0}}
    cut = thinned(DEFAULT_CANDIDATES, 10, defaults)
    assert sum(max(1, len(g.get("lam", [0]))) for g in cut.values()) == 10
    for name, grid in cut.items():
        if "lam" in defaults[name]:
            assert defaults[name]["lam"] in grid["lam"], name
    with pytest.raises(hf_mloss.InvalidParameterError, match="budget=3 is below the number of candidate methods"):
        thinned(DEFAULT_CANDIDATES, 3, defaults)


def test_a_grid_end_choice_warns(tiny_paths, image_folder):
    base, models = tiny_paths
    with pytest.warns(UserWarning, match="chose a grid edge"):
        hf_mloss.merge(base, models, "auto", data=str(image_folder), candidates={"task_arithmetic": {"lam": [
            0.01, 0.02, 0.03]}}, compare_samples=8, progress=False)


@pytest.mark.parametrize("candidates, message", [
    (["tsv_m", "nope"], "Unknown merge method 'nope'"),
    (["adamerging"], "cannot be a candidate of auto"),
    ({"ties": {"lam": 1.0}}, r"candidates\['ties'\] must be a grid"),
    ({"ties": {"k": [1.5]}}, r"candidates\['ties'\]: the setting \{'k': 1.5\} is invalid"),
    ("tsv_m", "candidates must be a non-empty list"),
])
def test_bad_candidates_are_refused_before_any_work(tiny_paths, candidates, message):
    base, models = tiny_paths
    with pytest.raises(hf_mloss.HfMLossError, match=message):
        hf_mloss.merge(base, models, "auto", candidates=candidates, progress=False)


def test_a_causal_lm_from_a_yaml_recipe(tmp_path):
    """YAML ``method: auto`` on a tiny Llama with texts: next-token distributions compared, padding excluded."""
    torch.manual_seed(0)
    base, models = testing.save_with_finetunes(testing.tiny_decoder("llama"), tmp_path / "llama", 2,
                                               tokenizer=testing.word_tokenizer(64), scale=5e-2)
    texts = tmp_path / "texts.txt"
    texts.write_text("\n".join(" ".join(f"w{(7 * i + j) % 50}" for j in range(3 + i % 5)) for i in range(16)))
    recipe = tmp_path / "auto.yaml"
    recipe.write_text(yaml.safe_dump({"base": str(base), "models": [str(m) for m in models], "method": "auto",
                                      "data": {"path": str(texts)}, "parameters": {
                                          "candidates": {"tsv_m": {"lam": [0.5, 1.0]}, "task_arithmetic": {
                                              "lam": [0.3, 0.6]}}, "compare_samples": 8}}))
    from hf_mloss.cli import main

    assert main(["merge", str(recipe), str(tmp_path / "out"), "-q"]) == 0
    saved = hf_mloss.MergeConfig.from_pretrained(tmp_path / "out")
    assert len(saved.parameters["scored"]) == 4
    assert saved.parameters["chosen"]["method"] in ("tsv_m", "task_arithmetic")


# --------------------------------------------------------------------------------------------------------------------
# Refusals before any work, and records that say what ran
# --------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("parameters, message", [
    ({"candidates": ["tsv_m", ["ties"]]}, r"candidates\[1\] must be a method name, got \['ties'\]"),
    ({"candidates": ["tsv_m", "tsv_m"]}, "candidates names a method twice"),
    ({"candidates": {"dare_ties": {"lam": [0.5]}, "dare": {"lam": [2.0]}}},
     "candidates names 'dare_ties' twice \\('dare_ties' and 'dare'\\)"),
    ({"candidates": {"tsv_m": {"lam": [1.0, 1.0]}}, "budget": 1}, r"candidates\['tsv_m'\].lam repeats a value"),
    ({"budget": 2}, "budget=2 is below the number of candidate methods \\(6\\)"),
    ({"chosen": {"method": "adamerging"}}, "chosen.method: 'adamerging' cannot be a candidate of auto"),
    ({"chosen": {"method": "ties", "parameters": {"k": 7}}}, "chosen.parameters: "),
    ({"candidates": ["tsv_m", "slerp"]}, "candidates: slerp merges exactly 1 fine-tuned model\\(s\\) and this run has 3"),
    ({"candidates": ["tsv_m", "nearswap"]}, "candidates: nearswap merges exactly 1"),
    ({"candidates": {"nuslerp": {}}}, "candidates: nuslerp merges exactly 2"),
    ({"heads": ["a.safetensors"]}, "heads: got 1 for 3 models"),
])
def test_auto_options_that_cannot_run_are_refused_when_the_recipe_is_built(tiny_paths, image_folder, parameters,
                                                                            message):
    base, models = tiny_paths
    with pytest.raises(hf_mloss.HfMLossError, match=message):
        hf_mloss.MergeConfig.from_kwargs(base, models, "auto", data=str(image_folder), **parameters)


def test_a_grid_the_budget_thins_below_the_limit_is_accepted(tiny_paths, image_folder):
    base, models = tiny_paths
    lams = [round(0.01 * i, 2) for i in range(1, 301)]
    with pytest.raises(hf_mloss.InvalidParameterError, match="auto has 300 candidates; the limit is 256"):
        hf_mloss.MergeConfig.from_kwargs(base, models, "auto", data=str(image_folder),
                                         candidates={"task_arithmetic": {"lam": lams}})
    hf_mloss.MergeConfig.from_kwargs(base, models, "auto", data=str(image_folder),
                                     candidates={"task_arithmetic": {"lam": lams}}, budget=10)


def test_options_that_compare_candidates_need_data(tiny_paths):
    base, models = tiny_paths
    with pytest.raises(hf_mloss.DataError, match="candidates cannot be honoured"):
        hf_mloss.MergeConfig.from_kwargs(base, models, "auto", candidates=["ties"])


def test_text_data_is_refused_for_what_auto_does_read(tiny_paths, image_folder):
    base, models = tiny_paths
    with pytest.raises(hf_mloss.InvalidParameterError, match="auto compares its candidates on `data` through the "
                                                             "vision tower only"):
        hf_mloss.MergeConfig.from_kwargs(base, models, "auto", data=str(image_folder), text_data=["a photo"])


def test_the_recorded_weights_are_those_the_chosen_merge_used(tiny_paths, image_folder, tmp_path):
    """TSV-M weighs each model 1 by default: the card and ``result.weights`` say so, and following them re-merges
    the same tensors."""
    result = _merge(tiny_paths, "auto", data=str(image_folder), candidates={"tsv_m": {"lam": [1.0]}},
                    compare_samples=8)
    assert result.config.parameters["chosen"]["method"] == "tsv_m"
    assert result.weights == [1.0, 1.0, 1.0]
    result.save_pretrained(tmp_path / "out")
    card = (tmp_path / "out" / "README.md").read_text()
    assert "| 0.333" not in card and "| 0.5 |" not in card
    again = _merge(tiny_paths, "tsv_m", lam=1.0, weights=result.weights)
    for key, value in again.model.state_dict().items():
        torch.testing.assert_close(result.model.state_dict()[key], value, rtol=2e-6, atol=1e-7)


def test_criterion_as_a_keyword_and_the_cards_caution_for_mloss(tiny_paths, image_folder, tmp_path):
    result = _merge(tiny_paths, "auto", data=str(image_folder), candidates={"tsv_m": {"lam": [0.5, 1.0]}},
                    criterion="mloss", compare_samples=8)
    assert result.config.method_params().criterion == "mloss" and result.config.select is None
    result.save_pretrained(tmp_path / "out")
    card = " ".join((tmp_path / "out" / "README.md").read_text().split())
    assert "M-Loss as a criterion measures the distance from the ensemble, not accuracy" in card


def test_fine_tunes_equal_to_the_base_are_a_tie_not_a_choice(tiny_paths, image_folder, tmp_path):
    base, _ = tiny_paths
    with pytest.warns(UserWarning, match="every candidate scored 0 by 'output', so the comparison cannot tell them "
                                         "apart") as caught:
        result = hf_mloss.merge(base, [base, base], "auto", data=str(image_folder), compare_samples=8,
                                candidates={"tsv_m": {"lam": [0.5, 1.0, 2.0]}}, progress=False)
    assert not [w for w in caught if "grid edge" in str(w.message)]
    result.save_pretrained(tmp_path / "out")
    card = " ".join((tmp_path / "out" / "README.md").read_text().split())
    assert "Every candidate scored the same" in card and "sits on an end of its grid" not in card


def test_a_grid_end_choice_is_on_the_card_too(tiny_paths, image_folder, tmp_path):
    with pytest.warns(UserWarning, match="chose a grid edge of task_arithmetic's grid"):
        result = _merge_warned(tiny_paths, data=str(image_folder), compare_samples=8,
                               candidates={"task_arithmetic": {"lam": [0.01, 0.02, 0.03]}})
    result.save_pretrained(tmp_path / "out")
    card = " ".join((tmp_path / "out" / "README.md").read_text().split())
    assert "The choice sits on an end of its grid (lam=" in card


def _merge_warned(paths, **kwargs):
    base, models = paths
    return hf_mloss.merge(base, models, "auto", progress=False, **kwargs)


def _head_file(path, width: int, classes: int = 4) -> str:
    from safetensors.torch import save_file

    save_file({"weight": torch.randn(classes, width), "bias": torch.zeros(classes)}, str(path))
    return str(path)


def test_heads_resolve_against_the_recipe_are_written_relative_and_checked_before_any_candidate(
        tiny_paths, image_folder, tmp_path):
    from transformers import AutoConfig

    from hf_mloss.cli import main

    base, models = tiny_paths
    width = AutoConfig.from_pretrained(base).hidden_size
    project = tmp_path / "project"
    project.mkdir()
    names = [f"head{i}.safetensors" for i in range(3)]
    for name in names:
        _head_file(project / name, width)
    recipe = {"base": base, "models": models, "method": "auto", "data": {"path": str(image_folder)},
              "parameters": {"candidates": {"tsv_m": {"lam": [0.5, 1.0]}}, "compare_samples": 8, "heads": names}}
    (project / "auto.yaml").write_text(yaml.safe_dump(recipe))
    config = hf_mloss.MergeConfig.from_yaml(project / "auto.yaml")
    assert config.parameters["heads"] == [str(project / n) for n in names]
    assert str(project / names[0]) in config.input_paths()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert main(["merge", str(project / "auto.yaml"), str(project / "out"), "-q"]) == 0
    written = yaml.safe_load((project / "out" / "hf_mloss_config.yaml").read_text())
    assert written["parameters"]["heads"] == [f"../{n}" for n in names]
    assert str(project) not in (project / "out" / "README.md").read_text()
    _head_file(project / names[1], width + 3)
    with pytest.raises(hf_mloss.InvalidParameterError, match=rf"heads\[1\] .* reads {width + 3} features, but the "
                                                             rf"tower's pooled output has {width}"):
        hf_mloss.run(config, progress=False)
    (project / names[2]).unlink()
    with pytest.raises(hf_mloss.InvalidParameterError, match=r"heads\[2\]: .* does not exist"):
        hf_mloss.run(config, progress=False)


def test_on_a_mixture_of_experts_the_default_candidates_leave_regmean_out_and_say_so(tmp_path):
    import transformers

    torch.manual_seed(0)
    moe = transformers.MixtralForCausalLM(transformers.MixtralConfig(
        vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        max_position_embeddings=64, bos_token_id=1, eos_token_id=2, pad_token_id=3, intermediate_size=12,
        num_local_experts=4, num_experts_per_tok=2)).eval()
    base, models = testing.save_with_finetunes(moe, tmp_path / "mixtral", 2, tokenizer=testing.word_tokenizer(64),
                                               scale=5e-2)
    texts = [" ".join(f"w{(5 * i + j) % 60}" for j in range(4 + i % 3)) for i in range(8)]
    with pytest.warns(UserWarning, match="auto: regmean_plusplus is left out of the default candidates"):
        result = hf_mloss.merge(base, models, "auto", data=texts, compare_samples=4, budget=6, progress=False)
    assert "regmean_plusplus" not in {c["method"] for c in result.config.parameters["scored"]}
    with pytest.raises(hf_mloss.UnsupportedModelError, match="candidates: regmean_plusplus cannot run on this model"):
        hf_mloss.merge(base, models, "auto", data=texts, candidates=["tsv_m", "regmean_plusplus"], progress=False)


@pytest.mark.parametrize("method", ["auto", "regmean"])
def test_scoring_the_merged_prefix_is_refused_for_merges_not_guided_by_mloss(tiny_paths, image_folder, method):
    base, models = tiny_paths
    config = hf_mloss.MergeConfig.from_kwargs(base, models, method, data=str(image_folder),
                                              score={"prefix": "merged"})
    with pytest.raises(hf_mloss.InvalidParameterError, match=f"method {method!r} does not merge by M-Loss"):
        hf_mloss.run_score(config, progress=False)


def test_a_criterion_that_needs_heads_is_refused_by_its_own_name(tiny_paths, image_folder):
    base, models = tiny_paths
    with pytest.raises(hf_mloss.InvalidParameterError, match="criterion 'disagreement' needs one classification head"):
        hf_mloss.merge(base, models, "auto", data=str(image_folder), criterion="disagreement", compare_samples=4,
                       candidates={"tsv_m": {"lam": [1.0]}}, progress=False)
