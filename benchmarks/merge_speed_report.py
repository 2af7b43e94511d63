"""Ratios and Markdown of ``merge_speed.py`` results: every repeat's table and ratios, and the targets over repeats.

Kept apart from the runner so that ``merge_speed.py --render RESULTS.json`` can re-write the Markdown of a results
file, and so that each function stays short.
"""

from __future__ import annotations

CPU_NOTE = "CPU-time basis, informational (less sensitive to other jobs on the cores)"
TARGETS = {
    "ties_tensor_vs_mergekit_wall": 0.2,
    "ties_tensor_vs_mergekit_rss": 0.5,
    "m_ties_vs_mergekit_wall": 0.5,
    "tsv_m_vs_mergekit_wall": 0.25,
    "tsv_m_vs_svd_floor_f64": 1.5,
    "m_ties_vs_floor": 1.25,
    "score_vs_floor": 1.2,
    "compatibility_vs_score_own": 1.5,
    "select_m_ties_vs_m_ties": 3.0,
    "l14_m_ties_rss_gb": 4.0,
    "regmean_plusplus_vs_score_own": 1.3,
    "regmean_plusplus_rss_vs_score_own": 1.25,
    "auto_vs_slowest_candidate": 3.0,
    "regmean_plusplus_own_vs_pooled": 1.1,
    "wudi_vs_tsv_m_wall": 2.0,
    "wudi_vs_tsv_m_rss": 1.0,
    "cart_vs_tsv_m_wall": 1.0,
    "tsv_m_svc_vs_tsv_m_wall": 1.5,
    "task_arithmetic_svc_vs_task_arithmetic_wall": 1.5,
}
DECODER_TARGETS = {"ties_tensor_vs_mergekit_wall": 0.5, "compatibility_vs_own_floor": 1.3}
SHAPE_TARGETS = {"llama2-7b": {"ties_tensor_vs_mergekit_wall": 0.3}}
"""Targets of one shape (issue 75: a 7B decoder's TIES against mergekit-yaml)."""
"""The targets set otherwise, or only, for decoder shapes (data-free merges of a bf16 LLM against mergekit; the
compatibility report against the q own forwards it must run)."""
HF_NAMES = ("ties_tensor", "ties_tensor_mk", "ties_global", "dare", "task_arithmetic", "m_ties", "m_ties_bf16",
            "select_m_ties", "ties_global_fb", "tsv_m", "iso_c", "iso_cts", "regmean", "regmean_plusplus",
            "regmean_own", "regmean_plusplus_own", "auto", "auto2", "wudi", "cart", "tsv_m_svc", "task_arithmetic_svc")
MEASURE_RUNS = ("forward", "read", "svd_floor", "wudi_floor", "svc_floor", "score", "score_bf16", "score_own",
                "compatibility")
DESCRIPTIONS = {
    "read": "every tensor of base + q fine-tunes read onto the device as stored (safetensors); inner = faster pass",
    "wudi_floor": "WUDI's floor here: its 400 τ·G products per matrix alone (mean of 3 steps per shape × count × 400); "
                  "inner = that",
    "svc_floor": "SVC's floor here: the float64 Gram of each merged task matrix on its smaller side and its "
                 "eigenvectors (mean of 2 per shape × count); inner = the faster of default threads and one",
    "svd_floor": "TSV-M's eigensolve floor here: its q + 2 symmetric eigenvalue solves per matrix alone "
                 "(eigvalsh of random matrices of those sizes); inner = fastest float32 pass",
    "forward": "plain CLIPVisionModel forward (fp32, inference_mode); inner = fastest pass (default threads or 1)",
    "score": "hf_mloss.score(prefix='base'), fp32",
    "score_bf16": "hf_mloss.score(prefix='base'), compute_dtype=bfloat16",
    "score_own": "hf_mloss.score(prefix='own'), fp32 (q own forwards)",
    "compatibility": "hf_mloss.compatibility() (every pair, leave-one-out, the whole set, task-vector baselines)",
    "ties_tensor": "hf_mloss ties, scope tensor (default convention)",
    "ties_tensor_mk": "hf_mloss ties, convention mergekit (exact k by argsort; parity run)",
    "ties_global": "hf_mloss ties, scope global (exact two-pass threshold)",
    "dare": "hf_mloss dare (DARE-TIES, p=0.7)",
    "task_arithmetic": "hf_mloss task_arithmetic (λ=0.3)",
    "m_ties": "hf_mloss m_ties (k=0.2, e=0.1, prefix merged)",
    "m_ties_bf16": "hf_mloss m_ties, same, compute_dtype=bfloat16 (scoring in bf16)",
    "select_m_ties": "hf_mloss m_ties, select='unlabeled' over k × λ = 3 × 3 (e=0.1)",
    "ties_global_fb": "hf_mloss ties, global, convention fusion_bench",
    "tsv_m": "hf_mloss tsv_m (top ⌊r/q⌋ components per task, λ=1)",
    "iso_c": "hf_mloss iso_c (λ=1)",
    "iso_cts": "hf_mloss iso_cts (λ=1)",
    "regmean": "hf_mloss regmean (Gram matrices of every linear's inputs, own prefix)",
    "regmean_plusplus": "hf_mloss regmean_plusplus (the same on the merged prefix)",
    "regmean_own": "hf_mloss regmean, each model its own N / q of the images (models' own data)",
    "regmean_plusplus_own": "hf_mloss regmean_plusplus, each model its own N / q of the images (models' own data)",
    "auto": "hf_mloss auto (default candidates on 6 λ each: TSV-M, Iso-C, Iso-CTS, TIES, TA, RegMean++; output "
            "criterion)",
    "auto2": "hf_mloss auto between two candidates (TIES, TA on 6 λ each; output criterion)",
    "wudi": "hf_mloss wudi (400 Adam steps per matrix at lr 1e-5, λ=1)",
    "cart": "hf_mloss cart (rank 8 % of each centred task matrix, λ=1)",
    "tsv_m_svc": "hf_mloss tsv_m (λ=1), calibrate='svc' (α=1)",
    "task_arithmetic_svc": "hf_mloss task_arithmetic (λ=0.3), calibrate='svc' (α=0.1)",
    "mergekit_ties": "mergekit-yaml ties (density 0.2, normalize)",
    "mergekit_1t_ties": "mergekit-yaml ties, OMP_NUM_THREADS=1",
    "fusion_bench_ties": "fusion-bench TiesMergingAlgorithm (dis-mean)",
}


