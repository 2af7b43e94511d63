"""Each fine-tune's own unlabeled data: one spelling in Python, YAML and the CLI; refusals before any work; the
recipe that records it (folders fingerprinted, Hub datasets pinned) and re-runs bit for bit; the card; the union
read by M-TIES, per-model data in learned merges, selection and ``auto`` against hand-computed references.

RegMean's Grams on each model's own data are checked against forward hooks in ``test_regmean.py``, compatibility's
pairs on their members' data here.
"""

from __future__ import annotations

import io
import sys
import warnings
from pathlib import Path

import pytest
import torch
import yaml
from PIL import Image

import hf_mloss
from examples.tiny import make_image_folder
from hf_mloss import MergeConfig
from hf_mloss.errors import ConfigError, DataError, InvalidParameterError

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="module")
def own_pixels():
    generator = torch.Generator().manual_seed(11)
    return [torch.randn(n, 3, 32, 32, generator=generator) for n in (6, 4, 5)]


@pytest.fixture(scope="module")
def heads():
    torch.manual_seed(3)
    return [torch.nn.Linear(32, 5) for _ in range(3)]


def _own(models, data, **extra):
    return [{"model": m, "data": d, **extra} for m, d in zip(models, data)]


def _quiet(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args, progress=False, **kwargs)


# --------------------------------------------------------------------------------------------- one spelling
def test_a_models_entry_takes_its_own_data_in_python_as_in_yaml(tiny_paths, tmp_path):
    base, models = tiny_paths
    folders = [make_image_folder(tmp_path / f"data{i}", n=4, seed=i) for i in range(3)]
    entries = [{"model": models[0], "data": str(folders[0]), "num_samples": 3, "weight": 1.0},
               {"model": models[1], "data": {"path": str(folders[1]), "split": "train"}, "weight": 1.0},
               {"model": models[2], "data": str(folders[2]), "weight": 2.0}]
    python = MergeConfig.from_kwargs(base, entries, "regmean", num_samples=2)
    assert [m.data.num_samples for m in python.models] == [3, 2, 2]  # the run's num_samples, per model; the entry's wins
    assert python.weights == [1.0, 1.0, 2.0]
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({"base": base, "method": "regmean", "models": [
        {"model": models[0], "data": {"path": "data0"}, "num_samples": 3, "weight": 1.0},
        {"model": models[1], "data": {"path": "data1", "split": "train", "num_samples": 2}, "weight": 1.0},
        {"model": models[2], "data": "data2", "num_samples": 2, "weight": 2.0}]}))
    from_yaml = MergeConfig.from_yaml(recipe)
    assert from_yaml.to_dict() == python.to_dict()
    again = MergeConfig.from_yaml(recipe).to_yaml(tmp_path / "again.yaml")
    assert MergeConfig.from_yaml(tmp_path / "again.yaml").to_dict() == python.to_dict(), again


def test_the_cli_merges_with_each_models_data_from_the_yaml(tiny_paths, tmp_path, capsys):
    from hf_mloss.cli import main

    base, models = tiny_paths
    folders = [make_image_folder(tmp_path / f"data{i}", n=3, seed=i) for i in range(3)]
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({"base": base, "method": "regmean_plusplus", "models": [
        {"model": m, "data": {"path": f"data{i}"}} for i, m in enumerate(models)]}))
    assert main(["merge", str(recipe), str(tmp_path / "out")]) == 0
    assert "  own data:   ft0: data0 (3), ft1: data1 (3), ft2: data2 (3)" in capsys.readouterr().out
    recorded = MergeConfig.from_pretrained(tmp_path / "out")
    assert all(m.data.fingerprint.startswith("xxh3-128:") and m.data.num_samples == 128 for m in recorded.models)
    direct = _quiet(hf_mloss.merge, base, [{"model": m, "data": str(f)} for m, f in zip(models, folders)],
                    "regmean_plusplus")
    from transformers import CLIPVisionModel

    written = CLIPVisionModel.from_pretrained(tmp_path / "out").state_dict()
    for key, value in direct.model.state_dict().items():
        assert torch.equal(written[key], value), key


# ------------------------------------------------------------------------------------------------ refusals
@pytest.mark.parametrize("method, options", [("regmean", {}), ("adamerging", {"objective": "mloss"}),
                                             ("auto", {}), ("ties", {"select": "unlabeled",
                                                                     "grid": {"lam": [0.5, 1.0]}})])
