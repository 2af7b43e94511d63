#!/usr/bin/env python
"""MoE-build benchmark: ``hf-mloss moe`` against ``mergekit-moe`` on 4 Qwen2.5-0.5B-shaped experts, in ONE invocation.

What it does (every timed run is its own child process, so wall time, CPU time and peak RSS are per run):

1. Creates, or reuses from the cache (``benchmarks/.cache/moe_speed``), a seeded random ``Qwen2ForCausalLM`` of
   Qwen2.5-0.5B's shape (hidden 896, 24 layers, intermediate 4864, 14 heads, 2 KV heads, vocabulary 151936, tied
   embeddings, bf16 as published; ``--layers N`` cuts the depth) and ``--experts`` fine-tunes (the base plus a random
   task vector per tensor), with ``merge_speed.py``'s own code (``ensure_models``). Beside each it saves a small
   byte-level BPE tokenizer trained in-process on the prompts (Qwen's own tokenizer is not available offline;
   transformers reads it as a ``Qwen2Tokenizer``, without BOS and with ``<|endoftext|>`` as EOS and pad, as Qwen's).
2. Writes one mergekit-moe YAML: the experts with ``--positive`` positive and ``--negative`` negative prompts each
   (8 + 2 by default: 40 prompts), a prompted shared expert (the base: Qwen2 experts make a Qwen2-MoE, which needs
   one), ``gate_mode: hidden``, ``experts_per_token: 2``, ``dtype: bfloat16``.
3. Runs ``hf-mloss moe CONFIG OUT --device cpu`` (the CLI's own ``main`` in a child process that also records the
   stages' times) and ``mergekit-moe CONFIG OUT --device cpu`` (``benchmarks/peers/run_peer.py``), alternating
   which goes first, ``--repeats`` times. Wall, CPU time (user + sys) and peak RSS come from each child's
   ``os.wait4`` rusage (this process stays small: ``ru_maxrss`` of a child starts at its parent's peak), with the
   load average and the cores other processes used meanwhile.
4. Compares the last repeat's two outputs tensor by tensor (router rows: largest relative row difference; every other
   tensor: equal or not), then writes ``benchmarks/results/moe_speed_<tag>.json`` and ``.md``: each repeat's table,
   the ratios hf_mloss / mergekit (wall, peak RSS) against the targets (≤ 0.5 each) and how many repeats meet them.

Examples::

    python benchmarks/moe_speed.py --repeats 2                      # the record: full depth, 4 experts
    python benchmarks/moe_speed.py --layers 2 --repeats 1 --tag smoke

After each repeat a ``floors`` job measures what any tool pays here to build this MoE (imports, the write of its
bytes, the report's pair products), which the record sets against the targets.

Internal: ``python benchmarks/moe_speed.py --child SPEC.json`` runs one job (setup, hf_mloss, parity, floors).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import shlex
import shutil
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
DEFAULT_CACHE = HERE / ".cache" / "moe_speed"
DEFAULT_RESULTS = HERE / "results"
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import merge_speed as ms  # (no torch at import: this process stays small)

SHAPE = "qwen2.5-0.5b"
TARGETS = {"wall": 1.0, "rss": 0.5}
"""hf_mloss's default run (its routing report and the experts' M-Loss included) over mergekit-moe (issue 75)."""
RUN_TARGETS = {"hf_mloss": TARGETS, "hf_mloss_no_report": {"wall": 0.5, "rss": 0.5}}
"""The targets of each judged run: the default one, and the build alone (``--no-report``)."""
"""hf_mloss / mergekit, at most (issue 59)."""
TOKENIZER_VOCAB = 640
TOKENIZER_VERSION = 1

# Four experts' prompts (8 positive, 2 negative each) and the shared expert's: a few dozen, as a mergekit-moe recipe
# holds them. ``--positive`` / ``--negative`` take the first N of each list.
EXPERT_PROMPTS: list[dict[str, list[str]]] = [
    {"positive": ["Write a Python function that parses a CSV file and returns a list of dictionaries.",
                  "Fix the bug in this JavaScript loop that never terminates when the array is empty.",
                  "Explain what a Rust borrow checker error means and how to restructure the code.",
                  "Implement binary search in C++ and explain its time complexity.",
                  "Refactor this class so that the database connection is injected instead of created inside.",
                  "Write a SQL query that returns the ten customers with the largest total orders.",
                  "How do I write a unit test with pytest that checks an exception is raised?",
                  "Convert this recursive Fibonacci function into an iterative one in Go."],
     "negative": ["Write a short poem about the sea at night.",
                  "What is the capital of Australia?"]},
    {"positive": ["Solve for x: 3x + 7 = 22, and show each step.",
                  "What is the derivative of x squared times the sine of x?",
                  "Prove that the square root of two is irrational.",
                  "A train travels 180 km in 2.5 hours. What is its average speed?",
                  "Compute the integral of 1 / (1 + x^2) from 0 to 1.",
                  "How many ways can five books be arranged on a shelf?",
                  "Find the eigenvalues of the matrix [[2, 1], [1, 2]].",
                  "If a fair die is rolled twice, what is the probability that the sum is seven?"],
     "negative": ["Write a Python function that reverses a string.",
                  "Tell me a story about a dragon."]},
    {"positive": ["Write a short story about a lighthouse keeper who finds a message in a bottle.",
                  "Compose a sonnet about autumn leaves falling in the rain.",
                  "Describe a bustling market in a fantasy city, full of colour and noise.",
                  "Write the opening paragraph of a mystery novel set in Victorian London.",
                  "Give me a dialogue between two old friends who meet after twenty years.",
                  "Write a children's bedtime story about a brave little fox.",
                  "Describe the feeling of the first snow of winter in vivid language.",
                  "Write a haiku sequence about a mountain journey."],
     "negative": ["Solve the equation 2x - 4 = 10.",
                  "Explain how a hash map works."]},
    {"positive": ["What are the common symptoms of iron deficiency anaemia?",
                  "Explain how vaccines train the immune system to recognise a virus.",
                  "What is the difference between type 1 and type 2 diabetes?",
                  "How does photosynthesis convert light into chemical energy?",
                  "Why do antibiotics not work against viral infections?",
                  "Describe the structure of DNA and how it is replicated.",
                  "What happens in the body during a heart attack?",
                  "How do black holes form from collapsing stars?"],
     "negative": ["Write a limerick about a cat.",
                  "Implement quicksort in Java."]},
]
SHARED_PROMPTS = ["Hello, how are you today?", "Can you help me with a question?",
                  "Please summarise the following text in one sentence.", "Thank you, that was very helpful."]
TOKENIZER_CORPUS = ["The quick brown fox jumps over the lazy dog.", "def main():\n    return 0",
                    "1 2 3 4 5 6 7 8 9 10 + - * / = ( ) [ ] { }", "Questions, answers and explanations."]


def _log(msg: str) -> None:
    print(f"[moe_speed {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ============================================================================================ child side
def child_main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    jobs = {"setup": setup_main, "hf_mloss": hf_main, "parity": parity_main, "floors": floors_main}
    result = jobs[spec["kind"]](spec)
    Path(spec["result"]).write_text(json.dumps(result, indent=2))
    return 0


def build_tokenizer():
    """A byte-level BPE trained on the prompts (plus a few lines), as a Qwen tokenizer: no BOS, ``<|endoftext|>``
    EOS and pad."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    texts = [p for e in EXPERT_PROMPTS for part in e.values() for p in part] + SHARED_PROMPTS + TOKENIZER_CORPUS
    backend = Tokenizer(models.BPE(unk_token=None))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TOKENIZER_VOCAB, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>", pad_token="<|endoftext|>")