def _ok(res: dict | None) -> bool:
    return bool(res) and "error" not in res and "skipped" not in res


def _inner(res: dict) -> float | None:
    return (res.get("child") or {}).get("inner_s")


def _inner_cpu(res: dict) -> float | None:
    return (res.get("child") or {}).get("inner_cpu_s")


# ============================================================================================ ratios
class Ratios(dict):
    """``key → {value, num, den, target, meets_target, note}``."""

    def add(self, key: str, num, den, target: float | None = None, note: str = "") -> None:
        if num is None or den is None or den <= 0:
            return
        value = num / den
        self[key] = {"value": value, "num": num, "den": den, "target": target, "note": note,
                     "meets_target": (value <= target) if target is not None else None}


def scored_share(p: dict) -> float:
    """Multiply-adds of the q-source part of the base-prefix scorer per source, as a share of one block's: the
    scored linear(s) of each source over its linear layers (attention scores and norms left out: at 128 tokens
    ~1.5 % of a decoder block).

    A CLIP block (MLP d → f → d, f = 4d): fc1 is d·f of 4d² + 2·d·f = 1/3. A gated decoder block (Qwen2, Llama): the
    gap needs each source's gate AND up projections, 2·d·f of d·(2d + 2·kv·h) + 3·d·f; for Qwen2.5-0.5B
    (d 896, f 4864, 2 KV heads of 64) that is 0.585, not 1/3 (the floor was (1 + q/3)·F before).
    """
    config = (p.get("models") or {}).get("config") or {}
    d, f = config.get("hidden_size"), config.get("intermediate_size")
    if not d or not f:
        return 1 / 3
    if not is_decoder(p):
        return d * f / (4 * d * d + 2 * d * f)
    head = d // config["num_attention_heads"]
    kv = config.get("num_key_value_heads") or config["num_attention_heads"]
    return 2 * d * f / (d * (2 * d + 2 * kv * head) + 3 * d * f)


def floor_figures(runs: dict, q: int, share: float = 1 / 3) -> dict:
    """F (fastest plain forward), the scoring floor (1 + q·share)·F (``share``: :func:`scored_share`), and their
    CPU-time versions."""
    fwd = runs.get("forward")
    if not _ok(fwd):
        return {}
    child = fwd["child"]
    default = [p["wall_s"] for p in child.get("passes", []) if p.get("threads") == child.get("torch_threads")]
    forwards = 1 + q * share
    return {"forward_s": child["inner_s"], "forward_threads": child.get("inner_threads"),
            "forward_default_threads_s": min(default) if default else None, "floor_forwards": forwards,
            "scored_share": share, "score_floor_s": forwards * child["inner_s"], "own_floor_s": q * child["inner_s"],
            "score_floor_cpu_s": forwards * child["inner_cpu_s"], "score_floor_q3_s": (1 + q / 3) * child["inner_s"]}


def tsv_floor_ratios(ratios: Ratios, runs: dict) -> None:
    """TSV-M's inner time over its eigensolve floor (the float64 eigenvalue solves alone) and over the float64 work
    its eigen route cannot skip (``svd_floor``'s ``algorithm_floor_s``)."""
    tsv, floor = runs.get("tsv_m"), runs.get("svd_floor")
    if not (_ok(tsv) and _inner(tsv) is not None and _ok(floor)):
        return
    child = floor["child"]
    if child.get("float64_s"):
        ratios.add("tsv_m_vs_svd_floor_f64", _inner(tsv), child["float64_s"], TARGETS["tsv_m_vs_svd_floor_f64"],
                   "tsv_m's inner time / its q + 2 float64 eigenvalue solves per matrix (eigvalsh)")
    if child.get("algorithm_floor_s"):
        ratios.add("tsv_m_vs_algorithm_floor", _inner(tsv), child["algorithm_floor_s"], None,
                   "tsv_m's inner time / the float64 work its eigen route cannot skip (q Grams, the eigenvectors of "
                   "the q + 2 problems, the polar factors applied)")


