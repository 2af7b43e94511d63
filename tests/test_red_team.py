"""Red team: a careless or hostile user through the public API and the CLI.

Every case runs in a project folder holding real copies of the models, the images and a config, with a secret in
``HF_TOKEN``. For each it checks the exact error class and key words, that no file of the project was written,
changed or deleted (outputs aside, where a case expects one), and that the secret appears nowhere: not in the
message, the exception chain, stdout/stderr or logs.

Classes (one mechanism each, named in the README's "Errors and safety"): remote code, inputs overwritten or deleted,
files outside the checkpoint, silent garbage, unbounded input, arguments not validated at the door, push
uploading what it should not, secrets in errors.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

import hf_mloss
import hf_mloss.parallel
import hf_mloss.merging.selection
from hf_mloss import (
    CheckpointNotFoundError,
    ConfigError,
    CorruptCheckpointError,
    DataError,
    IncompatibleCheckpointsError,
    InvalidParameterError,
    OutputExistsError,
    PushError,
    UnknownMethodError,
    UnsafeCheckpointError,
    UnsupportedModelError,
)
from hf_mloss.cli import main
from examples.tiny import make_base, make_finetune, make_image_folder, save_model

sys.path.insert(0, str(Path(__file__).parent))
from fake_hub import FakeHub, fake_hub  # noqa: E402,F401  (fixture re-export)

SECRET = "hf_RedTeamSecretTokenNeverShown42"
MARKER = "REMOTE_CODE_RAN"
IMAGES = {"num_samples": 8, "batch_size": 4}


# ---------------------------------------------------------------------------------------------------- fixtures
@dataclass
class Project:
    root: Path
    base: Path
    models: list[Path]
    images: Path
    config: Path
    outputs: set[str] = field(default_factory=set)
    """Top-level names a case may create (its expected output)."""

    @property
    def model_args(self) -> tuple[str, list[str]]:
        return str(self.base), [str(m) for m in self.models]


@pytest.fixture(scope="module")
def originals(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("originals")
    base = make_base(0)
    save_model(base, root / "base")
    for i in range(2):
        save_model(make_finetune(base, i), root / f"ft{i}")
    make_image_folder(root / "images", n=12, size=40)
    return root


@pytest.fixture
def project(originals, tmp_path, monkeypatch) -> Project:
    root = tmp_path / "project"
    shutil.copytree(originals, root)
    config = root / "merge.yaml"
    config.write_text(yaml.safe_dump({"base": "./base", "models": ["./ft0", "./ft1"], "method": "ties",
                                      "parameters": {"k": 0.5}}))
    monkeypatch.setenv("HF_TOKEN", SECRET)
    monkeypatch.chdir(root)
    return Project(root, root / "base", [root / "ft0", root / "ft1"], root / "images", config)


def tree(path: Path) -> dict[str, str]:
    """Every file under ``path`` (hidden ones too) with a hash of its content, and every folder."""
    out = {}
    for p in sorted(path.rglob("*")):
        rel = p.relative_to(path).as_posix()
        if p.is_symlink():
            out[rel] = "link:" + os.readlink(p)
        elif p.is_dir():
            out[rel] = "dir"
        else:
            out[rel] = hashlib.sha1(p.read_bytes()).hexdigest()
    return out


def chain(err: BaseException) -> str:
    """The text of an exception and of every exception chained to it (what a traceback would print)."""
    parts, seen = [], err
    while seen is not None:
        parts.append(f"{type(seen).__name__}: {seen}")
        seen = seen.__cause__ or (None if seen.__suppress_context__ else seen.__context__)
    return "\n".join(parts)


@dataclass
class Case:
    id: str
    action: Callable[[Project], object]
    error: type[BaseException] | None
    words: tuple[str, ...] = ()
    check: Callable[[Project, object], None] | None = None
    exit_code: int | None = None
    """For CLI cases: the expected exit status (the error then shows in stderr)."""


def run_case(case: Case, project: Project, capsys, caplog) -> None:
    before = tree(project.root)
    caplog.set_level(logging.DEBUG)
    outcome = None
    if case.exit_code is not None:
        outcome = case.action(project)
        captured = capsys.readouterr()
        assert outcome == case.exit_code, captured.err[-2000:]
        text = captured.err + captured.out
        if case.exit_code:
            assert captured.err.startswith("hf-mloss: error:") and "Traceback" not in captured.err, captured.err
        for word in case.words:
            assert word in text, f"{word!r} not in {text[-1500:]!r}"
    elif case.error is not None:
        with pytest.raises(case.error) as info:
            case.action(project)
        text = chain(info.value)
        assert len(str(info.value)) < 1500, f"message of {len(str(info.value))} characters"
        for word in case.words:
            assert word in str(info.value), f"{word!r} not in {str(info.value)!r}"
        captured = capsys.readouterr()
        text += captured.err + captured.out
    else:
        outcome = case.action(project)
        captured = capsys.readouterr()
        text = captured.err + captured.out
    assert SECRET not in text + caplog.text
    after = tree(project.root)
    changed = {k for k in set(before) | set(after) if before.get(k) != after.get(k)}
    unexpected = {k for k in changed if k.split("/")[0] not in project.outputs}
    assert not unexpected, f"files written, changed or deleted: {sorted(unexpected)[:8]}"
    if case.check is not None:
        case.check(project, outcome)


def merge_args(p: Project, method: str = "ties", **kwargs):
    base, models = p.model_args
    return hf_mloss.merge(base, models, method, progress=False, **kwargs)


def cli(*args: str) -> Callable[[Project], int]:
    return lambda p: main([a.format(root=p.root) for a in args] + ["--quiet"])


def write_config(name: str, content: dict | str) -> Callable[[Project], str]:
    def make(p: Project) -> str:
        path = p.root / name
        path.write_text(content if isinstance(content, str) else yaml.safe_dump(content))
        p.outputs.add(name)
        return str(path)

    return make


def cli_config(name: str, content: dict | str, *extra: str) -> Callable[[Project], int]:
    def act(p: Project) -> int:
        return main(["merge", write_config(name, content)(p), *[e.format(root=p.root) for e in extra], "--quiet"])

    return act


def with_output(name: str, action: Callable[[Project], object]) -> Callable[[Project], object]:
    def act(p: Project):
        p.outputs.add(name)
        return action(p)

    return act


# --------------------------------------------------------------------------------------------- remote code
def _custom_code_folder(p: Project, source: Path, name: str, *, model_type: str | None = None,
                        processor: bool = False) -> str:
    """A copy of ``source`` whose config (or processor config) names custom code that would leave a marker."""
    folder = p.root / name
    shutil.copytree(source, folder)
    (folder / "evil.py").write_text(f"open({str(p.root / MARKER)!r}, 'w').write('ran')\nclass Evil: pass\n")
    target = folder / ("preprocessor_config.json" if processor else "config.json")
    data = json.loads(target.read_text())
    data["auto_map"] = {"AutoConfig": "evil.Evil", "AutoModel": "evil.Evil", "AutoImageProcessor": "evil.Evil"}
    if processor:
        data["image_processor_type"] = "EvilImageProcessor"
    if model_type is not None:
        data["model_type"] = model_type
    target.write_text(json.dumps(data))
    p.outputs.add(name)
    return str(folder)


def _warned(match: str, run: Callable[[], Any]) -> Any:
    """``run()``, which must warn with ``match`` (the warning is part of what the case checks)."""
    with pytest.warns(UserWarning, match=match):
        return run()


def no_marker(p: Project, _=None) -> None:
    assert not (p.root / MARKER).exists(), "code from a model folder ran"


REMOTE_CODE = [
    Case("auto_map_in_a_finetune_is_ignored", lambda p: hf_mloss.merge(
        str(p.base), [_custom_code_folder(p, p.models[0], "evil_ft"), str(p.models[1])], "ties", progress=False),
        None, check=no_marker),
    Case("auto_map_in_the_base_is_ignored", lambda p: _warned(r"names custom code \(auto_map\), which is not copied",
                                                              lambda: hf_mloss.merge(
        _custom_code_folder(p, p.base, "evil_base"), p.model_args[1], "average", progress=False)), None,
        check=no_marker),
    Case("custom_model_type_is_refused", lambda p: hf_mloss.merge(
        str(p.base), [_custom_code_folder(p, p.models[0], "evil_type", model_type="evil_net")], progress=False),
        UnsupportedModelError, ("'evil_net'", "not a transformers architecture", "custom code", "never runs"),
        check=no_marker),
    Case("custom_model_type_as_base_is_refused", lambda p: hf_mloss.merge(
        _custom_code_folder(p, p.base, "evil_base_type", model_type="evil_net"), p.model_args[1], progress=False),
        UnsupportedModelError, ("'evil_net'", "never runs"), check=no_marker),
    Case("custom_image_processor_is_refused", lambda p: hf_mloss.merge(
        _custom_code_folder(p, p.base, "evil_proc", processor=True), p.model_args[1], "m_ties",
        data=str(p.images), progress=False, **IMAGES),
        InvalidParameterError, ("image processor", "cannot be loaded", "processor="), check=no_marker),
    Case("custom_processor_argument_is_refused", lambda p: merge_args(
        p, "m_ties", data=str(p.images), processor=_custom_code_folder(p, p.base, "evil_proc2", processor=True),
        **IMAGES), InvalidParameterError, ("cannot be loaded",), check=no_marker),
    Case("custom_model_type_through_the_cli", lambda p: (
        _custom_code_folder(p, p.models[0], "evil_cli", model_type="evil"),
        cli_config("evil.yaml", {"base": "./base", "models": ["./evil_cli"], "method": "average"}, "{root}/out")(p),
    )[-1], None, ("not a transformers architecture",), exit_code=2),
    Case("loading_script_in_the_data_folder_is_not_run", lambda p: (
        (p.images / "images.py").write_text(f"open({str(p.root / MARKER)!r}, 'w')\n"), p.outputs.add("images"),
        merge_args(p, "m_ties", data=str(p.images), **IMAGES))[-1], None, check=no_marker),
]


# --------------------------------------------------------------------------------- inputs deleted or replaced
def _save(p: Project, target: str, **kwargs):
    return merge_args(p, "average").save_pretrained(Path(target.format(root=p.root)), **kwargs)


def _symlink(p: Project, name: str, to: Path) -> str:
    (p.root / name).symlink_to(to, target_is_directory=True)
    p.outputs.add(name)
    return str(p.root / name)


def _twice(p: Project):
    p.outputs.add("twice")
    result = merge_args(p, "average")
    result.save_pretrained(p.root / "twice")
    first = tree(p.root / "twice")
    try:
        result.save_pretrained(p.root / "twice")
    finally:
        assert tree(p.root / "twice") == first


def _failed_overwrite(p: Project, monkeypatch_target: str = "hf_mloss.output.checkpoint.save_torch_state_dict"):
    p.outputs.add("kept")
    result = merge_args(p, "average")
    result.save_pretrained(p.root / "kept")
    before = tree(p.root / "kept")
    import hf_mloss.output.checkpoint as checkpoint

    original = checkpoint.save_torch_state_dict

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    checkpoint.save_torch_state_dict = disk_full
    try:
        result.save_pretrained(p.root / "kept", overwrite=True)
    finally:
        checkpoint.save_torch_state_dict = original
        assert tree(p.root / "kept") == before  # the old folder is untouched
        assert [n for n in os.listdir(p.root) if n.startswith(".hf_mloss-tmp")] == []


def _disk_full(p: Project):
    original = shutil.disk_usage
    shutil.disk_usage = lambda path: shutil._ntuple_diskusage(10, 9, 1)
    try:
        return _save(p, "{root}/full")
    finally:
        shutil.disk_usage = original


INPUTS = [
    Case("overwrite_an_input_model_folder_cli", cli("merge", "merge.yaml", "{root}/ft0", "--overwrite"), None,
         ("overlaps an input",), exit_code=2),
    Case("overwrite_the_base_folder_api", lambda p: _save(p, "{root}/base", overwrite=True),
         InvalidParameterError, ("overlaps an input",)),
    Case("overwrite_the_project_holding_config_and_inputs", cli("merge", "merge.yaml", "{root}", "--overwrite"),
         None, ("overlaps an input",), exit_code=2),
    Case("output_inside_an_input_folder", cli("merge", "merge.yaml", "{root}/ft1/merged"), None,
         ("overlaps an input",), exit_code=2),
    Case("output_is_the_data_folder", lambda p: merge_args(p, "m_ties", data=str(p.images), **IMAGES)
         .save_pretrained(p.images, overwrite=True), InvalidParameterError, ("overlaps an input",)),
    Case("output_is_a_symlink_to_a_folder", lambda p: _save(p, _symlink(p, "link", p.root / "images")),
         InvalidParameterError, ("symbolic link",)),
    Case("output_is_a_symlink_to_an_input", lambda p: (
        _symlink(p, "ft0link", p.models[0]), cli("merge", "merge.yaml", "{root}/ft0link", "--overwrite")(p))[-1],
         None, ("symbolic link",), exit_code=2),
    Case("second_save_into_the_same_folder", _twice, OutputExistsError, ("already exists", "overwrite=True")),
    Case("output_under_a_file", lambda p: (p.outputs.add("afile"), (p.root / "afile").write_text("x"),
                                           _save(p, "{root}/afile/out"))[-1],
         InvalidParameterError, ("cannot be created", "is a file")),
    Case("output_under_a_file_cli_before_merging", lambda p: (p.outputs.add("bfile"), (p.root / "bfile").write_text(
        "x"), main(["merge", "merge.yaml", str(p.root / "bfile" / "out"), "--quiet"]))[-1], None,
         ("is a file",), exit_code=2),
    Case("output_is_a_file", lambda p: (p.outputs.add("cfile"), (p.root / "cfile").write_text("x"),
                                        _save(p, "{root}/cfile"))[-1], OutputExistsError, ("is a file",)),
    Case("output_name_too_long", lambda p: _save(p, "{root}/" + "n" * 300), InvalidParameterError,
         ("bytes; this filesystem allows",)),
    Case("output_name_near_the_limit_works", with_output("m" * 250, lambda p: _save(p, "{root}/" + "m" * 250)),
         None, check=lambda p, out: (out / "model.safetensors").is_file()),
    Case("filesystem_full_before_writing", lambda p: _disk_full(p), InvalidParameterError,
         ("Not enough free space",)),
    Case("disk_full_while_writing_keeps_the_old_folder", _failed_overwrite, hf_mloss.SaveError,
         ("No space left on device", "nothing was written")),
]


# ------------------------------------------------------------------------------------ files outside the folder
def _sharded_copy(p: Project, name: str, shard_name: str | None = None, index: object = None) -> str:
    folder = p.root / name
    shutil.copytree(p.models[0], folder)
    p.outputs.add(name)
    if index is None:
        tensors = load_file(str(folder / "model.safetensors"))
        (folder / "model.safetensors").rename(folder / "shard.safetensors")
        index = {"metadata": {}, "weight_map": {k: shard_name or "shard.safetensors" for k in tensors}}
    (folder / "model.safetensors.index.json").write_text(index if isinstance(index, str) else json.dumps(index))
    (folder / "model.safetensors").unlink(missing_ok=True)
    return str(folder)


def _outside(p: Project):
    elsewhere = p.root / "elsewhere"
    shutil.copytree(p.models[1], elsewhere)
    p.outputs.add("elsewhere")
    return hf_mloss.merge(str(p.base), [_sharded_copy(p, "traversal", "../elsewhere/model.safetensors")],
                          progress=False)


OUTSIDE = [
    Case("shard_index_with_parent_path", _outside, CorruptCheckpointError, ("outside the checkpoint folder",)),
    Case("shard_index_with_absolute_path", lambda p: hf_mloss.merge(
        str(p.base), [_sharded_copy(p, "absolute", str(p.models[1] / "model.safetensors"))], progress=False),
        CorruptCheckpointError, ("outside the checkpoint folder",)),
    Case("shard_index_not_json", lambda p: hf_mloss.merge(
        str(p.base), [_sharded_copy(p, "notjson", index="{not json")], progress=False),
        CorruptCheckpointError, ("Cannot parse model.safetensors.index.json",)),
    Case("shard_index_weight_map_is_a_list", lambda p: hf_mloss.merge(
        str(p.base), [_sharded_copy(p, "listmap", index={"weight_map": ["a"]})], progress=False),
        CorruptCheckpointError, ("weight_map",)),
    Case("shard_index_names_a_missing_shard", lambda p: hf_mloss.merge(
        str(p.base), [_sharded_copy(p, "missing", "gone.safetensors")], progress=False),
        CorruptCheckpointError, ("gone.safetensors",)),
    Case("shard_index_with_home_path", lambda p: hf_mloss.merge(
        str(p.base), [_sharded_copy(p, "home", "~/model.safetensors")], progress=False),
        CorruptCheckpointError, ("outside the checkpoint folder",)),
]


# ----------------------------------------------------------------------------------------------- silent garbage
def _edited_config(p: Project, name: str, **changes) -> str:
    folder = p.root / name
    shutil.copytree(p.base, folder)
    p.outputs.add(name)
    data = json.loads((folder / "config.json").read_text())
    data.update(changes)
    (folder / "config.json").write_text(json.dumps(data))
    return str(folder)


GARBAGE = [
    Case("config_with_more_layers_than_tensors", lambda p: hf_mloss.merge(
        _edited_config(p, "deep", num_hidden_layers=4), p.model_args[1], progress=False),
        IncompatibleCheckpointsError, ("does not match its weights", "randomly initialised")),
    Case("config_with_fewer_layers_than_tensors", lambda p: hf_mloss.merge(
        _edited_config(p, "shallow", num_hidden_layers=1), p.model_args[1], progress=False),
        IncompatibleCheckpointsError, ("does not describe",)),
    Case("config_hidden_size_disagrees", lambda p: hf_mloss.merge(
        _edited_config(p, "wide", hidden_size=48), p.model_args[1], progress=False),
        IncompatibleCheckpointsError, ("does not match its weights", "shape")),
    Case("config_intermediate_size_disagrees", lambda p: hf_mloss.merge(
        _edited_config(p, "mlp", intermediate_size=128), p.model_args[1], progress=False),
        IncompatibleCheckpointsError, ("mlp.fc1",)),
    Case("huge_lambda_overflows", cli_config("lam.yaml", {"base": "./base", "models": ["./ft0", "./ft1"],
                                                          "method": "task_arithmetic",
                                                          "parameters": {"lam": 1e300}}, "{root}/out"),
         None, ("lam is 1e+300", "beyond the range of float32"), exit_code=2),
    Case("float16_cast_overflows", lambda p: merge_args(p, "task_arithmetic", lam=1e6, dtype="float16"),
         InvalidParameterError, ("would overflow", "float16", "bfloat16")),
    Case("nan_pixels", lambda p: merge_args(p, "m_ties", data=torch.full((4, 3, 32, 32), float("nan")), **IMAGES),
         DataError, ("NaN or Inf", "4 of the 4")),
    Case("inf_pixels", lambda p: merge_args(p, "m_ties", data=torch.cat([torch.zeros(3, 3, 32, 32),
                                                                         torch.full((1, 3, 32, 32), float("inf"))]),
                                            **IMAGES), DataError, ("1 of the 4",)),
    Case("split_typo_in_an_image_folder", lambda p: merge_args(p, "m_ties", data=str(p.images), split="trian",
                                                               **IMAGES),
         DataError, ("'trian'", "its splits are", "'train'")),
    Case("nan_in_a_finetune", lambda p: hf_mloss.merge(str(p.base), [_poisoned(p)], progress=False),
         CorruptCheckpointError, ("non-finite", "ft_nan")),
    Case("float_and_int_tensors_mixed", lambda p: hf_mloss.merge(str(p.base), [_int_tensor(p)], progress=False),
         IncompatibleCheckpointsError, ("missing",)),
]


def _poisoned(p: Project) -> str:
    folder = p.root / "ft_nan"
    shutil.copytree(p.models[0], folder)
    p.outputs.add("ft_nan")
    tensors = load_file(str(folder / "model.safetensors"))
    name = next(k for k in tensors if k.endswith("fc1.weight"))
    tensors[name][0, 0] = float("nan")
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return str(folder)


def _int_tensor(p: Project) -> str:
    folder = p.root / "ft_int"
    shutil.copytree(p.models[0], folder)
    p.outputs.add("ft_int")
    tensors = load_file(str(folder / "model.safetensors"))
    name = next(k for k in tensors if k.endswith("fc1.bias"))
    tensors[name] = tensors[name].to(torch.int64)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return str(folder)


# ----------------------------------------------------------------------------------------------- unbounded input
BOMB = "\n".join(["a: &a [x, x, x, x, x, x, x, x, x, x]"]
                 + [f"{c}: &{c} [*{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}]"
                    for p, c in zip("abcdefgh", "bcdefghi")]) + "\nbase: *i\n"


def _config_cli(name: str, text: str) -> Callable[[Project], int]:
    return lambda p: main(["merge", write_config(name, text)(p), str(p.root / "out"), "--quiet"])


UNBOUNDED = [
    Case("billion_laughs_yaml", _config_cli("bomb.yaml", BOMB), None, ("expands to more than",), exit_code=2),
    Case("recursive_alias_yaml", _config_cli("loop.yaml", "a: &a [*a]\nbase: *a\n"), None, ("YAML",),
         exit_code=2),
    Case("config_file_too_large", _config_cli("big.yaml", "# " + "x" * (1 << 21) + "\n"), None,
         ("bytes; merge configs are small",), exit_code=2),
    Case("huge_method_name_is_cut", _config_cli("longname.yaml", yaml.safe_dump(
        {"base": "./base", "models": ["./ft0"], "method": "z" * 600_000})), None, ("Unknown merge method",),
         exit_code=2),
    Case("huge_key_is_cut", _config_cli("longkey.yaml", yaml.safe_dump(
        {"base": "./base", "models": ["./ft0"], "k" * 500_000: 1})), None, ("Unknown top-level key",), exit_code=2),
    Case("deeply_nested_yaml", _config_cli("deep.yaml", "base: " + "[" * 5000 + "]" * 5000 + "\n"), None,
         ("hf-mloss: error",), exit_code=2),
    Case("binary_config_file", lambda p: (write_config("bin.yaml", "")(p), (p.root / "bin.yaml").write_bytes(
        b"\xff\xfe\x00\x01" * 100), main(["merge", str(p.root / "bin.yaml"), str(p.root / "out"), "-q"]))[-1],
         None, ("Cannot read config file",), exit_code=2),
    Case("config_is_a_folder", cli("merge", "{root}/images", "{root}/out"), None, ("is not a file",),
         exit_code=2),
]


# ---------------------------------------------------------------------------------------- arguments at the door
def door(**kwargs) -> Callable[[Project], object]:
    def act(p: Project):
        method = kwargs.pop("method", "ties")
        return merge_args(p, method, **kwargs)

    return act


DOOR = [
    Case("device_cuda_without_cuda", door(device="cuda"), InvalidParameterError, ("CUDA device(s)",))
    if not torch.cuda.is_available() else Case("device_cuda_index_too_high", door(device="cuda:99"),
                                                InvalidParameterError, ("CUDA device(s)",)),
    Case("device_meta", door(device="meta"), InvalidParameterError, ("'meta' cannot run a merge",)),
    Case("device_nonsense", door(device="toaster"), InvalidParameterError, ("not a torch device",)),
    Case("dtype_int8", door(dtype="int8"), InvalidParameterError, ("dtype must be one of", "'int8'")),
    Case("dtype_float8", door(dtype="float8_e4m3fn"), InvalidParameterError, ("dtype must be one of",)),
    Case("dtype_torch_object", door(dtype=torch.float64), InvalidParameterError, ("dtype",)),
    Case("compute_dtype_int", door(compute_dtype="int16"), InvalidParameterError, ("compute_dtype",)),
    Case("seed_negative", door(seed=-1), InvalidParameterError, ("seed must be an integer in [0,", "-1")),
    Case("seed_huge", door(seed=2**70), InvalidParameterError, ("seed must be an integer",)),
    Case("seed_float", door(seed=1.5), InvalidParameterError, ("seed must be an integer",)),
    Case("seed_bool", door(seed=True), InvalidParameterError, ("seed must be an integer",)),
    Case("base_none", lambda p: hf_mloss.merge(None, p.model_args[1], progress=False), InvalidParameterError,
         ("base is required",)),
    Case("base_int", lambda p: hf_mloss.merge(3, p.model_args[1], progress=False), InvalidParameterError,
         ("base", "PreTrainedModel")),
    Case("models_a_string", lambda p: hf_mloss.merge(str(p.base), str(p.models[0]), progress=False),
         InvalidParameterError, ("models must be a non-empty list",)),
    Case("models_empty", lambda p: hf_mloss.merge(str(p.base), [], progress=False), InvalidParameterError,
         ("non-empty list",)),
    Case("models_plain_module", lambda p: hf_mloss.merge(str(p.base), [torch.nn.Linear(2, 2)], progress=False),
         InvalidParameterError, ("Hub id, a local folder or a loaded",)),
    Case("numpy_scalar_weights_work", door(weights=[np.float32(1), np.int64(2)]), None,
         check=lambda p, r: r.config.weights == [1.0, 2.0]),
    Case("numpy_array_weights_work", door(weights=np.array([0.25, 0.75])), None,
         check=lambda p, r: r.config.weights == [0.25, 0.75]),
    Case("weights_nan", door(weights=[1.0, float("nan")]), InvalidParameterError, ("weights[1]", "finite")),
    Case("weights_wrong_count", door(weights=[1.0]), InvalidParameterError, ("Got 1 weights for 2 models",)),
    Case("weights_a_dict", door(weights={"a": 1}), InvalidParameterError, ("one entry per model",)),
    Case("data_is_a_file", door(method="m_ties", data="merge.yaml", **IMAGES), DataError,
         ("is a file, not a folder",)),
    Case("data_missing_folder", door(method="m_ties", data="./no/such/images"), DataError, ("does not exist",)),
    Case("data_empty_list", door(method="m_ties", data=[], **IMAGES), DataError, ("empty",)),
    Case("data_wrong_tensor_shape", door(method="m_ties", data=torch.zeros(4, 32, 32)), DataError,
         ("[N, 3, H, W]",)),
    Case("data_wrong_image_size", door(method="m_ties", data=torch.rand(4, 3, 7, 7)), DataError,
         ("7×7 pixels", "takes 32×32")),
    Case("data_wrong_image_size_regmean", door(method="regmean", data=torch.rand(4, 3, 7, 7)), DataError,
         ("7×7 pixels", "takes 32×32")),
    Case("data_wrong_image_size_auto", door(method="auto", data=torch.rand(4, 3, 7, 7)), DataError,
         ("7×7 pixels", "takes 32×32")),
    Case("batch_size_overflows", door(method="m_ties", data=".", batch_size=10**12), InvalidParameterError,
         ("batch_size must be an integer in [1, 65536]",)),
    Case("batch_size_zero", door(method="m_ties", data=".", batch_size=0), InvalidParameterError, ("batch_size",)),
    Case("num_samples_negative", door(method="m_ties", data=".", num_samples=-3), DataError, ("num_samples",)),
    Case("revision_not_a_string", door(revision=123), InvalidParameterError, ("revisions must be a list",)),
    Case("method_none", door(method=None), InvalidParameterError, ("method is required",)),
    Case("method_typo_suggests", door(method="mties"), UnknownMethodError, ("did you mean 'm_ties'",)),
    Case("k_numpy_is_accepted", door(k=np.float32(0.5)), None, check=lambda p, r: r.params["k"] == 0.5),
    Case("lam_infinite", door(lam=float("inf")), InvalidParameterError, ("lam must be a finite number",)),
    Case("e_bool", door(method="m_ties", data=".", e=True), InvalidParameterError, ("e must be a finite number",)),
    Case("layers_negative", door(method="m_ties", data=".", layers=[-1]), InvalidParameterError,
         ("layers must be an integer >= 0",)),
    Case("layers_a_string", door(method="m_ties", data=".", layers="0"), InvalidParameterError,
         ("layers must be a list",)),
    Case("output_unknown", door(output="both"), InvalidParameterError, ("output must be one of",)),
    Case("unknown_parameter_suggests", door(densty=0.2), InvalidParameterError, ("'densty'", "valid parameters")),
    Case("processor_not_a_processor", door(method="m_ties", data=".", processor=[1]), InvalidParameterError,
         ("processor must be",)),
]


# ----------------------------------------------------------------------------------------------------- push
def _saved(p: Project, name: str = "pushme") -> Path:
    p.outputs.add(name)
    return merge_args(p, "average").save_pretrained(p.root / name)


def _push(folder: Path, hub: FakeHub | None = None, **kwargs):
    from hf_mloss.output.push import push_folder

    return push_folder(folder, kwargs.pop("repo", "tester/red-team"), token=SECRET, **kwargs)


def _pushed_files(hub: FakeHub) -> set[str]:
    return set(hub.commits[-1].files) if hub.commits else set()


PUSH_SETUPS: list[tuple[str, Callable[[Project], Path], type[BaseException] | None, tuple[str, ...],
                        Callable[[set[str]], None] | None]] = [
    ("hidden_files_stay_home", lambda p: (lambda f: ((f / ".secrets").mkdir(), (f / ".secrets" / "token")
                                                     .write_text(SECRET), f)[-1])(_saved(p)), None, (),
     lambda files: (not any(".secrets" in f for f in files)) or pytest.fail(str(files))),
    ("git_folder_is_never_uploaded", lambda p: (lambda f: ((f / ".git").mkdir(), (f / ".git" / "config")
                                                           .write_text("x"), f)[-1])(_saved(p)), None, (),
     lambda files: (not any(".git" in f for f in files)) or pytest.fail(str(files))),
    ("files_added_after_saving_stay_home", lambda p: (lambda f: ((f / "notes.txt").write_text("private"), f)[-1])(
        _saved(p)), None, (), lambda files: ("notes.txt" not in files) or pytest.fail(str(files))),
    ("symlinked_weights_are_refused", lambda p: (lambda f: ((f / "model.safetensors").unlink(),
                                                            (f / "model.safetensors").symlink_to(p.models[0] /
                                                                                                 "model.safetensors"),
                                                            f)[-1])(_saved(p)),
     PushError, ("not a regular file",), None),
    ("no_manifest_is_refused", lambda p: (lambda f: ((f / "hf_mloss_files.json").unlink(), f)[-1])(_saved(p)),
     PushError, ("hf_mloss_files.json", "not written by hf_mloss"), None),
    ("truncated_weights_are_refused", lambda p: (lambda f: ((f / "model.safetensors").write_bytes(
        (f / "model.safetensors").read_bytes()[:100]), f)[-1])(_saved(p)), PushError, ("changed after",), None),
    ("an_edited_card_is_uploaded", lambda p: (lambda f: ((f / "README.md").write_text(
        (f / "README.md").read_text() + "\nMore words.\n"), f)[-1])(_saved(p)), None, (),
     lambda files: ("README.md" in files) or pytest.fail(str(files))),
    ("invalid_repo_id_before_any_request", lambda p: _saved(p), InvalidParameterError, ("not a valid Hub repo id",),
     None),
]


# ------------------------------------------------------------------------------- round 3: every writer guarded
SCORE_CONFIG = {"base": "./base", "models": ["./ft0", "./ft1"], "method": "average",
                "data": {"path": "./images", "num_samples": 8}, "batch_size": 4}


def score_cli(*extra: str, config: dict | None = None, name: str = "score.yaml") -> Callable[[Project], int]:
    def act(p: Project) -> int:
        path = write_config(name, config or SCORE_CONFIG)(p)
        return main(["score", path, *[e.format(root=p.root) for e in extra], "--quiet"])

    return act


def config_intact(name: str, content: dict) -> Callable[[Project, object], None]:
    return lambda p, _: (yaml.safe_load((p.root / name).read_text()) == content) or pytest.fail("config changed")


def _linked_report_folder(p: Project, *extra: str) -> int:
    """A report folder (as hf_mloss lists it) whose compatibility.md links to a file outside it: the link is never
    written through."""
    (p.root / "victim.txt").write_text("precious")
    (p.root / "compat").mkdir()
    (p.root / "compat" / "compatibility.md").symlink_to(p.root / "victim.txt")
    (p.root / "compat" / "hf_mloss_files.json").write_text(json.dumps({"files": {"compatibility.md": 8}}))
    p.outputs.update({"compat", "victim.txt"})
    return score_cli("--pairwise", "--out", "{root}/compat", *extra)(p)


def victim_intact(p: Project, _=None) -> None:
    assert (p.root / "victim.txt").read_text() == "precious", "a report was written through a symbolic link"


def _heads(p: Project, content: bytes | None = None) -> list[str]:
    (p.root / "heads").mkdir(exist_ok=True)
    paths = []
    for i in range(2):
        path = p.root / "heads" / f"h{i}.safetensors"
        if content is None:
            save_file({"weight": torch.randn(3, 32)}, str(path))
        else:
            path.write_bytes(content)
        paths.append(f"./heads/h{i}.safetensors")
    p.outputs.add("heads")
    return paths


def _select_config(p: Project, **select) -> dict:
    return {"base": "./base", "models": ["./ft0", "./ft1"], "method": "task_arithmetic",
            "data": {"path": "./images", "num_samples": 8}, "batch_size": 4,
            "select": {"grid": {"lam": [0.5, 1.0]}, "num_samples": 8, **select}}


def _merge_onto(name: str, make_config: Callable[[Project], dict]) -> Callable[[Project], int]:
    def act(p: Project) -> int:
        return main(["merge", write_config("sel.yaml", make_config(p))(p), str(p.root / name), "--overwrite",
                     "--quiet"])

    return act


def _processor_config(p: Project) -> dict:
    shutil.copytree(p.base, p.root / "proc")
    p.outputs.add("proc")
    return {"base": "./base", "models": ["./ft0", "./ft1"], "method": "average", "processor": "./proc"}


def _shares_config(p: Project) -> dict:
    shutil.copytree(p.images, p.root / "images2")
    p.outputs.add("images2")
    return _select_config(p, share="given", shares=["./images", "./images2"])


def _into_the_current_folder(p: Project):
    work = p.root / "work"
    work.mkdir()
    (work / "notes.txt").write_text("mine")
    p.outputs.add("work")
    os.chdir(work)
    try:
        return _save(p, ".", overwrite=True)
    finally:
        os.chdir(p.root)
        assert (work / "notes.txt").read_text() == "mine" and sorted(os.listdir(work)) == ["notes.txt"]


GUARDED_WRITERS = [
    Case("score_json_onto_the_config", score_cli("--json", "{root}/score.yaml"), None, ("overlaps an input",),
         check=config_intact("score.yaml", SCORE_CONFIG), exit_code=2),
    Case("score_json_onto_the_base_weights", score_cli("--json", "{root}/base/model.safetensors"), None,
         ("overlaps an input",), exit_code=2),
    Case("score_json_into_a_device_file", score_cli("--json", "/dev/full"), None,
         ("'/dev/full'", "not a regular file"), exit_code=2),
    Case("score_json_over_an_existing_report_needs_overwrite", lambda p: (
        p.outputs.add("old.json"), (p.root / "old.json").write_text("{}"),
        score_cli("--json", "{root}/old.json")(p))[-1], None, ("already exists", "--overwrite"),
         check=lambda p, _: (p.root / "old.json").read_text() == "{}" or pytest.fail("replaced"), exit_code=2),
    Case("pairwise_out_is_the_data_folder", score_cli("--pairwise", "--out", "{root}/images"), None,
         ("overlaps an input",), exit_code=2),
    Case("pairwise_out_inside_a_finetune", score_cli("--pairwise", "--out", "{root}/ft0/compat"), None,
         ("overlaps an input",), exit_code=2),
    Case("pairwise_out_with_a_linked_file_is_refused", lambda p: _linked_report_folder(p), None,
         ("already exists",), check=victim_intact, exit_code=2),
    Case("pairwise_out_overwrite_replaces_the_link_not_its_target", lambda p: _linked_report_folder(
        p, "--overwrite"), None, ("compatibility.md",), check=lambda p, _: (
            victim_intact(p), (p.root / "compat" / "compatibility.md").is_symlink() and pytest.fail("link kept")),
         exit_code=0),
    Case("merge_overwrite_onto_the_processor_folder", _merge_onto("proc", _processor_config), None,
         ("overlaps an input",), exit_code=2),
    Case("merge_overwrite_onto_the_heads_folder", _merge_onto("heads", lambda p: _select_config(
        p, heads=_heads(p))), None, ("overlaps an input",), exit_code=2),
    Case("merge_overwrite_onto_a_shares_folder", _merge_onto("images2", _shares_config), None,
         ("overlaps an input",), exit_code=2),
    Case("save_into_the_current_folder", _into_the_current_folder, InvalidParameterError,
         ("current working folder",)),
]


# ------------------------------------------------------------------------------------------- round 3: no NaN wins
NON_FINITE = [
    Case("nan_candidate_never_wins", lambda p: merge_args(
        p, "task_arithmetic", select="unlabeled", grid={"lam": [1e8, 0.3]}, data=str(p.images), **IMAGES),
         InvalidParameterError, ("select.grid", "'lam': 100000000.0", "not finite", "Nothing was chosen")),
    Case("compatibility_weights_that_overflow", lambda p: hf_mloss.compatibility(
        str(p.base), p.model_args[1], str(p.images), weights=[1e308, 1e308], progress=False, **IMAGES),
         InvalidParameterError, ("weights[0]", "1e+308", "beyond the range of float32")),
]


# ------------------------------------------------------------------------------------- round 3: secrets echoed
def _config_file(name: str, content: str | bytes) -> Callable[[Project], int]:
    def act(p: Project) -> int:
        path = write_config(name, "")(p)
        Path(path).write_bytes(content if isinstance(content, bytes) else content.encode())
        return main(["merge", path, str(p.root / "out"), "--quiet"])

    return act


SECRETS = [
    Case("token_file_given_as_the_config", _config_file("token", SECRET + "\n"), None,
         ("holds a str", "right file"), exit_code=2),
    Case("dotenv_given_as_the_config", _config_file(".env", f"HF_TOKEN={SECRET}\nOTHER=1\n"), None,
         ("holds a str",), exit_code=2),
    Case("dotenv_with_export_and_quotes", _config_file("env.sh", f'export HF_TOKEN="{SECRET}"\n'), None,
         ("hf-mloss: error",), exit_code=2),
    Case("yaml_error_on_the_token_line", _config_file("broken.yaml", f"base: ./base\nt: {SECRET}: x\n"),
         None, ("not valid YAML", "line 2"), exit_code=2),
    Case("token_as_a_yaml_key", _config_file("keyed.yaml", f"HF_TOKEN: {SECRET}\nbase: ./base\n"), None,
         ("HF_TOKEN", "hf auth login"), exit_code=2),
    Case("token_as_a_model_path", cli_config("path.yaml", {"base": "./base", "models": [f"./{SECRET}"]},
                                             "{root}/out"), None, ("access token",), exit_code=2),
    Case("token_in_a_model_path_from_python", lambda p: hf_mloss.merge(str(p.base), [f"./{SECRET}/x"],
                                                                       progress=False),
         CheckpointNotFoundError, ("hf_***",)),
    Case("head_file_holding_a_token", lambda p: MergeConfig_from(p, _select_config(
        p, heads=_heads(p, f"HF_TOKEN={SECRET}".encode()))), ConfigError,
         ("select.heads[0]", "not a safetensors file")),
]


def MergeConfig_from(p: Project, content: dict):  # noqa: N802
    return hf_mloss.MergeConfig.from_dict(content, base_dir=p.root)


# ---------------------------------------------------------------------------------- round 3: mergekit's meaning
def mergekit(**changes) -> Callable[[Project], object]:
    def act(p: Project):
        content = {"merge_method": "ties", "base_model": "./base", "parameters": {"normalize": True},
                   "models": [{"model": "./ft0", "parameters": {"weight": 1.0, "density": 0.5}},
                              {"model": "./ft1", "parameters": {"weight": 1.0, "density": 0.5}}]}
        for key, value in changes.items():
            if value is None:
                content.pop(key, None)
            else:
                content[key] = value(content) if callable(value) else value
        return MergeConfig_from(p, content)

    return act


def _params(i: int, **params) -> Callable[[dict], list]:
    def edit(content: dict) -> list:
        models = [dict(m) for m in content["models"]]
        models[i] = {"model": models[i]["model"], "parameters": params}
        return models

    return edit


MERGEKIT = [
    Case("mergekit_density_omitted_on_one_model_is_1", mergekit(models=_params(1, weight=1.0)), None,
         check=lambda p, config: [m.parameters for m in config.models] == [{"k": 0.5}, {"k": 1.0}] or
         pytest.fail(str([m.parameters for m in config.models]))),
    Case("mergekit_density_omitted_everywhere_keeps_all", mergekit(models=lambda c: [
        {"model": m["model"], "parameters": {"weight": 1.0}} for m in c["models"]]), None,
         check=lambda p, config: config.parameters["k"] == 1.0 or pytest.fail(str(config.parameters))),
    Case("mergekit_weight_omitted_is_refused", mergekit(models=_params(0, density=0.5)), ConfigError,
         ("models[0].parameters.weight is missing",)),
    Case("mergekit_method_as_a_list", mergekit(merge_method=["ties"]), ConfigError,
         ("merge_method must be one method name",)),
    Case("mergekit_parameters_as_a_list", mergekit(parameters=["normalize"]), ConfigError,
         ("parameters must be a mapping",)),
    Case("mergekit_model_parameters_as_a_list", mergekit(models=lambda c: [
        {"model": "./ft0", "parameters": [1.0]}, c["models"][1]]), ConfigError,
         ("models[0].parameters must be a mapping",)),
    Case("mergekit_normalize_with_zero_weights", mergekit(merge_method="task_arithmetic", models=lambda c: [
        {"model": m["model"], "parameters": {"weight": 0.0}} for m in c["models"]]), ConfigError,
         ("normalize", "sum of the models' weights")),
    Case("mergekit_normalize_not_a_bool", mergekit(parameters={"normalize": "yes please"}), ConfigError,
         ("normalize must be true or false",)),
    Case("mergekit_tokenizer_source_union", mergekit(tokenizer_source="union"), None,
         check=lambda p, config: config.tokenizer_source == "union" or pytest.fail(str(config.tokenizer_source))),
    Case("mergekit_tokenizer_section", mergekit(tokenizer={"source": "union", "tokens": {"<x>": {"source": "./ft0"}}}),
         None, check=lambda p, config: config.tokenizer_source["tokens"] == {"<x>": {"source": 1}} or pytest.fail(
             str(config.tokenizer_source))),
    Case("mergekit_tokenizer_source_unknown_model", mergekit(tokenizer_source="./elsewhere"), ConfigError,
         ("tokenizer_source", "not one of the merge's models")),
    Case("mergekit_tokenizer_source_and_section", mergekit(tokenizer_source="union", tokenizer={"source": "base"}),
         ConfigError, ("both tokenizer_source and tokenizer",)),
    Case("mergekit_tokenizer_source_base_is_accepted", mergekit(tokenizer_source="base"), None,
         check=lambda p, config: config.parameters["k"] == 0.5 or pytest.fail(str(config.parameters))),
]


# ------------------------------------------------------------------------------------------ round 3: bounded knobs
def with_env(name: str, value: str, action: Callable[[Project], object]) -> Callable[[Project], object]:
    def act(p: Project):
        old = os.environ.get(name)
        os.environ[name] = value
        try:
            return action(p)
        finally:
            os.environ.pop(name) if old is None else os.environ.__setitem__(name, old)

    return act


def _select_cli(*grid: str, method: str = "task_arithmetic") -> Callable[[Project], int]:
    config = {**SCORE_CONFIG, "method": method}
    return score_cli("--select", "unlabeled", *[item for g in grid for item in ("--grid", g)],
                     "--select-samples", "4", config=config, name="sel.yaml")


KNOBS = [
    Case("grid_beyond_the_cap_is_refused_at_once", lambda p: hf_mloss.spec.selection.SelectionOptions(
        grid={"lam": [i / 1000 for i in range(1, 1001)], "k": [0.2, 0.5]}), InvalidParameterError,
         ("2000 candidates", "limit is 1024")),
    Case("threads_env_superscript", with_env("HF_MLOSS_THREADS", "²", lambda p: merge_args(p, "average")),
         InvalidParameterError, ("HF_MLOSS_THREADS='²'", "ASCII digits")),
    Case("threads_env_negative", with_env("HF_MLOSS_THREADS", "-4", lambda p: merge_args(p, "average")),
         InvalidParameterError, ("HF_MLOSS_THREADS",)),
    Case("threads_env_huge_is_clamped", with_env("HF_MLOSS_THREADS", "100000", lambda p: (
        hf_mloss.parallel.run_threads("cpu"), merge_args(p, "average"))), None,
         check=lambda p, out: out[0] <= (os.cpu_count() or 1) or pytest.fail(f"{out[0]} threads")),
    Case("cli_grid_values_read_as_yaml_floats", _select_cli("lam=1e-1,1"), None, ("lam=0.1 ", "lam=1 "),
         exit_code=0),
    Case("cli_grid_as_a_flow_list", _select_cli("k=[0.2,0.5]", "lam=1", method="ties"), None,
         ("k=0.2, lam=1", "k=0.5, lam=1"), exit_code=0),
    Case("cli_grid_broken_list", _select_cli("k=[0.2,", method="ties"), None, ("--grid k", "not valid YAML"),
         exit_code=2),
    Case("cli_grid_nested_list", _select_cli("k=[[0.2]]", method="ties"), None, ("--grid k", "one number"),
         exit_code=2),
]


# ------------------------------------------------------------------------------ round 3: library errors wrapped
def _integer_image_column(p: Project):
    import datasets

    return merge_args(p, "m_ties", data=datasets.Dataset.from_dict({"image": [1, 2, 3, 4], "label": [0, 1, 0, 1]}),
                      **IMAGES)


def _integer_image_stream(p: Project):
    import datasets

    stream = datasets.Dataset.from_dict({"image": [1, 2, 3, 4]}).to_iterable_dataset()
    return merge_args(p, "m_ties", data=stream, **IMAGES)


WRAPPED = [
    Case("integer_image_column", _integer_image_column, DataError, ("'image'", "int64", "image_column=")),
    Case("integer_image_column_streamed", _integer_image_stream, DataError, ("'image'", "image_column=")),
    Case("heads_file_not_safetensors", lambda p: merge_args(
        p, "task_arithmetic", data=str(p.images), select="unlabeled", grid={"lam": [0.5, 1.0]},
        heads=_heads(p, b"\x00" * 64), **IMAGES), InvalidParameterError,
         ("select.heads[0]", "h0.safetensors", "not a safetensors file")),
]


# ------------------------------------------------------------------------------------------ the table runner
CASES = REMOTE_CODE + INPUTS + OUTSIDE + GARBAGE + UNBOUNDED + DOOR + GUARDED_WRITERS + NON_FINITE + SECRETS + \
    MERGEKIT + KNOBS + WRAPPED


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_red_team(case: Case, project, capsys, caplog):
    run_case(case, project, capsys, caplog)


@pytest.mark.parametrize("name, setup, error, words, check", PUSH_SETUPS, ids=[s[0] for s in PUSH_SETUPS])
def test_red_team_push(name, setup, error, words, check, project, fake_hub, capsys, caplog):
    folder = setup(project)
    repo = "not a repo!" if name == "invalid_repo_id_before_any_request" else "tester/red-team"
    before = tree(project.root)
    if error is None:
        _push(folder, repo=repo)
        check(_pushed_files(fake_hub))
    else:
        with pytest.raises(error) as info:
            _push(folder, repo=repo)
        assert all(w in str(info.value) for w in words), str(info.value)
        assert not fake_hub.commits
        assert SECRET not in chain(info.value)
    assert tree(project.root) == before
    assert SECRET not in capsys.readouterr().err + caplog.text


def test_refused_repo_id_leaves_no_temporary_copy(project, tmp_path, monkeypatch):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    with pytest.raises(InvalidParameterError, match="not a valid Hub repo id"):
        merge_args(project, "average").push_to_hub("not a repo!")
    assert list((tmp_path / "tmp").iterdir()) == []


def test_failed_push_to_hub_leaves_no_temporary_copy(project, fake_hub, tmp_path, monkeypatch):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    fake_hub.fail_commits(403)
    with pytest.raises(PushError, match="403") as info:
        merge_args(project, "average").push_to_hub("tester/denied", token=SECRET)
    assert list((tmp_path / "tmp").iterdir()) == [] and SECRET not in chain(info.value)
    assert "Nothing was kept locally" in str(info.value)


# ------------------------------------------------------------------------------------------- secrets in errors
@pytest.mark.parametrize("status", [400, 401, 403, 500])
def test_download_errors_name_the_status_and_never_the_token(project, fake_hub, status):
    fake_hub.add_repo("org/model", {"config.json": (project.base / "config.json").read_bytes()})
    fake_hub.echo_auth_errors("/api/models/org/model", status)
    with pytest.raises(CheckpointNotFoundError) as info:
        hf_mloss.merge("org/model", ["org/model"], "average", token=SECRET, progress=False)
    message = str(info.value)
    assert SECRET not in chain(info.value) and info.value.__cause__ is None
    if status in (400, 401, 403, 500):
        assert f"HTTP {status}" in message and "offline" not in message, message


@pytest.mark.parametrize("status", [401, 403, 500])
def test_push_errors_never_echo_the_token(project, fake_hub, capsys, status):
    folder = _saved(project)
    fake_hub.echo_auth_errors("/commit/", status)
    with pytest.raises(PushError) as info:
        _push(folder)
    assert f"HTTP {status}" in str(info.value) and SECRET not in chain(info.value)
    assert main(["push", str(folder), "tester/red-team", "-q"]) == 1
    assert SECRET not in capsys.readouterr().err


def test_token_never_reaches_saved_files_or_reprs(project, capsys):
    result = merge_args(project, "average", token=SECRET)
    folder = result.save_pretrained(project.root / "out")
    for path in folder.rglob("*"):
        if path.is_file():
            assert SECRET.encode() not in path.read_bytes(), path
    assert SECRET not in repr(result) + repr(result.config) + result.config.to_yaml()


# -------------------------------------------------------------------------------------- processes and signals
SAVE_FOREVER = textwrap.dedent("""
    import sys, hf_mloss
    base, ft, target = sys.argv[1:4]
    result = hf_mloss.merge(base, [ft], "average", progress=False)
    print("ready", flush=True)
    while True:
        result.save_pretrained(target, max_shard_size="4KB", overwrite=True)
