#!/usr/bin/env python
"""LoRA merge benchmark: hf_mloss vs PEFT on 8 rank-16 adapters of a ViT-B/32-shaped CLIP vision tower.

What it does, in ONE invocation:

1. Creates (or reuses from ``benchmarks/.cache/lora_speed``) a seeded random-init ``CLIPVisionModel`` with
   ViT-B/32 shapes (hidden 768, MLP 3072, 12 blocks, 224 px, patch 32) and 8 PEFT LoRA adapters of rank 16
   (``lora_alpha`` 32) on ``q_proj``, ``v_proj``, ``fc1``, ``fc2``, every factor random (B ≠ 0), saved with
   ``save_pretrained``.
2. Times four jobs, each in its own child process (wall, CPU time and peak RSS are per job), ``--repeats`` times
   (default 3), one repeat after the other:
   * ``hf_mloss_full``: ``hf_mloss.merge(base, adapters, "task_arithmetic", lam=1, weights=w)`` then
     ``save_pretrained``: the merged full model.
   * ``peft_full``: ``PeftModel.from_pretrained`` + ``load_adapter`` x 7, ``add_weighted_adapter(..., "cat")``,
     ``merge_and_unload()`` then ``save_pretrained``: the same full model.
   * ``hf_mloss_adapter``: the same merge with ``output="adapter", combination="svd", lora_rank=64``.
   * ``peft_adapter``: ``add_weighted_adapter(..., "svd", svd_rank=64, svd_full_matrices=False)`` then
     ``save_pretrained`` of that adapter. (PEFT's default ``svd_full_matrices=True`` computes the full U of every
     3072 x 768 ΔW: 561 s for this job in a one-repeat run on the 2 shared cores, so the faster setting is timed.)
3. Checks the outputs agree (max |Δ| between the two full models, and between the two rank-64 adapters merged
   into the base), and writes ``benchmarks/results/lora_speed_cpu.json`` and ``.md`` with every repeat, the median,
   the load average before each job, and the command.

The machine's cores may be shared: the load average is recorded beside every job; compare ratios within one repeat.

``--warm`` measures the adapter outputs instead, warm in one process (imports, file cache and first-call costs paid
by an untimed run first), on a ~58 M-parameter Llama (hidden 512, 8 blocks, vocabulary 32000) with 2 rank-16
adapters on the attention projections: ``cat`` (task arithmetic, PEFT's ``combination_type="cat"``) and ``svd``
(rank 16, ``svd_full_matrices=False``) side by side. Each job runs in its own child process, which times
``--runs`` runs after the warm-up (median) and reports its peak RSS. hf_mloss's timed run is
``merge(..., output="adapter")`` + ``save_pretrained`` from the folders; PEFT's is ``add_weighted_adapter`` +
``save_pretrained`` of that adapter on a model whose adapters are already loaded (the loading, which PEFT needs
first, is timed apart as ``load``). Results: ``benchmarks/results/lora_adapter_output_<tag>.json`` / ``.md``.

Usage::

    python benchmarks/lora_speed.py                      # 3 repeats, results under benchmarks/results/
    python benchmarks/lora_speed.py --repeats 1 --tag smoke
    python benchmarks/lora_speed.py --warm               # adapter outputs, warm in one process

Internal: ``python benchmarks/lora_speed.py --child JOB OUT_DIR`` runs one timed job (used by the parent).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
CACHE = HERE / ".cache" / "lora_speed"
RESULTS = HERE / "results"
Q, RANK, ALPHA, OUT_RANK = 8, 16, 32, 64
TARGETS = ["q_proj", "v_proj", "fc1", "fc2"]
WEIGHTS = [0.3 + 0.1 * i for i in range(Q)]
JOBS = ("hf_mloss_full", "peft_full", "hf_mloss_adapter", "peft_adapter")
VIT_B32 = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
               image_size=224, patch_size=32)


def build_inputs(cache: Path) -> tuple[Path, list[Path]]:
    """The base and the Q adapters (created once, then reused)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import CLIPVisionConfig, CLIPVisionModel

    base_dir = cache / "base"
    adapters = [cache / f"lora{i}" for i in range(Q)]
    if all((a / "adapter_model.safetensors").is_file() for a in adapters) and (base_dir / "config.json").is_file():
        return base_dir, adapters
    shutil.rmtree(cache, ignore_errors=True)
    torch.manual_seed(0)
    CLIPVisionModel(CLIPVisionConfig(**VIT_B32)).save_pretrained(base_dir)
    for i, folder in enumerate(adapters):
        model = get_peft_model(CLIPVisionModel.from_pretrained(base_dir),
                               LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=TARGETS))
        generator = torch.Generator().manual_seed(100 + i)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_" in name:
                    param.copy_(0.02 * torch.randn(param.shape, generator=generator))
        model.save_pretrained(folder)
        config = json.loads((folder / "adapter_config.json").read_text())
        config["base_model_name_or_path"] = str(base_dir)
        (folder / "adapter_config.json").write_text(json.dumps(config))
    return base_dir, adapters