def test_models_without_data_are_named_where_the_method_reads_each_models_own(tiny_paths, own_pixels, method,
                                                                              options):
    base, models = tiny_paths
    entries = [{"model": models[0], "data": own_pixels[0]}, *models[1:]]
    with pytest.raises(DataError, match=r"models\[1\] \(ft1\), models\[2\] \(ft2\) have none while models\[0\]"):
        hf_mloss.merge(base, entries, method, progress=False, **options)
    covered = _quiet(hf_mloss.merge, base, entries, "m_ties")  # M-TIES reads the union: two models' data will do
    assert covered.data_info.num_samples == len(own_pixels[0])


def test_bad_own_data_is_refused_before_anything_is_loaded(tiny_paths, own_pixels, monkeypatch, tmp_path):
    base, models = tiny_paths
    (tmp_path / "empty" / "train").mkdir(parents=True)

    def never(*args, **kwargs):
        raise AssertionError("data was read")

    monkeypatch.setattr("hf_mloss.loading.data.load_model_inputs", never)
    with pytest.raises(DataError, match=r"models\[1\] \(ft1\): data is empty"):
        hf_mloss.merge(base, _own(models, [own_pixels[0], [], own_pixels[2]]), "regmean", progress=False)
    with pytest.raises(DataError, match=r"models\[1\] \(ft1\): data.path '.*empty' is a folder with no file in it"):
        hf_mloss.merge(base, _own(models, [own_pixels[0], str(tmp_path / "empty"), own_pixels[2]]), "regmean",
                       progress=False)
    with pytest.raises(DataError, match=r"models\[2\] \(ft2\)\.data holds texts, but this clip_vision .* reads "
                                        "images"):
        hf_mloss.merge(base, _own(models, [own_pixels[0], own_pixels[1], ["a cat", "a dog"]]), "regmean",
                       progress=False)
    with pytest.raises(InvalidParameterError, match="every model has its own: the shared `data` would never be read"):
        hf_mloss.merge(base, _own(models, own_pixels), "regmean", data=own_pixels[0], progress=False)
    with pytest.raises(InvalidParameterError, match="share='all' compares every sample with every model"):
        hf_mloss.merge(base, _own(models, own_pixels), "adamerging", objective="mloss", share="all", progress=False)
    with pytest.raises(InvalidParameterError, match="weights= and a `weight` in a models entry"):
        hf_mloss.merge(base, _own(models, own_pixels, weight=1.0), "regmean", weights=[1, 1, 1], progress=False)
    with pytest.raises(InvalidParameterError, match=r"models\[0\] \(ft0\): num_samples is the number of samples"):
        hf_mloss.merge(base, [{"model": models[0], "num_samples": 4}, *models[1:]], "m_ties", data=own_pixels[0],
                       progress=False)
    with pytest.raises(InvalidParameterError, match=r"models\[1\] \(ft1\): num_samples is given twice, 2 in the entry "
                                                    r"and 3 in its `data`: give it once"):
        hf_mloss.merge(base, [{"model": models[0], "data": own_pixels[0]},
                              {"model": models[1], "data": {"objects": own_pixels[1], "num_samples": 3},
                               "num_samples": 2}, {"model": models[2], "data": own_pixels[2]}], "regmean",
                       progress=False)
    for bad in (0, "8"):  # the run's own num_samples: said as the run's, not as the first model's data
        with pytest.raises(DataError, match=r"^num_samples must be an integer"):
            hf_mloss.merge(base, _own(models, own_pixels), "regmean", num_samples=bad, progress=False)
    with pytest.raises(InvalidParameterError, match="Unknown key in models\\[0\\] 'dataset'"):
        hf_mloss.merge(base, [{"model": models[0], "dataset": own_pixels[0]}, *models[1:]], "regmean",
                       progress=False)


def _pixels_with(value, where=(1, 0, 0, 0)):
    pixels = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(5))
    pixels[where] = value
    return pixels