""")


def test_a_sigterm_inside_a_held_section_is_raised_when_the_section_ends():
    """Whichever thread the kernel hands a SIGTERM to, Python runs the handler in the main thread: the hold lives
    there, so creating or removing a temporary folder is never cut in the middle (a per-thread mask was not enough:
    a signal delivered to a worker thread raised inside ``mkdtemp`` and left the folder behind)."""
    import threading

    from hf_mloss import saving

    steps, go = [], threading.Event()

    def worker():  # started before the section, so the signal mask of the section does not cover it
        go.wait()
        os.kill(os.getpid(), signal.SIGTERM)

    sender = threading.Thread(target=worker)
    sender.start()
    with pytest.raises(SystemExit) as caught, saving._sigterm_raises():
        with saving._sigterm_held():
            go.set()
            sender.join()
            for _ in range(1000):  # bytecodes run: the handler has had every chance to run here
                steps.append(1)
            with saving._sigterm_held():  # nested: only the outermost section's end raises
                steps.append(2)
            steps.append(3)
        steps.append(4)  # never reached
    assert caught.value.code == 128 + signal.SIGTERM and steps[-2:] == [2, 3] and 4 not in steps


SIGTERM_AS_TEMPORARY_APPEARS = textwrap.dedent("""
    import os, signal, sys, tempfile
    from hf_mloss import saving

    def signalled(create):
        def wrapped(*args, **kwargs):
            made = create(*args, **kwargs)
            os.kill(os.getpid(), signal.SIGTERM)  # delivered right after the folder or file exists
            return made
        return wrapped

    tempfile.mkdtemp, tempfile.mkstemp = signalled(tempfile.mkdtemp), signalled(tempfile.mkstemp)
    entry, folder = sys.argv[1], sys.argv[2]
    if entry == "write_file":
        saving.write_file(os.path.join(folder, "card.md"), "text")
    else:
        saving.check_output_dir(os.path.join(folder, "out"))