def mergekit_ratios(ratios: Ratios, runs: dict, q: int, targets: dict = TARGETS) -> None:
    tsv_floor_ratios(ratios, runs)
    mk, tt, mt = runs.get("mergekit_ties"), runs.get("ties_tensor"), runs.get("m_ties")
    if not (_ok(mk) and mk.get("tasks") == q):
        return
    wall = "process wall incl. imports, load and save, both sides"
    if _ok(tt):
        ratios.add("ties_tensor_vs_mergekit_wall", tt["wall_s"], mk["wall_s"], targets["ties_tensor_vs_mergekit_wall"],
                   wall)
        ratios.add("ties_tensor_vs_mergekit_rss", tt["max_rss_mb"], mk["max_rss_mb"],
                   targets["ties_tensor_vs_mergekit_rss"], "peak RSS (os.wait4 ru_maxrss)")
        ratios.add("ties_tensor_vs_mergekit_cpu", tt["cpu_s"], mk["cpu_s"], None, f"process CPU (user+sys); {CPU_NOTE}")
    if _ok(mt):
        ratios.add("m_ties_vs_mergekit_wall", mt["wall_s"], mk["wall_s"], TARGETS["m_ties_vs_mergekit_wall"], wall)
        ratios.add("m_ties_vs_mergekit_cpu", mt["cpu_s"], mk["cpu_s"], None, f"process CPU (user+sys); {CPU_NOTE}")
    if _ok(runs.get("tsv_m")):
        ratios.add("tsv_m_vs_mergekit_wall", runs["tsv_m"]["wall_s"], mk["wall_s"], TARGETS["tsv_m_vs_mergekit_wall"],
                   wall + "; TSV-M against mergekit's TIES")
    if _ok(runs.get("svd_floor")):
        svd_floor_ratios(ratios, runs["svd_floor"], runs.get("tsv_m"), mk, targets["tsv_m_vs_mergekit_wall"])
    if _ok(runs.get("m_ties_bf16")):
        ratios.add("m_ties_bf16_vs_mergekit_wall", runs["m_ties_bf16"]["wall_s"], mk["wall_s"], None,
                   "process wall; M-TIES with compute_dtype=bfloat16 scoring (merge arithmetic stays fp32)")
    one = runs.get("mergekit_1t_ties")
    if _ok(one):
        for name in ("ties_tensor", "m_ties"):
            if _ok(runs.get(name)):
                ratios.add(f"{name}_vs_mergekit_1t_wall", runs[name]["wall_s"], one["wall_s"], None,
                           "process wall vs mergekit run with OMP_NUM_THREADS=1 (informational)")


def svd_floor_ratios(ratios: Ratios, floor: dict, tsv: dict | None, mk: dict, target: float) -> None:
    """What exact TSV-M's eigensolves alone would leave of ``target`` × mergekit's TIES wall: the ``svd_floor``
    run's eigenvalue solves (float32, the cheapest; float64, what meets the 1e-5 bound on flat spectra) plus,
    where ``tsv_m`` ran, its process time outside ``merge()`` (start-up, imports, saving; ``merge()`` itself reads
    the checkpoints), over mergekit's wall. Above ``target``, a TSV-M that solves these eigenproblems densely cannot
    meet ``tsv_m_vs_mergekit_wall`` on this machine; at or below it, it might."""
    ran = _ok(tsv) and _inner(tsv) is not None
    outside = tsv["wall_s"] - _inner(tsv) if ran else 0.0
    what = (f" + tsv_m's {outside:.1f} s outside merge(): start-up, imports, saving" if ran else
            " (no tsv_m run: start-up, imports and saving not counted)")
    for key, seconds, dtype in (("svd_floor_vs_mergekit_wall", _inner(floor), "float32"),
                                ("svd_floor_f64_vs_mergekit_wall", floor["child"].get("float64_s"), "float64")):
        if seconds is not None:
            ratios.add(key, seconds + outside, mk["wall_s"], None,
                       f"({dtype} eigenvalue solves{what}) / mergekit's process wall; above {target}, dense "
                       "eigensolves alone rule out tsv_m_vs_mergekit_wall here")


def floor_ratios(ratios: Ratios, runs: dict, floor: dict, targets: dict = TARGETS) -> None:
    if not floor:
        return
    for name in ("score_own", "compatibility"):  # the own-prefix walk runs q forwards: its FLOP floor is q·F
        if _ok(runs.get(name)) and "own_floor_s" in floor:
            ratios.add(f"{name}_vs_own_floor", _inner(runs[name]), floor["own_floor_s"],
                       targets.get(f"{name}_vs_own_floor"), "inner time / q·F (the q own forwards)")
    tt, mt = runs.get("ties_tensor"), runs.get("m_ties")
    if _ok(mt) and _ok(tt):
        ratios.add("m_ties_vs_floor", _inner(mt), floor["score_floor_s"] + _inner(tt), TARGETS["m_ties_vs_floor"],
                   "inner merge() times: M-TIES / ((1 + q·share)·F + per-tensor TIES merge())")
        ratios.add("m_ties_vs_floor_wall", mt["wall_s"], floor["score_floor_s"] + tt["wall_s"], None,
                   "process walls: M-TIES / ((1 + q·share)·F + per-tensor TIES process)")
        ratios.add("m_ties_vs_floor_cpu", _inner_cpu(mt), floor["score_floor_cpu_s"] + _inner_cpu(tt), None,
                   f"inner CPU times; {CPU_NOTE}")
    for name in ("score", "score_bf16"):
        if _ok(runs.get(name)):
            ratios.add(f"{name}_vs_floor", _inner(runs[name]), floor["score_floor_s"],
                       TARGETS["score_vs_floor"] if name == "score" else None,
                       "inner score() time (incl. loading the base) / (1 + q·share)·F")
            if abs(floor.get("scored_share", 1 / 3) - 1 / 3) > 1e-9:
                ratios.add(f"{name}_vs_floor_q3", _inner(runs[name]), floor["score_floor_q3_s"], None,
                           "the same against the earlier floor (1 + q/3)·F, which counts one projection per source")
            ratios.add(f"{name}_vs_floor_cpu", _inner_cpu(runs[name]), floor["score_floor_cpu_s"], None,
                       f"inner CPU times; {CPU_NOTE}")


IO_FLOOR_RUNS = ("score", "score_own", "compatibility", "ties_tensor", "task_arithmetic", "m_ties", "tsv_m", "iso_c",
                 "iso_cts")


def io_floor_ratios(ratios: Ratios, runs: dict, floor: dict, q: int) -> None:
    """Each run's inner time against the I/O floor (the ``read`` run: bytes of base + q checkpoints ÷ the measured
    read-onto-device rate) plus, for the data-guided runs, the compute floor (1 + q·share)·F: the two serial floors
    a run cannot go below without overlapping reading and computing (q·F for the own-prefix walks; informational,
    no target)."""
    read = runs.get("read")
    if not _ok(read):
        return
    io_s = _inner(read)
    for name in IO_FLOOR_RUNS:
        if not _ok(runs.get(name)):
            continue
        compute, what = 0.0, "read"
        if floor and name in ("score", "m_ties"):
            compute, what = floor["score_floor_s"], "read + (1 + q·share)·F"
        elif floor and name in ("score_own", "compatibility"):  # q own forwards
            compute, what = q * floor["forward_s"], "read + q·F"
        ratios.add(f"{name}_vs_io_floor", _inner(runs[name]), io_s + compute, None,
                   f"inner time / ({what}); read = {read['child']['bytes_read'] / 1e9:.2f} GB at "
                   f"{read['child']['read_gb_per_s']:.2f} GB/s")