@pytest.mark.parametrize("data, match", [
    (5, "data of type int"), (b"abc", "data of type bytes"), (False, "data of type bool"),
    (torch.randn(4, 3, 32, 32).numpy(), "numpy ndarray: pass torch.from_numpy"),
    ((x for x in range(3)), "generator, which can be read only once"),
    ([1, 2], r"data\[0\] is of type int"), ([{"a": 1}], r"data\[0\] is of type dict"),
    (torch.randn(3, 32, 32), r"shape \[N, 3, H, W\], got \(3, 32, 32\)"),
    (torch.full((4, 3, 32, 32), 200, dtype=torch.uint8), "must be floating point .* got torch.uint8"),
    (torch.rand(4, 3, 32, 32) > 0.5, "must be floating point .* got torch.bool"),
    (_pixels_with(float("nan")), r"1 of the 4 scoring images hold NaN or Inf pixel values \(the first: image 1\)"),
    (_pixels_with(float("inf"), (2, 1, 3, 3)), r"NaN or Inf pixel values \(the first: image 2\)"),
    (_pixels_with(1e20), r"reach 1e\+20; an image processor's output is normalised"),
    ({"path": "images", "foo": 1}, "Unknown key in data 'foo'"),
    ({"id": "org/data", "seed": 1}, "data.seed: hf_mloss uses one seed"),
    ("  ", "data is empty"),
    ([torch.zeros(3, 32, 32, dtype=torch.uint8)] * 2, "must be floating point .* got torch.uint8"),
    ([torch.zeros(3, 32, 32), torch.full((3, 32, 32), float("nan"))], r"1 of the 2 scoring images hold NaN"),
    ({"objects": [torch.full((3, 32, 32), float("inf"))]}, r"1 of the 1 scoring images hold NaN or Inf"),
    ({"objects": []}, "data is empty"),
    ({"id": "  "}, "data.id is blank"),
    (torch.tensor([[101, 2023, 102]]), r"integer tensor of shape \(1, 3\), which reads as token ids"),
    ({"input_ids": [[1, 2, 3]], "attention_mask": [[1, 1, 1]]}, "values are not all torch tensors: pass a "
                                                                 "tokenizer's .* return_tensors='pt'"),
    (["a cat", Image.new("RGB", (40, 40))], r"data\[0\] \('a cat'\) is not a file, and data\[1\] is a PIL image"),
    ([Image.new("RGB", (40, 40)), "/no/such/image.png"], r"data\[1\] \('/no/such/image.png'\) is not a file, and "
                                                         r"data\[0\] is a PIL image"),
], ids=["int", "bytes", "bool", "numpy", "generator", "list-of-ints", "list-of-dicts", "3-d", "uint8", "bool-tensor",
        "nan", "inf", "huge", "unknown-key", "seed", "blank", "list-of-uint8", "list-with-nan", "objects-with-inf",
        "empty-objects", "blank-id", "token-ids-alone", "token-lists", "texts-among-images",
        "missing-path-among-images"])
def test_data_no_loader_reads_is_refused_when_the_run_is_configured(tiny_paths, own_pixels, monkeypatch, data,
                                                                    match):
    """Each refused in MergeConfig, naming the model: before any checkpoint is opened or any data read."""
    base, models = tiny_paths

    def never(*args, **kwargs):
        raise AssertionError("the run started")

    monkeypatch.setattr("hf_mloss.loading.inputs.CheckpointStore", never)
    monkeypatch.setattr("hf_mloss.loading.data.load_model_inputs", never)
    entries = _own(models, [own_pixels[0], data, own_pixels[2]])
    with pytest.raises(DataError, match=r"models\[1\] \(ft1\): .*" + match):
        hf_mloss.merge(base, entries, "regmean", progress=False)


def test_a_dataset_dict_is_a_models_data_as_its_split_is(tiny_paths, image_folder):
    import datasets

    base, models = tiny_paths
    split = datasets.load_dataset("imagefolder", data_dir=str(image_folder), split="train")
    as_split = _quiet(hf_mloss.merge, base, _own(models, [split] * 3), "regmean", num_samples=4)
    as_dict = _quiet(hf_mloss.merge, base, _own(models, [datasets.DatasetDict({"train": split})] * 3), "regmean",
                     num_samples=4)
    for name, tensor in as_split.model.state_dict().items():
        assert torch.equal(tensor, as_dict.model.state_dict()[name]), name


def test_a_recipes_blank_bad_or_python_data_is_refused_naming_the_model(tiny_paths, tmp_path):
    base, models = tiny_paths
    recipe = tmp_path / "recipe.yaml"
    for entry, match in [({"data": ""}, r"models\[0\]\.data: data is empty"),
                         ({"data": {"path": " "}}, r"models\[0\]\.data: data is empty"),
                         ({"data": str(tmp_path), "num_samples": 0}, r"models\[0\]: num_samples must be an integer "
                                                                      r"in \[1, 1000000\], got 0"),
                         ({"data": {"in_memory": "Tensor", "num_samples": 4}},  # not `data=`: that is the shared pool
                          r"models\[0\]\.data: data was passed from Python .* again in this model's entry")]:
        recipe.write_text(yaml.safe_dump({"base": base, "method": "regmean", "models": [
            {"model": models[0], **entry}, *models[1:]], "data": str(tmp_path)}))
        with pytest.raises(ConfigError, match=match):
            MergeConfig.from_yaml(recipe)
    recipe.write_text(yaml.safe_dump({"base": base, "method": "regmean", "models": models, "data": ""}))
    with pytest.raises(ConfigError, match="data is empty"):  # not the recipe's own folder
        MergeConfig.from_yaml(recipe)


