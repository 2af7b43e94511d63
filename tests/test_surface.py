"""What a user sees: the README's quick start, readings on printed numbers, one default per parameter, cards that keep
their promises, warnings where something is not what was asked."""

from __future__ import annotations

import argparse

import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import yaml

import hf_mloss
from hf_mloss.cli import main

REPO = Path(__file__).resolve().parents[1]


def readme_block(heading: str, language: str = "python") -> str:
    text = (REPO / "README.md").read_text()
    return text.split(f"## {heading}")[1].split(f"```{language}\n")[1].split("```")[0]


# ----------------------------------------------------------------------------------------------------- README
def test_readme_leads_with_the_two_commands_and_stays_short():
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    commands = text.split("```bash\n")[1].split("```")[0].splitlines()
    assert commands[0].endswith("python -m benchmarks.suites real-quick")
    assert '-e ".[suite,real]"' in commands[0] and "--no-deps" not in commands[0]  # pip check passes after it
    assert commands[1].startswith('pip install torch==2.13.0 -e ".[test]" && python -m pytest')
    headings = re.findall(r"^## (.+)$", text, flags=re.M)
    assert headings[:5] == ["Quick start: merge two local folders", "Which method to start with",
                            "Use your own models", "Python API", "Methods"]
    flat = " ".join(text.split())
    lines = text.splitlines()
    # issue 74: use first (what it is, the two commands, then a merge, within 40 lines), what the main job prints
    # last and writes where, and the image data= forms once each
    assert "hf_mloss.merge(" in "\n".join(lines[:40]) and lines.index("```bash") < 10
    assert "ends with `Total … s. Results: …` and `Cache: …`" in flat and "`hf_mloss_real_quick_suite/` here" in flat
    assert "G5 statistics FAIL" not in flat  # the gates' reading lives in docs/benchmarks.md
    forms = ["# a folder of images", "# a datasets split", "# a list of PIL images", "# an [N, 3, H, W] tensor"]
    assert all(text.count(form) == 1 for form in forms)
    assert "M-TIES has not beaten its own controls" in flat  # the README states the verdict
    assert "needs root" in flat and "rm -rf ~/.cache/huggingface/hf_mloss_suites" in flat
    # the CLI example writes somewhere other than the quick start's folder, so a newcomer's first CLI run works
    assert 'save_pretrained("merged")' in text and "hf-mloss merge merge.yaml merged-cli/" in flat
    for link in re.findall(r"\]\(((?:docs|benchmarks)/[^)#]+)\)", text):
        assert (REPO / link).is_file(), link


def test_readme_quick_start_runs(tmp_path):
    """The quick start runs where the package is installed: from a folder outside the clone, with only the package
    importable (the clone's examples/ and benchmarks/ are not on the path, as after `pip install`)."""
    code = readme_block("Quick start")
    assert len([line for line in code.splitlines() if line.strip()]) <= 12
    site = tmp_path / "site"
    site.mkdir()
    (site / "hf_mloss").symlink_to(REPO / "hf_mloss", target_is_directory=True)
    env = {**os.environ, "PYTHONPATH": str(site)}
    where = "import hf_mloss, importlib.util as u; print(hf_mloss.__file__, u.find_spec('examples'))"
    check = subprocess.run([sys.executable, "-c", where], cwd=tmp_path, capture_output=True, text=True, env=env,
                           check=True)
    assert check.stdout.startswith(str(site / "hf_mloss")) and check.stdout.rstrip().endswith("None"), check.stdout
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, env=env,
                          timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (tmp_path / "merged" / "model.safetensors").is_file()
    # the CLI equivalent the README gives
    (tmp_path / "merge.yaml").write_text(yaml.safe_dump({"base": "tiny_models/base", "method": "ties",
                                                         "models": ["tiny_models/ft0", "tiny_models/ft1"]}))
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        assert main(["merge", "merge.yaml", "merged-cli", "-q"]) == 0
    finally:
        os.chdir(cwd)