# ------------------------------------------------------------------------------------------------ child jobs
def run_job(job: str, out: Path) -> None:
    base_dir, adapters = CACHE / "base", [CACHE / f"lora{i}" for i in range(Q)]
    if job.startswith("hf_mloss"):
        import hf_mloss

        extra = dict(output="adapter", combination="svd", lora_rank=OUT_RANK) if job.endswith("adapter") else {}
        result = hf_mloss.merge(str(base_dir), [str(a) for a in adapters], "task_arithmetic", lam=1.0,
                                weights=WEIGHTS, progress=False, **extra)
        result.save_pretrained(out)
        return
    from peft import PeftModel
    from transformers import CLIPVisionModel

    model = PeftModel.from_pretrained(CLIPVisionModel.from_pretrained(base_dir), adapters[0], adapter_name="a0")
    for i, adapter in enumerate(adapters[1:], start=1):
        model.load_adapter(adapter, adapter_name=f"a{i}")
    names = [f"a{i}" for i in range(Q)]
    if job == "peft_full":
        model.add_weighted_adapter(names, WEIGHTS, "merged", combination_type="cat")
        model.set_adapter("merged")
        model.merge_and_unload().save_pretrained(out)
    else:
        model.add_weighted_adapter(names, WEIGHTS, "merged", combination_type="svd", svd_rank=OUT_RANK,
                                   svd_full_matrices=False)
        model.save_pretrained(out, selected_adapters=["merged"])


def child_main(job: str, out: str) -> None:
    start_wall, start_cpu = time.perf_counter(), time.process_time()
    run_job(job, Path(out))
    wall, cpu = time.perf_counter() - start_wall, time.process_time() - start_cpu
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
    print(json.dumps({"job": job, "wall_s": wall, "cpu_s": cpu, "peak_rss_mb": peak_mb}))


# ------------------------------------------------------------------------------------------------ parent
def time_job(job: str, out: Path) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    load = os.getloadavg()[0]
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, __file__, "--child", job, str(out)], capture_output=True, text=True,
                          env=env, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{job} failed:\n{proc.stderr[-3000:]}")
    record = json.loads(proc.stdout.strip().splitlines()[-1])
    record.update(process_wall_s=time.perf_counter() - started, load_before=load)
    return record