def workload_ratios(ratios: Ratios, runs: dict) -> None:
    """bf16 vs fp32, compatibility vs score(own), selection vs one M-TIES merge, hf_mloss vs fusion-bench."""
    if _ok(runs.get("score")) and _ok(runs.get("score_bf16")):
        ratios.add("score_bf16_vs_fp32", _inner(runs["score_bf16"]), _inner(runs["score"]), None,
                   "bf16 autocast scoring time / fp32")
    if _ok(runs.get("compatibility")) and _ok(runs.get("score_own")):
        ratios.add("compatibility_vs_score_own", _inner(runs["compatibility"]), _inner(runs["score_own"]),
                   TARGETS["compatibility_vs_score_own"], "inner: compatibility() / score(prefix='own') of all q")
    if _ok(runs.get("select_m_ties")) and _ok(runs.get("m_ties")):
        ratios.add("select_m_ties_vs_m_ties", _inner(runs["select_m_ties"]), _inner(runs["m_ties"]),
                   TARGETS["select_m_ties_vs_m_ties"], "inner: 3 × 3 label-free selection / one M-TIES merge()")
    own, plus = runs.get("score_own"), runs.get("regmean_plusplus")
    if _ok(own) and _ok(plus):
        ratios.add("regmean_plusplus_vs_score_own", _inner(plus), _inner(own), TARGETS["regmean_plusplus_vs_score_own"],
                   "inner: regmean_plusplus merge() / score(prefix='own') of all q")
        ratios.add("regmean_plusplus_rss_vs_score_own", plus["max_rss_mb"], own["max_rss_mb"],
                   TARGETS["regmean_plusplus_rss_vs_score_own"], "peak RSS of the two processes")
    for name in ("regmean", "regmean_plusplus"):
        own, pooled = runs.get(f"{name}_own"), runs.get(name)
        if _ok(own) and _ok(pooled):
            ratios.add(f"{name}_own_vs_pooled", _inner(own), _inner(pooled), TARGETS.get(f"{name}_own_vs_pooled"),
                       f"inner: {name} merge() with each model's own N / q images / with all N for every model")
    candidates = [name for name in ("tsv_m", "iso_cts", "ties_global", "task_arithmetic", "regmean_plusplus")
                  if _ok(runs.get(name))]
    if _ok(runs.get("auto")) and candidates:
        slowest = max(candidates, key=lambda name: _inner(runs[name]))
        ratios.add("auto_vs_slowest_candidate", _inner(runs["auto"]), _inner(runs[slowest]),
                   TARGETS["auto_vs_slowest_candidate"],
                   f"inner: auto merge() / the slowest single candidate merge() ({slowest}; of {', '.join(candidates)})")
    sota_ratios(ratios, runs)
    floor = runs.get("wudi_floor")
    if _ok(floor) and _ok(runs.get("wudi")):
        ratios.add("wudi_vs_wudi_floor", _inner(runs["wudi"]), _inner(floor), None,
                   "inner: wudi merge() / its 400 τ·G products per matrix alone")
    if _ok(floor) and floor.get("child", {}).get("literal_s"):
        ratios.add("wudi_floor_vs_literal_form", _inner(floor), floor["child"]["literal_s"], None,
                   "the products of the exact gradient / the literal loss's autograd steps (fusion-bench's form), "
                   "each extrapolated from per-shape steps to 400 steps of every matrix")
    svc, plain, calibrated = runs.get("svc_floor"), runs.get("task_arithmetic"), runs.get("task_arithmetic_svc")
    if _ok(svc) and _ok(plain):
        ratios.add("task_arithmetic_svc_floor_vs_task_arithmetic_wall", plain["wall_s"] + _inner(svc),
                   plain["wall_s"], None, "process wall: task arithmetic plus SVC's float64 factorisations alone / "
                   "task arithmetic (the lowest ratio any exact SVC over it can reach)")
    if _ok(svc) and _ok(plain) and _ok(calibrated):
        ratios.add("svc_added_vs_svc_floor", _inner(calibrated) - _inner(plain), _inner(svc), None,
                   "inner: what calibrating adds to task arithmetic's merge() / SVC's float64 factorisations alone")
    fb, tg = runs.get("fusion_bench_ties"), runs.get("ties_global_fb")
    if _ok(fb) and _ok(tg):
        ratios.add("ties_global_fb_vs_fusion_bench_wall", tg["wall_s"], fb["wall_s"], None,
                   f"{fb['tasks']} tasks, process wall")
        ratios.add("ties_global_fb_vs_fusion_bench_rss", tg["max_rss_mb"], fb["max_rss_mb"], None,
                   f"{fb['tasks']} tasks, peak RSS")