""")


@pytest.mark.parametrize("entry", ["check_output_dir", "write_file"])
def test_a_sigterm_while_a_temporary_is_created_leaves_none_behind(tmp_path, entry):
    """The writability probe and ``write_file``'s temporary sibling are created and removed under a held SIGTERM:
    the process exits with 143 and leaves nothing named ``.hf_mloss-tmp`` (the probe once stayed behind). Run in a
    child process: without the hold, the signal's default action would end the test run itself."""
    done = subprocess.run([sys.executable, "-c", SIGTERM_AS_TEMPORARY_APPEARS, entry, str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 128 + signal.SIGTERM, done.stderr
    assert [n.name for n in tmp_path.iterdir()] == []


@pytest.mark.slow
def test_sigterm_during_save_leaves_no_temporary_folder(project):
    target = project.root / "target"
    for delay in (0.05, 0.4):
        proc = subprocess.Popen([sys.executable, "-c", SAVE_FOREVER, str(project.base), str(project.models[0]),
                                 str(target)], stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(delay)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) != 0
        assert [n for n in os.listdir(project.root) if n.startswith(".hf_mloss-tmp")] == []
        if target.exists():
            assert (target / "hf_mloss_files.json").is_file()


KILLED_MID_OVERWRITE = textwrap.dedent("""
    import os, signal, sys
    import hf_mloss, hf_mloss.saving as saving
    base, ft, target, where = sys.argv[1:5]
    result = hf_mloss.merge(base, [ft], "average", progress=False)
    result.save_pretrained(target)
    (open(os.path.join(target, "first.txt"), "w").write("first"))
    saving.write_manifest(__import__("pathlib").Path(target))  # listed: the folder stays hf_mloss's own
    real_rename, real_exchange = os.rename, getattr(saving, "_exchange", None)

    def rename(src, dst):  # SIGKILL right after the old folder moved to its backup
        real_rename(src, dst)
        if "-old-" in os.path.basename(str(dst)):
            os.kill(os.getpid(), signal.SIGKILL)

    def exchange(first, second):  # SIGKILL right after the atomic swap
        done = real_exchange(first, second)
        os.kill(os.getpid(), signal.SIGKILL)

    if where == "backup":
        saving._exchange = lambda a, b: False  # a filesystem without RENAME_EXCHANGE
        os.rename = rename
    else:
        saving._exchange = exchange
    result.save_pretrained(target, overwrite=True)
""")


@pytest.mark.slow
@pytest.mark.parametrize("where", ["backup", "exchange"])
def test_kill_9_during_overwrite_keeps_the_previous_or_the_new_folder(project, where):
    """SIGKILL between moving the old folder away and renaming the new one in: the next save (or check) in the
    same parent restores the previous folder instead of deleting its backup as stale."""
    target = project.root / "out"
    proc = subprocess.run([sys.executable, "-c", KILLED_MID_OVERWRITE, str(project.base), str(project.models[0]),
                           str(target), where], capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    hf_mloss.saving.check_output_dir(project.root / "other")  # any later save or check in the same parent
    assert (target / "hf_mloss_files.json").is_file(), sorted(os.listdir(project.root))
    if where == "backup":
        assert (target / "first.txt").read_text() == "first"  # the previous merge is back, whole
    merge_args(project, "average").save_pretrained(project.root / "later")
    assert (target / "hf_mloss_files.json").is_file()
    assert [n for n in os.listdir(project.root) if n.startswith(".hf_mloss-tmp")] == []


def test_read_only_hub_cache_is_named_with_the_fix(project, monkeypatch):
    import errno

    import huggingface_hub

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system", "/shared/hf/hub/models--org--model")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", read_only)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", read_only)
    with pytest.raises(CheckpointNotFoundError) as info:
        hf_mloss.merge("org/model", ["org/other"], "average", progress=False)
    message = str(info.value)
    assert "not writable" in message and "HF_HOME" in message and "cache_dir=" in message, message
    with pytest.raises(CheckpointNotFoundError, match="HF_HOME"):
        hf_mloss.MergeConfig.from_pretrained("org/recipe")


@pytest.mark.parametrize("where, value", [("base", "{base}"), ("models", "../../../../etc"),
                                           ("data", {"path": "/"}), ("processor", "~/proc")])
def test_recipe_from_the_hub_names_only_hub_inputs(project, fake_hub, where, value):
    recipe = {"base": "org/base", "models": ["org/ft-a", "org/ft-b"], "method": "average"}
    value = value.format(base=project.base) if isinstance(value, str) else value
    recipe[where] = [value, "org/ft-b"] if where == "models" else value
    repo = f"stranger/recipe-{where}-{uuid.uuid4().hex[:8]}"  # the Hub cache outlives the fake Hub
    fake_hub.add_repo(repo, {"hf_mloss_config.yaml": yaml.safe_dump(recipe)})
    before = tree(project.root)
    with pytest.raises(ConfigError) as info:
        hf_mloss.MergeConfig.from_pretrained(repo)
    message = str(info.value)
    key = "models[0]" if where == "models" else where
    assert f"at {key} " in message and "allow_local_paths=True" in message, message
    assert tree(project.root) == before


def test_recipe_from_the_hub_with_local_paths_when_allowed(project, fake_hub):
    recipe = {"base": str(project.base), "models": [str(m) for m in project.models], "method": "average"}
    mine, theirs = (f"{owner}/recipe-{uuid.uuid4().hex[:8]}" for owner in ("me", "org"))
    fake_hub.add_repo(mine, {"hf_mloss_config.yaml": yaml.safe_dump(recipe)})
    config = hf_mloss.MergeConfig.from_pretrained(mine, allow_local_paths=True)
    assert config.base.model == str(project.base)
    hub_only = {"base": "org/base", "models": ["org/ft-a", "org/ft-b"], "method": "average"}
    fake_hub.add_repo(theirs, {"hf_mloss_config.yaml": yaml.safe_dump(hub_only)})
    assert hf_mloss.MergeConfig.from_pretrained(theirs).models[1].model == "org/ft-b"


def test_integer_image_column_of_a_hub_parquet_dataset_is_named(project, fake_hub, monkeypatch):
    import io

    import datasets
    import datasets.config

    monkeypatch.setattr(datasets.config, "SLEEP_TIME_ON_THREADS_SHUTDOWN", 0)
    buffer = io.BytesIO()
    datasets.Dataset.from_dict({"image": list(range(16)), "label": [i % 2 for i in range(16)]}).to_parquet(buffer)
    repo = f"org/integers-{uuid.uuid4().hex[:8]}"
    fake_hub.add_repo(repo, {"data/train-00000-of-00001.parquet": buffer.getvalue()}, repo_type="dataset")
    before = tree(project.root)
    with pytest.raises(DataError) as info:
        merge_args(project, "m_ties", data=repo, **IMAGES)
    assert "'image'" in str(info.value) and "image_column=" in str(info.value), str(info.value)
    assert tree(project.root) == before


def test_redaction_covers_token_shapes():
    from hf_mloss.errors import redact

    for text in [SECRET, f"HF_TOKEN={SECRET}", "token: 0123456789abcdef", "Authorization: Bearer abc.def-ghi",
                 "api_key='sk-0123456789abcdefghijklmn'"]:
        out = redact(f"got {text} here")
        assert "***" in out and "0123456789abcdef" not in out and SECRET not in out, out
    for text in ["tokenizer_source: union", "./hf_mloss_out", ".hf_mloss-tmp-12-old-ab", "max_tokens: 77"]:
        assert redact(text) == text


def test_json_report_write_failure_names_the_file(project, monkeypatch, capsys):
    import hf_mloss.saving as saving

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(saving.os, "fsync", full)
    path = write_config("score.yaml", SCORE_CONFIG)(project)
    assert main(["score", path, "--json", str(project.root / "r.json"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "r.json" in err and "No space left on device" in err and "nothing was written" in err, err
    assert not (project.root / "r.json").exists()
    assert [n for n in os.listdir(project.root) if n.startswith(".hf_mloss-tmp")] == []


PROMPT_SCRIPT = textwrap.dedent("""
    import sys
    from hf_mloss.cli import main
    sys.exit(main(sys.argv[1:]))
""")


@pytest.mark.slow
def test_answering_yes_to_a_prompt_never_runs_code(project):
    """Piping `yes` into the CLI: nothing may prompt, so nothing reads it and no code runs."""
    _custom_code_folder(project, project.models[0], "evil_yes")
    config = project.root / "yes.yaml"
    config.write_text(yaml.safe_dump({"base": "./base", "models": ["./evil_yes", "./ft1"], "method": "average"}))
    proc = subprocess.run([sys.executable, "-c", PROMPT_SCRIPT, "merge", str(config), str(project.root / "out"),
                           "--quiet"], input="yes\n" * 100, capture_output=True, text=True, cwd=project.root,
                          timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "trust_remote_code" not in proc.stdout + proc.stderr and "[y/N]" not in proc.stdout + proc.stderr
    no_marker(project)


def test_case_count():
    assert len(CASES) + len(PUSH_SETUPS) + 10 >= 80
    round_3 = GUARDED_WRITERS + NON_FINITE + SECRETS + MERGEKIT + KNOBS + WRAPPED
    assert len(round_3) >= 40 and len({c.id for c in CASES}) == len(CASES)