# --------------------------------------------------------------------------------------------- readings
def test_data_free_merge_has_a_report_that_says_how_to_measure(tiny_paths, tmp_path):
    base, models = tiny_paths
    result = hf_mloss.merge(base, models[:2], "ties", progress=False)
    assert result.report is not None and not result.report.computed
    assert "No M-Loss was computed: ties merges without data" in result.report.summary()
    folder = result.save_pretrained(tmp_path / "merged")
    assert not (folder / "mloss.json").exists() and "## M-Loss per layer" not in (folder / "README.md").read_text()


def test_printed_mloss_says_prefix_q_and_how_to_read_it(tiny_paths, image_folder):
    base, models = tiny_paths
    report = hf_mloss.score(base, models, str(image_folder), num_samples=6, batch_size=3, progress=False)
    text = report.summary()
    assert text.startswith("M-Loss of 3 models (q=3), prefix=own, reduction=abs")
    assert "prefix own: each model's own activations feed each layer" in text
    assert "Reading: lower is better; 0 means" in text and "% of the merged activations' norm" in text
    assert report.device == "cpu" and "on cpu" in text.splitlines()[0]


def test_leave_one_out_is_net_of_the_q_effect():
    from hf_mloss.engine.compatibility import CompatibilityReport

    # q = 3: the leave-one-out sets are the pairs; exchangeable models would give each 1.0 * (1 - 1/2) / (1 - 1/3)
    # = 0.75 of the whole set's 1.0
    q = 3
    subsets = [(0, 1), (0, 2), (1, 2), (0, 1, 2)]
    values = torch.tensor([[0.75], [0.75], [0.6], [1.0]], dtype=torch.float64)
    report = CompatibilityReport(models=["a", "b", "c"], weights=[1 / q] * q, layers=["l"], subsets=subsets,
                                 values={"mloss": values}, baselines={}, reduction="abs", activation="gelu", eps=1e-4,
                                 num_samples=4, num_positions=8)
    rows = {r["model"]: r for r in report.leave_one_out()}
    assert all(r["gain"] > 0 for r in rows.values())  # the raw gain: positive for every model
    assert rows["a"]["expected"] == pytest.approx(0.75)
    assert rows["a"]["net_gain"] == pytest.approx(0.15)  # without a, the rest merges better than q alone explains
    assert rows["b"]["net_gain"] == pytest.approx(0.0) and rows["c"]["net_gain"] == pytest.approx(0.0)
    summary = report.summary()
    assert "net gain" in summary and summary.index("  a ") < summary.index("  b ")
    assert "Median pair 7.5000e-01" in summary


def test_heatmap_labels_distinguish_different_values():
    from hf_mloss.output.plots import distinct_labels

    assert distinct_labels([0.4812, 0.4849, 0.12]) == ["0.481", "0.485", "0.12"]
    assert distinct_labels([0.5, 0.5, 0.25]) == ["0.5", "0.5", "0.25"]  # equal values may share a label
    assert len(set(distinct_labels([1.0, 1.0 + 1e-9]))) == 1  # beyond 6 digits: not forced apart


def test_node_heatmap_sorts_nodes_within_each_layer(tiny_paths, image_folder):
    from hf_mloss.output.plots import node_position_matrix

    base, models = tiny_paths
    report = hf_mloss.score(base, models, str(image_folder), num_samples=4, batch_size=4, progress=False)
    matrix = node_position_matrix(report)
    assert (matrix[:, :-1] >= matrix[:, 1:]).all()  # highest first: node order carries no meaning in an MLP


# --------------------------------------------------------------------------------------------- defaults
def test_one_default_per_parameter(capsys, ties_config_path):
    assert main(["methods"]) == 0
    listing = capsys.readouterr().out
    ties_line = listing.split("\nties ")[1]
    assert "scope='global'" in ties_line and "scope=None" not in listing
    assert main(["merge", str(ties_config_path), str(ties_config_path.parent / "out"), "-q"]) == 0
    printed = capsys.readouterr().out
    assert "scope='global'" in printed and "None" not in printed.split("parameters:")[1].splitlines()[0]
    card = (ties_config_path.parent / "out" / "README.md").read_text()
    assert "| `scope` | `global` |" in card
    # an unknown parameter's error lists the defaults as the listing does
    with pytest.raises(hf_mloss.InvalidParameterError, match=r"scope \(default 'global'\)"):
        hf_mloss.merge("base", ["a", "b"], "ties", scop="tensor")
    tsv_line = listing.split("\ntsv_m ")[1].split("\n\n")[0]
    assert "fraction='1/q'" in tsv_line