def sota_ratios(ratios: Ratios, runs: dict) -> None:
    """WUDI and CART against TSV-M, and each calibrated merge against the merge it calibrates (process wall, the
    targets; inner as information)."""
    pairs = [("wudi", "tsv_m", "wudi_vs_tsv_m"), ("cart", "tsv_m", "cart_vs_tsv_m"),
             ("tsv_m_svc", "tsv_m", "tsv_m_svc_vs_tsv_m"),
             ("task_arithmetic_svc", "task_arithmetic", "task_arithmetic_svc_vs_task_arithmetic")]
    for name, other, key in pairs:
        if not (_ok(runs.get(name)) and _ok(runs.get(other))):
            continue
        ratios.add(f"{key}_wall", runs[name]["wall_s"], runs[other]["wall_s"], TARGETS.get(f"{key}_wall"),
                   "process wall incl. imports, load and save, both sides")
        ratios.add(f"{key}_inner", _inner(runs[name]), _inner(runs[other]), None, "inner: merge() alone")
        ratios.add(f"{key}_cpu", runs[name]["cpu_s"], runs[other]["cpu_s"], None,
                   f"process CPU (user+sys); {CPU_NOTE}")
        ratios.add(f"{key}_rss", runs[name]["max_rss_mb"], runs[other]["max_rss_mb"], TARGETS.get(f"{key}_rss"),
                   "peak RSS (os.wait4 ru_maxrss)")


def rss_table(runs: dict, model_mb: float) -> dict:
    rss = {}
    for name, res in runs.items():
        if name in HF_NAMES and _ok(res):
            after = res.get("child", {}).get("vmrss_after_import_mb")
            rss[name] = {"peak_mb": res["max_rss_mb"], "over_two_models": res["max_rss_mb"] / (2 * model_mb),
                         "child_vmhwm_mb": res.get("child", {}).get("vmhwm_mb"), "after_imports_mb": after,
                         "above_imports_mb": res["max_rss_mb"] - after if after is not None else None}
    return rss


REFERENCE_SUFFIX = "@reference"
"""Suffix of the runs made under ``--reference`` (another hf_mloss tree, run side by side with this one)."""


def reference_view(runs: dict) -> dict | None:
    """The runs as the reference tree saw them: each ``X@reference`` in place of ``X`` (peers and the plain forward
    shared), so the same ratio functions give the reference's ratios; None without a reference."""
    if not any(name.endswith(REFERENCE_SUFFIX) for name in runs):
        return None
    view = {name: res for name, res in runs.items() if not name.endswith(REFERENCE_SUFFIX)}
    view.update({name[: -len(REFERENCE_SUFFIX)]: res for name, res in runs.items() if name.endswith(REFERENCE_SUFFIX)})
    return view


def summarize_repeat(repeat: dict, payload: dict) -> dict:
    summary = _summarize_runs(repeat["runs"], payload)
    view = reference_view(repeat["runs"])
    if view is not None:
        summary["reference_ratios"] = _summarize_runs(view, payload)["ratios"]
    return summary


def _summarize_runs(runs: dict, payload: dict) -> dict:
    q, model_mb = payload["q"], payload["models"]["model_bytes"] / 1e6
    floor = floor_figures(runs, q, scored_share(payload))
    ratios = Ratios()
    targets = TARGETS | DECODER_TARGETS if is_decoder(payload) else TARGETS
    targets = targets | SHAPE_TARGETS.get(payload.get("shape"), {})
    mergekit_ratios(ratios, runs, q, targets)
    floor_ratios(ratios, runs, floor, targets)
    io_floor_ratios(ratios, runs, floor, q)
    workload_ratios(ratios, runs)
    mt = runs.get("m_ties")
    if payload["shape"] == "l14" and payload["layers_override"] is None and _ok(mt):
        ratios.add("l14_m_ties_rss_gb", mt["max_rss_mb"] / 1024, 1.0, TARGETS["l14_m_ties_rss_gb"],
                   "absolute peak RSS in GB")
    return {"model_mb": model_mb, **floor, "ratios": dict(ratios), "rss_vs_models": rss_table(runs, model_mb),
            "full_depth_estimate": full_depth_estimate(runs, payload)}


def full_depth_estimate(runs: dict, payload: dict) -> dict | None:
    layers, full = payload["layers_override"], payload.get("shape_layers")
    if layers is None or full is None:
        return None
    return {"note": f"crude linear extrapolation x{full}/{layers} of the inner times (embeddings, load and save are "
                    "also scaled, so it overestimates slightly)",
            **{name: _inner(res) * full / layers for name, res in runs.items() if _ok(res) and _inner(res)}}


def summarize_repeats(payload: dict) -> dict:
    """Per repeat summaries, and for each ratio its value in every repeat and how many repeats meet its target."""
    per_repeat = [summarize_repeat(rep, payload) for rep in payload["repeats"]]
    keys = list(dict.fromkeys(k for s in per_repeat for k in s["ratios"]))
    across = {}
    for key in keys:
        values = [s["ratios"].get(key) for s in per_repeat]
        target = next((v["target"] for v in values if v), None)
        met = [v["meets_target"] for v in values if v and v["meets_target"] is not None]
        across[key] = {"target": target, "values": values, "met": sum(met), "of": len(met)}
    return {"per_repeat": per_repeat, "ratios": across}


# ============================================================================================ Markdown
def _fmt(x, nd=1) -> str:
    return "—" if x is None else f"{x:.{nd}f}"


def _load(t) -> str:
    return "(" + ", ".join(f"{x:.2f}" for x in t) + ")" if t else "—"


