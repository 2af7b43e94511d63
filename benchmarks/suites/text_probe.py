"""How much headroom (gate G1) a text-suite configuration gives, measured on one seed before paying for a full run.

Builds the configuration's data and heads (cached like the suite's), scores the pretrained heads on val, then
fine-tunes each named task once (seed from the task's name) and scores it on its own val split: the fine-tuned −
pretrained difference per task is what G1 averages. Nothing is merged.

Example (the probe behind the G1 / G5 paragraph of ``docs/benchmarks.md``)::

    python -m benchmarks.suites.text_probe --config '{"n_train": 4000, "max_tokens": 32, "fill": true,
        "tasks": ["words", "code", "mansection", "fortune8", "isocodes", "glossary"]}' \\
        --finetune '{"ft_steps": 300, "ft_lr": 0.0003}' --only isocodes,glossary,fortune8 --out probe.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import sys
import time
import zlib
from pathlib import Path

import torch

from benchmarks.suites import text as X
from benchmarks.suites.protocol import accuracy, pretrained_scores
from benchmarks.suites.training import Log, torch_threads


def probe(cfg: X.TextConfig, finetune: dict, only: list[str] | None, cache: Path, log: Log) -> dict:
    """Pretrained-head and fine-tuned val accuracy (%) per task, the fine-tunes' losses and wall seconds."""
    cfg = dataclasses.replace(cfg, seeds=())
    bench = X.build_text_suite(cfg, cache, log)
    labels = bench.labels("val")
    pre = {t: 100 * accuracy(s, labels[t]) for t, s in pretrained_scores(bench)["val"].items()}
    tuned_cfg = dataclasses.replace(cfg, **finetune)
    rows = {}
    for task in only or bench.tasks:
        start = time.perf_counter()
        model, losses = X.finetune_upper(tuned_cfg, bench.upper, bench.heads[task], *bench.train[task],
                                         seed=zlib.crc32(task.encode()) % 1000)
        own = 100 * accuracy(bench.heads[task].logits(X.pooled(model, *bench.hidden["val"][task])), labels[task])
        rows[task] = {"pretrained": pre[task], "finetuned": own, "headroom": own - pre[task], "losses": losses,
                      "wall_s": round(time.perf_counter() - start, 1)}
        log(f"{task}: pretrained {pre[task]:.1f}, fine-tuned {own:.1f} ({own - pre[task]:+.1f}), loss {losses}")
    return {"config": dataclasses.asdict(cfg), "finetune": finetune, "pretrained": pre, "tasks": rows,
            "sizes": bench.info["sizes"]}


def markdown(result: dict, command: str) -> str:
    """The probe as a table: per task, pretrained heads and fine-tuned val accuracy, the difference (G1 averages
    it over the suite's tasks and asks ≥ 30), the last fifth's training loss and the wall time."""
    cfg, rows = result["config"], result["tasks"]
    lines = [f"# Text headroom probe (G1), {len(rows)} of {len(result['pretrained'])} tasks fine-tuned", "",
             (f"Command: `{command}`. Configuration: tasks {', '.join(cfg['tasks'])}; {cfg['n_train']} train / "
              f"{cfg['n_val']} val snippets per task, ≤ {cfg['max_tokens']} tokens, lower {cfg['frozen']} blocks "
              f"frozen; fine-tuning changes {result['finetune']}; one seed per task (from its name)."), "",
             "| task | val snippets | pretrained heads | fine-tuned | headroom | last loss | wall s |",
             "|---|---|---|---|---|---|---|"]
    for task, row in rows.items():
        lines.append(f"| {task} | {result['sizes'][task]['val']['snippets']} | {row['pretrained']:.1f} | "
                     f"{row['finetuned']:.1f} | {row['headroom']:+.1f} | {row['losses'][-1]:.3f} | {row['wall_s']:.0f} |")
    mean = sum(r["headroom"] for r in rows.values()) / len(rows)
    lines += ["", f"Mean headroom over the fine-tuned tasks: {mean:+.1f} points (G1 needs ≥ +30 over all tasks)."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    from benchmarks.suites.__main__ import default_cache

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="{}", help="TextConfig changes (JSON)")
    parser.add_argument("--finetune", default="{}", help="fine-tuning changes for the probe (JSON: ft_steps, ...)")
    parser.add_argument("--only", default=None, help="comma-separated tasks to fine-tune (default: all)")
    parser.add_argument("--cache", type=Path, default=None)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, required=True, help="JSON file to write")
    args = parser.parse_args(argv)
    changes = json.loads(args.config)
    if "tasks" in changes:
        changes["tasks"] = tuple(changes["tasks"])
    torch.use_deterministic_algorithms(True)
    with torch_threads(args.threads):
        result = probe(X.TextConfig(**changes), json.loads(args.finetune),
                       args.only.split(",") if args.only else None, args.cache or default_cache(),
                       Log(True, "text probe"))
    from benchmarks.suites.__main__ import record_args

    command = "python -m benchmarks.suites.text_probe " + shlex.join(record_args(argv if argv is not None else sys.argv[1:]))
    result["command"] = command
    args.out.write_text(json.dumps(result, indent=1, default=str) + "\n")
    args.out.with_suffix(".md").write_text(markdown(result, command))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