def test_tsv_m_card_gives_the_fraction_it_used(tiny_paths, tmp_path):
    base, models = tiny_paths
    card = (hf_mloss.merge(base, models, "tsv_m", progress=False).save_pretrained(tmp_path / "default")
            / "README.md").read_text()
    assert "| `fraction` | `1/q = 0.3333` |" in card
    card = (hf_mloss.merge(base, models, "tsv_m", fraction=0.25, progress=False).save_pretrained(tmp_path / "set")
            / "README.md").read_text()
    assert "| `fraction` | `0.25` |" in card


@pytest.fixture
def ties_config_path(tmp_path, tiny_paths) -> Path:
    base, models = tiny_paths
    path = tmp_path / "ties.yaml"
    path.write_text(yaml.safe_dump({"base": base, "models": models[:2], "method": "ties"}))
    return path


def test_selection_on_a_grid_edge_warns(tiny_paths, image_folder):
    from hf_mloss.spec.selection import grid_edges

    assert grid_edges({"lam": [0.5, 1.0, 1.5], "k": [0.2, 0.5]}, {"lam": 1.5, "k": 0.2}) == \
        ["lam=1.5 (the highest of [0.5, 1.0, 1.5])"]  # a 2-value axis has no inside: not flagged
    assert grid_edges({"lam": [0.5, 1.0, 1.5]}, {"lam": 1.0}) == []
    base, models = tiny_paths
    with pytest.warns(UserWarning, match="chose a grid edge: lam=1e-06"):
        hf_mloss.merge(base, models, "task_arithmetic", data=str(image_folder), num_samples=4, batch_size=4,
                       select="unlabeled", grid={"lam": [1e-6, 30.0, 60.0]}, progress=False)


# --------------------------------------------------------------------------------------------- promises
def test_card_promises_a_rerun_only_when_the_recipe_can_rerun(tiny_paths, image_folder, tmp_path):
    from hf_mloss.loading.data import load_pixel_values
    from examples.tiny import tiny_processor

    base, models = tiny_paths
    pixels, _ = load_pixel_values(str(image_folder), tiny_processor(), num_samples=4)
    result = hf_mloss.merge(base, models, "m_ties", data=pixels, batch_size=4, progress=False)
    folder = result.save_pretrained(tmp_path / "from-tensor")
    card = (folder / "README.md").read_text()
    assert "cannot re-run as written: the scoring images were passed from Python" in card
    assert "reproduces the merge" not in card
    recorded = yaml.safe_load((folder / "hf_mloss_config.yaml").read_text())["data"]
    assert recorded["in_memory"] == "Tensor" and recorded["content"].startswith("xxh3-128:")
    with pytest.raises(hf_mloss.ConfigError, match=re.escape(recorded["content"])):
        hf_mloss.MergeConfig.from_pretrained(folder)
    again = hf_mloss.merge(base, models, "m_ties", data=str(image_folder), num_samples=4, batch_size=4,
                           progress=False).save_pretrained(tmp_path / "from-folder")
    assert "reproduces the merge from the same inputs" in (again / "README.md").read_text()


def test_paths_outside_the_project_are_recorded_absolute(tmp_path, monkeypatch):
    from hf_mloss.spec.config import _relative

    monkeypatch.setattr(Path, "home", classmethod(lambda cls: tmp_path / "home"))
    project = tmp_path / "home" / "project"
    assert _relative(str(project / "models" / "ft0"), project / "out") == os.path.join("..", "models", "ft0")
    cache = tmp_path / "home" / ".cache" / "huggingface" / "ft0"
    assert _relative(str(cache), project / "out") == str(cache)