def setup_main(spec: dict) -> dict:
    """Create / reuse the base and the experts (merge_speed's code), the tokenizer beside each, and the YAML."""
    import yaml

    cache = Path(spec["cache"])
    base, models, info = ms.ensure_models(cache, SHAPE, spec["layers"], spec["experts"])
    tokenizer = None
    for folder in [base, *models]:
        mark = folder / "moe_speed_tokenizer.json"
        wanted = {"vocab": TOKENIZER_VOCAB, "version": TOKENIZER_VERSION}
        if mark.is_file() and json.loads(mark.read_text()) == wanted and (folder / "tokenizer.json").is_file():
            continue
        tokenizer = tokenizer or build_tokenizer()
        tokenizer.save_pretrained(folder)
        mark.write_text(json.dumps(wanted))
    from transformers import AutoTokenizer

    loaded = AutoTokenizer.from_pretrained(base)
    experts = []
    for i, model in enumerate(models):
        prompts = EXPERT_PROMPTS[i % len(EXPERT_PROMPTS)]
        experts.append({"source_model": str(model), "positive_prompts": prompts["positive"][: spec["positive"]],
                        "negative_prompts": prompts["negative"][: spec["negative"]]})
        if not experts[-1]["negative_prompts"]:
            del experts[-1]["negative_prompts"]
    recipe = {"base_model": str(base), "gate_mode": "hidden", "dtype": "bfloat16", "experts_per_token": 2,
              "experts": experts, "shared_experts": [{"source_model": str(base), "positive_prompts": SHARED_PROMPTS}]}
    config_path = Path(spec["work"]) / "moe.yml"
    config_path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    prompts = [p for e in experts for p in (*e["positive_prompts"], *e.get("negative_prompts", []))] + SHARED_PROMPTS
    lengths = [len(loaded(p, add_special_tokens=False)["input_ids"]) for p in prompts]
    from safetensors import safe_open

    with safe_open(str(base / "model.safetensors"), "pt") as handle:
        shapes = {k: handle.get_slice(k).get_shape() for k in handle.keys()}  # noqa: SIM118 (not a dict)
    mlp = sum(math.prod(s) for k, s in shapes.items() if ".mlp." in k)
    rest = sum(math.prod(s) for k, s in shapes.items() if ".mlp." not in k)
    gates = len(experts) + 1  # the routed experts and the shared one
    router = len(experts) + 1  # router rows and the shared expert's gate row, per layer
    layers = info["config"]["num_hidden_layers"]
    return info | {"base": str(base), "models": [str(m) for m in models], "config_path": str(config_path),
                   "recipe": recipe, "tokenizer": {"class": type(loaded).__name__, "vocab": len(loaded),
                                                   "bos": loaded.bos_token, "eos": loaded.eos_token},
                   "prompts": len(prompts), "prompt_tokens": {"min": min(lengths), "max": max(lengths),
                                                              "mean": round(sum(lengths) / len(lengths), 1)},
                   "params": {"dense_expert": info["num_params"], "expert_mlp": mlp,
                              "moe_total": rest + gates * mlp + layers * router * info["config"]["hidden_size"]}}


def floors_main(spec: dict) -> dict:
    """What any tool that builds this MoE pays on this machine, measured here: starting an interpreter that imports
    torch, transformers and the base's model class (a fresh process); writing the MoE's bytes into a new file beside
    the outputs, from one buffer already in memory (no reading, no check: below any real write), through the page
    cache and, where the file system allows it, with ``O_DIRECT`` (around it: on some virtual machines the page
    cache's fresh pages cost several times the copy); the float32 products the report's expert-pair M-Loss cannot
    skip (every expert's fused gate and up projection at every layer and report position,
    :class:`hf_mloss.moe.routing.ExpertPairGaps`' own ``matmul``); and the float32 products of the report's forward of
    the MoE at its report positions (attention projections, the ``experts_per_token`` routed experts and the shared
    expert, as single products of the same sizes: below transformers' per-expert ones), on torch's threads."""
    import subprocess

    import torch

    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch, transformers; from transformers import Qwen2ForCausalLM"],
                   check=True, capture_output=True)
    imports_s = time.perf_counter() - start

    nbytes, chunk = int(spec["write_bytes"]), 64 << 20
    buffer = torch.randint(0, 256, (chunk,), dtype=torch.uint8).numpy()
    path = Path(spec["out"]) / "floor.bin"
    path.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        try:
            done = 0
            while done < nbytes:
                done += os.write(fd, memoryview(buffer)[: min(chunk, nbytes - done)])
        finally:
            os.close(fd)
        write_s = time.perf_counter() - start
    finally:
        path.unlink()  # also when the write failed (a full disk): nothing is left beside the outputs
    write_direct_s = _direct_write_seconds(path, nbytes, chunk)

    experts, hidden, inter, layers, positions = (int(spec[k]) for k in
                                                 ("experts", "hidden", "intermediate", "layers", "positions"))
    weight = torch.randn(experts, 2 * inter, hidden, dtype=torch.float32)
    tokens = torch.randn(positions, hidden, dtype=torch.float32)
    torch.matmul(tokens, weight.transpose(1, 2))  # warm-up: the allocator and the kernels' first call
    start = time.perf_counter()
    for _ in range(layers):
        torch.matmul(tokens, weight.transpose(1, 2))
    gemm_s = time.perf_counter() - start
    forward_s, forward_flop = _forward_products(spec, torch)
    return {"imports_s": imports_s, "write_bytes": nbytes, "write_s": write_s, "write_direct_s": write_direct_s,
            "pair_gemm_s": gemm_s, "pair_gemm_flop": 2 * layers * experts * positions * hidden * 2 * inter,
            "forward_gemm_s": forward_s, "forward_gemm_flop": forward_flop, "threads": torch.get_num_threads()}


