"""MergeConfig: the YAML schema a saved merge reproduces from, and one ConfigError per kind of invalid config."""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

import hf_mloss
from hf_mloss import ConfigError
from hf_mloss.cli import main
from hf_mloss._validation import field_help
from hf_mloss.spec.config import MERGE_CONFIG_NAME, DataSpec, MergeConfig, ModelSpec
from hf_mloss.methods import list_methods
from hf_mloss.spec.options import ScoringOptions

TOP_LEVEL_KEYS = ("hf_mloss_version", "base", "models", "method", "parameters", "data", "seed", "dtype",
                  "batch_size", "compute_dtype", "processor", "output", "score")


@pytest.fixture
def project(tmp_path, tiny_models, image_folder) -> Path:
    """A user's project folder: the tiny base, its fine-tunes and an image folder side by side (symlinks)."""
    base, models = tiny_models
    for src in [base, *models, image_folder]:
        (tmp_path / src.name).symlink_to(src, target_is_directory=True)
    return tmp_path


@pytest.fixture
def no_merge(monkeypatch):
    """Fail the test if a merge or scoring run (hence any download or computation) starts."""

    def refuse(*args, **kwargs):
        raise AssertionError("a merge or scoring run started for an invalid config")

    monkeypatch.setattr("hf_mloss.loading.inputs.open_inputs", refuse)


def weights_of(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "model.safetensors"))


def assert_same_weights(a: Path, b: Path) -> None:
    wa, wb = weights_of(a), weights_of(b)
    assert wa.keys() == wb.keys()
    for name in wa:
        assert wa[name].dtype == wb[name].dtype, name
        assert torch.equal(wa[name], wb[name]), name


# --------------------------------------------------------------------------------------- saved merges round trip
@pytest.mark.parametrize(
    "method, kwargs",
    [
        ("m_ties", {"k": 0.3, "e": 0.1, "num_samples": 8}),
        ("dare_ties", {"p": 0.6, "weights": [0.2, 0.5, 0.3], "seed": 3, "dtype": "bfloat16"}),
    ],
    ids=["m_ties", "dare_ties"],
)
def test_saved_merge_re_runs_bit_for_bit(project, image_folder, tmp_path, capsys, method, kwargs):
    models = [str(project / f"ft{i}") for i in range(3)]
    data = {"data": str(project / image_folder.name)} if method == "m_ties" else {}
    result = hf_mloss.merge(str(project / "base"), models, method, progress=False, **data, **kwargs)
    first = result.save_pretrained(project / "out" / "first")
    saved = yaml.safe_load((first / MERGE_CONFIG_NAME).read_text())
    assert saved["base"]["model"] == "../../base" and saved["models"][2]["model"] == "../../ft2"  # relative to it
    assert all(entry["fingerprint"].startswith("xxh3-128:") for entry in [saved["base"], *saved["models"]])

    # hf_mloss.run(from_pretrained(folder)) and `hf-mloss merge FOLDER/hf_mloss_config.yaml OUT`: the same weights
    config = MergeConfig.from_pretrained(first)
    assert config.method == method and config.seed == kwargs.get("seed", 0)
    assert Path(config.base.model) == (project / "base")
    if method == "m_ties":
        assert config.parameters == {"k": 0.3, "e": 0.1} and config.data.num_samples == 8
    else:
        assert [m.weight for m in config.models] == [0.2, 0.5, 0.3] and config.dtype == "bfloat16"
    again = hf_mloss.run(config, progress=False).save_pretrained(tmp_path / "again")
    assert_same_weights(first, again)
    assert main(["merge", str(first / MERGE_CONFIG_NAME), str(tmp_path / "cli"), "--quiet"]) == 0
    capsys.readouterr()
    assert_same_weights(first, tmp_path / "cli")
    assert MergeConfig.from_pretrained(tmp_path / "cli").to_dict(tmp_path) == config.to_dict(tmp_path)


