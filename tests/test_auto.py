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
    return _merge(tiny_paths, "auto", data=str(image_folder), candidates=GRIDS, compare_samples=12)


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
    """A candidate without λ is merged once, as the method alone merges it."""
    only = _merge(tiny_paths, "auto", data=str(image_folder), candidates=["regmean_plusplus"], compare_samples=12)
    direct = _merge(tiny_paths, "regmean_plusplus", data=str(image_folder))
    assert only.config.parameters["chosen"] == {"method": "regmean_plusplus", "parameters": {}}
    for key, value in direct.model.state_dict().items():
        assert torch.equal(only.model.state_dict()[key], value), key


def test_the_recorded_choice_reruns_without_choosing(chosen, tmp_path):
    chosen.save_pretrained(tmp_path / "out")
    card = (tmp_path / "out" / "README.md").read_text()
    assert "The merge chosen without labels" in card and "| regmean_plusplus | - |" in card
    assert "M-Loss per layer" in card and "diagnostic" in card  # the chosen merge's distance from the ensemble
    again = hf_mloss.run(str(tmp_path / "out"), progress=False)
    for key, value in chosen.model.state_dict().items():
        assert torch.equal(again.model.state_dict()[key], value), key


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
    defaults = {"tsv_m": {"lam": 1.0}, "iso_cts": {"lam": 1.0}, "ties": {"lam": 1.0}, "task_arithmetic": {"lam": 0.3},
                "regmean_plusplus": {}}
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
