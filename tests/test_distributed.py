"""Devices and processes: the default device, and jobs of 2 CPU processes (gloo) that score in parallel and write once.

Data-parallel scoring: 2 CPU processes (accelerate's debug_launcher) reduce to the 1-process result; ``torchrun``
jobs of ``hf-mloss merge`` / ``score --pairwise`` / ``merge --push-to-hub`` write one folder, one report, one commit.

The launcher forks; forking a process whose OpenMP pool is already running can deadlock, so the 2-process run
happens in a fresh interpreter (``python -m hf_mloss.testing_dp``-style script below) started by the test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import hf_mloss

sys.path.insert(0, os.path.dirname(__file__))
from fake_hub import fake_hub  # noqa: E402,F401  (fixture)

WORKER = textwrap.dedent(
    """
    import json, sys, torch
    from accelerate import PartialState, debug_launcher
    import hf_mloss

    base, models, data, out, prefix = json.loads(sys.argv[1])

    def worker():
        PartialState(cpu=True)  # the launcher's gloo group; hf_mloss then sees 2 processes through PartialState()
        report = hf_mloss.score(base, models, torch.load(data), prefix=prefix, batch_size=2, progress=False)
        state = PartialState()
        if state.is_main_process:
            torch.save({"node": report.node, "layer": report.layer, "positions": report.num_positions,
                        "processes": state.num_processes}, out)

    debug_launcher(worker, num_processes=2)
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("prefix", ["base", "own"])
def test_two_processes_agree_with_one(tmp_path, tiny_paths, image_folder, prefix):
    from hf_mloss.loading.data import load_pixel_values
    from examples.tiny import tiny_processor

    base, models = tiny_paths
    pixels, _ = load_pixel_values(str(image_folder), tiny_processor(), num_samples=10)
    torch.save(pixels, tmp_path / "pixels.pt")
    out = tmp_path / "dp.pt"
    args = json.dumps([base, models, str(tmp_path / "pixels.pt"), str(out), prefix])
    proc = subprocess.run([sys.executable, "-c", WORKER, args], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    single = hf_mloss.score(base, models, pixels, prefix=prefix, batch_size=2, progress=False)
    dp = torch.load(out)
    assert dp["processes"] == 2 and dp["positions"] == single.num_positions
    for name in single.layers:
        torch.testing.assert_close(dp["node"][name], single.node[name], rtol=1e-5, atol=1e-8)
        assert dp["layer"][name] == pytest.approx(single.layer[name], rel=1e-5)


# ------------------------------------------------------------------------------------------------ default device
@pytest.fixture
def single_process(monkeypatch):
    """No launcher around the test: a run is one process."""
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr("hf_mloss.distributed.distributed_state", lambda: None)


def mock_accelerators(monkeypatch, *, cuda: bool, mps: bool, count: int = 1) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count if cuda else 0)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: mps)


@pytest.mark.parametrize("device", [None, "auto", "AUTO"])
@pytest.mark.parametrize(("cuda", "mps", "expected"), [(False, False, "cpu"), (True, False, "cuda"),
                                                      (False, True, "mps"), (True, True, "cuda")])
def test_default_device_is_the_accelerator_when_present(monkeypatch, single_process, device, cuda, mps, expected):
    from hf_mloss.loading.inputs import resolve_device

    mock_accelerators(monkeypatch, cuda=cuda, mps=mps)
    assert resolve_device(device) == torch.device(expected)


def test_explicit_devices_are_checked_against_the_machine(monkeypatch, single_process):
    from hf_mloss.loading.inputs import resolve_device

    mock_accelerators(monkeypatch, cuda=False, mps=False)
    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(hf_mloss.InvalidParameterError, match=r"0 CUDA device\(s\); use 'auto', cpu\."):
        resolve_device("cuda")
    with pytest.raises(hf_mloss.InvalidParameterError, match="MPS is not available"):
        resolve_device("mps")
    with pytest.raises(hf_mloss.InvalidParameterError) as info:
        resolve_device("gpu0")
    assert str(info.value).endswith("'cpu', 'cuda', 'cuda:N' or 'mps'.")  # whole, not cut mid-word
    mock_accelerators(monkeypatch, cuda=True, mps=False, count=2)
    assert resolve_device("cuda:1") == torch.device("cuda:1")
    with pytest.raises(hf_mloss.InvalidParameterError, match="cuda:0..cuda:1"):
        resolve_device("cuda:2")