def test_a_data_free_merge_says_it_does_not_read_the_models_data(tiny_paths, own_pixels):
    base, models = tiny_paths
    with pytest.warns(UserWarning, match=r"models\[0\] \(ft0\) has data of its own, and TIES-Merging merges without data"):
        hf_mloss.merge(base, _own(models, own_pixels), "ties", progress=False)
    with pytest.warns(UserWarning, match="`data` is given, and Task arithmetic merges without data: it is not read"):
        hf_mloss.merge(base, models, "task_arithmetic", data=own_pixels[0], progress=False)


def test_a_model_given_twice_or_the_base_among_the_models_is_said(tiny_paths):
    base, models = tiny_paths
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hf_mloss.merge(base, [models[0], models[1], models[0] + "/", base], "task_arithmetic", progress=False)
    said = [str(w.message) for w in caught]
    assert "models[2] (ft0) is models[0] again: it counts twice in the merge" in " ".join(said), said
    assert "models[3] (base) is the base itself: its task vector is zero" in " ".join(said), said


def test_a_short_own_data_warning_names_its_model(tiny_paths, tmp_path):
    base, models = tiny_paths
    folders = [make_image_folder(tmp_path / f"data{i}", n=3 + i, seed=i) for i in range(3)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hf_mloss.merge(base, _own(models, [str(f) for f in folders]), "regmean", num_samples=5, progress=False)
    short = [str(w.message) for w in caught if "Asked for" in str(w.message)]  # 3 and 4 images; the third has 5
    assert short == ["Asked for 5 scoring images; models[0] (ft0).data ('data0') has only 3 usable ones, so 3 are "
                     "used.", "Asked for 5 scoring images; models[1] (ft1).data ('data1') has only 4 usable ones, so 4 "
                     "are used."], short


def test_a_stream_without_declared_features_is_typed_from_its_first_row(tiny_paths, own_pixels):
    """``IterableDataset.from_generator`` declares no features: its image column is found (or named) from the first
    row, and its PIL images decoded as a declared dataset's are."""
    import datasets
    from PIL import Image

    base, models = tiny_paths
    images = [Image.new("RGB", (40, 40), (40 * i, 20, 200 - 20 * i)) for i in range(5)]

    def rows():
        yield from ({"image": image, "label": i} for i, image in enumerate(images))

    stream = datasets.IterableDataset.from_generator(rows)
    found = _quiet(hf_mloss.merge, base, _own(models, [stream, own_pixels[1], own_pixels[2]]), "regmean")
    named = _quiet(hf_mloss.merge, base, _own(models, [{"objects": stream, "image_column": "image"}, own_pixels[1],
                                                       own_pixels[2]]), "regmean")
    listed = _quiet(hf_mloss.merge, base, _own(models, [images, own_pixels[1], own_pixels[2]]), "regmean")

    def encoded():  # PNG bytes beside a cell-like mapping that is not an image: the image column is still found
        for image in images:
            buffer = io.BytesIO()
            image.save(buffer, format="PNG")
            yield {"meta": {"path": "notes.json", "size": 3}, "image": buffer.getvalue()}

    as_bytes = _quiet(hf_mloss.merge, base, _own(models, [datasets.IterableDataset.from_generator(encoded),
                                                          own_pixels[1], own_pixels[2]]), "regmean")
    for name, tensor in listed.model.state_dict().items():
        assert torch.equal(found.model.state_dict()[name], tensor), name
        assert torch.equal(named.model.state_dict()[name], tensor), name
        assert torch.equal(as_bytes.model.state_dict()[name], tensor), name
    with pytest.raises(DataError, match="Image column 'img' not found; available columns: \\['image', 'label'\\]"):
        _quiet(hf_mloss.merge, base, _own(models, [{"objects": stream, "image_column": "img"}, own_pixels[1],
                                                   own_pixels[2]]), "regmean")


# -------------------------------------------------------------------------------------------- the recipe
def test_the_recipe_records_each_models_data_and_reruns_bit_for_bit(tiny_paths, tmp_path):
    base, models = tiny_paths
    folders = [make_image_folder(tmp_path / f"data{i}", n=4, seed=i) for i in range(3)]
    result = _quiet(hf_mloss.merge, base, _own(models, [str(f) for f in folders]), "regmean", num_samples=3)
    result.save_pretrained(tmp_path / "out")
    recorded = MergeConfig.from_pretrained(tmp_path / "out")
    assert [m.data.num_samples for m in recorded.models] == [3, 3, 3]
    assert len({m.data.fingerprint for m in recorded.models}) == 3
    card = (tmp_path / "out" / "README.md").read_text()
    assert "Each fine-tune's own unlabeled data (each model's own data is read as that model's alone" in card
    assert "| ft1 | data1 (split train), 3 images, sampled: whole split, 2 of 2 labels covered | 3 |" in card
    again = _quiet(hf_mloss.run, tmp_path / "out")
    for key, value in result.model.state_dict().items():
        assert torch.equal(again.model.state_dict()[key], value), key
    make_image_folder(folders[1], n=5, seed=9)  # the folder changes: the recipe no longer describes it
    with pytest.raises(DataError, match=r"models\[1\] \(ft1\)\.data: .*data1' is not the data this config was "
                                        "recorded from"):
        hf_mloss.run(tmp_path / "out", progress=False)


def test_a_hub_dataset_is_recorded_at_the_commit_it_was_read(tiny_paths, monkeypatch, tmp_path):
    from fake_hub import FakeHub
    from hub_replicas import DTD_ID, _dtd_files, use_hub

    base, models = tiny_paths
    with FakeHub() as hub:
        hub.add_repo(DTD_ID, _dtd_files(0)[0], repo_type="dataset", message="Upload dataset", author="tanganke")
        use_hub(monkeypatch, hub, tmp_path / "cache")
        monkeypatch.setenv("HF_HUB_OFFLINE", "0")
        monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)
        monkeypatch.setattr("datasets.config.HF_HUB_OFFLINE", False, raising=False)
        entries = [{"model": models[0], "data": DTD_ID, "num_samples": 3}, *models[1:]]
        result = _quiet(hf_mloss.merge, base, entries, "m_ties", data=str(make_image_folder(tmp_path / "shared",
                                                                                             n=3)))
        commit = hub.repo(DTD_ID, "dataset").resolve("main")
        assert result.config.models[0].data.revision == commit and result.config.models[0].data.id == DTD_ID
        again = _quiet(hf_mloss.run, result.config)
        for key, value in result.model.state_dict().items():
            assert torch.equal(again.model.state_dict()[key], value), key