def header_lines(p: dict) -> list[str]:
    m, q = p["machine"], p["q"]
    shape = p["shape"] + (f" (num_hidden_layers overridden to {p['layers_override']})" if p["layers_override"] else "")
    flags = ", ".join(f"{f} {'yes' if v else 'no'}" for f, v in m.get("cpu_flags", {}).items())
    peers = "".join(f", {peer} {m[f'{peer}_versions'].get(peer.replace('_', '-'), '?')}"
                    for peer in ("mergekit", "fusion_bench") if f"{peer}_versions" in m)
    model_mb = p["models"]["model_bytes"] / 1e6
    return [
        f"# merge_speed: {shape}, q = {q}, device {p['device']}, {len(p['repeats'])} run(s)", "",
        f"- Date (UTC): {m['date_utc']}",
        f"- Command: `{m['command']}` (cwd `{m['cwd']}`)",
        f"- CPU: {m['cpu_model']}, {m['cpu_affinity'] or m['cpu_count']} usable cores (torch threads "
        f"{m['torch_threads']}), {m['ram_gb']} GB RAM" + (f", GPU {m['gpu']}" if m.get("gpu") else ""),
        f"- CPU flags: {flags} (every flag is in the JSON, `machine.cpu_flags_all`)",
        f"- Software: Python {m['python']}, torch {m['torch']}, transformers {m['transformers']}, "
        f"hf_mloss {m['hf_mloss']}{peers}",
        f"- Load average (1/5/15 min) at the start {_load(m['loadavg_start'])}, at the end {_load(m['loadavg_end'])}. "
        "Each table gives, per run, the cores other processes used while it ran (/proc/stat busy time minus the "
        "run's own CPU time).",
        inputs_line(p, q, model_mb),
        f"- TIES everywhere: keep k = {p['k']} (mergekit density {p['k']}, fusion-bench threshold {p['k'] * 100:g}), "
        "λ = 1, disjoint mean.", "",
        "Wall, CPU (user+sys) and peak RSS are per process (`os.wait4` rusage of the child; peers measured by "
        "`benchmarks/peers/run_peer.py` the same way). They include interpreter start-up, imports, loading and "
        "saving. *inner* is the library call alone: `merge()`, `score()`, `compatibility()`, the forward loop, or "
        "fusion-bench's merge step." + (
            " *peak anon / file*: the highest `RssAnon` (the process's own allocations) and `RssFile` (pages of "
            "mapped files such as the safetensors inputs) of the child itself, sampled every 20 ms from "
            "/proc; peak RSS counts both." if any("peak_rss_anon_mb" in run for rep in p["repeats"]
                                                  for run in rep["runs"].values()) else ""), "",
    ]


DATA_RUNS = (*(n for n in MEASURE_RUNS if n not in ("read", "svd_floor", "wudi_floor", "svc_floor")), "m_ties",
             "m_ties_bf16", "select_m_ties", "regmean", "regmean_plusplus", "regmean_own", "regmean_plusplus_own",
             "auto", "auto2")
"""The runs that read the scoring data (images or token sequences)."""


def is_decoder(p: dict) -> bool:
    return (p.get("inputs") or {}).get("kind") == "decoder"


def inputs_line(p: dict, q: int, model_mb: float) -> str:
    """What the runs were given: a CLIP vision tower on images, or a decoder on token sequences."""
    tv = (f"{q} fine-tunes = base + task vector (std {p['task_vectors']['std']}, per-tensor scale "
          f"{p['task_vectors']['per_tensor_scale']})")
    params = p["models"]["num_params"] / 1e6
    if is_decoder(p):
        i = p["inputs"]
        used = any(name.split("@")[0] in DATA_RUNS for rep in p["repeats"] for name in rep["runs"])
        data = (f"{p['num_samples']} random token sequences × {i['seq_len']} tokens ({i['data']}), batch "
                f"{p['batch_size']}" if used else "no data (data-free merges only)")
        return (f"- Inputs: random-init {i['family']} decoder (`*ForCausalLM`; {params:.2f} M params, vocab "
                f"{i['vocab_size']}, hidden {i['hidden_size']}, {i['num_hidden_layers']} blocks, "
                f"{'tied' if i['tie_word_embeddings'] else 'untied'} input/output embeddings), {model_mb:.1f} MB "
                f"{i['dtype']} safetensors each; {tv}, saved in {i['dtype']}; {data}. Merges write {i['dtype']} "
                "(mergekit too). Checkpoints are in the page cache (warm reads).")
    return (f"- Inputs: random-init CLIP vision tower ({params:.2f} M params, {model_mb:.1f} MB fp32 safetensors "
            f"each), {tv}; {p['num_samples']} random images (preprocessed tensor), batch {p['batch_size']}. "
            "Checkpoints are in the page cache (warm reads).")


def reference_lines(p: dict) -> list[str]:
    """Every ratio of this tree beside the same ratio of the --reference tree, per run."""
    per_repeat = p["summary"]["per_repeat"]
    if not any("reference_ratios" in s for s in per_repeat):
        return []
    keys = list(dict.fromkeys(k for s in per_repeat for k in s["ratios"]))
    n = len(per_repeat)
    lines = [f"## This tree against the reference tree (`--reference {p['machine'].get('reference', '')}`)", "",
             "Each hf_mloss run was made twice in a row, under this tree and under the reference tree; the ratios "
             "below are computed the same way on each tree's runs (peers and the plain forward shared).", "",
             "| ratio | target | " + " | ".join(f"run {i + 1}: this / reference" for i in range(n)) + " |",
             "|---|---|" + "---|" * n]
    for key in keys:
        cells = []
        for s in per_repeat:
            ours, theirs = s["ratios"].get(key), s.get("reference_ratios", {}).get(key)
            cells.append(f"{ours['value']:.3f} / {theirs['value']:.3f}" if ours and theirs else
                         f"{ours['value']:.3f} / —" if ours else "—")
        target = next((s["ratios"][key]["target"] for s in per_repeat if key in s["ratios"]), None)
        lines.append(f"| {key} | {'≤ ' + str(target) if target is not None else ''} | " + " | ".join(cells) + " |")
    runs = [r["runs"] for r in p["repeats"]]
    for name in dict.fromkeys(n[: -len(REFERENCE_SUFFIX)] for rs in runs for n in rs if n.endswith(REFERENCE_SUFFIX)):
        cells = []
        for rs in runs:
            ours, theirs = rs.get(name), rs.get(name + REFERENCE_SUFFIX)
            ok = _ok(ours) and _ok(theirs) and _inner(ours) and _inner(theirs)
            cells.append(f"{_inner(ours) / _inner(theirs):.3f} ({_inner(ours):.1f} / {_inner(theirs):.1f} s)" if ok
                         else "—")
        lines.append(f"| {name}: inner time | | " + " | ".join(cells) + " |")
    return lines + [""]