def parity(outputs: dict[str, Path]) -> dict[str, float]:
    """Max |Δ| between the two full models, and between the two adapters merged into the base (both fp32)."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import CLIPVisionModel

    def full_state(folder: Path) -> dict:
        return {k.removeprefix("vision_model."): v for k, v in load_file(folder / "model.safetensors").items()}

    def adapter_state(folder: Path) -> dict:
        model = PeftModel.from_pretrained(CLIPVisionModel.from_pretrained(CACHE / "base"), folder)
        return model.merge_and_unload().state_dict()

    def max_diff(a: dict, b: dict) -> float:
        return max(float((a[k].float() - b[k].float()).abs().max()) for k in b)

    peft_adapter = outputs["peft_adapter"]
    if (peft_adapter / "merged").is_dir():  # save_pretrained(selected_adapters=[name]) nests non-default names
        peft_adapter = peft_adapter / "merged"
    return {"full_models_max_abs_diff": max_diff(full_state(outputs["hf_mloss_full"]), full_state(outputs["peft_full"])),
            "adapters_max_abs_diff": max_diff(adapter_state(outputs["hf_mloss_adapter"]), adapter_state(peft_adapter))}


def render(report: dict) -> str:
    lines = [f"# LoRA merge: hf_mloss vs PEFT ({Q} rank-{RANK} adapters, ViT-B/32 vision tower, CPU)", "",
             f"Command: `{report['command']}`  ", f"Machine: {report['machine']}  ",
             "Every job is its own process; wall = the job's own timer (imports excluded), peak RSS = the process's "
             "maximum resident set. `load` is the 1-minute load average when the job started (the cores are shared "
             "with other work).", ""]
    lines += ["| repeat | job | wall (s) | CPU (s) | peak RSS (MB) | load |", "|---|---|---|---|---|---|"]
    for i, rows in enumerate(report["repeats"], start=1):
        for row in rows:
            lines.append(f"| {i} | {row['job']} | {row['wall_s']:.2f} | {row['cpu_s']:.2f} | "
                         f"{row['peak_rss_mb']:.0f} | {row['load_before']:.1f} |")
    lines += ["", "Median over the repeats:", "", "| output | hf_mloss wall (s) | PEFT wall (s) | PEFT / hf_mloss | "
              "hf_mloss peak RSS (MB) | PEFT peak RSS (MB) |", "|---|---|---|---|---|---|"]
    med = report["median"]
    for kind in ("full", "adapter"):
        ours, theirs = med[f"hf_mloss_{kind}"], med[f"peft_{kind}"]
        label = "full model" if kind == "full" else f"rank-{OUT_RANK} adapter (svd)"
        lines.append(f"| {label} | {ours['wall_s']:.2f} | {theirs['wall_s']:.2f} | "
                     f"{theirs['wall_s'] / ours['wall_s']:.2f}x | {ours['peak_rss_mb']:.0f} | "
                     f"{theirs['peak_rss_mb']:.0f} |")
    p = report["parity"]
    lines += ["", f"Output parity: full models max |Δ| = {p['full_models_max_abs_diff']:.2e}; rank-{OUT_RANK} adapters "
              f"merged into the base max |Δ| = {p['adapters_max_abs_diff']:.2e}.", ""]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ warm adapter outputs
WARM_CACHE = HERE / ".cache" / "lora_adapter_output"
WARM_JOBS = ("hf_mloss_cat", "peft_cat", "hf_mloss_svd", "peft_svd")
WARM_Q, WARM_WEIGHTS = 2, [0.6, 0.4]
LLAMA_56M = dict(vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
                 num_key_value_heads=8, tie_word_embeddings=False)
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]


def build_warm_inputs(cache: Path) -> tuple[Path, list[Path]]:
    """A seeded ~58 M-parameter Llama and 2 random rank-16 adapters (created once, then reused)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    base_dir, adapters = cache / "base", [cache / f"lora{i}" for i in range(WARM_Q)]
    if all((a / "adapter_model.safetensors").is_file() for a in adapters) and (base_dir / "config.json").is_file():
        return base_dir, adapters
    shutil.rmtree(cache, ignore_errors=True)
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**LLAMA_56M)).save_pretrained(base_dir)
    for i, folder in enumerate(adapters):
        model = get_peft_model(LlamaForCausalLM.from_pretrained(base_dir),
                               LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=ATTENTION))
        generator = torch.Generator().manual_seed(200 + i)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_" in name:
                    param.copy_(0.02 * torch.randn(param.shape, generator=generator))
        model.save_pretrained(folder)
        config = json.loads((folder / "adapter_config.json").read_text())
        config["base_model_name_or_path"] = str(base_dir)
        (folder / "adapter_config.json").write_text(json.dumps(config))
    return base_dir, adapters