def test_missing_processor_is_named_in_full(tmp_path, tiny_paths, image_folder):
    from transformers import CLIPVisionModel

    base, models = tiny_paths
    bare = tmp_path / "bare-base"
    CLIPVisionModel.from_pretrained(base).save_pretrained(bare)  # no preprocessor_config.json
    with pytest.raises(hf_mloss.InvalidParameterError) as info:
        hf_mloss.score(str(bare), models, str(image_folder), num_samples=4, progress=False)
    message = str(info.value)
    assert f"{str(bare)!r} has no preprocessor_config.json" in message and "Pass processor=..." in message
    assert message.endswith("as a [N, 3, H, W] tensor.")
    with pytest.warns(UserWarning, match="The merged folder has no image processor"):
        hf_mloss.merge(str(bare), models, "ties", progress=False).save_pretrained(tmp_path / "merged")


def test_first_sentence_never_cuts_mid_word():
    from hf_mloss.loading.inputs import first_sentence

    long = "Can't load image processor for 'x' because " + "words " * 80
    cut = first_sentence(long, limit=60)
    assert cut.endswith(" …") and len(cut) <= 62 and long.startswith(cut[:-2])
    assert first_sentence("First part. Second part.") == "First part."


def test_fewer_images_than_asked_is_said(tiny_paths, image_folder):
    base, models = tiny_paths
    with pytest.warns(UserWarning, match=r"Asked for 500 scoring images; .* has only 12 usable ones"):
        report = hf_mloss.score(base, models, str(image_folder), num_samples=500, batch_size=6, progress=False)
    assert report.num_samples == 12


# --------------------------------------------------------------------------------------------- the card
def test_card_nits(tiny_paths, image_folder, tmp_path):
    base, models = tiny_paths
    card = (hf_mloss.merge(base, models, "m_ties", data=str(image_folder), num_samples=4, batch_size=4,
                           progress=False).save_pretrained(tmp_path / "m") / "README.md").read_text()
    assert "# M-TIES merge of 3 fine-tunes of a CLIPVisionModel" in card  # not the local folder's name ("base")
    assert "| `seed` | `0` |" in card  # the sample of images depends on it
    assert "author    = {Wang, Tiantong and" in card
    usage = card.split("## How to use")[1]
    assert usage.index('image = Image.open("photo.jpg")') < usage.index("images=image")


def test_a_text_family_speaks_of_texts_not_images(tmp_path, capsys):
    """Card, re-run error, report reading and CLI help name a text family's samples texts."""
    from examples import tiny

    from hf_mloss import ConfigError, MergeConfig

    base, models = tiny.save_with_finetunes(tiny.tiny_decoder("llama"), tmp_path / "llama", 2,
                                            tokenizer=tiny.word_tokenizer(64))
    texts = [" ".join(f"w{(i * 7 + j) % 60}" for j in range(6 + i % 5)) for i in range(12)]
    result = hf_mloss.merge(base, models, "m_ties", data=texts, num_samples=8, batch_size=4, progress=False)
    card = (result.save_pretrained(tmp_path / "merged") / "README.md").read_text()
    assert "image" not in card.lower(), [line for line in card.splitlines() if "image" in line.lower()]
    assert ", 8 texts (" in card and "M-Loss measures, on unlabeled texts" in card
    assert "the scoring texts were passed from Python" in card and "a re-run needs the same texts" in card
    assert "image" not in result.report.reading().lower()
    with pytest.raises(ConfigError) as err:
        MergeConfig.from_yaml(tmp_path / "merged" / "hf_mloss_config.yaml")
    assert "pass the same texts again" in str(err.value) and "image" not in str(err.value).lower()
    assert main(["merge", "--help"]) == 0
    help_text = " ".join(capsys.readouterr().out.split())
    assert "Unlabeled samples (images, or texts for text families) each candidate is scored on" in help_text