# ------------------------------------------------------------------------------------------ the methods
def test_m_ties_reads_the_union_of_the_models_data(tiny_paths, own_pixels):
    base, models = tiny_paths
    own = _quiet(hf_mloss.merge, base, _own(models, own_pixels), "m_ties", batch_size=4)
    pooled = _quiet(hf_mloss.merge, base, models, "m_ties", data=torch.cat(own_pixels), batch_size=4)
    for key, value in pooled.model.state_dict().items():
        assert torch.equal(own.model.state_dict()[key], value), key
    assert own.report.num_samples == sum(len(x) for x in own_pixels)


def test_score_reads_the_union_of_the_models_data(tiny_paths, own_pixels):
    base, models = tiny_paths
    own = _quiet(hf_mloss.score, base, _own(models, own_pixels), batch_size=4)
    pooled = _quiet(hf_mloss.score, base, models, data=torch.cat(own_pixels), batch_size=4)
    assert own.num_samples == pooled.num_samples == sum(len(x) for x in own_pixels)
    for name, value in pooled.node.items():
        assert torch.equal(own.node[name], value), name


def test_compatibility_refuses_two_models_without_data_before_loading(tiny_paths, own_pixels, monkeypatch):
    """Each subset reads its members' own data: two models without any (and no shared pool) would make a pair with
    no sample, reported as a perfect 0."""
    base, models = tiny_paths

    def never(*args, **kwargs):
        raise AssertionError("the run started")

    monkeypatch.setattr("hf_mloss.loading.inputs.CheckpointStore", never)
    with pytest.raises(DataError, match=r"models\[1\] \(ft1\), models\[2\] \(ft2\) have none: a pair of them would "
                                        r"have no sample"):
        hf_mloss.compatibility(base, [{"model": models[0], "data": own_pixels[0]}, *models[1:]], progress=False)


def test_a_compatibility_pair_is_scored_on_its_two_models_data(tiny_paths, own_pixels):
    base, models = tiny_paths
    report = _quiet(hf_mloss.compatibility, base, _own(models, own_pixels), batch_size=4)
    for pair in [(0, 1), (1, 2)]:
        alone = _quiet(hf_mloss.compatibility, base, [models[p] for p in pair],
                       data=torch.cat([own_pixels[p] for p in pair]), batch_size=4)
        assert report.score(list(pair)) == pytest.approx(alone.score([0, 1]), rel=1e-6)