def warm_child(job: str, out: str, runs: int) -> None:
    """One warm job: an untimed run, then ``runs`` timed ones; prints wall times, load time and peak RSS."""
    base_dir, adapters = WARM_CACHE / "base", [WARM_CACHE / f"lora{i}" for i in range(WARM_Q)]
    combination = job.rsplit("_", 1)[1]
    load_s = 0.0
    if job.startswith("hf_mloss"):
        import hf_mloss

        def once(i: int) -> None:
            result = hf_mloss.merge(str(base_dir), [str(a) for a in adapters], "task_arithmetic", lam=1.0,
                                    weights=WARM_WEIGHTS, output="adapter", combination=combination,
                                    lora_rank=RANK if combination == "svd" else None, progress=False)
            result.save_pretrained(Path(out) / f"run{i}")
    else:
        from peft import PeftModel
        from transformers import LlamaForCausalLM

        started = time.perf_counter()
        model = PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(base_dir), adapters[0], adapter_name="a0")
        for i, adapter in enumerate(adapters[1:], start=1):
            model.load_adapter(adapter, adapter_name=f"a{i}")
        load_s = time.perf_counter() - started
        names = [f"a{i}" for i in range(WARM_Q)]

        def once(i: int) -> None:
            name = f"merged{i}"
            extra = dict(svd_rank=RANK, svd_full_matrices=False) if combination == "svd" else {}
            model.add_weighted_adapter(names, WARM_WEIGHTS, name, combination_type=combination, **extra)
            model.save_pretrained(Path(out) / f"run{i}", selected_adapters=[name])
            model.delete_adapter(name)

    once(0)  # warm-up, untimed
    walls = []
    for i in range(1, runs + 1):
        started = time.perf_counter()
        once(i)
        walls.append(time.perf_counter() - started)
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"job": job, "walls_s": walls, "wall_s": statistics.median(walls), "load_s": load_s,
                      "peak_rss_mb": peak_mb}))


def warm_parity(out: Path) -> dict[str, float]:
    """Max |Δ| between hf_mloss's and PEFT's adapters of each combination, each merged into the base by PEFT."""
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    def merged(folder: Path) -> dict:
        if (folder / "adapter_config.json").is_file():
            adapter = folder
        else:  # save_pretrained(selected_adapters=[name]) nests a non-default name
            adapter = next(p for p in folder.iterdir() if (p / "adapter_config.json").is_file())
        model = PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(WARM_CACHE / "base"), adapter)
        return model.merge_and_unload().state_dict()

    result = {}
    for combination in ("cat", "svd"):
        ours, theirs = merged(out / f"hf_mloss_{combination}" / "run1"), merged(out / f"peft_{combination}" / "run1")
        result[f"{combination}_max_abs_diff"] = max(float((ours[k].float() - theirs[k].float()).abs().max())
                                                    for k in theirs)
    return result


def warm_main(args: argparse.Namespace, argv: list[str] | None) -> None:
    build_warm_inputs(WARM_CACHE)
    out = WARM_CACHE / "out"
    shutil.rmtree(out, ignore_errors=True)
    rows = []
    for job in WARM_JOBS:
        load = os.getloadavg()[0]
        env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
        proc = subprocess.run([sys.executable, __file__, "--warm-child", job, str(out / job), str(args.runs)],
                              capture_output=True, text=True, env=env, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"{job} failed:\n{proc.stderr[-3000:]}")
        row = json.loads(proc.stdout.strip().splitlines()[-1])
        row["load_before"] = load
        rows.append(row)
        print(f"{job}: {row['wall_s']:.3f} s (median of {args.runs}), peak RSS {row['peak_rss_mb']:.0f} MB", flush=True)
    import peft
    import torch

    report = {"command": "python " + " ".join(shlex.quote(a) for a in [str(Path(__file__).relative_to(REPO)),
                                                                            *(argv or sys.argv[1:])]),
              "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch "
                         f"{torch.__version__}, peft {peft.__version__}",
              "rows": rows, "parity": warm_parity(out)}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"lora_adapter_output_{args.tag}.json").write_text(json.dumps(report, indent=1) + "\n")
    text = render_warm(report)
    (RESULTS / f"lora_adapter_output_{args.tag}.md").write_text(text)
    print(text)


