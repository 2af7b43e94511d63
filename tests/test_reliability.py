"""Bad inputs and faults: clear errors before any work, no half-written folders, mixed dtypes handled."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from PIL import Image

import hf_mloss
from hf_mloss.loading.data import load_pixel_values
from examples.tiny import make_base, make_finetune, save_model, tiny_processor


def test_empty_and_too_small_data(tmp_path, tiny_paths):
    base, models = tiny_paths
    empty = tmp_path / "empty" / "train" / "x"
    empty.mkdir(parents=True)
    with pytest.raises(hf_mloss.DataError):
        hf_mloss.merge(base, models, "m_ties", data=str(tmp_path / "empty"), progress=False)
    with pytest.raises(hf_mloss.DataError, match="does not exist"):
        hf_mloss.merge(base, models, "m_ties", data=str(tmp_path / "nowhere") + "/", progress=False)
    with pytest.raises(hf_mloss.DataError, match="empty"):
        hf_mloss.merge(base, models, "m_ties", data=[], progress=False)
    with pytest.raises(hf_mloss.DataError, match="num_samples"):
        hf_mloss.merge(base, models, "m_ties", data=[Image.new("RGB", (8, 8))], num_samples=0, progress=False)
    with pytest.raises(hf_mloss.DataError, match="data-guided"):
        hf_mloss.merge(base, models, "m_ties", progress=False)


def test_undecodable_images_are_skipped_and_counted(tmp_path):
    good = [Image.new("RGB", (40, 40), (i * 20, 0, 0)) for i in range(3)]
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"not an image at all")
    pixels, info = load_pixel_values([good[0], str(bad), good[1], good[2]], tiny_processor(), num_samples=10)
    assert pixels.shape == (3, 3, 32, 32) and info.skipped == 1
    with pytest.raises(hf_mloss.DataError, match="1 undecodable skipped"):
        load_pixel_values([str(bad), good[0]], tiny_processor(), num_samples=10, min_samples=2)


@pytest.mark.parametrize("mode,size", [("L", (40, 40)), ("RGBA", (40, 40)), ("P", (40, 40)), ("I;16", (40, 40)),
                                       ("RGB", (1, 1)), ("RGB", (3000, 17)), ("CMYK", (33, 50))])
def test_any_image_mode_or_size_becomes_rgb_pixels(mode, size):
    image = Image.new(mode, size)
    pixels, info = load_pixel_values([image], tiny_processor(), num_samples=1)
    assert pixels.shape == (1, 3, 32, 32) and torch.isfinite(pixels).all() and info.skipped == 0


def test_image_column_is_found_or_named(tmp_path):
    import datasets

    images = [Image.new("RGB", (20, 20), (0, i * 40, 0)) for i in range(4)]
    ds = datasets.Dataset.from_dict({"picture_data": images, "label": [0, 1, 0, 1]}).cast_column(
        "picture_data", datasets.Image())
    pixels, info = load_pixel_values(ds, tiny_processor(), num_samples=4)
    assert info.image_column == "picture_data" and len(pixels) == 4
    plain = datasets.Dataset.from_dict({"text": ["a", "b"]})
    with pytest.raises(hf_mloss.DataError, match="image_column"):
        load_pixel_values(plain, tiny_processor(), num_samples=2)


def test_mixed_dtypes_compute_in_fp32_and_save_in_base_dtype(tmp_path):
    base = make_base(0)
    base_dir = save_model(base.to(torch.float16), tmp_path / "base16")
    ft_bf16 = save_model(make_finetune(make_base(0), 1).to(torch.bfloat16), tmp_path / "ft_bf16")
    ft_fp32 = save_model(make_finetune(make_base(0), 2), tmp_path / "ft_fp32")
    result = hf_mloss.merge(str(base_dir), [str(ft_bf16), str(ft_fp32)], "task_arithmetic", lam=0.5, progress=False)
    assert result.model.dtype == torch.float16 and result.config.dtype is None  # default: the base's dtype
    explicit = hf_mloss.merge(str(base_dir), [str(ft_bf16), str(ft_fp32)], "task_arithmetic", lam=0.5,
                              dtype="float32", progress=False)
    assert explicit.model.dtype == torch.float32
    torch.testing.assert_close(explicit.model.state_dict()["post_layernorm.weight"].half(),
                               result.model.state_dict()["post_layernorm.weight"])


def test_bad_dtype_and_batch_size(tiny_paths, image_folder):
    base, models = tiny_paths
    with pytest.raises(hf_mloss.InvalidParameterError, match="dtype must be one of"):
        hf_mloss.merge(base, models, "ties", dtype="float8", progress=False)
    with pytest.raises(hf_mloss.InvalidParameterError, match="batch_size"):
        hf_mloss.merge(base, models, "m_ties", data=str(image_folder), batch_size=0, progress=False)
    with pytest.raises(hf_mloss.InvalidParameterError, match="layers names block 5.*valid: 0..1"):
        hf_mloss.merge(base, models, "m_ties", data=str(image_folder), layers=[5], progress=False)


KILL_WRITER = textwrap.dedent(
    """
    import sys, hf_mloss
    base, ft, target = sys.argv[1:4]
    result = hf_mloss.merge(base, [ft], "average", progress=False)
    print("ready", flush=True)
    while True:  # keep rewriting: the parent kills us at a random moment
        result.save_pretrained(target, max_shard_size="4KB", overwrite=True)
    """
)


@pytest.mark.slow
def test_kill_9_mid_write_leaves_no_or_a_complete_folder(tmp_path, tiny_paths):
    from transformers import CLIPVisionModel

    base, models = tiny_paths
    target = tmp_path / "target"
    for delay in (0.05, 0.3, 0.9):
        proc = subprocess.Popen([sys.executable, "-c", KILL_WRITER, base, models[0], str(target)],
                                stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(delay)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        if target.exists():  # complete, loadable, with its card and merge config
            assert (target / "README.md").exists() and (target / "hf_mloss_config.yaml").exists()
            CLIPVisionModel.from_pretrained(target)
        leftovers = [p for p in tmp_path.iterdir() if p.name != "target"]
        for p in leftovers:  # interrupted temporaries are hidden siblings, never the target itself
            assert p.name.startswith(".hf_mloss-tmp-")
    # the next save into the same folder removes what a killed process left behind
    hf_mloss.merge(base, [models[0]], "average", progress=False).save_pretrained(tmp_path / "again")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["again"] + (["target"] if target.exists() else []))


def test_ctrl_c_during_scoring_exits_cleanly(tmp_path, tiny_paths, image_folder, monkeypatch, capsys):
    import yaml

    from hf_mloss import cli
    from hf_mloss.engine import score as scoring

    base, models = tiny_paths
    config = tmp_path / "merge.yaml"
    config.write_text(yaml.safe_dump({"base": base, "models": models, "method": "m_ties",
                                      "data": {"path": str(image_folder), "num_samples": 8}}))

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(scoring.MLossAccumulator, "add_sums", interrupted)  # both prefixes' fused kernels
    assert cli.main(["merge", str(config), str(tmp_path / "out"), "--quiet"]) == 130
    err = capsys.readouterr().err
    assert "interrupted" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["merge.yaml"]


# ------------------------------------------------------------------------------------------------- output guard
def test_write_file_is_atomic_refuses_links_and_replaces_only_with_overwrite(tmp_path):
    from hf_mloss.errors import OutputExistsError
    from hf_mloss.saving import write_file

    target = tmp_path / "report.json"
    assert write_file(target, "one") == target and target.read_text() == "one"
    with pytest.raises(OutputExistsError, match="overwrite=True"):
        write_file(target, "two")
    assert target.read_text() == "one"
    write_file(target, b"two", overwrite=True)
    assert target.read_text() == "two"
    (tmp_path / "victim").write_text("keep")
    (tmp_path / "link.json").symlink_to(tmp_path / "victim")
    for overwrite in (False, True):
        with pytest.raises(hf_mloss.InvalidParameterError, match="symbolic link"):
            write_file(tmp_path / "link.json", "x", overwrite=overwrite)
    with pytest.raises(hf_mloss.InvalidParameterError, match="overlaps an input"):
        write_file(tmp_path / "inputs" / "a.json", "x", protected=[tmp_path / "inputs"])
    with pytest.raises(hf_mloss.InvalidParameterError, match="not a regular file"):
        write_file("/dev/null", "x", overwrite=True)
    assert (tmp_path / "victim").read_text() == "keep"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.json", "report.json", "victim"]


def test_a_backup_left_by_a_killed_save_is_restored_not_deleted(tmp_path):
    from hf_mloss.saving import RECORD_SUFFIX, TMP_PREFIX, remove_stale_temporaries

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    backup = tmp_path / f"{TMP_PREFIX}{dead}-old-abc"
    backup.mkdir()
    (backup / "model.safetensors").write_text("previous")
    (tmp_path / (backup.name + RECORD_SUFFIX)).write_text("merged")
    remove_stale_temporaries(tmp_path)  # what the next save into this folder does first
    assert (tmp_path / "merged" / "model.safetensors").read_text() == "previous"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["merged"]
    backup.mkdir()  # the target is present: the backup is the stale one
    (tmp_path / (backup.name + RECORD_SUFFIX)).write_text("merged")
    remove_stale_temporaries(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["merged"]


@pytest.mark.parametrize("value, expected", [("2", "ok"), (" 1 ", "ok"), ("100000", "clamped"), ("²", "error"),
                                             ("0", "error"), ("-3", "error"), ("1.5", "error"), ("four", "error"),
                                             ("", "unset")])
def test_thread_env_parsed_strictly_and_clamped(monkeypatch, value, expected):
    from hf_mloss.parallel import env_threads, machine_cores

    monkeypatch.setenv("HF_MLOSS_THREADS", value)
    if expected == "error":
        with pytest.raises(hf_mloss.InvalidParameterError, match="HF_MLOSS_THREADS"):
            env_threads()
        return
    got = env_threads()
    if expected == "unset":
        assert got is None
    elif expected == "clamped":
        assert got == machine_cores() <= (os.cpu_count() or 1)
    else:
        assert got == min(int(value), machine_cores())


def test_non_finite_compatibility_values_are_refused_naming_the_subset(tiny_paths, image_folder, monkeypatch):
    import hf_mloss.engine.compatibility as compat

    real = compat.subset_mloss

    def overflowing(*args, **kwargs):
        scores = real(*args, **kwargs)
        scores[scores["metrics"][0]][1] = float("nan")  # the second subset overflows
        return scores

    monkeypatch.setattr(compat, "subset_mloss", overflowing)
    base, models = tiny_paths
    with pytest.raises(hf_mloss.InvalidParameterError, match=r"not finite \(weights") as info:
        hf_mloss.compatibility(base, models, str(image_folder), num_samples=4, batch_size=4, progress=False)
    assert "of subset [" in str(info.value)


def test_reports_with_nan_are_never_written(tmp_path):
    from hf_mloss.output.report import MLossReport

    report = MLossReport(node={"l": torch.ones(2)}, node_normalized={"l": torch.ones(2)}, layer={"l": float("nan")},
                         layer_normalized={"l": 1.0}, prefix="own", reduction="abs", activation="gelu", eps=1e-4,
                         num_samples=1, num_positions=1)
    with pytest.raises(hf_mloss.InvalidParameterError, match="NaN or infinite"):
        report.to_json(tmp_path / "r.json")
    with pytest.raises(hf_mloss.InvalidParameterError, match="NaN or infinite"):
        report.save(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_written_files_follow_the_umask(tmp_path):
    """Report files (``--json``, ``to_json``) get the modes a plain ``open`` would give, not ``mkstemp``'s 0600."""
    import os

    from hf_mloss.saving import write_file

    old = os.umask(0o022)
    try:
        path = write_file(tmp_path / "report.json", "{}\n")
    finally:
        os.umask(old)
    assert path.stat().st_mode & 0o777 == 0o644