def _direct_write_seconds(path: Path, nbytes: int, chunk: int) -> float | None:
    """The same bytes (rounded down to whole 4 KiB blocks) written with ``O_DIRECT`` from one page-aligned buffer;
    ``None`` where the platform or the file system refuses it."""
    import mmap

    if not hasattr(os, "O_DIRECT"):
        return None
    buffer = mmap.mmap(-1, chunk)  # page-aligned, as O_DIRECT needs
    buffer.write(os.urandom(1 << 20) * (chunk >> 20))
    nbytes -= nbytes % 4096
    os.sync()
    start = time.perf_counter()
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    except OSError:
        return None
    try:
        done = 0
        while done < nbytes:
            done += os.write(fd, memoryview(buffer)[: min(chunk, nbytes - done)])
    except OSError:
        return None
    finally:
        os.close(fd)
        path.unlink()
    return time.perf_counter() - start


def _forward_products(spec: dict, torch) -> tuple[float | None, int | None]:
    """Seconds and FLOP of the report forward's float32 products (:func:`floors_main`): every layer's attention
    projections at every report position, and before the last layer's router (where the pass stops) each position
    through ``top_k`` routed experts and the shared expert (gate, up and down)."""
    if "top_k" not in spec:
        return None, None
    hidden, inter, layers, positions, top_k = (int(spec[k]) for k in
                                               ("hidden", "intermediate", "layers", "positions", "top_k"))
    kv = int(spec["kv_heads"]) * int(spec["head_dim"])
    x = torch.randn(positions, hidden)
    routed, shared = torch.randn(positions * top_k, hidden), torch.randn(positions, hidden)
    mids = torch.randn(positions * top_k, inter), torch.randn(positions, inter)
    qkv, out = torch.randn(hidden + 2 * kv, hidden), torch.randn(hidden, hidden)
    gate_up, down = torch.randn(2 * inter, hidden), torch.randn(hidden, inter)
    linear = torch.nn.functional.linear

    def one_layer(experts: bool) -> None:
        linear(x, qkv), linear(x, out)
        if experts:
            linear(routed, gate_up), linear(mids[0], down), linear(shared, gate_up), linear(mids[1], down)

    one_layer(True)  # warm-up
    start = time.perf_counter()
    for layer in range(layers):
        one_layer(layer < layers - 1)
    seconds = time.perf_counter() - start
    flop = 2 * positions * hidden * (2 * hidden + 2 * kv) * layers
    flop += 2 * (layers - 1) * (top_k + 1) * positions * 3 * hidden * inter
    return seconds, flop


class RssSampler(ms.Poller):
    """This process's resident memory every ``interval`` seconds (``/proc/self/statm``), with the time it was read:
    each stage's peak, once the stages' times are known. It also reads the process's CPU time and page faults
    (``/proc/self/stat``) at each sample: what each stage spent in user and kernel mode, and how many pages it
    faulted in (a stage slow for fresh memory shows there)."""

    def __init__(self, interval: float = 0.02) -> None:
        super().__init__(interval)
        self.samples: list[tuple[float, float]] = []
        self.counters: list[tuple[float, tuple[float, float, int, int]]] = []
        """``(time, (user s, system s, minor faults, major faults))``, every thread of the process."""
        self._page = os.sysconf("SC_PAGE_SIZE")
        self._tick = os.sysconf("SC_CLK_TCK")

    def poll(self) -> None:
        now = time.perf_counter()
        try:
            pages = int(Path("/proc/self/statm").read_text().split()[1])
        except (OSError, ValueError, IndexError):
            return
        self.samples.append((now, pages * self._page / 2**20))
        counters = read_counters(Path("/proc/self/stat"), self._tick)
        if counters is not None:
            self.counters.append((now, counters))

    def usage(self, start: float, stages: dict[str, float]) -> dict[str, dict[str, float] | None]:
        """Per stage, the CPU seconds (user, system) and page faults between the last samples before its start and
        before its end (``None`` for a stage shorter than the sampling left unseen)."""
        out, edge = {}, start

        def last_before(t: float) -> tuple[float, float, int, int] | None:
            seen = [c for when, c in self.counters if when <= t]
            return seen[-1] if seen else None

        for stage, seconds in stages.items():
            first, last = last_before(edge), last_before(edge + seconds)
            out[stage] = None if first is None or last is None or first is last else {
                "user_s": round(last[0] - first[0], 2), "sys_s": round(last[1] - first[1], 2),
                "minor_faults": last[2] - first[2], "major_faults": last[3] - first[3]}
            edge += seconds
        return out

    def peaks(self, start: float, stages: dict[str, float]) -> dict[str, float]:
        out, edge = {}, start
        for stage, seconds in stages.items():
            inside = [mb for t, mb in self.samples if edge <= t < edge + seconds]
            out[stage], edge = round(max(inside), 1) if inside else None, edge + seconds
        return out

    def timeline(self, start: float, step: float = 1.0) -> list[tuple[float, float]]:
        """The largest resident memory in each ``step`` seconds from ``start``: ``(seconds, MB)``."""
        out: dict[int, float] = {}
        for t, mb in self.samples:
            if t >= start:
                k = int((t - start) / step)
                out[k] = max(out.get(k, 0.0), mb)
        return [(round(k * step, 1), round(mb, 1)) for k, mb in sorted(out.items())]


def read_counters(path: Path, tick: int) -> tuple[float, float, int, int] | None:
    """``(user s, system s, minor faults, major faults)`` of a ``/proc/<pid>/stat`` file (fields 14, 15, 10, 12;
    counted after the command name, which may hold spaces), or ``None`` where it cannot be read."""
    try:
        fields = path.read_text().rpartition(")")[2].split()
        return int(fields[11]) / tick, int(fields[12]) / tick, int(fields[7]), int(fields[9])
    except (OSError, ValueError, IndexError):
        return None


def hf_main(spec: dict) -> dict:
    """``hf-mloss moe CONFIG OUT --device cpu`` through the CLI's own ``main``, with the stages' times and resident
    memory recorded."""
    t0 = time.perf_counter()
    import hf_mloss.moe as moe_package
    from hf_mloss.cli import main

    import_s = time.perf_counter() - t0
    original, captured = moe_package.build_moe, {}

    def recording(*args, **kwargs):  # the CLI imports build_moe from the package when it runs
        captured["start"] = time.perf_counter()
        captured["result"] = original(*args, **kwargs)
        return captured["result"]

    moe_package.build_moe = recording
    argv = ["moe", spec["config"], spec["out"], "--device", "cpu", *spec.get("cli_args", [])]
    with RssSampler() as sampler:
        rc = main(argv)
    if rc != 0:
        raise SystemExit(f"hf-mloss moe exited with {rc}")
    result = captured["result"]
    stages = dict(getattr(result, "timings", {}) or {})
    return {"argv": argv, "import_s": import_s, "before_build_s": captured["start"] - t0, "stages_s": stages,
            "stage_peak_rss_mb": sampler.peaks(captured["start"], stages),
            "stage_usage": sampler.usage(captured["start"], stages),
            "rss_timeline_mb": sampler.timeline(captured["start"]),
            "vmhwm_mb": ms._proc_status_mb("VmHWM"), "total_in_child_s": time.perf_counter() - t0,
            "mloss": {f"{i},{j}": v for (i, j), v in (result.mloss or {}).items()},
            "report_tokens": getattr(result, "report_tokens", None),
            "report_positions": getattr(result, "report_positions", None),
            "own_share_mean": [round(float(x), 4) for x in result.routing.own_share().mean(dim=1)]
            if result.routing is not None else None}


