"""The merge-speed benchmark's pieces that decide its numbers: the scoring floor's share of a block, the
checkpoints of the large shapes written tensor by tensor, and the wall budget that bounds a run to a fixed time slot."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import merge_speed
from merge_speed import write_safetensors_streamed
from merge_speed_report import scored_share


def _payload(kind: str, **config) -> dict:
    return {"inputs": {"kind": kind}, "models": {"config": config}}


def test_scored_share_is_one_third_for_clip_and_gate_plus_up_for_a_gated_decoder() -> None:
    """CLIP (f = 4d): fc1 is d·f of a block's 4d² + 2df = 1/3. Qwen2.5-0.5B: gate and up, 2·d·f, over the block's
    attention projections d·(2d + 2·kv·h) plus its three MLP matrices 3·d·f."""
    assert scored_share(_payload("clip_vision", hidden_size=768, intermediate_size=3072)) == pytest.approx(1 / 3)
    d, f = 896, 4864
    qwen = _payload("decoder", hidden_size=d, intermediate_size=f, num_attention_heads=14, num_key_value_heads=2)
    assert scored_share(qwen) == pytest.approx(2 * d * f / (d * (2 * d + 2 * 2 * 64) + 3 * d * f))
    assert scored_share(qwen) == pytest.approx(0.5846, abs=1e-4)


def test_streamed_safetensors_file_reads_back_as_written(tmp_path) -> None:
    """Header first, then each tensor's bytes as produced: safetensors reads the same tensors, dtypes and shapes."""
    tensors = {"a": torch.randn(3, 5).to(torch.bfloat16), "b.bias": torch.randn(7), "c": torch.randn(2, 2).half()}
    entries = [(name, tuple(t.shape), t.dtype) for name, t in tensors.items()]
    write_safetensors_streamed(tmp_path / "model.safetensors", entries, lambda name: tensors[name].clone())
    back = load_file(tmp_path / "model.safetensors")
    assert set(back) == set(tensors)
    for name, tensor in tensors.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor)
    with pytest.raises(ValueError, match="expected"):
        write_safetensors_streamed(tmp_path / "bad.safetensors", [("a", (4, 5), torch.float32)],
                                   lambda name: torch.zeros(3, 5))


def test_budget_cuts_timeouts_and_skips_runs_once_spent(tmp_path, monkeypatch) -> None:
    """``--budget``: each run's timeout is what is left of it; once spent, the remaining runs are recorded as not
    started (so the results are still written) instead of being run or lost."""
    args = merge_speed.parse_args(["--shape", "tiny", "--skip-peers", "--methods", "read,ties_tensor,m_ties",
                                   "--timeout", "100", "--budget", "30", "--cache", str(tmp_path),
                                   "--results-dir", str(tmp_path / "res")])
    plan = merge_speed.make_plan(args)
    assert 28 < plan.run_timeout() <= 30
    started = []

    def fake_run(plan, name, repeat, reference=False):
        started.append(name)
        plan.deadline -= 40  # this run used up the budget
        return {"name": name, "wall_s": 1.0, "cpu_s": 1.0, "max_rss_mb": 1.0}

    monkeypatch.setattr(merge_speed, "run_hf", fake_run)
    monkeypatch.setattr(merge_speed, "run_checks", lambda *a: {})
    repeat = merge_speed.run_repeat(plan, 0)
    assert started == ["read"]
    assert plan.run_timeout() == 0
    assert repeat["runs"]["read"]["wall_s"] == 1.0
    for name in ("ties_tensor", "m_ties"):
        assert repeat["runs"][name]["skipped"].startswith("not started: the --budget of 30 s was spent")
    plan.deadline = None
    assert plan.run_timeout() == 100