def _entropy_reference(base, models, own, heads, *, steps, lr, batch, init=0.3):
    """Task-wise AdaMerging by hand: θ = θ₀ + Σ_p λ_p τ_p; each step one batch of each model's own images, the loss
    Σ_p mean entropy of head_p on model p's batch (AdaMerging's −Σ p·log(p + 1e-8)), Adam on λ."""
    from transformers import CLIPVisionModel

    from hf_mloss.loading.model_inputs import spread_sample
    from hf_mloss.merging.learned import batch_schedule, sample_batches

    theta0 = CLIPVisionModel.from_pretrained(base).eval()
    state0 = {k: v for k, v in theta0.state_dict().items() if v.is_floating_point()}
    taus = [{k: CLIPVisionModel.from_pretrained(m).state_dict()[k] - v for k, v in state0.items()} for m in models]
    lam = torch.nn.Parameter(torch.full((len(models),), init))
    optimizer = torch.optim.Adam([lam], lr=lr)
    plans = []
    for pixels in own:
        pool = spread_sample(pixels, 256, 0)
        index = sample_batches(len(pool), batch, 0)
        plans.append((pool, index, batch_schedule(len(index), steps, 0)))
    for step in range(steps):
        optimizer.zero_grad()
        params = {k: v + sum(lam[p] * taus[p][k] for p in range(len(models))) for k, v in state0.items()}
        loss = 0
        for p, (pool, index, schedule) in enumerate(plans):
            features = torch.func.functional_call(theta0, params, (pool[index[schedule[step]]],)).pooler_output
            probs = torch.softmax(heads[p](features), -1)
            loss = loss + (-(probs * torch.log(probs + 1e-8)).sum(-1).mean())
        loss.backward()
        optimizer.step()
    return lam.detach()


def test_task_wise_adamerging_sums_one_entropy_per_model_on_its_own_data(tiny_paths, own_pixels, heads):
    base, models = tiny_paths
    expected = _entropy_reference(base, models, own_pixels, heads, steps=4, lr=0.05, batch=2)
    result = _quiet(hf_mloss.merge, base, _own(models, own_pixels), "adamerging", granularity="task",
                    objective="entropy", heads=heads, steps=4, lr=0.05, batch_size=2)
    (row,) = result.config.parameters["coefficients"]
    assert not torch.allclose(expected, torch.full_like(expected, 0.3), atol=1e-3)  # training moved them
    torch.testing.assert_close(torch.tensor(row[1:]), expected, rtol=0, atol=2e-5)


def _own_output_criterion(candidate, models, own, heads):
    """Selection's ``output`` with each model's own data, by hand: every image of model p against model p alone,
    KL(softmax(head_p(f_p)) ‖ softmax(head_p(f_m))), averaged over every (image, own model) pair."""
    from transformers import CLIPVisionModel

    total, count = 0.0, 0
    with torch.no_grad():
        merged = [candidate(pixel_values=x).pooler_output for x in own]
        for p, (model, x) in enumerate(zip(models, own)):
            expert = CLIPVisionModel.from_pretrained(model).eval()(pixel_values=x).pooler_output
            log_e, log_m = torch.log_softmax(heads[p](expert), -1), torch.log_softmax(heads[p](merged[p]), -1)
            kl = (log_e.exp() * (log_e - log_m)).sum(-1)
            total, count = total + float(kl.double().sum()), count + len(kl)
    return total / count


def test_selection_compares_each_model_with_its_own_data(tiny_paths, own_pixels, heads):
    base, models = tiny_paths
    result = _quiet(hf_mloss.merge, base, _own(models, own_pixels), "task_arithmetic", select="unlabeled",
                    grid={"lam": [0.4]}, heads=heads)
    (candidate,) = result.config.select.candidates
    assert result.config.select.num_samples == 32  # per model, as recorded (each model has fewer: all are read)
    expected = _own_output_criterion(result.model.eval(), models, own_pixels, heads)
    assert candidate["output"] == pytest.approx(expected, rel=1e-5)


def test_auto_compares_each_candidate_with_each_model_on_its_own_data(tiny_paths, own_pixels, heads):
    """Without holding out (held_out=False) every candidate is compared on all of each model's own images."""
    base, models = tiny_paths
    result = _quiet(hf_mloss.merge, base, _own(models, own_pixels), "auto", heads=heads, criterion="output",
                    held_out=False, candidates={"tsv_m": {"lam": [0.7, 1.0]}, "regmean_plusplus": {"lam": [1.0]}})
    scored = {(c["method"], c["setting"].get("lam")): c["output"] for c in result.config.parameters["scored"]}
    chosen = result.config.parameters["chosen"]
    assert scored[(chosen["method"], chosen["parameters"]["lam"])] == min(scored.values())
    expected = _own_output_criterion(result.model.eval(), models, own_pixels, heads)
    assert min(scored.values()) == pytest.approx(expected, rel=1e-5)
    again = _quiet(hf_mloss.run, result.config)
    for key, value in result.model.state_dict().items():
        assert torch.equal(again.model.state_dict()[key], value), key
    from hf_mloss.output.card import build_model_card

    assert result.config.parameters["compared"] == 4 + 5 + 6  # each model's own images, fewer than compare_samples
    assert "fitted" not in result.config.parameters
    assert "15 unlabeled images in all, each model's own, each compared with its own model" in str(
        build_model_card(result))