def test_re_run_refuses_changed_weights(project, tmp_path):
    """The fingerprint recorded for a local input is checked before a re-run computes anything."""
    copy_dir = tmp_path / "ft-copy"
    shutil.copytree(project / "ft0", copy_dir)
    result = hf_mloss.merge(str(project / "base"), [str(copy_dir), str(project / "ft1")], "average", progress=False)
    folder = result.save_pretrained(tmp_path / "merged")
    tensors = load_file(str(copy_dir / "model.safetensors"))
    name = next(iter(tensors))
    tensors[name] = tensors[name] + 1
    from safetensors.torch import save_file

    save_file(tensors, str(copy_dir / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(hf_mloss.IncompatibleCheckpointsError, match="not the folder this config was recorded from"):
        hf_mloss.run(MergeConfig.from_pretrained(folder), progress=False)


def test_recorded_config_pins_what_ran(tiny_paths):
    base, models = tiny_paths
    result = hf_mloss.merge(base, models, "ties", k=0.5, weights=np.array([1, 2, 3], dtype=np.float32),
                            progress=False)
    record = result.config
    assert record.hf_mloss_version == hf_mloss.__version__ and record.parameters == {"k": 0.5}
    assert [m.weight for m in record.models] == [1.0, 2.0, 3.0]  # numpy scalars become plain floats
    assert isinstance(record.models[0].weight, float)
    assert record.base.fingerprint and record.models[0].fingerprint != record.models[1].fingerprint
    assert result.params["scope"] is None and result.params["k"] == 0.5


def test_fingerprints_are_hashed_beside_the_merge_and_equal_the_folders(tiny_paths, monkeypatch):
    """A run hashes its local inputs on a background thread while it merges (not in a pass before it), and records
    exactly what fingerprint_folder gives; score() records nothing, so it hashes nothing."""
    from hf_mloss.loading import hub

    base, models = tiny_paths
    threads, real = [], hub._FilesHash.__init__

    def spy(self, *args, **kwargs):
        threads.append(threading.current_thread().name)
        real(self, *args, **kwargs)

    monkeypatch.setattr(hub._FilesHash, "__init__", spy)
    hub._FINGERPRINTS.clear()
    record = hf_mloss.merge(base, models, "task_arithmetic", progress=False).config
    assert threads == ["hf_mloss_fingerprints"] * 4
    hub._FINGERPRINTS.clear()
    assert [m.fingerprint for m in [record.base, *record.models]] == [hub.fingerprint_folder(f)
                                                                      for f in [base, *models]]
    threads.clear()
    hf_mloss.score(base, models, torch.rand(4, 3, 32, 32), progress=False)
    assert threads == []


@pytest.fixture
def weights_folder(tmp_path, monkeypatch):
    """A folder of 10 KB of weights hashed in 1 KB chunks, the fingerprint cache empty."""
    from hf_mloss.loading import hub

    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(bytes(range(256)) * 40)
    monkeypatch.setattr(hub, "_HASH_CHUNK", 1024)
    hub._FINGERPRINTS.clear()
    return folder


def test_background_fingerprints_keep_pace_with_the_run(weights_folder, monkeypatch):
    """The hash runs at most ``ahead`` bytes past what the run has read (so the run finds those pages cached), goes on
    as the run reads, and reading a value lifts the pacing; the values are fingerprint_folder's."""
    from hf_mloss.loading import hub

    hashed, real = [], hub._FilesHash.step
    monkeypatch.setattr(hub._FilesHash, "step", lambda self: (hashed.append(n := real(self)), n)[1])
    read = [0]
    fingerprints = hub.FolderFingerprints({0: "xxh3-128:known"}, {1: weights_folder, 2: weights_folder},
                                          progress=lambda: read[0], ahead=3000)

    def hashed_past(limit: int) -> int:  # waits (10 s at most) until the hash is past limit, then a little more
        deadline = time.monotonic() + 10
        while sum(hashed) <= limit and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)
        return sum(hashed)

    assert 3000 < hashed_past(3000) <= 3000 + 2 * 1024  # one chunk of each folder past the limit, then it waits
    read[0] = 6000
    assert 9000 < hashed_past(9000) <= 9000 + 2 * 1024
    hub._FINGERPRINTS.clear()
    expected = hub.fingerprint_folder(weights_folder)
    assert dict(fingerprints) == {0: "xxh3-128:known", 1: expected, 2: expected}  # unpaced: it runs to the end


def test_background_fingerprints_raise_their_error_and_stop_when_closed(weights_folder, tmp_path):
    from hf_mloss.loading import hub

    missing = hub.FolderFingerprints({}, {1: tmp_path / "gone"})
    with pytest.raises(FileNotFoundError):
        missing[1]

    stopped = hub.FolderFingerprints({}, {1: weights_folder}, progress=lambda: 0, ahead=0)  # waits for the run
    time.sleep(0.1)
    stopped.close()
    with pytest.raises(RuntimeError, match="run has ended"):
        stopped[1]


def test_to_dict_from_dict_and_yaml_round_trip(project, tmp_path):
    config = MergeConfig.from_dict({
        "base": "base",
        "models": ["ft0", {"model": "./ft1"}],
        "method": "m_dare",
        "parameters": {"p": 0.5, "k": 0.6, "layers": (1, 0)},
        "data": {"path": "images0", "num_samples": 4},
        "score": {"prefix": "base", "reduction": "sq", "layers": [0]},
    }, base_dir=project)  # fmt: skip
    assert config.parameters["layers"] == [1, 0] and config.method_params().layers == (0, 1)  # YAML-safe lists
    assert MergeConfig.from_dict(config.to_dict()) == config
    config.to_yaml(tmp_path / "out.yaml")
    assert MergeConfig.from_yaml(tmp_path / "out.yaml") == config  # paths relative to the file: same from any folder


def test_relative_paths_resolve_against_the_config_folder(project, tmp_path, monkeypatch):
    """Relative paths follow the config file, whatever the working directory."""
    (project / "configs").mkdir()
    path = project / "configs" / "merge.yaml"
    path.write_text(yaml.safe_dump({
        "base": "../base", "models": [{"model": "../ft0", "weight": 2}, {"model": "../ft1", "weight": 1}],
        "method": "ties",
        "data": {"path": "../images0"},
    }))  # fmt: skip
    elsewhere = tmp_path / "elsewhere"  # (tmp_path is also the project folder)
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    config = MergeConfig.from_yaml(Path("..") / "configs" / "merge.yaml")
    assert Path(config.base.model) == (project / "base")
    assert Path(config.models[1].model) == (project / "ft1") and config.models[1].weight == 1
    assert config.data.path == str((project / "images0")) and config.data.id is None


def test_plain_strings_hub_ids_and_data_forms(project):
    config = MergeConfig.from_dict({"base": "org/base", "models": ["org/a", "ft0"], "data": "tanganke/dtd"},
                                   base_dir=project)
    assert config.base == ModelSpec("org/base")  # not a folder here: a Hub id, kept as written
    assert config.models[1].model == str((project / "ft0"))  # an existing folder next to the config
    assert config.data == DataSpec(id="tanganke/dtd")
    assert config.method == "ties" and config.parameters == {} and config.batch_size == 16
    local = MergeConfig.from_dict({"base": "org/base", "models": ["org/a"], "data": "./images0"}, base_dir=project)
    assert local.data.path == str((project / "images0"))


def test_a_missing_local_data_path_is_named_without_asking_the_hub(tiny_paths):
    base, models = tiny_paths
    for path in ("path/to/images", "./images", "~/no-such-folder-xyz"):
        with pytest.raises(hf_mloss.DataError, match="does not exist"):
            hf_mloss.merge(base, models, "m_ties", data=path, progress=False)


def test_yaml_reads_exponent_floats(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("base: org/base\nmodels: [org/a]\nmethod: m_ties\nparameters: {eps: 1e-4, k: 2.5e-1}\n"
                    "data: org/images\n")
    config = MergeConfig.from_yaml(path)
    assert config.parameters == {"eps": 1e-4, "k": 0.25}


def test_method_aliases_and_suggestions():
    assert MergeConfig(base="org/b", models=["org/a"], method="dare").method == "dare_ties"
    with pytest.raises(hf_mloss.UnknownMethodError, match="did you mean 'm_ties'"):
        MergeConfig(base="org/b", models=["org/a"], method="mties")
    with pytest.raises(hf_mloss.InvalidParameterError, match="'density' .*did you mean 'k'"):
        MergeConfig(base="org/b", models=["org/a"], method="ties", parameters={"density": 0.2})
    with pytest.raises(hf_mloss.InvalidParameterError, match="'lambda' .*did you mean 'lam'"):
        hf_mloss.merge("org/b", ["org/a"], "task_arithmetic", **{"lambda": 0.2})


def test_per_model_revisions_reach_the_hub(monkeypatch):
    seen = []

    def fake_resolve(ref, *, revision=None, **kwargs):
        seen.append((ref, revision))
        raise hf_mloss.CheckpointNotFoundError("stop here")

    monkeypatch.setattr("hf_mloss.loading.inputs.resolve_model", fake_resolve)
    with pytest.raises(hf_mloss.CheckpointNotFoundError):
        hf_mloss.merge("org/base", ["org/a"], "average", revision=["abc", "def"], progress=False)
    assert seen == [("org/base", "abc")]
    with pytest.raises(hf_mloss.InvalidParameterError, match="3 revisions for 2 models"):
        hf_mloss.merge("org/base", ["org/a"], "average", revision=["a", "b", "c"], progress=False)
    config = MergeConfig.from_kwargs("org/base", ["org/a", "org/b"], revision="v1")
    assert [s.revision for s in [config.base, *config.models]] == ["v1", "v1", "v1"]


def test_python_takes_the_methods_parameters_as_one_mapping_as_a_recipe_does():
    """``parameters={...}`` (a recipe's spelling) equals the keywords; everything else about it is refused by name,
    before anything is read (it once reached the dataclass as a duplicate keyword)."""
    models = ["org/a", "org/b"]
    mapped = MergeConfig.from_kwargs("org/base", models, "ties", parameters={"k": 0.3, "lam": 0.8}, seed=3)
    keywords = MergeConfig.from_kwargs("org/base", models, "ties", k=0.3, lam=0.8, seed=3)
    assert mapped.to_dict() == keywords.to_dict()
    assert mapped.parameters == {"k": 0.3, "lam": 0.8} and mapped.seed == 3
    with pytest.raises(hf_mloss.InvalidParameterError, match=r"parameters must be a mapping .* got \[1, 2\]"):
        hf_mloss.merge("org/base", models, "ties", parameters=[1, 2], progress=False)
    with pytest.raises(hf_mloss.InvalidParameterError, match=r"\['k'\] given both in parameters= and as keywords"):
        hf_mloss.merge("org/base", models, "ties", parameters={"k": 0.3}, k=0.2, progress=False)
    with pytest.raises(hf_mloss.InvalidParameterError, match=r"\['parameters'\] for score\(\) with prefix='own'"):
        hf_mloss.score("org/base", models, "unused", parameters={"k": 0.3}, progress=False)
    for field in ("resolved_parameters", "hf_mloss_version"):
        with pytest.raises(hf_mloss.InvalidParameterError, match=rf"\['{field}'\]: a run records these"):
            hf_mloss.merge("org/base", models, "ties", **{field: {"k": 0.1}}, progress=False)


@pytest.mark.parametrize("value", [0.2, {"x": 1}, [{"filter": "mlp", "value": 0.1}]])
def test_an_unknown_parameter_is_named_whatever_its_value(value):
    """A list or mapping value is read as a per-layer schedule only for a parameter the method has."""
    with pytest.raises(hf_mloss.InvalidParameterError, match=r"Unknown parameter 'kk' \(did you mean 'k'\?\)"):
        MergeConfig.from_kwargs("org/base", ["org/a", "org/b"], "ties", kk=value)


def test_version_0_1_saved_configs_still_load(project):
    """hf_mloss 0.1 wrote what it had read about the data into the data section; those records are dropped."""
    saved = {"hf_mloss_version": "0.1.0", "base": {"model": "base"}, "models": [{"model": "ft0", "weight": 1.0}],
             "method": "m_ties", "parameters": {"k": 0.3}, "seed": 0, "dtype": "float32", "batch_size": 4,
             "compute_dtype": "float32",
             "data": {"source": "imagefolder", "id": "images0", "split": "train", "num_samples": 8, "seed": 0,
                      "image_column": "image", "skipped": 0}}  # fmt: skip
    config = MergeConfig.from_dict(saved, base_dir=project)
    assert config.data == DataSpec(path=str((project / "images0")), num_samples=8, image_column="image")
    hub = dict(saved, data=dict(saved["data"], source="hub", id="tanganke/dtd"))
    assert MergeConfig.from_dict(hub, base_dir=project).data.id == "tanganke/dtd"


# ----------------------------------------------------------------------------------------------- invalid configs
def _valid(project: Path) -> dict:
    return {
        "base": str(project / "base"),
        "models": [str(project / "ft0"), str(project / "ft1")],
        "method": "m_ties",
        "parameters": {"k": 0.3},
        "data": {"path": str(project / "images0"), "num_samples": 8},
        "batch_size": 4,
    }


def _set(key, value):
    return lambda d: d.update({key: value})


def _drop(key):
    return lambda d: d.pop(key)


def _data(**changes):
    return lambda d: d["data"].update(changes)


def _model(index, entry):
    def mutate(d):
        d["models"][index] = entry(d["models"][index]) if callable(entry) else entry

    return mutate


def _weights(*weights):
    def mutate(d):
        d["models"] = [{"model": m, "weight": w} if w is not None else m for m, w in zip(d["models"], weights)]

    return mutate


SECRET = "hf_notARealTokenButNeverEchoIt"

INVALID = [
    ("unknown_top_level_key", _set("metod", "ties"), ["Unknown top-level key 'metod'", "did you mean 'method'", "valid keys"]),
    ("unknown_method", _set("method", "tiez"), ["Unknown merge method 'tiez'", "'m_ties'", "'ties'", "available methods"]),
    ("method_not_a_string", _set("method", ["ties"]), ["method must be a non-empty string", "['ties']"]),
    ("unknown_parameter", _set("parameters", {"keep": 0.3}), ["Unknown parameter 'keep'", "m_ties", "valid parameters", "k (default 0.2)", "e (default 0.1)"]),
    ("parameter_out_of_range", _set("parameters", {"k": 1.5}), ["k must be a number in (0, 1", "got 1.5"]),
    ("parameter_wrong_type", _set("parameters", {"k": "most"}), ["k must be a finite number", "'most'"]),
    ("e_not_below_k", _set("parameters", {"k": 0.1, "e": 0.2}), ["e must satisfy 0 <= e < k", "e=0.2"]),
    ("bad_parameter_choice", _set("parameters", {"prefix": "sideways"}), ["prefix must be one of", "'own'", "'sideways'"]),
    ("unknown_activation", _set("parameters", {"activation": "swoosh"}), ["Invalid parameters for method 'm_ties'", "activation", "'swoosh'", "'gelu'"]),
    ("parameters_not_a_mapping", _set("parameters", [0.3]), ["parameters must be a mapping", "[0.3]"]),
    ("weight_wrong_type", _weights("heavy", 0.5), ["models[0].weight must be a finite number", "'heavy'"]),
    ("weight_bool", _weights(0.5, True), ["models[1].weight", "True"]),
    ("weight_negative", _weights(0.5, -1), ["models[1].weight", "-1"]),
    ("weights_all_zero", _weights(0, 0.0), ["weights must not all be 0"]),
    ("weights_partial", _weights(0.5, None), ["weight to every model or to none", "models[1] has no weight"]),
    ("missing_base", _drop("base"), ["Missing required key 'base'"]),
    ("missing_models", _drop("models"), ["Missing required key 'models'"]),
    ("models_not_a_list", _set("models", "ft0"), ["models must be a list", "'ft0'"]),
    ("models_a_mapping", _set("models", {"a": 1}), ["models must be a list", "{'a': 1}"]),
    ("models_empty", _set("models", []), ["models must be a non-empty list"]),
    ("model_entry_wrong_type", _model(0, 3), ["models[0] must be a Hub id or local folder", "got 3"]),
    ("model_entry_without_model", _model(0, {"weight": 1}), ["models[0] has no `model` key"]),
    ("model_entry_unknown_key", _model(0, lambda m: {"model": m, "wieght": 1}), ["Unknown key in models[0] 'wieght'", "did you mean 'weight'", "'revision'"]),
    ("model_missing_folder", _model(1, "./no-such-model"), ["models[1]", "no-such-model", "does not exist"]),
    ("model_empty_name", _model(1, {"model": ""}), ["models[1].model must be a Hub id or a local folder", "''"]),
    ("revision_not_a_string", _set("base", {"model": "org/base", "revision": 1234}), ["base.revision must be", "quote it", "1234"]),
    ("revision_on_local_folder", _model(0, lambda m: {"model": m, "revision": "main"}), ["models[0].revision='main' only applies to Hub ids"]),
    ("base_with_weight", _set("base", {"model": "org/base", "weight": 1}), ["base.weight", "the base has no weight"]),
    ("data_missing_m_ties", _drop("data"), ["'m_ties' is data-guided", "no data was given"]),
    ("data_missing_m_dare", lambda d: (d.pop("data"), d.update(method="m_dare", parameters={})), ["'m_dare' is data-guided", "no data was given"]),
    ("data_unknown_key", _data(n=8), ["Unknown key in data 'n'", "'num_samples'"]),
    ("data_wrong_type", _set("data", 128), ["data must be a Hub dataset id, a local folder or a mapping", "128"]),
    ("data_neither_id_nor_path", _set("data", {"split": "train"}), ["exactly one of `id`", "`path`"]),
    ("data_both_id_and_path", _data(id="org/images"), ["exactly one of `id`", "'org/images'"]),
    ("data_path_missing", _data(path="./no-such-images"), ["data.path", "no-such-images", "does not exist"]),
    ("data_num_samples_zero", _data(num_samples=0), ["data.num_samples must be an integer", "got 0"]),
    ("data_seed", _data(seed=5), ["data.seed", "set only the top-level `seed`"]),
    ("data_in_memory", _set("data", {"in_memory": "Tensor", "num_samples": 8}), ["data was passed from Python", "`id`", "`path`"]),
    ("dtype_invalid", _set("dtype", "float64"), ["dtype must be one of", "'bfloat16'", "'float64'"]),
    ("compute_dtype_invalid", _set("compute_dtype", "int8"), ["compute_dtype must be one of", "'int8'"]),
    ("batch_size_zero", _set("batch_size", 0), ["batch_size must be an integer", "got 0"]),
    ("seed_not_int", _set("seed", "abc"), ["seed must be an integer", "'abc'"]),
    ("score_bad_prefix", _set("score", {"prefix": "sideways"}), ["score", "prefix must be one of", "'sideways'"]),
    ("score_unknown_key", _set("score", {"prefx": "own"}), ["Unknown key in score 'prefx'", "did you mean 'prefix'"]),
    ("token_top_level", _set("token", SECRET), ["token", "never reads access tokens", "hf auth login", "HF_TOKEN"]),
    ("token_in_model_entry", _model(0, lambda m: {"model": m, "token": SECRET}), ["models[0].token", "hf auth login"]),
    ("token_in_parameters", _set("parameters", {"hf_token": SECRET}), ["parameters.hf_token", "HF_TOKEN"]),
]  # fmt: skip


@pytest.mark.parametrize("mutate, keywords", [c[1:] for c in INVALID], ids=[c[0] for c in INVALID])
def test_invalid_config_fails_early_naming_the_field(project, tmp_path, capsys, no_merge, mutate, keywords):
    config = _valid(project)
    mutate(config)
    path = tmp_path / "merge.yaml"
    path.write_text(yaml.safe_dump(config))
    with pytest.raises(ConfigError) as info:
        MergeConfig.from_yaml(path)
    message = str(info.value)
    for word in keywords:
        assert word in message, f"{word!r} not in {message!r}"
    assert SECRET not in message
    out_dir = tmp_path / "out"
    assert main(["merge", str(path), str(out_dir), "--quiet"]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("hf-mloss: error: Invalid config") and "Traceback" not in captured.err
    assert keywords[0] in captured.err and SECRET not in captured.err + captured.out
    assert not out_dir.exists()


@pytest.mark.parametrize(
    "text, keywords",
    [
        ("- base\n- models\n", ["must be a mapping", "list"]),
        ("", ["is empty"]),
        ("base: [unclosed\n", ["is not valid YAML", "line"]),
        ("base: org/b\nmodels: [org/a]\nmethod: ties\nmethod: dare\n", ["duplicate key 'method'"]),
    ],
    ids=["not_a_mapping", "empty", "syntax_error", "duplicate_key"],
)
def test_invalid_yaml_file(tmp_path, capsys, no_merge, text, keywords):
    path = tmp_path / "merge.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        MergeConfig.from_yaml(path)
    assert all(word in str(info.value) for word in keywords), str(info.value)
    assert main(["merge", str(path), str(tmp_path / "out")]) == 2
    assert "hf-mloss: error:" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_missing_config_file(tmp_path, no_merge):
    with pytest.raises(ConfigError, match="does not exist"):
        MergeConfig.from_yaml(tmp_path / "nope.yaml")
    assert main(["merge", str(tmp_path / "nope.yaml"), str(tmp_path / "out")]) == 2
    assert not (tmp_path / "out").exists()


def test_config_error_is_a_value_error():
    with pytest.raises(ValueError):
        MergeConfig.from_dict({"base": "org/b"})


# ---------------------------------------------------------------------------------------------- property-based
HUB_ID = st.from_regex(r"[a-z][a-z0-9]{0,6}/[a-z][a-z0-9_]{0,6}", fullmatch=True)
PARAMETER_VALUES = {
    "k": st.sampled_from([0.2, 0.5, 0.8, 1.0]),
    "e": st.sampled_from([0.0, 0.05, 0.1]),
    "p": st.sampled_from([0.3, 0.7, 1.0]),
    "lam": st.floats(-3, 3, allow_nan=False),
    "scope": st.sampled_from([None, "tensor", "global"]),
    "convention": st.sampled_from(["hf_mloss", "mergekit", "fusion_bench", "peft"]),
    "rescale": st.sampled_from(["inverse", "l1"]),
    "layers": st.none() | st.lists(st.integers(0, 11), min_size=1, max_size=3, unique=True),
    "prefix": st.sampled_from(["own", "base", "merged"]),
    "rank": st.sampled_from(["mloss", "random", "inverted"]),
    "budget": st.sampled_from(["all", "changed"]),
    "reduction": st.sampled_from(["abs", "sq"]),
    "activation": st.sampled_from([None, "gelu", "quick_gelu"]),
    "eps": st.sampled_from([1e-6, 1e-4, 0.5]),
    "fraction": st.none() | st.sampled_from([0.1, 0.25]),
    "common_space_fraction": st.sampled_from([0.5, 0.8, 1.0]),
    "t": st.floats(0, 1, allow_nan=False),
    "gamma": st.sampled_from([0.0, 0.01, 0.1]),
    "normalize": st.booleans(),
    "filter_wise": st.booleans(),
    "granularity": st.sampled_from(["layer", "block", "task"]),
    "objective": st.sampled_from(["entropy", "output_gap", "disagreement", "mloss"]),
    "init": st.floats(-1, 1, allow_nan=False),
    "steps": st.integers(1, 1000),
    "lr": st.sampled_from([1e-4, 1e-3, 0.1]),
    "max_samples": st.integers(1, 4096),
    "share": st.sampled_from(["auto", "all"]),
    "heads": st.none(),
    "coefficients": st.none() | st.just([["all", 0.25, -0.5]]),
    "relearn": st.booleans(),
    "mask_init": st.sampled_from([0.1, 1.0]),
    "learn_lam": st.booleans(),
    "temperature": st.sampled_from([1.0, 10.0]),
    "masks": st.none() | st.just([["encoder.layers.0.mlp.fc1.weight", [0, 3], []]]),
    "select_topk": st.sampled_from([0.0, 0.3, 1.0]),
    "task_vectors": st.booleans(),
    "flatten": st.booleans(),
    "row_wise": st.booleans(),
    "normalize_weights": st.booleans(),
    "max_iter": st.integers(0, 20),
    "tol": st.sampled_from([1e-6, 1e-5]),
    "epsilon": st.sampled_from([1e-6, 1e-5]),
    "r": st.sampled_from([0.0, 0.1]),
    "alpha": st.sampled_from([0.2, 0.5]),
    "calibrate": st.none() | st.just("svc"),
    "reduce_non_diagonal_ratio": st.sampled_from([0.0, 0.95, 1.0]),
    "candidates": st.none() | st.just(["tsv_m", "ties"]) | st.just({"task_arithmetic": {"lam": [0.3, 0.5]}}),
    "criterion": st.sampled_from(["output", "mloss"]),
    "reselect": st.booleans(),
    "compare_samples": st.integers(1, 64),
    "chosen": st.none() | st.just({"method": "tsv_m", "parameters": {"lam": 1.0}}),
    "scored": st.none() | st.just([{"method": "tsv_m", "setting": {"lam": 1.0}, "output": 0.25}]),
    "compared": st.none() | st.integers(1, 64),
    "held_out": st.booleans(),
    "cross_fit": st.booleans(),
    "cross_fitted": st.none() | st.booleans(),
    "fitted": st.none() | st.integers(1, 64),
}
METHOD_VALUES = {("breadcrumbs", "rescale"): st.sampled_from(["none", "l1"]),
                 # auto's budget counts merges (at least one per default candidate), TIES's names entries
                 ("auto", "budget"): st.none() | st.integers(6, 20),
                 ("breadcrumbs_ties", "rescale"): st.sampled_from(["none", "l1"]),
                 ("cart", "fraction"): st.sampled_from([0.08, 0.25]),  # CART's rank share has no "default" None
                 ("adarank_cart", "fraction"): st.sampled_from([0.08, 0.25]),  # nor AdaRank's over CART
                 # RegMean's λ scales the solved task vector: positive (λ = 1 the published merge)
                 ("regmean", "lam"): st.floats(0.01, 3), ("regmean_plusplus", "lam"): st.floats(0.01, 3),
                 # AdaRank's coefficients go with learn_lam=True only (tests/test_adarank.py covers them)
                 ("adarank_tsv", "coefficients"): st.none(), ("adarank_iso", "coefficients"): st.none(),
                 ("adarank_cart", "coefficients"): st.none()}


@st.composite
def valid_configs(draw) -> dict:
    from hf_mloss.methods import get_method

    method = draw(st.sampled_from(list_methods()))
    names = list(field_help(get_method(method).params_class))
    parameters = draw(st.fixed_dictionaries({}, optional={n: METHOD_VALUES.get((method, n), PARAMETER_VALUES[n])
                                                          for n in names}))
    weighted = draw(st.booleans())
    models = []
    for model_id in draw(st.lists(HUB_ID, min_size=1, max_size=4)):
        weight = draw(st.floats(0.01, 2)) if weighted else None
        revision = draw(st.none() | st.sampled_from(["main", "v1.0"]))
        if weight is None and revision is None and draw(st.booleans()):
            models.append(model_id)
        else:
            models.append({k: v for k, v in {"model": model_id, "weight": weight, "revision": revision}.items()
                           if v is not None})
    if parameters.get("alpha") is not None and "calibrate" in names and parameters.get("calibrate") is None:
        parameters["calibrate"] = "svc"  # SVC's alpha goes with calibrate only (a lone alpha is refused)
    if method == "nearswap" and "t" not in parameters:  # t has no default (mergekit's): a recipe gives it
        parameters["t"] = draw(st.sampled_from([1e-4, 0.01]))
    config = {"base": draw(HUB_ID), "models": models, "method": method, "parameters": parameters}
    if method == "passthrough":  # it stacks layer ranges: one input per slice (hf_mloss.spec.slices)
        config["slices"] = [{"sources": [{"model": i, "layer_range": [0, draw(st.integers(1, 4))]}]}
                            for i in range(len(models) + 1)]
    seed = draw(st.integers(0, 2**31))
    optional = {
        "seed": st.just(seed),
        "dtype": st.sampled_from(["float32", "bf16", "float16"]),
        "batch_size": st.integers(1, 64),
        "compute_dtype": st.sampled_from(["float32", "bfloat16"]),
        "hf_mloss_version": st.just("0.2.0"),
        "score": st.fixed_dictionaries({}, optional={"prefix": PARAMETER_VALUES["prefix"],
                                                     "reduction": PARAMETER_VALUES["reduction"],
                                                     "layers": PARAMETER_VALUES["layers"]}),
    }
    config.update(draw(st.fixed_dictionaries({}, optional=optional)))
    # auto's own parameters (candidates, budget) steer a comparison on data: without data they are refused
    if get_method(method).needs_data or (method == "auto" and parameters) or draw(st.booleans()):
        config["data"] = draw(st.one_of(HUB_ID, st.fixed_dictionaries(
            {"id": HUB_ID},
            optional={"split": st.sampled_from(["train", "test"]), "num_samples": st.integers(1, 512),
                      "image_column": st.just("img")},
        )))  # fmt: skip
    return config


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(valid_configs())
def test_valid_configs_round_trip(config):
    loaded = MergeConfig.from_dict(config)
    again = MergeConfig.from_dict(loaded.to_dict())
    assert again == loaded
    assert again.to_dict() == loaded.to_dict()
    assert MergeConfig.from_dict(yaml.safe_load(loaded.to_yaml())) == loaded
    assert loaded.method == config["method"] and len(loaded.models) == len(config["models"])


JUNK = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12)
    | st.sampled_from(["", ".", "~nobody-xyz/a", "/", "org/name", "m_ties", "ties", "images", "\x00"]),
    lambda children: st.lists(children, max_size=3)
    | st.dictionaries(st.sampled_from(["model", "weight", "revision", "id", "path", "split", "num_samples", "seed",
                                       "prefix", "k", "e", "p", "layers", "token"]) | st.text(max_size=4),
                      children, max_size=4),
    max_leaves=12,
)  # fmt: skip


@st.composite
def junk_configs(draw):
    if draw(st.booleans()):  # a valid config with one value replaced by junk
        config = draw(valid_configs())
        config[draw(st.sampled_from(TOP_LEVEL_KEYS + ("token",)))] = draw(JUNK)
        return config
    return draw(JUNK | st.dictionaries(st.sampled_from(TOP_LEVEL_KEYS) | st.text(max_size=6), JUNK, max_size=6))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(junk_configs())
def test_junk_loads_or_raises_config_error(config):
    try:
        loaded = MergeConfig.from_dict(config)
    except ConfigError as err:
        assert str(err)
    else:
        assert MergeConfig.from_dict(loaded.to_dict()) == loaded


def test_specs_are_plain_dataclasses():
    spec = ScoringOptions(prefix="own", layers=[2, 1])
    assert spec.to_dict() == {"prefix": "own", "reduction": "abs", "activation": None, "eps": 1e-4, "layers": [1, 2]}
    assert ModelSpec("org/a", weight=0.5, revision="main").to_dict() == {"model": "org/a", "revision": "main",
                                                                          "weight": 0.5}