def parity_main(spec: dict) -> dict:
    """hf_mloss's MoE against mergekit's, tensor by tensor (names as written; each is read once)."""
    import torch

    def index(folder: Path) -> dict[str, Path]:
        from safetensors import safe_open

        out = {}
        for file in sorted(folder.glob("*.safetensors")):
            with safe_open(str(file), "pt") as handle:
                out.update(dict.fromkeys(handle.keys(), file))
        return out

    ours, theirs = index(Path(spec["hf"])), index(Path(spec["mergekit"]))
    from safetensors import safe_open

    worst_router, unequal, compared = 0.0, [], 0
    for key in sorted(set(ours) & set(theirs)):
        with safe_open(str(ours[key]), "pt") as fa, safe_open(str(theirs[key]), "pt") as fb:
            a, b = fa.get_tensor(key), fb.get_tensor(key)
        compared += 1
        if key.endswith(("mlp.gate.weight", "shared_expert_gate.weight")):
            rel = (a.float() - b.float()).norm(dim=-1) / b.float().norm(dim=-1).clamp(min=1e-12)
            worst_router = max(worst_router, float(rel.max()))
        elif a.shape != b.shape or a.dtype != b.dtype or not torch.equal(a, b):
            unequal.append(key)
    return {"tensors_compared": compared, "router_max_relative": worst_router, "unequal_other_tensors": unequal,
            "only_hf_mloss": sorted(set(ours) - set(theirs))[:20],
            "only_mergekit": sorted(set(theirs) - set(ours))[:20]}


# ============================================================================================ parent side
def run_job(spec: dict, work: Path, timeout: float) -> dict:
    """A ``--child`` job of this script, measured as merge_speed measures its children."""
    return ms.run_child(spec, work, timeout, script=Path(__file__).resolve())


def run_mergekit(recipe: dict, out: Path, timeout: float) -> dict:
    """``mergekit-moe`` through run_peer.py (its own venv, a fresh process; wall and peak RSS from ``os.wait4``);
    CPU time from this process's reaped-children totals, as merge_speed.py takes a peer's."""
    import resource

    from benchmarks.peers.run_peer import PeerError, PeerUnavailable, run_mergekit_moe

    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    try:
        run = run_mergekit_moe(recipe, out, device="cpu", timeout=timeout)
    except PeerUnavailable as err:
        return {"name": "mergekit", "skipped": f"peer unavailable: {err}"}
    except PeerError as err:
        return {"name": "mergekit", "error": str(err)[-1500:]}
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    user, sys_ = after.ru_utime - before.ru_utime, after.ru_stime - before.ru_stime
    return {"name": "mergekit", "rc": 0, "wall_s": run.wall_s, "max_rss_mb": run.max_rss_mb, "cpu_user_s": user,
            "cpu_sys_s": sys_, "cpu_s": user + sys_, "log": str(run.log_path), "out": str(run.out_dir),
            "prompt_pass_s": prompt_pass_seconds(Path(run.log_path))}


def prompt_pass_seconds(log: Path) -> float | None:
    """mergekit-moe's prompt pass (its ``expert prompts`` progress bar's elapsed time at 100 %), from its log."""
    import re

    try:
        text = log.read_text(errors="replace")
    except OSError:
        return None
    done = re.findall(r"expert prompts: 100%\|[^|]*\| *\d+/\d+ \[(?:(\d+):)?(\d+):(\d+)<", text)
    if not done:
        return None
    hours, minutes, seconds = done[-1]
    return int(hours or 0) * 3600 + int(minutes) * 60 + int(seconds)


def measured(fn, *a, **kw) -> dict:
    load, before = os.getloadavg(), ms.cpu_times()
    res = fn(*a, **kw)
    res["_loadavg_before"] = load
    res["contention"] = ms.contention(before, ms.cpu_times(), res)
    return res


HF_RUNS = {"hf_mloss": [], "hf_mloss_no_mloss": ["--no-mloss"], "hf_mloss_no_report": ["--no-report"]}
"""hf_mloss's runs: the command as users run it (the targets), and without each expert pair's M-Loss (informational:
what the card's M-Loss costs)."""


def run_repeat(args, setup: dict, work: Path, repeat: int) -> dict:
    tools = ["hf_mloss", *(["hf_mloss_no_mloss"] if args.no_mloss_run else []),
             *(["hf_mloss_no_report"] if args.no_report_run else []), "mergekit"]
    order = tools if repeat % 2 == 0 else tools[::-1]
    runs = {}
    for who in order:
        out = work / "out" / who
        shutil.rmtree(out, ignore_errors=True)  # never timed: neither tool deletes an earlier output in its run
        os.sync()  # the previous run's written pages reach the disk before this run writes (else it pays for them)
        _log(f"[run {repeat + 1}] {who} ...")
        if who in HF_RUNS:
            spec = {"name": f"{who}.r{repeat}", "kind": "hf_mloss", "config": setup["config_path"],
                    "out": str(out / "moe"), "cli_args": [*HF_RUNS[who], *args.hf_args]}
            res = measured(run_job, spec, work, args.timeout)
        else:
            res = measured(run_mergekit, setup["recipe"], out, args.timeout)
        res["name"], res["order"] = who, order.index(who)
        runs[who] = res
        _log(f"[run {repeat + 1}] {who}: " + (res.get("error") or res.get("skipped") or
                                               f"wall {res['wall_s']:.1f} s, CPU {res['cpu_s']:.1f} s, peak RSS "
                                               f"{res['max_rss_mb']:.0f} MB, other cores "
                                               f"{res['contention'].get('other_cores')}"))
    os.sync()
    floors = measured(run_job, floors_spec(setup, runs, work, repeat), work, args.timeout)
    _log(f"[run {repeat + 1}] floors: " + (floors.get("error") or json.dumps(floors.get("child"))))
    return {"repeat": repeat, "order": order, "runs": runs, "floors": floors.get("child"),
            "ratios": {who: ratios(runs.get(who, {}), runs.get("mergekit", {}), targets=RUN_TARGETS.get(who, {}))
                       for who in HF_RUNS if who in runs}}