def _own_disagreement(candidate, models, own, heads):
    """Selection's ``disagreement`` with each model's own data, by hand: the fraction of (image, own model) pairs
    where head_p's top class on the merge differs from it on model p."""
    from transformers import CLIPVisionModel

    differ, count = 0, 0
    with torch.no_grad():
        for p, (model, x) in enumerate(zip(models, own)):
            expert = CLIPVisionModel.from_pretrained(model).eval()(pixel_values=x).pooler_output
            merged = candidate(pixel_values=x).pooler_output
            differ += int((heads[p](expert).argmax(-1) != heads[p](merged).argmax(-1)).sum())
            count += len(x)
    return differ / count


def test_auto_ranks_by_disagreement_with_heads_and_by_output_without(tiny_paths, own_pixels, heads):
    """The default criterion: disagreement when heads give class outputs, output otherwise; recorded either way."""
    base, models = tiny_paths
    candidates = {"tsv_m": {"lam": [0.3, 1.0, 3.0]}}
    with_heads = _quiet(hf_mloss.merge, base, _own(models, own_pixels), "auto", heads=heads, candidates=candidates)
    assert with_heads.config.parameters["criterion"] == "disagreement"
    scored = {c["setting"]["lam"]: c["disagreement"] for c in with_heads.config.parameters["scored"]}
    chosen = with_heads.config.parameters["chosen"]["parameters"]["lam"]
    assert scored[chosen] == min(scored.values()) and chosen == min(k for k, v in scored.items() if v == scored[chosen])
    assert scored[chosen] == pytest.approx(_own_disagreement(with_heads.model.eval(), models, own_pixels, heads))
    without = _quiet(hf_mloss.merge, base, _own(models, own_pixels), "auto", candidates=candidates)
    assert without.config.parameters["criterion"] == "output"
    chosen_by_output = _quiet(hf_mloss.merge, base, _own(models, own_pixels), "auto", heads=heads,
                              candidates=candidates, criterion="output").config.parameters
    assert chosen_by_output["criterion"] == "output" and "disagreement" not in chosen_by_output["scored"][0]