def render_warm(report: dict) -> str:
    by_job = {row["job"]: row for row in report["rows"]}
    lines = [f"# Adapter outputs, warm in one process: hf_mloss vs PEFT ({WARM_Q} rank-{RANK} adapters, ~58 M-parameter "
             "Llama, CPU)", "", f"Command: `{report['command']}`  ", f"Machine: {report['machine']}  ",
             "Each job is its own process: an untimed warm-up run, then the timed runs (median). hf_mloss: "
             "`merge(..., output=\"adapter\")` + `save_pretrained`, from the folders. PEFT: `add_weighted_adapter` + "
             "`save_pretrained` on a model with the adapters already loaded (`load`: that loading, once, not in the "
             "timed runs). hf_mloss's runs after the first reuse the base's content fingerprint (cached in the process while "
             "its files are unchanged). `load avg` is the 1-minute load average when the job started (the cores are "
             "shared).", "",
             "| combination | hf_mloss wall (s) | PEFT wall (s) | hf_mloss / PEFT | PEFT load (s) | hf_mloss peak RSS (MB) "
             "| PEFT peak RSS (MB) | load avg |", "|---|---|---|---|---|---|---|---|"]
    for combination in ("cat", "svd"):
        ours, theirs = by_job[f"hf_mloss_{combination}"], by_job[f"peft_{combination}"]
        lines.append(f"| {combination} | {ours['wall_s']:.3f} | {theirs['wall_s']:.3f} | "
                     f"{ours['wall_s'] / theirs['wall_s']:.2f}x | {theirs['load_s']:.2f} | {ours['peak_rss_mb']:.0f} | "
                     f"{theirs['peak_rss_mb']:.0f} | {ours['load_before']:.1f} / {theirs['load_before']:.1f} |")
    p = report["parity"]
    lines += ["", f"Parity (each adapter merged into the base by PEFT): cat max |Δ| = {p['cat_max_abs_diff']:.2e}, "
              f"svd max |Δ| = {p['svd_max_abs_diff']:.2e}.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tag", default="cpu")
    parser.add_argument("--warm", action="store_true", help="adapter outputs, warm in one process (see above)")
    parser.add_argument("--runs", type=int, default=5, help="--warm: timed runs per job after the warm-up")
    parser.add_argument("--child", nargs=2, metavar=("JOB", "OUT"), help=argparse.SUPPRESS)
    parser.add_argument("--warm-child", nargs=3, metavar=("JOB", "OUT", "RUNS"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child_main(*args.child)
        return
    if args.warm_child:
        job, out, runs = args.warm_child
        warm_child(job, out, int(runs))
        return
    if args.warm:
        warm_main(args, argv)
        return
    build_inputs(CACHE)
    outputs = {job: CACHE / "out" / job for job in JOBS}
    repeats = []
    for i in range(args.repeats):
        rows = [time_job(job, outputs[job]) for job in JOBS]
        repeats.append(rows)
        print(f"repeat {i + 1}: " + ", ".join(f"{r['job']} {r['wall_s']:.1f}s {r['peak_rss_mb']:.0f}MB" for r in rows),
              flush=True)
    median = {job: {key: statistics.median(r[key] for rows in repeats for r in rows if r["job"] == job)
                    for key in ("wall_s", "cpu_s", "peak_rss_mb")} for job in JOBS}
    import peft
    import torch

    report = {"command": "python " + " ".join(shlex.quote(a) for a in [str(Path(__file__).relative_to(REPO)),
                                                                            *(argv or sys.argv[1:])]),
              "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch "
                         f"{torch.__version__}, peft {peft.__version__}",
              "repeats": repeats, "median": median, "parity": parity(outputs)}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"lora_speed_{args.tag}.json").write_text(json.dumps(report, indent=1) + "\n")
    (RESULTS / f"lora_speed_{args.tag}.md").write_text(render(report))
    print(render(report))


if __name__ == "__main__":
    main()