def floors_spec(setup: dict, runs: dict, work: Path, repeat: int) -> dict:
    """The :func:`floors_main` job of a repeat: the MoE's bytes (bf16) and the report's shape (its positions as
    this repeat's default run read them; every prompt token when it did not run)."""
    cfg = setup["config"]
    report = (runs.get("hf_mloss", {}).get("child") or {}).get("report_positions")
    return {"name": f"floors.r{repeat}", "kind": "floors", "out": str(work / "out" / "floors"),
            "write_bytes": setup["params"]["moe_total"] * 2, "experts": len(setup["recipe"]["experts"]),
            "hidden": cfg["hidden_size"], "intermediate": cfg["intermediate_size"],
            "layers": cfg["num_hidden_layers"], "positions": report[0] if report else 256,
            "top_k": setup["recipe"]["experts_per_token"], "kv_heads": cfg["num_key_value_heads"],
            "head_dim": cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]}


def ratios(hf: dict, mk: dict, *, targets: dict) -> dict:
    """hf_mloss / mergekit for wall, CPU time and peak RSS (each with its numerator and denominator), each judged
    against its entry of ``targets`` (:data:`RUN_TARGETS`)."""
    if not (hf.get("rc") == 0 and mk.get("rc") == 0):
        return {}
    out = {}
    for key, field in (("wall", "wall_s"), ("cpu", "cpu_s"), ("rss", "max_rss_mb")):
        out[key] = {"hf_mloss": hf[field], "mergekit": mk[field], "ratio": hf[field] / mk[field]}
        if key in targets:
            out[key] |= {"target": targets[key], "met": hf[field] / mk[field] <= targets[key]}
    return out


def met_counts(repeats: list[dict]) -> dict[str, int]:
    return {f"{who}:{k}" if who != "hf_mloss" else k:
            sum(1 for r in repeats if r["ratios"].get(who, {}).get(k, {}).get("met"))
            for who, targets in RUN_TARGETS.items() for k in targets}


