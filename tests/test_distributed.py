"""Data-parallel scoring: 2 CPU processes (accelerate's debug_launcher) reduce to the 1-process result.

The launcher forks; forking a process whose OpenMP pool is already running can deadlock, so the 2-process run
happens in a fresh interpreter (``python -m hf_mloss.testing_dp``-style script below) started by the test.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

import hf_mloss

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


@pytest.mark.parametrize("prefix", ["base", "own"])
def test_two_processes_agree_with_one(tmp_path, tiny_paths, image_folder, prefix):
    from hf_mloss.data import load_pixel_values
    from hf_mloss.testing import tiny_processor

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
