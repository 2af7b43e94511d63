"""``hf-mloss``: merge / score / push / methods, in-process through ``main([...])`` and through the console script."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch
import yaml
from transformers import CLIPVisionModel

import hf_mloss
from hf_mloss.output import push as hub_push
from hf_mloss.cli import build_parser, main
from hf_mloss.methods import MERGE_METHODS, list_methods
from hf_mloss.spec.config import MERGE_CONFIG_NAME


def write_config(path: Path, **config) -> Path:
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


@pytest.fixture
def mties_config(tmp_path, tiny_paths, image_folder) -> Path:
    base, models = tiny_paths
    return write_config(tmp_path / "mties.yaml", base=base, models=models, method="m_ties",
                        parameters={"k": 0.3, "e": 0.1},
                        data={"path": str(image_folder), "num_samples": 8}, batch_size=4)


@pytest.fixture
def ties_config(tmp_path, tiny_paths) -> Path:
    base, models = tiny_paths
    return write_config(tmp_path / "ties.yaml", base=base, models=models[:2], method="ties", parameters={"k": 0.5})


@pytest.fixture
def fake_push(monkeypatch):
    """Record push_folder calls instead of uploading."""
    calls = []

    class Info:
        commit_url = "https://huggingface.co/org/repo/commit/0123"
        pr_url = None

    def push_folder(folder, repo_id, **kwargs):
        calls.append((Path(folder), repo_id, kwargs))
        return Info()

    monkeypatch.setattr(hub_push, "push_folder", push_folder)
    return calls


def console_script() -> str:
    for candidate in (Path(sysconfig.get_path("scripts")) / "hf-mloss", Path(sys.executable).parent / "hf-mloss"):
        if candidate.exists():
            return str(candidate)
    found = shutil.which("hf-mloss")
    if found is None:
        pytest.skip("the hf-mloss console script is not installed (pip install -e .)")
    return found


# ----------------------------------------------------------------------------------------------------- merge
def test_merge_m_ties_writes_a_loadable_folder(mties_config, tmp_path, capsys):
    out_dir = tmp_path / "merged"
    assert main(["merge", str(mties_config), str(out_dir), "--quiet"]) == 0
    captured = capsys.readouterr()
    model = CLIPVisionModel.from_pretrained(out_dir)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    for name in ("config.json", "model.safetensors", "preprocessor_config.json", "README.md", MERGE_CONFIG_NAME,
                 "mloss.json"):
        assert (out_dir / name).exists(), name
    assert "Merged 3 models with M-TIES (m_ties)" in captured.out
    assert "k=0.3" in captured.out and "ft0 (weight 0.3333)" in captured.out
    rows = [line for line in captured.out.splitlines() if line.startswith("encoder.layers.")]
    assert len(rows) == model.config.num_hidden_layers  # the M-Loss table, one row per scored layer
    assert f"Saved to {out_dir}" in captured.out
    assert "it/s" not in captured.err  # --quiet: no progress bars
    saved = yaml.safe_load((out_dir / MERGE_CONFIG_NAME).read_text())
    assert saved["method"] == "m_ties" and saved["parameters"]["k"] == 0.3 and saved["data"]["num_samples"] == 8


def test_merge_matches_the_python_api(ties_config, tiny_paths, tmp_path):
    assert main(["merge", str(ties_config), str(tmp_path / "cli"), "-q"]) == 0
    base, models = tiny_paths
    api = hf_mloss.merge(base, models[:2], "ties", k=0.5, progress=False).model.state_dict()
    cli = CLIPVisionModel.from_pretrained(tmp_path / "cli").state_dict()
    assert all(torch.equal(api[k], cli[k]) for k in api)


def test_merge_relative_paths_follow_the_config_file(tiny_models, tmp_path, monkeypatch, capsys):
    base, models = tiny_models
    config = write_config(tmp_path / "merge.yaml", base=os.path.relpath(base, tmp_path),
                          models=[os.path.relpath(m, tmp_path) for m in models[:2]], method="average")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert main(["merge", "../merge.yaml", "out", "--quiet"]) == 0, capsys.readouterr().err
    assert (elsewhere / "out" / "model.safetensors").exists()  # OUT_DIR follows the working directory
    assert config.exists()


def test_overwrite(ties_config, tmp_path, capsys, tiny_paths):
    out_dir = tmp_path / "merged"
    out_dir.mkdir()
    (out_dir / "keep.txt").write_text("old")
    assert main(["merge", str(ties_config), str(out_dir), "-q"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hf-mloss: error: Output folder") and "--overwrite" in err and "Traceback" not in err
    assert sorted(p.name for p in out_dir.iterdir()) == ["keep.txt"]  # untouched

    assert main(["merge", str(ties_config), str(out_dir), "-q", "--overwrite"]) == 2  # not a folder hf_mloss wrote
    assert "'keep.txt'" in capsys.readouterr().err
    assert sorted(p.name for p in out_dir.iterdir()) == ["keep.txt"]
    (out_dir / "keep.txt").unlink()
    assert main(["merge", str(ties_config), str(out_dir), "-q"]) == 0
    assert main(["merge", str(ties_config), str(out_dir), "-q", "--overwrite"]) == 0  # its own output: replaced
    assert (out_dir / "model.safetensors").exists()

    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["merge", str(ties_config), str(empty), "-q"]) == 0  # an empty folder is not "existing output"

    a_file = tmp_path / "file"
    a_file.write_text("x")
    assert main(["merge", str(ties_config), str(a_file), "-q"]) == 2
    assert a_file.read_text() == "x"


def test_existing_output_is_refused_before_merging(ties_config, tmp_path, monkeypatch):
    monkeypatch.setattr(hf_mloss, "merge", lambda *a, **k: pytest.fail("merged before checking OUT_DIR"))
    out_dir = tmp_path / "merged"
    out_dir.mkdir()
    (out_dir / "x").write_text("x")
    assert main(["merge", str(ties_config), str(out_dir)]) == 2


def test_private_without_a_push_is_refused_before_any_work(ties_config, tmp_path, capsys):
    assert main(["merge", str(ties_config), str(tmp_path / "merged"), "-q", "--private"]) == 2
    assert "--private makes the Hub repo private when one is created: it needs --push-to-hub" in capsys.readouterr().err
    assert not (tmp_path / "merged").exists()


def test_merge_push_to_hub(ties_config, tmp_path, fake_push, capsys):
    out_dir = tmp_path / "merged"
    assert main(["merge", str(ties_config), str(out_dir), "-q", "--push-to-hub", "org/repo", "--private"]) == 0
    assert fake_push == [(out_dir, "org/repo", {"private": True})]
    assert "Pushed to the Hub repo org/repo" in capsys.readouterr().out
    assert (out_dir / "model.safetensors").exists()


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--push-to-hub", "not a repo!"], "is not a valid Hub repo id"),
        (["--device", "toaster"], "device 'toaster' is not a torch device"),
        (["--device", "meta"], "device 'meta' cannot run a merge"),
    ]
    + ([(["--device", "cuda"], "CUDA device(s)")] if not torch.cuda.is_available() else []),
)
def test_bad_flags_fail_before_merging(ties_config, tmp_path, monkeypatch, capsys, flags, message):
    monkeypatch.setattr("hf_mloss.merging.driver.run_merge", lambda *a, **k: pytest.fail("merged despite a bad flag"))
    assert main(["merge", str(ties_config), str(tmp_path / "out"), *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hf-mloss: error:") and message in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_user_errors_from_the_api_are_one_paragraph(tmp_path, tiny_paths, capsys):
    base, models = tiny_paths
    config = write_config(tmp_path / "c.yaml", base=base, models=[models[0], "./missing-model"])
    with pytest.raises(hf_mloss.ConfigError):  # caught by the config already (a local folder that does not exist)
        hf_mloss.spec.config.MergeConfig.from_yaml(config)
    incompatible = tmp_path / "other"
    from examples.tiny import make_base, save_model

    save_model(make_base(1, hidden_size=48, intermediate_size=96), incompatible)
    config = write_config(tmp_path / "c.yaml", base=base, models=[str(incompatible)])
    capsys.readouterr()
    assert main(["merge", str(config), str(tmp_path / "out"), "-q"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hf-mloss: error: ") and "share one architecture" in err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_unexpected_errors_keep_their_traceback(ties_config, tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr("hf_mloss.merging.driver.run_merge", broken)
    with pytest.raises(RuntimeError, match="a bug"):
        main(["merge", str(ties_config), str(tmp_path / "out")])


# ----------------------------------------------------------------------------------------------------- score
def test_score_prints_one_row_per_layer_and_writes_json(tmp_path, tiny_paths, image_folder, capsys):
    base, models = tiny_paths
    config = write_config(tmp_path / "score.yaml", base=base, models=models, method="ties",
                          data={"path": str(image_folder), "num_samples": 8}, batch_size=4,
                          score={"prefix": "base", "reduction": "sq"})
    out = tmp_path / "reports" / "mloss.json"
    assert main(["score", str(config), "--json", str(out), "--per-row", "-q"]) == 0
    stdout = capsys.readouterr().out
    rows = [line for line in stdout.splitlines() if line.startswith("encoder.layers.")]
    assert [r.split()[0] for r in rows] == ["encoder.layers.0.mlp.fc1", "encoder.layers.1.mlp.fc1"]
    assert "prefix=base, reduction=sq" in stdout and "8 samples" in stdout
    report = json.loads(out.read_text())
    assert report["prefix"] == "base" and report["reduction"] == "sq" and report["num_samples"] == 8
    assert [r["layer"] for r in report["layers"]] == [r.split()[0] for r in rows]
    assert len(report["node"]["encoder.layers.0.mlp.fc1"]) == 64  # --per-row: one value per fc1 row


def test_score_defaults_and_merged_prefix(mties_config, tmp_path, capsys):
    assert main(["score", str(mties_config), "-q"]) == 0
    assert "prefix=own, reduction=abs" in capsys.readouterr().out  # no score section: hf_mloss.score defaults
    config = yaml.safe_load(mties_config.read_text())
    config["score"] = {"prefix": "merged"}
    merged = write_config(tmp_path / "merged.yaml", **config)
    assert main(["score", str(merged), "-q"]) == 0
    stdout = capsys.readouterr().out
    assert "prefix=merged" in stdout and "keep mean" in stdout  # the M-TIES merge of the config, k=0.3
    assert "0.300" in stdout


def test_score_without_data_fails_before_loading(ties_config, monkeypatch, capsys):
    monkeypatch.setattr(hf_mloss, "score", lambda *a, **k: pytest.fail("scored without data"))
    assert main(["score", str(ties_config)]) == 2
    err = capsys.readouterr().err
    assert "Scoring needs unlabeled data" in err and "data:" in err


# ------------------------------------------------------------------------------------------------------ push
def test_push_forwards_its_options(tmp_path, fake_push, capsys):
    folder = tmp_path / "merged"
    assert main(["push", str(folder), "org/repo", "--private", "--revision", "dev", "--create-pr",
                 "--commit-message", "hello", "-q"]) == 0
    assert fake_push == [(folder, "org/repo", {"private": True, "revision": "dev", "create_pr": True,
                                               "commit_message": "hello"})]
    assert "https://huggingface.co/org/repo/commit/0123" in capsys.readouterr().out
    assert main(["push", str(folder), "org/repo"]) == 0
    assert fake_push[-1][2] == {"private": None, "revision": None, "create_pr": False, "commit_message": None}


def test_push_failure_is_a_one_line_error(tmp_path, capsys):
    assert main(["push", str(tmp_path / "nothing"), "org/repo"]) == 1  # PushError: exit 1, no traceback
    err = capsys.readouterr().err
    assert err.startswith("hf-mloss: error: Cannot push") and "Traceback" not in err
    assert main(["push", str(tmp_path), "bad repo id!"]) == 2


# --------------------------------------------------------------------------------------------------- methods
def test_methods_lists_methods_parameters_and_defaults(capsys):
    assert main(["methods"]) == 0
    out = capsys.readouterr().out
    for name in list_methods():
        method = MERGE_METHODS[name]
        assert name in out and method.pretty_name in out and method.reference in out
    assert "k=0.2, scope='global', lam=1.0, convention='hf_mloss'" in out  # ties
    assert "M-TIES  [needs data]" in out


def test_methods_json(capsys):
    assert main(["methods", "--json"]) == 0
    entries = {e["name"]: e for e in json.loads(capsys.readouterr().out)}
    assert sorted(entries) == list_methods()
    assert entries["m_ties"]["needs_data"] is True and entries["m_ties"]["parameters"]["k"] == 0.2
    assert entries["task_arithmetic"]["parameters"] == {"lam": 0.3, "calibrate": None, "alpha": None}


# ------------------------------------------------------------------------------------------------------ misc
def test_usage_errors(capsys):
    assert main([]) == 2
    assert main(["merge"]) == 2  # argparse: missing arguments
    assert main(["frobnicate"]) == 2
    assert main(["--version"]) == 0
    assert hf_mloss.__version__ in capsys.readouterr().out


def test_every_command_has_help():
    parser = build_parser()
    for command in ("merge", "score", "push", "methods"):
        with pytest.raises(SystemExit) as info:
            parser.parse_args([command, "--help"])
        assert info.value.code == 0


@pytest.mark.slow
def test_console_script(tmp_path):
    """The installed `hf-mloss` entry point: a listing, and a user error without a traceback."""
    script = console_script()
    listing = subprocess.run([script, "methods"], check=False, capture_output=True, text=True, timeout=120)
    assert listing.returncode == 0, listing.stderr
    assert "m_ties" in listing.stdout and "M-TIES" in listing.stdout

    config = write_config(tmp_path / "bad.yaml", base="org/base", models=["org/a"], method="tiez")
    failed = subprocess.run([script, "merge", str(config), str(tmp_path / "out")], check=False, capture_output=True,
                            text=True, timeout=120)
    assert failed.returncode == 2
    assert failed.stderr.startswith("hf-mloss: error: Invalid config") and "Unknown merge method 'tiez'" in failed.stderr
    assert "Traceback" not in failed.stderr and failed.stderr.count("\n") == 1
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------------ file permissions
@pytest.mark.parametrize(("umask", "folder_mode", "file_mode"), [(0o022, 0o755, 0o644), (0o027, 0o750, 0o640),
                                                                  (0o077, 0o700, 0o600)])
def test_output_modes_follow_the_umask(ties_config, tmp_path, umask, folder_mode, file_mode):
    import stat

    previous = os.umask(umask)
    try:
        assert main(["merge", str(ties_config), str(tmp_path / "merged"), "--quiet"]) == 0
    finally:
        os.umask(previous)
    out = tmp_path / "merged"
    assert stat.S_IMODE(out.stat().st_mode) == folder_mode
    files = [p for p in out.rglob("*") if p.is_file()]
    assert "model.safetensors" in {p.name for p in files}
    assert {p.name: oct(stat.S_IMODE(p.stat().st_mode)) for p in files} == {p.name: oct(file_mode) for p in files}


def test_merge_summary_shows_schedules_as_given_and_counts_models(tmp_path, tiny_paths, capsys):
    """SLERP with a per-filter t: the printed summary gives the filter list (not the default t=0.5) and counts
    "1 model"."""
    base, models = tiny_paths
    config = write_config(tmp_path / "slerp.yaml", base=base, models=models[:1], method="slerp",
                          parameters={"t": [{"filter": "self_attn", "value": 0.2}, {"value": 0.7}]})
    assert main(["merge", str(config), str(tmp_path / "out")]) == 0
    printed = capsys.readouterr().out
    assert "Merged 1 model with SLERP (spherical linear interpolation) (slerp)" in printed
    assert "parameters: t='self_attn: 0.2; elsewhere: 0.7'" in printed and "t=0.5" not in printed