def test_max_length_above_the_position_limit_is_refused_and_the_default_lowered(tmp_path):
    """The README's `max_length=128` on a model with 64 positions is refused naming max_length (issue 57: a given
    value past the positions is the user's to fix); left out, the default 128 is lowered to 64 without a word."""
    from examples import tiny

    base, models = tiny.save_with_finetunes(tiny.tiny_decoder("llama"), tmp_path / "llama", 2,
                                            tokenizer=tiny.word_tokenizer(64))
    texts = [" ".join(f"w{(i + j) % 60}" for j in range(100)) for i in range(4)]  # 100 words, 64 positions
    with pytest.raises(hf_mloss.DataError, match=r"data.max_length=128 is past the 64 positions .* max_length <= 64"):
        hf_mloss.score(base, models, data=texts, max_length=128, num_samples=4, progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        report = hf_mloss.score(base, models, data=texts, num_samples=4, progress=False)
    assert report.num_samples == 4 and report.num_positions == 4 * 64
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # within the limit: no warning, texts cut where asked
        assert hf_mloss.score(base, models, data=texts, max_length=32, num_samples=4,
                              progress=False).num_positions == 4 * 32


def test_evaluate_is_exported():
    assert hf_mloss.evaluate is hf_mloss.merging.evaluation.evaluate and "evaluate" in hf_mloss.__all__
    assert hf_mloss.EvalResult(accuracy={"a": 0.5, "b": 1.0}).mean == 0.75


def test_quiet_silences_transformers_loading_bars(tiny_paths, tmp_path, capfd):
    base, models = tiny_paths
    config = tmp_path / "ties.yaml"
    config.write_text(yaml.safe_dump({"base": base, "models": models[:2], "method": "ties"}))
    assert main(["merge", str(config), str(tmp_path / "out")]) == 0
    err = capfd.readouterr().err
    assert "Loading weights" not in err and "Merging (ties)" in err  # one bar per stage, ours
    assert main(["merge", str(config), str(tmp_path / "out2"), "-q"]) == 0
    assert capfd.readouterr().err == ""


def test_reading_images_shows_one_bar_that_quiet_silences(image_folder, capsys):
    """Decoding and preprocessing the scoring images (streamed or from a folder) shows a "Reading images" bar."""
    from hf_mloss.loading.data import load_pixel_values
    from examples.tiny import tiny_processor

    load_pixel_values(str(image_folder), tiny_processor(), num_samples=4, progress=True)
    assert "Reading images" in capsys.readouterr().err
    load_pixel_values(str(image_folder), tiny_processor(), num_samples=4, progress=False)
    assert "Reading images" not in capsys.readouterr().err


def test_committed_records_name_no_machine_folders(monkeypatch):
    """Benchmark records are shared: their commands and paths are relative to the tree (or named, as the reference
    tree of a side-by-side run), never one machine's absolute folders."""
    monkeypatch.setenv("HF_MLOSS_PEER_ENVS", "/x/peers")  # where CI builds them varies; the role name does not
    sys.path.insert(0, str(REPO))
    from benchmarks.merge_speed import REPO as TREE, portable, record_roots

    record = {"cwd": "/x/tree", "runs": [{"log": "/x/tree/benchmarks/.cache/r.log", "pythonpath": "/y/old"}]}
    assert portable(record, {"/x/tree": ".", "/y/old": "REFERENCE"}) == {
        "cwd": ".", "runs": [{"log": "benchmarks/.cache/r.log", "pythonpath": "REFERENCE"}]}
    args = argparse.Namespace(cache="/x/cache", results_dir=str(TREE / "benchmarks" / "results"), reference=None)
    assert record_roots(args) == {str(TREE): ".", "/x/peers": "PEER_ENVS", "/x/cache": "CACHE"}
    relative = record_roots(argparse.Namespace(cache="c", results_dir="out", reference=None))  # run outside the tree
    assert "c" not in relative and portable({"text": "merge_speed records: cpu scale"}, relative) == {
        "text": "merge_speed records: cpu scale"}
    absolute = re.compile(r"(?<![\w.])/(?:home|root|tmp|work|Users|mnt)/")
    offenders = [p.name for p in sorted((REPO / "benchmarks" / "results").iterdir())
                 if p.suffix in (".json", ".md") and absolute.search(p.read_text())]
    assert not offenders, f"records with machine folders: {offenders}"