def targets_lines(p: dict) -> list[str]:
    across = p["summary"]["ratios"]
    n = len(p["repeats"])
    lines = [f"## Targets over the {n} run(s)", "",
             "| ratio | target | " + " | ".join(f"run {i + 1}: value (num / den)" for i in range(n)) + " | met |",
             "|---|---|" + "---|" * n + "---|"]
    for key, v in across.items():
        if v["target"] is None:
            continue
        cells = [f"{x['value']:.3f} ({x['num']:.1f} / {x['den']:.1f})" if x else "—" for x in v["values"]]
        lines.append(f"| {key} | ≤ {v['target']} | " + " | ".join(cells) + f" | {v['met']} of {v['of']} |")
    return lines + [""]


def runs_table_lines(rep: dict, p: dict) -> list[str]:
    q, model_mb = p["q"], p["models"]["model_bytes"] / 1e6
    cuda = str(p.get("device", "cpu")).startswith("cuda")
    split = any("peak_rss_anon_mb" in res for res in rep["runs"].values())  # records since the split was sampled
    lines = ["| run | library / method | tasks | wall s | inner s | CPU s | CPU/wall | peak RSS MB | RSS / (2 × model) "
             "| others' cores |" + (" peak anon / file MB |" if split else "") + (" peak CUDA MB |" if cuda else ""),
             "|---|---|---|---|---|---|---|---|---|---|" + ("---|" if split else "") + ("---|" if cuda else "")]
    for name, res in rep["runs"].items():
        kind = name.removesuffix(REFERENCE_SUFFIX)  # a --reference tree's run is described as this tree's
        label, tasks = DESCRIPTIONS.get(kind, name), res.get("tasks", q)
        if name == "forward" and is_decoder(p):
            label = "plain bare-decoder forward (AutoModel, fp32, inference_mode, no lm_head); inner = fastest pass"
        if "skipped" in res or "error" in res:
            what = f"skipped: {res['skipped']}" if "skipped" in res else f"FAILED: {res['error'][:200]!r}"
            lines.append(f"| {name} | {label} | {tasks} | {what} | | | | | | |" + (" |" if split else "")
                         + (" |" if cuda else ""))
            continue
        rel = res["max_rss_mb"] / (2 * model_mb) if kind not in MEASURE_RUNS else None
        others = res.get("contention", {}).get("other_cores")
        lines.append(f"| {name} | {label} | {'—' if name == 'forward' else tasks} | {_fmt(res['wall_s'])} | "
                     f"{_fmt(_inner(res))} | {_fmt(res['cpu_s'])} | {_fmt(res['cpu_s'] / res['wall_s'], 2)} | "
                     f"{res['max_rss_mb']:.0f} | {_fmt(rel, 2) if rel is not None else ''} | {_fmt(others, 2)} |"
                     + (f" {_split(res)} |" if split else "")
                     + (f" {_fmt(res.get('child', {}).get('cuda_max_allocated_mb'), 0)} |" if cuda else ""))
    warm = [f"{name} {res['warm_read']['s']:.1f} s" for name, res in rep["runs"].items() if "warm_read" in res]
    if warm:  # records since the inputs are read once before each run
        lines += ["", "Before each hf_mloss run its inputs were read once, untimed, so that it reads them from the page "
                  "cache (a read of the files from the disk shows here as a slow one): " + ", ".join(warm) + "."]
    return lines + [""]


def _split(res: dict) -> str:
    """The sampled peaks of the run's own allocations and of its mapped file pages (see ``RssSampler``)."""
    anon, file = res.get("peak_rss_anon_mb"), res.get("peak_rss_file_mb")
    return "" if anon is None else f"{anon:.0f} / {file:.0f}" if file is not None else f"{anon:.0f} / -"


def forward_line(rep: dict, summary: dict, p: dict) -> list[str]:
    fwd = rep["runs"].get("forward")
    if not _ok(fwd) or "forward_s" not in summary:
        return []
    passes = ", ".join(f"{x['wall_s']:.2f} s ({x.get('threads', '?')} thr)" for x in fwd["child"]["passes"])
    what = (f"sequences of {p['inputs']['seq_len']} tokens (bare decoder, fp32, no lm_head)" if is_decoder(p) else
            "images")
    return [f"Forward F = {summary['forward_s']:.2f} s for {p['num_samples']} {what}, the fastest pass (passes: "
            f"{passes}; attention {fwd['child'].get('attn_implementation')}). Scoring floor (1 + q·share)·F = "
            f"{summary['floor_forwards']:.2f} × F = {summary['score_floor_s']:.1f} s, share = "
            f"{summary.get('scored_share', 1 / 3):.3f}: the multiply-adds of each source's scored projection(s) over "
            "a block's (1/3 for a CLIP block's fc1; a gated decoder's gap needs gate and up).", ""]


def svd_floor_line(rep: dict) -> list[str]:
    floor = rep["runs"].get("svd_floor")
    if not _ok(floor):
        return []
    child = floor["child"]
    passes = ", ".join(f"{x['dtype']} {x['wall_s']:.2f} s ({x['threads']} thr)" for x in child["passes"])
    tsv = rep["runs"].get("tsv_m")
    against = (f"; tsv_m's inner time is {_inner(tsv) / child['float64_s']:.2f}× the float64 floor"
               if _ok(tsv) and _inner(tsv) else "")
    if "algorithm_floor_s" in child:
        against += (f". The work its float64 eigen route cannot skip (the q Gram products and the eigenvectors of "
                    f"all q + 2 problems, the polar factors applied) takes {child['algorithm_floor_s']:.2f} s")
        if _ok(tsv) and _inner(tsv):
            against += f": tsv_m's inner time is {_inner(tsv) / child['algorithm_floor_s']:.2f}× that"
    return [f"TSV-M floor: {child['problems']} eigenproblems for {child['matrices']} matrices (largest "
            f"{child['largest']} × {child['largest']}), eigenvalue solves only (eigvalsh): {passes}{against}.", ""]


