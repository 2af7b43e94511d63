"""The MoE-build benchmark's pieces that decide its record: the ratios against the targets, the tokenizer it saves
beside the Qwen-shaped models, and the Markdown it writes (no tool is run here)."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import moe_speed


def _run(wall: float, cpu: float, rss: float, order: int = 0) -> dict:
    return {"rc": 0, "wall_s": wall, "cpu_s": cpu, "max_rss_mb": rss, "order": order,
            "contention": {"loadavg_before": [4.0, 4.0, 4.0], "loadavg_after": [4.2, 4.0, 4.0], "other_cores": 1.0}}


SETUP = {"experts": 4, "positive": 8, "negative": 2, "prompts": 44, "config_shape": {
    "hidden_size": 896, "num_hidden_layers": 24, "intermediate_size": 4864, "num_attention_heads": 14,
    "num_key_value_heads": 2, "vocab_size": 151936}, "params": {
    "dense_expert": 494_032_768, "expert_mlp": 313_786_368, "moe_total": 1_749_000_000},
    "tokenizer": {"class": "Qwen2Tokenizer", "vocab": 640, "bos": None, "eos": "<|endoftext|>"},
    "prompt_tokens": {"min": 8, "max": 31, "mean": 20.7},
    "recipe": {"shared_experts": [{"positive_prompts": ["a", "b"]}]}}
"""A record's setup: the 0.5B shape, 4 experts and the prompts' sizes."""


def test_ratios_are_judged_against_each_runs_targets() -> None:
    hf, mk = _run(40.0, 38.0, 1500.0), _run(100.0, 90.0, 3800.0)
    judged = moe_speed.ratios(hf, mk, targets=moe_speed.RUN_TARGETS["hf_mloss"])
    assert judged["wall"]["ratio"] == 0.4 and judged["wall"]["met"] and judged["rss"]["met"]
    assert judged["rss"]["hf_mloss"] == 1500.0 and judged["rss"]["mergekit"] == 3800.0
    assert "met" not in judged["cpu"] and "met" not in moe_speed.ratios(hf, mk, targets={})["wall"]
    slow = moe_speed.ratios(_run(60.0, 55.0, 1500.0), mk, targets=moe_speed.RUN_TARGETS["hf_mloss_no_report"])
    assert not slow["wall"]["met"] and slow["wall"]["target"] == 0.5  # the build alone: half of mergekit-moe
    assert moe_speed.RUN_TARGETS["hf_mloss"]["wall"] == 1.0  # the default run, its report included (issue 75)
    assert moe_speed.ratios({"rc": 1}, mk, targets=moe_speed.TARGETS) == {}


def test_the_tokenizer_reads_as_qwens(tmp_path) -> None:
    from transformers import AutoTokenizer, Qwen2Config

    moe_speed.build_tokenizer().save_pretrained(tmp_path)
    Qwen2Config(vocab_size=151936).save_pretrained(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    assert type(tokenizer).__name__ == "Qwen2Tokenizer" and tokenizer.bos_token is None
    assert tokenizer.eos_token == tokenizer.pad_token == "<|endoftext|>"
    ids = tokenizer(moe_speed.EXPERT_PROMPTS[0]["positive"][0], add_special_tokens=False)["input_ids"]
    assert 5 < len(ids) < 40 and max(ids) < moe_speed.TOKENIZER_VOCAB


def test_the_record_states_the_targets_the_contention_and_the_stages() -> None:
    runs = {"hf_mloss": _run(90.0, 85.0, 1600.0) | {"child": {
                "before_build_s": 4.5, "stages_s": {"gates": 14.0, "mloss": 40.0}, "vmhwm_mb": 1600.0,
                "stage_peak_rss_mb": {"gates": 500.0, "mloss": 1600.0}}},
            "mergekit": _run(50.0, 50.0, 3800.0, 1)}
    repeat = {"repeat": 0, "order": ["hf_mloss", "mergekit"], "runs": runs,
              "ratios": {"hf_mloss": moe_speed.ratios(runs["hf_mloss"], runs["mergekit"], targets=moe_speed.TARGETS)}}
    payload = {"tag": "t", "generated": "now", "command": "python benchmarks/moe_speed.py", "machine": {},
               "setup": SETUP, "repeats": [repeat], "met": moe_speed.met_counts([repeat]), "parity": None}
    text = moe_speed.render_markdown(payload)
    assert "| wall time | ≤ 1.0 | 1.800 | 0 of 1 |" in text
    assert "| peak RSS | ≤ 0.5 | 0.421 | 1 of 1 |" in text
    assert "494.0 M per dense expert" in text and "other cores" in text
    assert "| 1 | hf_mloss | 4.5 s | 14.0 s, 500 MB | 40.0 s, 1600 MB | 1600 |" in text


def test_mergekits_prompt_pass_is_read_from_its_progress_bar(tmp_path) -> None:
    log = tmp_path / "peer_run.log"
    log.write_text("expert prompts:  80%|████| 4/5 [00:25<00:06,  5.61s/it]\rexpert prompts: 100%|█████| 5/5 "
                   "[01:03<00:00,  5.61s/it]\rexpert prompts: 100%|█████| 5/5 [01:03<00:00, 12.7s/it]\nWeights: ...")
    assert moe_speed.prompt_pass_seconds(log) == 63
    log.write_text("no bar")
    assert moe_speed.prompt_pass_seconds(log) is None


def test_the_floors_say_which_targets_no_tool_could_meet() -> None:
    floors = {"imports_s": 3.0, "write_s": 5.0, "write_bytes": 3_500_000_000, "pair_gemm_s": 2.5,
              "pair_gemm_flop": 4e11, "threads": 2}
    runs = {"hf_mloss": _run(30.0, 45.0, 900.0) | {"child": {"stages_s": {"gates": 3.6}}},
            "hf_mloss_no_report": _run(19.0, 24.0, 700.0) | {"child": {"stages_s": {"gates": 4.0}}},
            "mergekit": _run(14.0, 17.0, 3800.0) | {"prompt_pass_s": 3}}
    x = moe_speed.repeat_floors({"repeat": 0, "runs": runs, "floors": floors})
    assert x["prompt"] == 3 and x["build"] == 11.0 and x["default"] == 13.5  # the faster tool's prompt pass
    lines = "\n".join(moe_speed.floors_section({"repeats": [{"repeat": 0, "runs": runs, "floors": floors}]}))
    assert "| 1 | 3.0 | 3.0 | 5.0 | - | 2.5 | - | 11.0 | 13.5 | 14.0 | 7.0 (below the floor) | 14.0 | 1.727 | 2.222 |" \
        in lines  # a record made before the direct write and the report's forward were measured
    assert "3.50 GB" in lines and "400 GFLOP" in lines
    assert moe_speed.repeat_floors({"repeat": 0, "runs": runs, "floors": None}) is None
    # the faster of the two writes counts, and the default floor adds the report's forward
    floors |= {"write_direct_s": 1.5, "forward_gemm_s": 2.0, "forward_gemm_flop": 5e11}
    x = moe_speed.repeat_floors({"repeat": 0, "runs": runs, "floors": floors})
    assert x["write"] == 1.5 and x["build"] == 7.5 and x["default"] == 12.0
    lines = "\n".join(moe_speed.floors_section({"repeats": [{"repeat": 0, "runs": runs, "floors": floors}]}))
    assert "| 1 | 3.0 | 3.0 | 5.0 | 1.5 | 2.5 | 2.0 | 7.5 | 12.0 | 14.0 | 7.0 (below the floor) | 14.0 | 2.533 | 2.500 |" \
        in lines
    assert "500 GFLOP" in lines and "`O_DIRECT`" in lines


def test_the_floors_job_measures_each_floor(tmp_path) -> None:
    spec = {"out": str(tmp_path / "floors"), "write_bytes": (64 << 20) + 5, "experts": 2, "hidden": 8,
            "intermediate": 16, "layers": 3, "positions": 4, "top_k": 2, "kv_heads": 1, "head_dim": 4}
    out = moe_speed.floors_main(spec)
    assert out["imports_s"] > 0 and out["write_s"] > 0 and out["pair_gemm_s"] > 0 and out["forward_gemm_s"] > 0
    assert out["write_direct_s"] is None or out["write_direct_s"] > 0  # None where O_DIRECT is refused
    assert out["write_bytes"] == (64 << 20) + 5 and out["pair_gemm_flop"] == 2 * 3 * 2 * 4 * 8 * 2 * 16
    # attention projections at every layer (q and o: 8 x 8; k and v: 8 x 4), experts (2 routed + 1 shared) before
    # the last layer's router
    assert out["forward_gemm_flop"] == 2 * 4 * 8 * (2 * 8 + 2 * 4) * 3 + 2 * 2 * (2 + 1) * 4 * 3 * 8 * 16
    assert not (tmp_path / "floors" / "floor.bin").exists()  # nothing is left beside the outputs


def test_each_stage_gets_its_cpu_time_and_page_faults(tmp_path) -> None:
    """/proc/<pid>/stat's fields are read after the command name (which may hold spaces and parentheses), and each
    stage gets the difference of the counters read last before its start and before its end."""
    import os

    stat = tmp_path / "stat"
    fields = ["S", "1", "1", "1", "0", "-1", "4194560", "1500", "0", "7", "0", "250", "50"] + ["0"] * 30
    stat.write_text("4242 (hf mloss (moe)) " + " ".join(fields))
    assert moe_speed.read_counters(stat, 100) == (2.5, 0.5, 1500, 7)
    assert moe_speed.read_counters(tmp_path / "missing", 100) is None
    user, _, faults, _ = moe_speed.read_counters(Path("/proc/self/stat"), os.sysconf("SC_CLK_TCK"))
    assert abs(user - os.times().user) < 0.1 and faults > 0  # this very process

    sampler = moe_speed.RssSampler()
    sampler.counters = [(10.0, (1.0, 0.2, 100, 0)), (10.5, (1.4, 0.3, 900, 1)), (12.0, (3.0, 0.8, 5100, 1)),
                        (12.01, (3.0, 0.8, 5100, 1))]
    usage = sampler.usage(10.2, {"gates": 0.5, "write": 1.9, "routing": 0.001})
    assert usage["gates"] == {"user_s": 0.4, "sys_s": 0.1, "minor_faults": 800, "major_faults": 1}
    assert usage["write"] == {"user_s": 1.6, "sys_s": 0.5, "minor_faults": 4200, "major_faults": 0}
    assert usage["routing"] is None  # no sample inside it


def test_the_record_gives_each_stages_cpu_time_and_faults() -> None:
    child = {"before_build_s": 4.5, "stages_s": {"gates": 14.0, "write": 9.0}, "vmhwm_mb": 1600.0,
             "stage_peak_rss_mb": {"gates": 500.0, "write": 900.0},
             "stage_usage": {"gates": {"user_s": 20.0, "sys_s": 1.5, "minor_faults": 120_000, "major_faults": 0},
                             "write": None}}
    runs = {"hf_mloss": _run(90.0, 85.0, 1600.0) | {"child": child}, "mergekit": _run(50.0, 50.0, 3800.0, 1)}
    repeat = {"repeat": 0, "order": ["hf_mloss", "mergekit"], "runs": runs,
              "ratios": {"hf_mloss": moe_speed.ratios(runs["hf_mloss"], runs["mergekit"], targets=moe_speed.TARGETS)}}
    lines = moe_speed.render_markdown({"tag": "t", "generated": "now", "command": "c", "machine": {},
                                       "setup": SETUP, "repeats": [repeat], "met": moe_speed.met_counts([repeat]),
                                       "parity": None})
    assert "| 1 | hf_mloss | 20.0 + 1.5 s, 120 k faults | - |" in lines


def test_a_record_names_its_folders_by_their_roles() -> None:
    """Folders inside one another each get their own name, the longest first, in every string of the record."""
    roots = {"/home/u": "HOME", "/home/u/cache": "CACHE", "/home/u/results": "out"}
    record = {"command": "moe_speed.py --cache /home/u/cache --results-dir /home/u/results",
              "logs": ["/home/u/cache/runs/a.log", "/home/u/other"]}
    assert moe_speed.portable(record, roots) == {"command": "moe_speed.py --cache CACHE --results-dir out",
                                                 "logs": ["CACHE/runs/a.log", "HOME/other"]}