def test_under_a_launcher_each_process_gets_its_own_accelerator(monkeypatch):
    from hf_mloss.loading.inputs import resolve_device

    class State:
        device = torch.device("cuda:1")
        num_processes, is_main_process = 2, False

    mock_accelerators(monkeypatch, cuda=True, mps=False, count=2)
    monkeypatch.setattr("hf_mloss.distributed.distributed_state", lambda: State())
    assert resolve_device(None) == torch.device("cuda:1")
    assert resolve_device("cuda") == torch.device("cuda:1")  # not every process on cuda:0
    assert resolve_device("cuda:0") == torch.device("cuda:0")


def test_single_process_has_no_distributed_state(monkeypatch):
    from hf_mloss.distributed import distributed_state, is_main_process, main_process_only

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert distributed_state() is None and is_main_process()
    with main_process_only() as main:
        assert main


def test_the_device_is_recorded_in_the_result_and_the_card(monkeypatch, single_process, tiny_paths, tmp_path):
    mock_accelerators(monkeypatch, cuda=False, mps=False)
    base, models = tiny_paths
    result = hf_mloss.merge(base, models[:2], "ties", k=0.5, device="auto", progress=False)
    assert result.device == "cpu"
    folder = result.save_pretrained(tmp_path / "merged")
    card = (folder / "README.md").read_text()
    assert "Computed on `cpu`." in card
    assert "`seed`" not in card  # TIES is deterministic: no seed to list


