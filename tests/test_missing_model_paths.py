"""A mistyped local model folder is named as one at once: neither a folder nor a (cached) Hub id, which it looked
like, no device line and no Hub call before it (issue 56, item 3)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import hf_mloss
from hf_mloss.cli import main
from hf_mloss.loading.hub import missing_model, resolve_model


@pytest.fixture
def project(tmp_path, monkeypatch) -> Path:
    """A working folder laid out as the README's quick start leaves it: tiny_models/{base,ft0,ft1}."""
    for name in ("base", "ft0", "ft1"):
        (tmp_path / "tiny_models" / name).mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture
def no_hub(mocker):
    import huggingface_hub

    return mocker.spy(huggingface_hub, "snapshot_download")


def test_a_typo_under_a_local_folder_is_named_as_a_local_path(project, no_hub, capsys):
    with pytest.raises(hf_mloss.CheckpointNotFoundError) as info:
        hf_mloss.merge("tiny_models/base", ["tiny_models/nope", "tiny_models/ft1"], "ties", progress=False)
    message = str(info.value)
    assert message.startswith("models[0]: 'tiny_models/nope' is neither a folder nor a cached Hub id")
    assert "it reads as a local path ('tiny_models' is a folder here)" in message
    assert str(project / "tiny_models" / "nope") in message
    assert "config" not in message and "cannot be reached" not in message
    assert isinstance(info.value, FileNotFoundError)
    assert no_hub.call_count == 0 and capsys.readouterr().out == ""


def test_a_path_written_as_one_is_not_called_a_hub_id_nor_a_config_entry(project, no_hub):
    with pytest.raises(hf_mloss.CheckpointNotFoundError) as info:
        hf_mloss.merge("./nope", ["tiny_models/ft0", "tiny_models/ft1"], "ties", progress=False)
    message = str(info.value)
    assert message == (f"base: './nope' is neither a folder nor a Hub id: it is written as a local path, and "
                       f"{project / 'nope'} does not exist. Check the path.")
    with pytest.raises(hf_mloss.CheckpointNotFoundError, match="is not spelled like one"):
        hf_mloss.merge("tiny_models/ft0/extra", ["tiny_models/ft0"], "ties", progress=False)
    assert no_hub.call_count == 0


def test_close_names_are_suggested_and_files_are_named_as_files(project):
    assert "does not exist. Did you mean 'tiny_models/base'? Check the path" in missing_model("tiny_models/bsae")
    assert "Did you mean './tiny_models'?" in missing_model("./tiny_model")
    (project / "weights.safetensors").write_bytes(b"")
    assert "is a file, not a model folder" in missing_model("./weights.safetensors")
    assert missing_model("tiny_models/ft0") is None


def test_a_cached_hub_id_of_the_same_spelling_stays_a_hub_id(project, monkeypatch):
    from huggingface_hub import constants

    cache = project / "hub"
    (cache / "models--tiny_models--nope" / "snapshots").mkdir(parents=True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    assert missing_model("tiny_models/nope") is None
    assert missing_model("org/name") is None  # no local folder 'org': a Hub id, asked of the Hub as before


def test_a_hub_id_that_is_not_cached_says_it_is_no_local_folder_either(project):
    with pytest.raises(hf_mloss.CheckpointNotFoundError) as info:
        resolve_model("org/not-cached")
    assert "not in the local Hub cache" in str(info.value) and "nor is it a local folder here" in str(info.value)


def test_cli_prints_one_line_and_no_device_line(project, capsys):
    config = project / "merge.yaml"
    config.write_text(yaml.safe_dump({"base": "tiny_models/base", "models": ["tiny_models/nope", "tiny_models/ft1"],
                                      "method": "ties"}))
    assert main(["merge", str(config), "merged-cli"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""  # no "Computing on ..." before the error
    assert captured.err.count("\n") == 1 and captured.err.startswith("hf-mloss: error: Invalid config ")
    assert "models[0]: 'tiny_models/nope' is neither a folder nor a cached Hub id" in captured.err
    assert f"Relative paths in this config resolve against its folder, {str(project)!r}." in captured.err
    assert not (project / "merged-cli").exists()


def test_an_absolute_path_in_a_config_is_not_explained_as_relative(project, capsys):
    config = project / "merge.yaml"
    config.write_text(yaml.safe_dump({"base": str(project / "tiny_models" / "base"),
                                      "models": [str(project / "gone"), "tiny_models/ft1"]}))
    assert main(["merge", str(config), "merged-cli"]) == 2
    err = capsys.readouterr().err
    assert "it is written as a local path" in err and "Relative paths" not in err


@pytest.mark.slow  # another process
def test_cli_refuses_before_importing_torch(project):
    """The check is fast: it runs before torch, transformers and the device are touched."""
    (project / "merge.yaml").write_text("base: tiny_models/base\nmodels: [tiny_models/nope, tiny_models/ft1]\n")
    code = ("import sys; from hf_mloss.cli import main; rc = main(['merge', 'merge.yaml', 'out']); "
            "print(rc, 'torch' in sys.modules, 'transformers' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=project)
    assert done.stdout == "2 False False\n", done.stdout + done.stderr
    assert done.stderr.startswith("hf-mloss: error:") and done.stderr.count("\n") == 1


def test_a_typo_in_the_parent_folder_gets_a_did_you_mean_before_any_work(project, no_hub, capsys):
    """``tiny_model/ft1`` beside ``tiny_models/ft1`` (a model folder) reads as a Hub id by its spelling; with no such
    model in the Hub cache it is named as a mistyped path with the folder meant, before the device line (issue 74)."""
    for name in ("base", "ft0", "ft1"):
        (project / "tiny_models" / name / "config.json").write_text("{}")
    with pytest.raises(hf_mloss.CheckpointNotFoundError) as info:
        hf_mloss.merge("tiny_models/base", ["tiny_models/ft0", "tiny_model/ft1"], "ties", progress=False)
    message = str(info.value)
    assert message.startswith("models[1]: 'tiny_model/ft1' is neither a folder nor a cached Hub id: it reads as a "
                              "mistyped local path ('tiny_model' is not a folder here, 'tiny_models/ft1' is). "
                              "Did you mean 'tiny_models/ft1'?")
    assert "hf download tiny_model/ft1" in message
    assert "Did you mean 'tiny_models/ft1'?" in missing_model("tiny_model/ftl")  # both parts mistyped
    assert no_hub.call_count == 0 and capsys.readouterr().out == ""
    config = project / "merge.yaml"
    config.write_text(yaml.safe_dump({"base": "tiny_model/base", "models": ["tiny_models/ft0", "tiny_models/ft1"]}))
    assert main(["merge", str(config), "merged-cli"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "Did you mean 'tiny_models/base'?" in captured.err  # no "Computing on" first
    # a folder of that name that is no model, or a Hub id with no folder like it, stays a Hub id as before
    (project / "tiny_models" / "notes").mkdir()
    assert missing_model("tiny_model/notes") is None and missing_model("org/ft1") is None