def test_auto_holds_part_of_each_models_data_out_of_the_fit_it_compares_on(tiny_paths, own_pixels, heads):
    """Without cross-fitting, a candidate fitted on the data (RegMean++) is fitted on part of each model's images and
    every candidate is compared on the other part (half of each model's, spread as selection spreads); the chosen
    one is then fitted on all of them."""
    from hf_mloss.loading.model_inputs import spread_index
    from hf_mloss.output.card import build_model_card

    base, models = tiny_paths
    candidates = {"tsv_m": {"lam": [0.7, 1.0]}, "regmean_plusplus": {"lam": [1.0]}}
    result = _quiet(hf_mloss.merge, base, _own(models, own_pixels), "auto", heads=heads, criterion="output", candidates=candidates,
                    cross_fit=False)
    held = [spread_index(len(x), len(x) // 2, result.config.seed) for x in own_pixels]
    compared = [x[i] for x, i in zip(own_pixels, held)]
    fitted = [x[[j for j in range(len(x)) if j not in set(i.tolist())]] for x, i in zip(own_pixels, held)]
    assert [len(x) for x in compared] == [3, 2, 2]
    scored = {(c["method"], c["setting"]["lam"]): c["output"] for c in result.config.parameters["scored"]}
    for (method, lam), value in scored.items():
        data = fitted if method == "regmean_plusplus" else own_pixels  # a data-free merge reads none
        alone = _quiet(hf_mloss.merge, base, _own(models, data), method, lam=lam)
        assert value == pytest.approx(_own_output_criterion(alone.model.eval(), models, compared, heads), rel=1e-5)
    chosen = result.config.parameters["chosen"]
    assert chosen["method"] == "regmean_plusplus"  # so the refit on all the data is what is checked next
    final = _quiet(hf_mloss.merge, base, _own(models, own_pixels), chosen["method"], **chosen["parameters"])
    for key, value in final.model.state_dict().items():  # the chosen merge as that method makes it on all the data
        torch.testing.assert_close(result.model.state_dict()[key], value, rtol=2e-6, atol=1e-7)
    assert result.config.parameters["compared"] == 7 and result.config.parameters["fitted"] == 8
    card = str(build_model_card(result))
    assert "7 unlabeled images in all, each model's own" in card
    assert "fitted on 8 other images, so that none was compared on what it was fitted on" in card
    again = _quiet(hf_mloss.run, result.config)  # the recorded choice re-runs without choosing
    for key, value in result.model.state_dict().items():
        assert torch.equal(again.model.state_dict()[key], value), key



def test_auto_cross_fits_each_models_data_so_every_candidate_is_compared_on_all_of_it(tiny_paths, own_pixels, heads):
    """By default each model's images are cut in two halves: RegMean++ is fitted on each half and compared on the
    other, TSV-M on both, so every candidate is compared with each model on all of its images (by hand below)."""
    from hf_mloss.loading.model_inputs import spread_index
    from hf_mloss.output.card import build_model_card

    base, models = tiny_paths
    candidates = {"tsv_m": {"lam": [0.7, 1.0]}, "regmean_plusplus": {"lam": [1.0]}}
    result = _quiet(hf_mloss.merge, base, _own(models, own_pixels), "auto", heads=heads, criterion="output", candidates=candidates)
    params = result.config.parameters
    assert params["compared"] == 15 and params["fitted"] == 8 and params["cross_fitted"] is True
    first = [spread_index(len(x), len(x) // 2, result.config.seed) for x in own_pixels]
    halves = [[x[i] for x, i in zip(own_pixels, first)],
              [x[[j for j in range(len(x)) if j not in set(i.tolist())]] for x, i in zip(own_pixels, first)]]
    sizes = [sum(len(x) for x in half) for half in halves]
    assert sizes == [7, 8]
    scored = {(c["method"], c["setting"]["lam"]): c["output"] for c in params["scored"]}
    for lam in (0.7, 1.0):
        alone = _quiet(hf_mloss.merge, base, _own(models, own_pixels), "tsv_m", lam=lam).model.eval()
        assert scored["tsv_m", lam] == pytest.approx(_own_output_criterion(alone, models, own_pixels, heads),
                                                     rel=1e-5)
    by_hand = 0.0
    for fit, compared, size in ((halves[1], halves[0], sizes[0]), (halves[0], halves[1], sizes[1])):
        merged = _quiet(hf_mloss.merge, base, _own(models, fit), "regmean_plusplus", lam=1.0).model.eval()
        by_hand += _own_output_criterion(merged, models, compared, heads) * size / sum(sizes)
    assert scored["regmean_plusplus", 1.0] == pytest.approx(by_hand, rel=1e-5)
    card = str(build_model_card(result))
    assert "15 unlabeled images in all, each model's own" in card
    assert "on each half of the data in turn and compared on the other (halves of up to 8 images)" in card


def test_the_held_out_split_takes_at_most_half_of_each_models_data_and_the_rest_is_fitted_on():
    from hf_mloss.loading.model_inputs import held_out_split

    owner = torch.tensor([-1, -1, -1, -1, 2, 2, 2, 0, 0, 0, 0, 0, 0])  # shared pool (model 1), model 2's, model 0's
    held, rest = held_out_split(owner, len(owner), 32, 0, 3)
    assert sorted(held.tolist() + rest.tolist()) == list(range(13))  # every sample on exactly one side
    counts = {p: (int((owner[held] == p).sum()), int((owner[rest] == p).sum())) for p in (-1, 0, 2)}
    assert counts == {-1: (2, 2), 0: (3, 3), 2: (1, 2)}  # half of each, rounded down: compare_samples is not reached
    held, _ = held_out_split(owner, len(owner), 1, 0, 3)
    assert len(held) == 3  # compare_samples caps each group
    held, rest = held_out_split(None, 12, 32, 0, 3)  # one pool for every model
    assert len(held) == 6 and len(rest) == 6
    assert held_out_split(torch.tensor([0, 0, 1]), 3, 32, 0, 2) is None  # model 1 has one sample: nothing to hold


def test_auto_warns_when_a_models_data_is_too_small_to_hold_any_out(tiny_paths, own_pixels, heads):
    base, models = tiny_paths
    data = [own_pixels[0][:1], own_pixels[1], own_pixels[2]]
    with pytest.warns(UserWarning, match="some model's data holds a single sample"):
        result = hf_mloss.merge(base, _own(models, data), "auto", heads=heads, progress=False,
                                candidates={"tsv_m": {"lam": [1.0]}, "regmean_plusplus": {"lam": [1.0]}})
    assert result.config.parameters["compared"] == 1 + 4 + 5 and "fitted" not in result.config.parameters