def test_cli_help_names_the_default_device(capsys):
    from hf_mloss.cli import main

    assert main(["merge", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "auto (default: the accelerator when present" in text and "cpu (default)" not in text


# ------------------------------------------------------------------------------------------ two-process CLI jobs
def torchrun(args: list[str], *, env: dict[str, str] | None = None, cwd=None) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc_per_node 2 -m hf_mloss.cli ARGS`` on CPU (gloo)."""
    full_env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "HF_MLOSS_THREADS": "1",
                **(env or {})}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               "-m", "hf_mloss.cli", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=600, env=full_env, cwd=cwd)


def two_process_config(tmp_path, tiny_paths, image_folder, method: str, **parameters):
    import yaml

    base, models = tiny_paths
    config = {"base": base, "models": models, "method": method, "parameters": parameters}
    if method.startswith("m_") or method.startswith("regmean"):
        config.update(data={"path": str(image_folder), "num_samples": 8}, batch_size=2)
    path = tmp_path / f"{method}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ties", "m_ties"])
def test_torchrun_merge_writes_one_folder(tmp_path, tiny_paths, image_folder, method):
    from transformers import CLIPVisionModel

    config = two_process_config(tmp_path, tiny_paths, image_folder, method, k=0.5)
    out = tmp_path / "merged"
    proc = torchrun(["merge", str(config), str(out)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("Saved to") == 1, proc.stdout  # one summary per job
    assert "already exists" not in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".hf_mloss-tmp")) == []
    single = hf_mloss.run(hf_mloss.MergeConfig.from_yaml(config), device="cpu", progress=False)
    merged = CLIPVisionModel.from_pretrained(out)
    for name, tensor in single.model.state_dict().items():
        torch.testing.assert_close(merged.state_dict()[name], tensor, rtol=1e-5, atol=1e-6)
    if method == "m_ties":  # the scoring was split across the 2 processes and reduced: the 1-process report
        saved = json.loads((out / "mloss.json").read_text())
        assert saved["num_positions"] == single.report.num_positions
        for row, name in zip(saved["layers"], single.report.layers):
            assert row["mloss"] == pytest.approx(single.report.layer[name], rel=1e-5)


def _two_processes_equal_one(config, out):
    """Merge ``config`` under torchrun into ``out`` and in one process; every tensor within 1e-6 (relative). Returns
    the single process's result."""
    proc = torchrun(["merge", str(config), str(out), "-q"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    from transformers import CLIPVisionModel

    single = hf_mloss.run(hf_mloss.MergeConfig.from_yaml(config), device="cpu", progress=False)
    merged = CLIPVisionModel.from_pretrained(out).state_dict()
    for name, tensor in single.model.state_dict().items():
        error = float((merged[name] - tensor).norm() / tensor.norm().clamp_min(1e-30))
        assert error < 1e-6, (name, error)
    return single


@pytest.mark.slow
@pytest.mark.parametrize("method", ["regmean", "regmean_plusplus"])
def test_torchrun_regmean_sums_the_processes_grams(tmp_path, tiny_paths, image_folder, method, monkeypatch):
    """Each process walks its share of the images; the Gram sums, reduced before the solve, give the single
    process's merge within 1e-6 (both on one thread: the forwards round alike)."""
    monkeypatch.setenv("HF_MLOSS_THREADS", "1")
    config = two_process_config(tmp_path, tiny_paths, image_folder, method)
    _two_processes_equal_one(config, tmp_path / "merged")


@pytest.mark.slow
@pytest.mark.parametrize("method", ["regmean", "regmean_plusplus", "auto"])
def test_torchrun_walks_each_processs_share_of_every_models_own_data(tmp_path, tiny_paths, method, monkeypatch):
    """Each model's own images (5, 3 and 7: shares of unequal sizes); each process walks its share of every model's
    data, the positions of each model summed over the processes before its Grams are folded: the single process's
    merge within 1e-6. ``auto``: RegMean++ cross-fitted on the two halves of the data, chosen, fitted on all."""
    import yaml

    from examples.tiny import make_image_folder

    monkeypatch.setenv("HF_MLOSS_THREADS", "1")
    base, models = tiny_paths
    entries = [{"model": m, "data": {"path": str(make_image_folder(tmp_path / f"data{i}", n=n, seed=i))}}
               for i, (m, n) in enumerate(zip(models, (5, 3, 7)))]
    config = tmp_path / f"{method}.yaml"
    extra = {"parameters": {"candidates": {"tsv_m": {"lam": [1.0]}, "regmean_plusplus": {"lam": [1.0, 1.5]}}}} \
        if method == "auto" else {}
    config.write_text(yaml.safe_dump({"base": base, "models": entries, "method": method, "batch_size": 2, **extra},
                                     sort_keys=False))
    out = tmp_path / "merged"
    single = _two_processes_equal_one(config, out)
    if method == "auto":
        assert single.config.parameters["fitted"] == 3 + 2 + 4  # the larger half of 5, 3, 7 (the other: 2 + 1 + 3)
        assert single.config.parameters["cross_fitted"] is True
        assert hf_mloss.MergeConfig.from_pretrained(out).parameters["chosen"] == single.config.parameters["chosen"]
    recorded = hf_mloss.MergeConfig.from_pretrained(out)
    assert [m.data.fingerprint for m in recorded.models] == [m.data.fingerprint for m in single.config.models]


@pytest.mark.slow
def test_torchrun_score_pairwise_writes_once(tmp_path, tiny_paths, image_folder):
    config = two_process_config(tmp_path, tiny_paths, image_folder, "m_ties", k=0.5)
    out = tmp_path / "compat"
    proc = torchrun(["score", str(config), "--pairwise", "--no-baselines", "--out", str(out), "--quiet"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("Wrote ") == 1, proc.stdout
    assert (out / "compatibility.json").is_file()
    from hf_mloss.engine.compatibility import run_compatibility

    single = run_compatibility(hf_mloss.MergeConfig.from_yaml(config), baselines=False, device="cpu", progress=False)
    written, expected = json.loads((out / "compatibility.json").read_text()), json.loads(single.to_json())
    written.pop("timings"), expected.pop("timings")
    assert _close_json(written, expected)


def _close_json(a, b, where: str = "") -> bool:
    """Same JSON up to float rounding (the sums are reduced in another order); fails naming the first difference."""
    if isinstance(a, dict) and isinstance(b, dict):
        assert a.keys() == b.keys(), where
        return all(_close_json(a[k], b[k], f"{where}.{k}") for k in a)
    if isinstance(a, list) and isinstance(b, list):
        assert len(a) == len(b), where
        return all(_close_json(x, y, f"{where}[{i}]") for i, (x, y) in enumerate(zip(a, b)))
    if isinstance(a, float) and isinstance(b, float):
        assert a == pytest.approx(b, rel=1e-5, abs=1e-9), where
        return True
    assert a == b, where
    return True


@pytest.mark.slow
def test_torchrun_merge_push_to_hub_makes_one_commit(tmp_path, tiny_paths, image_folder, fake_hub):
    config = two_process_config(tmp_path, tiny_paths, image_folder, "ties", k=0.5)
    env = {"HF_ENDPOINT": fake_hub.url, "HF_HUB_OFFLINE": "0", "HF_TOKEN": "hf_test_token"}
    proc = torchrun(["merge", str(config), str(tmp_path / "merged"), "--push-to-hub", "tester/merged", "-q"], env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(fake_hub.commits) == 1, fake_hub.commits
    assert "model.safetensors" in fake_hub.commits[0].files
    assert proc.stdout.count("Pushed to the Hub repo tester/merged") == 1


@pytest.mark.slow
def test_torchrun_learned_merge_splits_each_batch_and_learns_the_single_process_values(tmp_path, tiny_paths,
                                                                                      image_folder):
    """Each process trains on its rows of every batch; the gradients, weighted by rows and summed across the
    processes, are the single process's (the mloss objective is a mean over equally many positions per sample).
    ``adarank_tsv`` trains through the same loop (one launch here: each costs ~25 s on 2 cores)."""
    import yaml

    base, models = tiny_paths
    method, parameters = "adamerging", {"objective": "mloss", "steps": 3, "lr": 0.05, "max_samples": 8}
    config = tmp_path / f"{method}.yaml"
    config.write_text(yaml.safe_dump({"base": base, "models": models, "method": method, "parameters": parameters,
                                      "data": {"path": str(image_folder), "num_samples": 8}, "batch_size": 4},
                                     sort_keys=False))
    out = tmp_path / "merged"
    proc = torchrun(["merge", str(config), str(out)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("Saved to") == 1, proc.stdout
    single = hf_mloss.run(hf_mloss.MergeConfig.from_yaml(config), device="cpu", progress=False)
    recorded = hf_mloss.MergeConfig.from_pretrained(out).parameters
    card = (out / "README.md").read_text()
    assert "each step's batch split over 2 processes" in card
    trace = single.method_description.split("learned on unlabeled data: ")[1].split(";")[0]
    assert trace in card  # the same objective values, first and last step (4 significant digits)
    theirs = {row[0]: row[1:] for row in single.config.parameters["coefficients"]}
    assert any(abs(v - 0.3) > 1e-3 for row in theirs.values() for v in row)  # training moved them
    for row in recorded["coefficients"]:  # moved by up to lr·steps = 0.15; float32 rounding, amplified by Adam
        assert row[1:] == pytest.approx(theirs[row[0]], abs=5e-5), row[0]
    from transformers import CLIPVisionModel

    merged = CLIPVisionModel.from_pretrained(out)
    for name, tensor in single.model.state_dict().items():
        torch.testing.assert_close(merged.state_dict()[name], tensor, rtol=1e-5, atol=1e-6)