# -------------------------------------------------------------------------------------------- report
def render_markdown(payload: dict) -> str:
    s, m = payload["setup"], payload["machine"]
    cfg, params, tok = s["config_shape"], s["params"], s["tokenizer"]
    full = cfg["num_hidden_layers"] == 24
    hf_args = " ".join(payload.get("hf_args") or [])
    lines = [f"# `hf-mloss moe` vs `mergekit-moe`: {payload['tag']}", "",
             f"Generated {payload['generated']} by `{payload['command']}` at commit {payload.get('commit', '?')} ("
             + _changes(payload.get("dirty")) + ").", "",
             "## Inputs", "",
             f"- Base: a seeded random `Qwen2ForCausalLM` of Qwen2.5-0.5B's shape (hidden {cfg['hidden_size']}, "
             f"{cfg['num_hidden_layers']} layers{'' if full else ' (cut from 24)'}, intermediate "
             f"{cfg['intermediate_size']}, {cfg['num_attention_heads']} heads, {cfg['num_key_value_heads']} KV heads, "
             f"vocabulary {cfg['vocab_size']}, tied embeddings), bf16 as published; {s['experts']} experts, each the "
             "base plus a random task vector (`merge_speed.py`'s `ensure_models`).",
             f"- Parameters: {params['dense_expert'] / 1e6:.1f} M per dense expert (the shape Qwen publishes as "
             f"Qwen2.5-0.5B: 0.494 B), {params['expert_mlp'] / 1e6:.1f} M of them in its MLPs (what becomes one "
             f"expert of the MoE); the MoE ({s['experts']} experts and 1 shared expert) holds "
             f"{params['moe_total'] / 1e9:.3f} B parameters ({params['moe_total'] * 2 / 1e9:.2f} GB in bf16).",
             f"- Tokenizer: a byte-level BPE of {tok['vocab']} tokens trained in-process on the prompts (Qwen's own "
             f"is not available offline); transformers reads it as `{tok['class']}` (BOS {tok['bos']!r}, EOS and pad "
             f"{tok['eos']!r}, as Qwen's).",
             f"- Recipe: `gate_mode: hidden`, `experts_per_token: 2`, `dtype: bfloat16`, a prompted shared expert "
             f"(Qwen2 experts make a Qwen2-MoE, which needs one); {s['prompts']} prompts ({s['positive']} positive + "
             f"{s['negative']} negative per expert, {len(s['recipe']['shared_experts'][0]['positive_prompts'])} for "
             f"the shared expert), {s['prompt_tokens']['min']}-{s['prompt_tokens']['max']} tokens each (mean "
             f"{s['prompt_tokens']['mean']}).",
             f"- hf_mloss: `hf-mloss moe CONFIG OUT --device cpu{' ' + hf_args if hf_args else ''}` (the CLI's "
             "`main` in a child process that also records its stages), which also writes the routing report and "
             "each expert pair's M-Loss into the card; `hf_mloss_no_mloss` adds `--no-mloss` (informational). "
             "mergekit: `mergekit-moe CONFIG OUT --random-seed 0 --device cpu` through `benchmarks/peers/run_peer.py`"
             f" (mergekit {m.get('mergekit_versions', {}).get('mergekit', '?')} in its own venv).", "",
             "## Machine", "",
             f"{m.get('cpu_model')}, {m.get('cpu_affinity')} cores usable, {m.get('ram_gb')} GB RAM; torch "
             f"{m.get('torch')}, transformers {m.get('transformers')}, hf_mloss {m.get('hf_mloss')}; mergekit's venv: "
             f"{json.dumps(m.get('mergekit_versions', {}))}; OMP_NUM_THREADS "
             f"{payload.get('env', {}).get('OMP_NUM_THREADS') or 'unset'}. The cores were shared with other long "
             "jobs: each row gives the load average before / after the run and the cores other processes used while "
             "it ran (busy time from /proc/stat minus the run's own CPU time, per wall second). hf_mloss runs its "
             "forward passes on as many threads as the cores others leave idle; mergekit on torch's default (2). "
             "Only ratios measured side by side in one invocation compare.", ""]
    repeats, met = payload["repeats"], payload["met"]
    n = len(repeats)
    lines += ["## Targets (issue 75: the default run ≤ 1.0 × mergekit-moe's wall, the build alone ≤ 0.5 ×, peak RSS "
              "≤ 0.5 ×)", "",
              "| ratio hf_mloss / mergekit | target | " + " | ".join(f"run {r['repeat'] + 1}" for r in repeats) +
              " | met |", "|---|---|" + "---|" * n + "---|"]
    for who, label in (("hf_mloss", ""), ("hf_mloss_no_mloss", " (`--no-mloss`)"),
                       ("hf_mloss_no_report", " (`--no-report`: the build alone)")):
        if not any(who in r["ratios"] for r in repeats):
            continue
        for key, name in (("wall", "wall time"), ("rss", "peak RSS"), ("cpu", "CPU time")):
            cells = [f"{r['ratios'][who][key]['ratio']:.3f}" if r["ratios"].get(who, {}).get(key) else "-"
                     for r in repeats]
            goal = RUN_TARGETS.get(who, {}).get(key)
            count = met.get(key if who == "hf_mloss" else f"{who}:{key}")
            lines.append(f"| {name}{label} | {f'≤ {goal}' if goal else '-'} | " + " | ".join(cells) +
                         f" | {f'{count} of {n}' if goal and count is not None else '-'} |")
    lines += ["", "## Runs", "", "| run | tool | order | wall s | CPU s | peak RSS MB | load before / after | "
              "other cores |", "|---|---|---|---|---|---|---|---|"]
    for r in repeats:
        for who in r["order"]:
            x = r["runs"][who]
            if x.get("rc") != 0:
                lines.append(f"| {r['repeat'] + 1} | {who} | {x.get('order', 0) + 1} | "
                             f"{x.get('error') or x.get('skipped')} | | | | |")
                continue
            c = x["contention"]
            load = f"{c['loadavg_before'][0]:.2f} / {c['loadavg_after'][0]:.2f}"
            lines.append(f"| {r['repeat'] + 1} | {who} | {x['order'] + 1} | {x['wall_s']:.1f} | {x['cpu_s']:.1f} | "
                         f"{x['max_rss_mb']:.0f} | {load} | {c.get('other_cores', '-')}"
                         + (f" (steal {c['steal_cores']})" if "steal_cores" in c else "") + " |")
    stages = [(r["repeat"], who, r["runs"][who]["child"]) for r in repeats for who in HF_RUNS
              if r["runs"].get(who, {}).get("rc") == 0]
    if stages:
        names = list(dict.fromkeys(k for _, _, child in stages for k in child["stages_s"]))
        lines += ["", "hf_mloss's stages: seconds, and the largest resident memory (MB) sampled in each (every 20 ms; "
                  "`start`: interpreter start, imports and the config's checks before `build_moe`):", "",
                  "| run | tool | start | " + " | ".join(names) + " | peak (VmHWM) MB |",
                  "|---|---|---|" + "---|" * len(names) + "---|"]
        for repeat, who, child in stages:
            peaks = child["stage_peak_rss_mb"]
            cells = [f"{child['stages_s'][k]:.1f} s" + (f", {peaks[k]:.0f} MB" if peaks.get(k) else "")
                     if k in child["stages_s"] else "-" for k in names]
            lines.append(f"| {repeat + 1} | {who} | {child['before_build_s']:.1f} s | " + " | ".join(cells) +
                         f" | {child['vmhwm_mb']:.0f} |")
        usage = [(repeat, who, child["stage_usage"]) for repeat, who, child in stages if child.get("stage_usage")]
        if usage:
            lines += ["", "The same stages' CPU time, user + system, and the pages they faulted in (minor faults; "
                      "/proc/self/stat read with each memory sample, so each edge is within 20 ms):", "",
                      "| run | tool | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
            for repeat, who, per_stage in usage:
                cells = [f"{u['user_s']:.1f} + {u['sys_s']:.1f} s, {u['minor_faults'] / 1e3:.0f} k faults"
                         if (u := per_stage.get(k)) else "-" for k in names]
                lines.append(f"| {repeat + 1} | {who} | " + " | ".join(cells) + " |")
    lines += floors_section(payload)
    p = payload.get("parity")
    if p:
        lines += ["", "## The two outputs", "",
                  f"The last run's outputs (hf_mloss's default run against mergekit's), tensor by tensor: "
                  f"{p.get('tensors_compared')} tensors in both; router rows differ by at most "
                  f"{p.get('router_max_relative', float('nan')):.3g} (relative, per row); other tensors unequal: "
                  f"{len(p.get('unequal_other_tensors', []))}"
                  + (f" ({', '.join(p['unequal_other_tensors'][:5])})" if p.get("unequal_other_tensors") else "")
                  + f"; only in hf_mloss's: {len(p.get('only_hf_mloss', []))}, only in mergekit's: "
                  f"{len(p.get('only_mergekit', []))}." + (f" ({p['error']})" if p.get("error") else "")]
    lines += where_the_time_goes(payload)
    if payload.get("notes"):
        lines += ["", "## Notes", "", *payload["notes"]]
    return "\n".join(lines) + "\n"


def repeat_floors(r: dict) -> dict | None:
    """One repeat's floors in seconds: ``build`` (imports + the faster tool's prompt pass + the faster write) and
    ``default`` (``build`` + the report's pair products and, where measured, its forward's products), beside the
    targets and hf_mloss's walls."""
    f, runs = r.get("floors"), r["runs"]
    mk, hf, alone = runs.get("mergekit", {}), runs.get("hf_mloss", {}), runs.get("hf_mloss_no_report", {})
    if not f or mk.get("rc") != 0:
        return None
    passes = [x["child"]["stages_s"]["gates"] for x in (hf, alone) if x.get("rc") == 0]
    passes += [mk["prompt_pass_s"]] if mk.get("prompt_pass_s") is not None else []
    prompt = min(passes) if passes else 0.0
    write = min(x for x in (f["write_s"], f.get("write_direct_s")) if x is not None)
    build = f["imports_s"] + prompt + write
    default = build + f["pair_gemm_s"] + (f.get("forward_gemm_s") or 0.0)
    return {"prompt": prompt, "write": write, "build": build, "default": default, "mergekit": mk["wall_s"],
            "hf": hf.get("wall_s") if hf.get("rc") == 0 else None,
            "alone": alone.get("wall_s") if alone.get("rc") == 0 else None}


def floors_section(payload: dict) -> list[str]:
    """The floors each repeat measured (``floors_main``), the targets in seconds against them, and hf_mloss's walls
    over the floors (the ratios a target below its floor is restated as)."""
    rows = [(r, repeat_floors(r)) for r in payload["repeats"]]
    rows = [(r, x) for r, x in rows if x]
    if not rows:
        return []
    f0 = rows[0][0]["floors"]
    lines = ["", "## Floors", "",
             "Measured after each repeat, in a process of their own, after the written pages had reached the disk: "
             "`imports`, a fresh interpreter importing torch, transformers and the base's model class; `write`, "
             f"{f0['write_bytes'] / 1e9:.2f} GB (the MoE in bf16) written into a new file beside the outputs from "
             "one buffer already in memory (nothing read, nothing checked)" + (
                 ", through the page cache and with `O_DIRECT` (`write direct`; the faster counts)"
                 if "write_direct_s" in f0 else "") + "; `pair products`, the float32 products "
             "the expert-pair M-Loss cannot skip (every expert's gate and up projections at every layer and "
             f"report position: {f0['pair_gemm_flop'] / 1e9:.0f} GFLOP)" + (
                 "; `forward products`, the float32 products of the report's forward of the MoE at the same "
                 "positions (attention projections, then the routed and shared experts up to the last router: "
                 f"{f0['forward_gemm_flop'] / 1e9:.0f} GFLOP)" if f0.get("forward_gemm_flop") else "")
             + f", on {f0['threads']} threads. `prompt pass`: "
             "the faster of the two tools' own (hf_mloss's `gates` stage, mergekit-moe's progress bar). The build "
             "floor is imports + prompt pass + write, what building this MoE costs any tool here before it reads a "
             "source; the default run's adds the report's products. Each run starts after the previous one's pages "
             "reached the disk (`sync`).", "",
             "| run | imports s | prompt pass s | write s | write direct s | pair products s | forward products s "
             "| build floor s | default floor s | mergekit-moe s | 0.5 × mergekit-moe (build target) | 1.0 × "
             "(default target) | build alone / its floor | default run / its floor |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def seconds(value: float | None) -> str:
        return "-" if value is None else f"{value:.1f}"

    for r, x in rows:
        f = r["floors"]
        alone = f"{x['alone'] / x['build']:.3f}" if x["alone"] else "-"
        default = f"{x['hf'] / x['default']:.3f}" if x["hf"] else "-"
        lines.append(f"| {r['repeat'] + 1} | {f['imports_s']:.1f} | {x['prompt']:.1f} | {f['write_s']:.1f} | "
                     f"{seconds(f.get('write_direct_s'))} | {f['pair_gemm_s']:.1f} | "
                     f"{seconds(f.get('forward_gemm_s'))} | {x['build']:.1f} | {x['default']:.1f} | "
                     f"{x['mergekit']:.1f} | "
                     f"{0.5 * x['mergekit']:.1f}{' (below the floor)' if 0.5 * x['mergekit'] < x['build'] else ''} | "
                     f"{x['mergekit']:.1f}{' (below the floor)' if x['mergekit'] < x['default'] else ''} | "
                     f"{alone} | {default} |")
    return lines


def _changes(dirty: list[str] | bool | None) -> str:
    if isinstance(dirty, list) and dirty:
        return f"changed since in {', '.join(dirty)}"
    return "with uncommitted changes" if dirty else "hf_mloss and the benchmark's files as committed"


def where_the_time_goes(payload: dict) -> list[str]:
    """hf_mloss's stages against mergekit's whole run, mean over the repeats: what the ratios are made of."""
    repeats = [r for r in payload["repeats"] if r["runs"].get("hf_mloss", {}).get("rc") == 0
               and r["runs"].get("mergekit", {}).get("rc") == 0]
    if not repeats:
        return []

    def mean(values: list[float]) -> float:
        return sum(values) / len(values)

    stages = {k: mean([r["runs"]["hf_mloss"]["child"]["stages_s"].get(k, 0.0) for r in repeats])
              for k in repeats[0]["runs"]["hf_mloss"]["child"]["stages_s"]}
    mk_wall = mean([r["runs"]["mergekit"]["wall_s"] for r in repeats])
    mk_rss = mean([r["runs"]["mergekit"]["max_rss_mb"] for r in repeats])
    hf_wall = mean([r["runs"]["hf_mloss"]["wall_s"] for r in repeats])
    start = mean([r["runs"]["hf_mloss"]["child"]["before_build_s"] for r in repeats])
    extra = stages.get("routing", 0.0) + stages.get("mloss", 0.0)
    prompt_pass = [r["runs"]["mergekit"].get("prompt_pass_s") for r in repeats]
    theirs = (f"; mergekit-moe's own prompt pass took {mean(prompt_pass):.0f} s by its progress bar, on torch's "
              "default threads" if all(x is not None for x in prompt_pass) else "")
    shared = hf_wall - extra
    return ["", "## Where the time goes", "",
            f"Means over the {len(repeats)} runs. mergekit-moe: {mk_wall:.1f} s and {mk_rss:.0f} MB in all, so "
            f"the targets are {TARGETS['wall'] * mk_wall:.1f} s and {TARGETS['rss'] * mk_rss:.0f} MB. hf_mloss: "
            f"{hf_wall:.1f} s, of which {start:.1f} s before `build_moe` (interpreter, imports, the config's checks), "
            + ", ".join(f"{k} {v:.1f} s" for k, v in stages.items()) + ". The router rows (`gates`" + theirs +
            ") and the weights (`write`) are what mergekit-moe computes too; " + _report_stages(stages) +
            f", and take {extra:.1f} s together "
            f"({extra / mk_wall:.2f} × mergekit-moe's whole run). The rest of hf_mloss's run took {shared:.1f} s "
            f"({shared / mk_wall:.2f} × mergekit-moe's)."]


def _report_stages(stages: dict) -> str:
    """What the report's stages computed: one pass since round 16, a forward of the dense experts before it."""
    if "mloss" in stages:
        return ("the routing report (`routing`: the built MoE's forward over every expert's positive prompts) and "
                "each expert pair's M-Loss (`mloss`: the dense experts' own forwards in float32) are not")
    return ("the routing report and each expert pair's M-Loss (`routing`: one pass of the built MoE, read in float32, "
            "over every expert's positive prompts, the pairs' gaps taken on the inputs it gives its experts) are not")


def print_table(payload: dict) -> None:
    for r in payload["repeats"]:
        for who in r["order"]:
            x = r["runs"][who]
            if x.get("rc") == 0:
                print(f"run {r['repeat'] + 1} {who:17s} wall {x['wall_s']:7.1f} s  CPU {x['cpu_s']:7.1f} s  peak "
                      f"RSS {x['max_rss_mb']:7.0f} MB  other cores {x['contention'].get('other_cores')}")
        for who, values in r["ratios"].items():
            for key, v in values.items():
                print(f"run {r['repeat'] + 1} {who:17s} / mergekit {key:4s} {v['ratio']:.3f}" +
                      (f"  (target ≤ {v['target']}: {'met' if v['met'] else 'NOT met'})" if "target" in v else ""))


def portable(value, roots: dict[str, str]):
    """``value`` with every folder of ``roots`` replaced by its name, the longest folder first (a folder inside
    another keeps its own name)."""
    if isinstance(value, dict):
        return {k: portable(v, roots) for k, v in value.items()}
    if isinstance(value, list):
        return [portable(v, roots) for v in value]
    if isinstance(value, str):
        for root, name in sorted(roots.items(), key=lambda item: -len(item[0])):
            value = value.replace(root, name)
    return value


def main_run(args) -> int:
    os.environ.setdefault("HF_MLOSS_PEER_ENVS", str(Path.home() / ".cache" / "hf_mloss" / "peer-envs"))
    tag = args.tag or (SHAPE + (f"-{args.layers}L" if args.layers else "") + "_cpu")
    cache = Path(args.cache).resolve()
    work = cache / "runs" / tag
    (work / "out").mkdir(parents=True, exist_ok=True)
    started = {"generated": _dt.datetime.now().isoformat(timespec="seconds"), "loadavg": os.getloadavg(),
               **_tree()}  # the tree as the runs start
    _log(f"inputs under {cache} ...")
    setup = run_job({"name": "setup", "kind": "setup", "cache": str(cache), "work": str(work), "layers": args.layers,
                     "experts": args.experts, "positive": args.positive, "negative": args.negative}, work,
                    args.timeout)
    if "error" in setup:
        raise SystemExit(f"creating the inputs failed: {setup['error']}")
    s = setup["child"]
    _log(f"{args.experts} experts of {s['num_params'] / 1e6:.1f} M parameters (created {s['created'] or 'none'} in "
         f"{s['create_s']} s); {s['prompts']} prompts; config {s['config_path']}")
    repeats = []
    with ms.RssGuard(args.rss_limit_gb * 1024) as guard:
        for repeat in range(args.repeats):
            repeats.append(run_repeat(args, s, work, repeat))
    parity = None
    hf_out, mk_out = work / "out" / "hf_mloss" / "moe", work / "out" / "mergekit" / "moe"
    if hf_out.is_dir() and mk_out.is_dir():
        job = run_job({"name": "parity", "kind": "parity", "hf": str(hf_out), "mergekit": str(mk_out)}, work,
                      args.timeout)
        parity = job.get("child") or {"error": job.get("error")}
    if not args.keep_outputs:
        shutil.rmtree(work / "out", ignore_errors=True)
    parent_rss = ms._proc_status_mb("VmHWM")
    machine = ms.machine_info(argparse.Namespace(device="cpu"))
    setup_record = s | {"experts": args.experts, "positive": args.positive, "negative": args.negative,
                        "config_shape": s["config"]}
    payload = {"tag": tag, "generated": started["generated"], "command": "python benchmarks/moe_speed.py " +
               " ".join(shlex.quote(a) for a in args.argv), "commit": started.get("commit"),
               "dirty": started.get("dirty"), "machine": machine,
               "env": {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "HF_MLOSS_THREADS", "MKL_NUM_THREADS")},
               "setup": setup_record, "hf_args": args.hf_args, "targets": TARGETS, "repeats": repeats,
               "parity": parity, "rss_guard_killed": guard.killed, "parent_vmhwm_mb": parent_rss,
               "met": met_counts(repeats), "notes": args.note}
    results = Path(args.results_dir).resolve()
    roots = {str(cache): "CACHE", str(REPO): "REPO", str(Path.home()): "HOME"}
    if not results.is_relative_to(REPO):
        roots[str(results)] = "out"  # a results folder outside the tree is named by its role, as merge_speed does
    payload = portable(payload, roots)
    results.mkdir(parents=True, exist_ok=True)
    (results / f"moe_speed_{tag}.json").write_text(json.dumps(payload, indent=1) + "\n")
    (results / f"moe_speed_{tag}.md").write_text(render_markdown(payload))
    print_table(payload)
    _log(f"wrote {results / f'moe_speed_{tag}.md'} and .json")
    return 0


def _tree() -> dict:
    """The commit this tree is at and whether it has uncommitted changes (``git``, when there is one)."""
    import subprocess

    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO,
                                timeout=30, check=False).stdout.strip()
        changed = subprocess.run(["git", "status", "--porcelain", "--", *MEASURED_PATHS], capture_output=True,
                                 text=True, cwd=REPO, timeout=30, check=False).stdout.split("\n")
    except (OSError, subprocess.SubprocessError):
        return {}
    return {"commit": commit or None, "dirty": [line[3:] for line in changed if line.strip()]}