def ratio_lines(summary: dict) -> list[str]:
    if not summary["ratios"]:
        return []
    lines = ["| ratio | value | target | met | numerator / denominator | basis |", "|---|---|---|---|---|---|"]
    for key, v in summary["ratios"].items():
        tgt = f"≤ {v['target']}" if v.get("target") is not None else "—"
        met = {True: "yes", False: "**no**", None: "—"}[v.get("meets_target")]
        lines.append(f"| {key} | {v['value']:.3f} | {tgt} | {met} | {v['num']:.1f} / {v['den']:.1f} | "
                     f"{v.get('note', '')} |")
    return lines + [""]


def stage_lines(rep: dict) -> list[str]:
    """The library's own stage times where a run reported them (``compatibility()``: its M-Loss walk and its
    task-vector baselines), inside the inner time."""
    lines = [f"- {name}: " + ", ".join(f"{stage} {seconds:.1f} s" for stage, seconds in res["child"]["stages_s"].items())
             for name, res in rep["runs"].items() if _ok(res) and res.get("child", {}).get("stages_s")]
    return (["Stages inside the inner time (the call's own timings):", "", *lines, ""]) if lines else []


def repeat_lines(rep: dict, summary: dict, p: dict) -> list[str]:
    lines = [f"## Run {rep['repeat']}", "",
             f"Load average at its start {_load(rep['loadavg_start'])}, at its end {_load(rep['loadavg_end'])}.", ""]
    return (lines + runs_table_lines(rep, p) + stage_lines(rep) + forward_line(rep, summary, p) + svd_floor_line(rep)
            + ratio_lines(summary))


def rss_lines(p: dict) -> list[str]:
    summary = p["summary"]["per_repeat"][-1]
    if not summary.get("rss_vs_models"):
        return []
    model_mb = summary["model_mb"]
    lines = [f"## Peak RSS of each hf_mloss merge vs base + merged model (run {len(p['repeats'])})", "",
             f"Reference figure: 2 × {model_mb:.1f} MB = {2 * model_mb:.1f} MB.", "",
             "| run | peak RSS MB | / (2 × model) | child's own VmHWM MB | RSS after imports MB | peak − imports MB |",
             "|---|---|---|---|---|---|"]
    for name, v in summary["rss_vs_models"].items():
        lines.append(f"| {name} | {v['peak_mb']:.0f} | {v['over_two_models']:.2f} | {_fmt(v.get('child_vmhwm_mb'), 0)}"
                     f" | {_fmt(v.get('after_imports_mb'), 0)} | {_fmt(v.get('above_imports_mb'), 0)} |")
    parent = p.get("parent_peak_rss_mb_during_runs")
    return lines + ["", "Peak RSS is `ru_maxrss` from `os.wait4`, which on Linux is at least the parent's peak RSS at "
                    "spawn time; the parent stayed at " + (f"{parent:.0f} MB" if parent is not None else "an unrecorded "
                    "size") + " until the timed runs were over. *child's own VmHWM* is the child's /proc high-water "
                    "mark.", ""]


def check_lines(p: dict) -> list[str]:
    lines = []
    for rep in p["repeats"]:
        checks = rep.get("checks", {})
        b = checks.get("bf16")
        if b and "error" not in b:
            lines.append(f"- run {rep['repeat']}, bf16 vs fp32 scoring (prefix base): layer M-Loss relative error max "
                         f"{b['layer_rel_err_max']:.2e}, mean {b['layer_rel_err_mean']:.2e}; Spearman ρ of node "
                         f"M-Loss per layer min {b['node_spearman_min']:.4f}, mean {b['node_spearman_mean']:.4f}")
        for key, v in checks.get("parity", {}).items():
            if "error" in v:
                lines.append(f"- run {rep['repeat']}, {key}: {v['error']}")
                continue
            lines.append(f"- run {rep['repeat']}, {key}: max |Δ| = {v['max_abs_diff']:.2e} over "
                         f"{v['tensors_compared']} tensors; {v['entries_differing_gt_1e-6']} of "
                         f"{v['entries_compared']:,} entries differ by > 1e-6"
                         + (f"; keys not shared: {v['keys_not_shared']}" if v["keys_not_shared"] else ""))
    return (["## Output checks", ""] + lines + [""]) if lines else []


def tail_lines(p: dict) -> list[str]:
    lines = []
    est = (p["summary"]["per_repeat"][-1] or {}).get("full_depth_estimate")
    if est:
        est = dict(est)
        lines += ["## Full-depth estimate", "", est.pop("note"), ""] + [f"- {k}: {v:.0f} s" for k, v in est.items()]
        lines.append("")
    skipped = {n: r["skipped"] for rep in p["repeats"] for n, r in rep["runs"].items() if "skipped" in r}
    if skipped:
        lines += ["## Skipped", ""] + [f"- {k}: {v}" for k, v in skipped.items()] + [""]
    if p.get("notes"):
        lines += ["## Notes", ""] + [f"- {n}" for n in p["notes"]] + [""]
    if p["rss_guard"]["killed"]:
        lines += ["## Killed by the RSS guard", ""] + [f"- {k}" for k in p["rss_guard"]["killed"]] + [""]
    return lines


def render_markdown(p: dict) -> str:
    lines = header_lines(p) + targets_lines(p) + reference_lines(p)
    for rep, summary in zip(p["repeats"], p["summary"]["per_repeat"]):
        lines += repeat_lines(rep, summary, p)
    return "\n".join(lines + rss_lines(p) + check_lines(p) + tail_lines(p))