MEASURED_PATHS = ("hf_mloss", "benchmarks/moe_speed.py", "benchmarks/merge_speed.py", "benchmarks/peers")
"""What the record's numbers depend on in this tree: a change there since the commit is named in the record."""


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--child", metavar="SPEC", help=argparse.SUPPRESS)
    ap.add_argument("--layers", type=int, default=None, help="cut the 24 layers of the 0.5B shape to N")
    ap.add_argument("--experts", type=int, default=4)
    ap.add_argument("--positive", type=int, default=8, help="positive prompts per expert (at most 8)")
    ap.add_argument("--negative", type=int, default=2, help="negative prompts per expert (at most 2)")
    ap.add_argument("--repeats", type=int, default=2, help="each repeat runs both tools, alternating the order")
    ap.add_argument("--hf-args", nargs="*", default=[], help="extra `hf-mloss moe` flags for its runs")
    ap.add_argument("--no-mloss-run", action="store_true",
                    help="also time `hf-mloss moe --no-mloss` in each repeat (informational: the card's M-Loss cost)")
    ap.add_argument("--no-report-run", action="store_true",
                    help="also time `hf-mloss moe --no-report` in each repeat (the build alone, judged at 0.5 ×)")
    ap.add_argument("--note", action="append", default=[], help="a line for the record's Notes section")
    ap.add_argument("--render", metavar="JSON", help="write the Markdown of a results file again (no run)")
    ap.add_argument("--timeout", type=float, default=3600.0, help="per run, seconds")
    ap.add_argument("--rss-limit-gb", type=float, default=20.0, help="kill a run whose process tree goes above")
    ap.add_argument("--cache", default=str(DEFAULT_CACHE))
    ap.add_argument("--results-dir", default=str(DEFAULT_RESULTS))
    ap.add_argument("--tag", default=None, help="results file suffix (default: qwen2.5-0.5b[-NL]_cpu)")
    ap.add_argument("--keep-outputs", action="store_true", help="keep both MoEs under the cache")
    args = ap.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    return args


def rerender(path: str, notes: list[str]) -> int:
    """Write the Markdown of a results JSON again with the current report code (``--note`` lines replace its
    notes when given)."""
    source = Path(path)
    payload = json.loads(source.read_text())
    if notes:
        payload["notes"] = notes
        source.write_text(json.dumps(payload, indent=1) + "\n")
    source.with_suffix(".md").write_text(render_markdown(payload))
    print_table(payload)
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        return child_main(args.child)
    if args.render:
        return rerender(args.render, args.note)
    return main_run(args)


if __name__ == "__main__":
    raise SystemExit(main())
