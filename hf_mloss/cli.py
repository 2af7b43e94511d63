"""``hf-mloss``: the command line, a thin layer over the Python API.

```
hf-mloss merge CONFIG.yaml OUT_DIR [--push-to-hub REPO] [--private] [--overwrite] [--device DEVICE] [--quiet]
              [--select unlabeled --grid PARAM=V1,V2,... [--criterion output|entropy|mloss] [--select-samples N]]
hf-mloss score CONFIG.yaml [--json OUT] [--per-row] [--overwrite] [--device DEVICE] [--quiet]
              [--pairwise [--subsets I,J,...] [--output-gap] [--no-baselines] [--out DIR]]
              [--select unlabeled --grid PARAM=V1,V2,...]   (print every candidate's criteria, write nothing)
hf-mloss moe CONFIG.yaml OUT_DIR [--overwrite] [--device DEVICE] [--quiet] [--no-mloss] [--no-report]
             [--report-positions N|all] [--prompt-dtype bfloat16|float32]
             [--i-understand-this-is-not-useful-without-training]   (mergekit-moe's YAML: an MoE from dense fine-tunes)
hf-mloss push OUT_DIR REPO [--private] [--revision REV] [--create-pr] [--commit-message MSG] [--quiet]
hf-mloss methods [--json]
```

A user error (any :class:`hf_mloss.HfMLossError`: invalid config, missing model, existing output folder...) prints one
paragraph ``hf-mloss: error: ...`` on stderr and exits with status 2 (1 when a Hub upload fails); anything else is a
bug and keeps its traceback. Tokens are never read from configs or flags: ``hf auth login`` or ``HF_TOKEN``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ._version import __version__
from .errors import HfMLossError, InvalidParameterError, PushError, redact

EXIT_USER_ERROR = 2
EXIT_PUSH_ERROR = 1
DEVICE_HELP = ("Where to compute: auto (default: the accelerator when present - this process's GPU under torchrun or "
               "accelerate launch, else CUDA, then MPS - else the CPU), cpu, cuda, cuda:1, mps.")


# ------------------------------------------------------------------------------------------------------- merge
def merge_command_parser(subparsers: Any = None) -> argparse.ArgumentParser:
    description = ("Merge the models of a YAML config and write a Hub-ready folder (safetensors, config, image "
                   "processor, model card, hf_mloss_config.yaml and the M-Loss report).")
    parser = _subparser(subparsers, "merge", description,
                        parents=[_quiet_parent(), _selection_parent(), _text_data_parent()])
    parser.add_argument("config", metavar="CONFIG.yaml", help="The merge config (see hf_mloss.spec.config).")
    parser.add_argument("out_dir", metavar="OUT_DIR", help="Folder to write the merged model to.")
    parser.add_argument("--push-to-hub", metavar="REPO", default=None,
                        help="Also upload the folder to this Hub repo, in one commit (uses `hf auth login`/HF_TOKEN).")
    parser.add_argument("--private", action="store_true", help="Create the Hub repo as private (with --push-to-hub).")
    parser.add_argument("--overwrite", action="store_true",
                        help="Replace OUT_DIR if it exists and is not empty (only once the new folder is complete).")
    parser.add_argument("--device", default=None, help=DEVICE_HELP)
    if subparsers is not None:
        parser.set_defaults(func=merge_command)
    return parser


def merge_command(args: argparse.Namespace) -> int:
    config = _read_config(args)  # a missing model folder is named in a second, before torch is imported
    from .api import run
    from .output.card import model_specs, shown_parameters, weight_text
    from .spec.schedule import described_schedules
    from .distributed import describe_device, is_main_process, main_process_only
    from .output.push import check_repo_id
    from .loading.inputs import resolve_device
    from .saving import check_output_dir

    _check_environment()
    device = resolve_device(args.device)
    if args.push_to_hub:
        check_repo_id(args.push_to_hub)
    elif args.private:
        raise InvalidParameterError("--private makes the Hub repo private when one is created: it needs "
                                    "--push-to-hub REPO (or push later with `hf-mloss push OUT_DIR REPO --private`).")
    protected = [args.config, *config.input_paths()]
    out_dir = Path(args.out_dir).expanduser()
    with main_process_only() as main:  # under torchrun: checked once, before any process can write it
        if main:
            out_dir = check_output_dir(args.out_dir, overwrite=args.overwrite, protected=protected,
                                       needed_bytes=_estimated_size(config))
    show = not args.quiet and is_main_process()
    if show:
        print(f"Computing on {describe_device(device)}", flush=True)
    with _progress_bars(show, datasets_too=config.has_data() or config.has_data("text_data")):
        result = run(config, device=device, progress=show)
        push_kwargs = {"private": True} if args.push_to_hub and args.private else {}
        saved = result.save_pretrained(out_dir, overwrite=args.overwrite, push_to_hub=bool(args.push_to_hub),
                                       repo_id=args.push_to_hub, **push_kwargs)
    method = config.merge_method()
    count = f"{len(result.models)} model{'' if len(result.models) == 1 else 's'}"
    shown = {**shown_parameters(result.config.method_params(), len(result.models)),  # values that vary over the model, as given
             **described_schedules(method, result.config.parameters)}
    lines = [f"Merged {count} with {method.pretty_name} ({result.method})",
             f"  base:       {result.base.name}",
             "  models:     " + ", ".join(f"{r.name} (weight {weight_text(w, spec)})" for r, w, spec in
                                          zip(result.models, result.weights, model_specs(result), strict=True)),
             "  parameters: " + (", ".join(f"{k}={v!r}" for k, v in shown.items()) or "none"),
             f"  device:     {result.device}"]
    own = (result.model_data_info or {}).get("data") or []
    if result.data_info is not None and (not own or result.config.data is not None):
        info = result.data_info
        count = (f"{info.num_samples} images" if info.num_tokens is None else
                 f"{info.num_samples} sequences, {info.num_tokens} tokens")
        lines.append(f"  data:       {info.source} {info.id!r} (split {info.split!r}, {count})")
    if own:  # each model's own data: its source and sample count
        lines.append("  own data:   " + ", ".join(f"{r.name}: {info.id or info.source} ({info.num_samples})"
                                                  for r, info in zip(result.models, own) if info is not None))
    if result.config.select is not None:
        lines += ["", result.config.select.summary()]
    if result.report is not None and result.report.computed:
        lines += ["", result.report.summary(), ""]
    lines.append(f"Saved to {saved}")
    if args.push_to_hub:
        lines.append(f"Pushed to the Hub repo {args.push_to_hub}")
    if is_main_process():  # one summary per job, not one per process
        print("\n".join(lines))
    return 0


def _estimated_size(config) -> int:
    """Bytes of the base's weight files when it is a local folder (the merge is about that size), else 0; a recipe
    with ``slices`` scales it by its output layers over the base's (a passthrough that stacks layers grows)."""
    if not config.base.is_local:
        return 0
    folder = Path(config.base.model).expanduser()
    size = sum(p.stat().st_size for p in folder.iterdir() if p.suffix in (".safetensors", ".bin") and p.is_file())
    slices = getattr(config, "slices", None)
    if slices:
        from .spec.slices import num_layers_of

        try:
            base_layers = num_layers_of(json.loads((folder / "config.json").read_text(encoding="utf-8")))
            out_layers = sum(s["sources"][0]["layer_range"][1] - s["sources"][0]["layer_range"][0] for s in slices)
        except (OSError, ValueError, KeyError, IndexError, TypeError):
            return size
        if base_layers:
            size = int(size * max(1.0, out_layers / base_layers))
    return size


# ------------------------------------------------------------------------------------------------------- score
def score_command_parser(subparsers: Any = None) -> argparse.ArgumentParser:
    description = ("Measure the M-Loss (mergeability) of the config's models on its unlabeled data, without merging, "
                   "and print the per-layer table. Options come from the config's optional `score:` section.")
    parser = _subparser(subparsers, "score", description,
                        parents=[_quiet_parent(), _selection_parent(), _text_data_parent()])
    parser.add_argument("config", metavar="CONFIG.yaml", help="A config with base, models and data.")
    parser.add_argument("--json", metavar="OUT", default=None, help="Also write the report as JSON to this file.")
    parser.add_argument("--per-row", action="store_true", help="Include the per-row (node) vectors in the JSON.")
    parser.add_argument("--overwrite", action="store_true",
                        help="Replace the --json file or the --out folder if it exists (once the new one is "
                             "complete).")
    parser.add_argument("--device", default=None, help=DEVICE_HELP)
    pairwise = parser.add_argument_group("compatibility report (--pairwise)")
    pairwise.add_argument("--pairwise", action="store_true",
                          help="Score every pair, the set without each model and the whole set from one forward per "
                               "model, with label-free baselines (see hf_mloss.compatibility).")
    pairwise.add_argument("--subsets", metavar="I,J,...", action="append", default=None,
                          help="A further subset to score, as model indices (repeat the option for more).")
    pairwise.add_argument("--output-gap", action="store_true",
                          help="Add the output-level merge-vs-ensemble gap (one more forward per scored subset).")
    pairwise.add_argument("--no-baselines", action="store_true", help="Skip the task-vector baselines.")
    pairwise.add_argument("--out", metavar="DIR", default=None,
                          help="Write compatibility.json, compatibility.md and the heatmap PNG into this folder.")
    if subparsers is not None:
        parser.set_defaults(func=score_command)
    return parser


def score_command(args: argparse.Namespace) -> int:
    config = _read_config(args)
    from .api import run, run_score
    from .distributed import describe_device, is_main_process
    from .loading.inputs import resolve_device

    _check_environment()
    device = resolve_device(args.device)
    main = is_main_process()  # every process scores its share; the main one prints and writes the reduced result
    show = not args.quiet and main
    if not config.has_data() and not config.has_data("text_data"):  # fail now, not after downloading the models
        raise InvalidParameterError("Scoring needs unlabeled data (images, or texts for text families) and the config "
                                    "has no `data`: add e.g. `data: {id: tanganke/dtd, split: train, num_samples: 128}`, "
                                    "`data: {path: ./images}` or `data: {path: prompts.txt}`.")
    if not args.pairwise and (args.subsets or args.output_gap or args.no_baselines or args.out):
        raise InvalidParameterError("--subsets, --output-gap, --no-baselines and --out belong to the compatibility "
                                    "report: add --pairwise.")
    json_path, protected = _check_report_targets(config, args)
    if show:
        print(f"Computing on {describe_device(device)}", flush=True)
    if args.select:  # score the candidates of the grid, print them, write nothing
        with _progress_bars(show, datasets_too=True):
            result = run(config, device=device, progress=show)
        if main:
            print(result.config.select.summary())
        return 0
    with _progress_bars(show, datasets_too=True):
        if args.pairwise:
            from .engine.compatibility import run_compatibility

            report = run_compatibility(config, subsets=_parse_subsets(args.subsets), baselines=not args.no_baselines,
                                       output_gap=args.output_gap, device=device, progress=show)
        else:
            report = run_score(config, device=device, progress=show)
    from .distributed import main_process_only

    with main_process_only() as main:
        if main:
            print(report.summary())
            _write_outputs(report, json_path, args, protected)
    return 0


def _check_report_targets(config: Any, args: argparse.Namespace) -> tuple[Path | None, list[Any]]:
    """Check ``--json`` and ``--out`` with the output guard before any work: never an input of the run (the
    config file, models, processor, data, heads, shares) or inside one, never a link or a device file, never an
    existing file or folder without ``--overwrite``."""
    from .saving import check_output_dir, check_output_file

    protected: list[Any] = [args.config, *config.input_paths()]
    json_path = None
    if args.json:
        json_path = check_output_file(args.json, overwrite=args.overwrite, protected=protected, what="--json file")
    if args.pairwise and args.out:
        check_output_dir(args.out, overwrite=args.overwrite, protected=[*protected, *([json_path] if json_path
                                                                                      else [])])
    return json_path, protected


def _parse_subsets(values: Sequence[str] | None) -> list[list[int]] | None:
    if not values:
        return None
    try:
        return [[int(v) for v in value.split(",") if v.strip()] for value in values]
    except ValueError:
        raise InvalidParameterError(f"--subsets takes comma-separated model indices such as 0,2,3; got "
                                    f"{values!r}.") from None


def _write_outputs(report: Any, json_path: Path | None, args: argparse.Namespace, protected: list[Any]) -> None:
    from .saving import write_file

    if json_path is not None:
        text = report.to_json() if args.pairwise else report.to_json(per_row=args.per_row)
        write_file(json_path, text + "\n", overwrite=args.overwrite, protected=protected, what="--json file")
        print(f"Wrote {json_path}")
    if args.pairwise and args.out:
        written = report.save(args.out, overwrite=args.overwrite,
                              protected=[*protected, *([json_path] if json_path else [])])
        print("Wrote " + ", ".join(str(p) for p in written.values()))


# -------------------------------------------------------------------------------------------------------- push
def push_command_parser(subparsers: Any = None) -> argparse.ArgumentParser:
    description = ("Upload a saved merge folder to the Hub in one commit (the token comes from `hf auth login` or "
                   "HF_TOKEN).")
    parser = _subparser(subparsers, "push", description, parents=[_quiet_parent()])
    parser.add_argument("out_dir", metavar="OUT_DIR", help="A folder written by `hf-mloss merge`.")
    parser.add_argument("repo", metavar="REPO", help="The Hub repo id (org/name); created if needed.")
    parser.add_argument("--private", action="store_true", help="Create the repo as private.")
    parser.add_argument("--revision", default=None, help="Branch to commit to (default: main).")
    parser.add_argument("--create-pr", action="store_true", help="Open a pull request instead of committing.")
    parser.add_argument("--commit-message", default=None, help="Commit message.")
    if subparsers is not None:
        parser.set_defaults(func=push_command)
    return parser


def push_command(args: argparse.Namespace) -> int:
    from .output import push as hub_push

    hub_push.check_repo_id(args.repo)
    with _progress_bars(not args.quiet):
        info = hub_push.push_folder(args.out_dir, args.repo, private=True if args.private else None,
                                    revision=args.revision, create_pr=args.create_pr,
                                    commit_message=args.commit_message)
    url = getattr(info, "pr_url", None) or getattr(info, "commit_url", None)
    print(f"Pushed {args.out_dir} to {args.repo}" + (f": {url}" if url else ""))
    return 0


# --------------------------------------------------------------------------------------------------------- moe
def moe_command_parser(subparsers: Any = None) -> argparse.ArgumentParser:
    description = ("Build a mixture of experts (Mixtral, Qwen2-MoE or Qwen3-MoE) from dense fine-tunes of one base, "
                   "from mergekit-moe's YAML, and write a Hub-ready folder (safetensors, config, tokenizer, model "
                   "card, hf_mloss_moe.yaml and the routing report).")
    parser = _subparser(subparsers, "moe", description, parents=[_quiet_parent()])
    parser.add_argument("config", metavar="CONFIG.yaml",
                        help="mergekit-moe's config (base_model, experts, gate_mode...).")
    parser.add_argument("out_dir", metavar="OUT_DIR", help="Folder to write the MoE to.")
    parser.add_argument("--overwrite", action="store_true",
                        help="Replace OUT_DIR if it exists and is not empty (only once the new folder is complete).")
    parser.add_argument("--device", default=None, help=DEVICE_HELP)
    parser.add_argument("--no-mloss", action="store_true", help="Skip each expert pair's M-Loss on the prompts.")
    parser.add_argument("--no-report", action="store_true",
                        help="Build alone: no routing report and no M-Loss (the folder is still checked to load).")
    parser.add_argument("--report-positions", default=None, metavar="N|all",
                        help="The most token positions the routing report and the M-Loss read (default 256): "
                             "prompts holding more are each cut to their first tokens (the model is causal, so "
                             "those positions' values are the whole prompt's); 'all' reads every token.")
    parser.add_argument("--prompt-dtype", default=None, choices=["bfloat16", "float32"],
                        help="The dtype the base reads the prompts in for hidden router rows (replaces the config's "
                             "prompt_dtype; default bfloat16, mergekit-moe's rows bit for bit; float32 is several "
                             "times faster on a CPU without bfloat16 units).")
    parser.add_argument("--i-understand-this-is-not-useful-without-training", dest="allow_identical",
                        action="store_true", help="Accept experts that are all one model (mergekit-moe's flag).")
    if subparsers is not None:
        parser.set_defaults(func=moe_command)
    return parser


def moe_command(args: argparse.Namespace) -> int:
    from .moe.config import MoEConfig

    overrides = {**({"allow_identical_experts": True} if args.allow_identical else {}),
                 **({"prompt_dtype": args.prompt_dtype} if args.prompt_dtype else {})}
    config = MoEConfig.from_yaml(args.config, **overrides)
    from .distributed import describe_device
    from .loading.inputs import resolve_device
    from .moe import build_moe
    from .saving import check_output_dir

    _check_environment()
    tokens = {} if args.report_positions is None else {"report_positions": _report_positions(args.report_positions)}
    check_output_dir(args.out_dir, overwrite=args.overwrite, protected=config.input_paths())  # before any output
    device = resolve_device(args.device)
    show = not args.quiet
    if show:
        print(f"Computing on {describe_device(device)}", flush=True)
    with _progress_bars(show):
        result = build_moe(config, args.out_dir, overwrite=args.overwrite, device=device, progress=show,
                           mloss=not args.no_mloss, report=not args.no_report, **tokens)
    print(result.summary())
    return 0


def _report_positions(value: str) -> int | None:
    """``--report-positions``: ``all`` or a positive whole number."""
    from .errors import InvalidParameterError

    if value.strip().lower() == "all":
        return None
    if not value.strip().isdigit() or int(value) < 1:
        raise InvalidParameterError(f"--report-positions takes a positive whole number or 'all', got {value!r:.40}.")
    return int(value)


# ----------------------------------------------------------------------------------------------------- methods
def methods_command_parser(subparsers: Any = None) -> argparse.ArgumentParser:
    description = "List the registered merge methods with their reference, parameters and defaults."
    parser = _subparser(subparsers, "methods", description)
    parser.add_argument("--json", action="store_true", help="Print JSON instead of a table.")
    if subparsers is not None:
        parser.set_defaults(func=methods_command)
    return parser


def methods_command(args: argparse.Namespace) -> int:
    from ._validation import field_help
    from .methods import MERGE_METHODS, list_methods

    entries = []
    for name in list_methods():
        method = MERGE_METHODS[name]
        # defaults as the card shows them: a None that stands for a value resolved (TIES's scope, TSV-M's fraction)
        helps = field_help(method.params_class)
        fields = {k: (default, helps[k][1]) for k, default in method.params_class.shown_defaults().items()}
        entries.append({
            "name": name, "pretty_name": method.pretty_name, "reference": method.reference,
            "reference_url": method.reference_url, "needs_data": method.needs_data,
            "default_weight": method.default_weight, "per_model": list(method.per_model_params),
            "parameters": {k: list(v) if isinstance(v, tuple) else v for k, (v, _) in fields.items()},
            "help": {k: text for k, (_, text) in fields.items()},
        })  # fmt: skip
    if args.json:
        print(json.dumps(entries, indent=2))
        return 0
    width = max(len(e["name"]) for e in entries) + 2
    pad = " " * width
    blocks = []
    for e in entries:
        lines = [f"{e['name']:<{width}}{e['pretty_name']}" + ("  [needs data]" if e["needs_data"] else "")]
        reference = e["reference"] + (f" ({e['reference_url']})" if e["reference_url"] else "")
        if reference:
            lines.append(f"{pad}{reference}")
        params = ", ".join(f"{k}={v!r}" for k, v in e["parameters"].items()) or "none"
        lines.append(f"{pad}parameters: {params}")
        if e["per_model"]:
            lines.append(f"{pad}per model (models[i].parameters): {', '.join(e['per_model'])}")
        blocks.append("\n".join(lines))
    print("\n\n".join(blocks))
    return 0


# -------------------------------------------------------------------------------------------------------- main
COMMANDS = (merge_command_parser, score_command_parser, moe_command_parser, push_command_parser,
            methods_command_parser)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        "hf-mloss", description="Hugging Face-native model merging guided by M-Loss.",
        epilog="Run `hf-mloss COMMAND --help` for a command's options.",
    )  # fmt: skip
    parser.add_argument("--version", action="version", version=f"hf_mloss {__version__}")
    subparsers = parser.add_subparsers(title="commands", metavar="COMMAND")
    for command_parser in COMMANDS:
        command_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``hf-mloss`` with ``argv`` (default: ``sys.argv[1:]``) and return the exit status."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # --help, --version, usage errors (argparse exits with 2)
        return exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else EXIT_USER_ERROR)
    if not hasattr(args, "func"):
        parser.print_help(sys.stderr)
        return EXIT_USER_ERROR
    try:
        with _plain_warnings():
            return args.func(args)
    except HfMLossError as err:
        message = redact(" ".join(str(err).split()))  # one paragraph, no traceback: this is the user's to fix
        print(f"hf-mloss: error: {message}", file=sys.stderr)
        return EXIT_PUSH_ERROR if isinstance(err, PushError) else EXIT_USER_ERROR
    except KeyboardInterrupt:
        print("hf-mloss: interrupted", file=sys.stderr)
        return 130
    finally:
        _close_process_group()


def _close_process_group() -> None:
    """Close torch.distributed's process group if the run opened one (under ``torchrun``): a gloo group left open at
    interpreter exit can abort the process in its C++ teardown ("terminate called without an active exception")."""
    dist = sys.modules.get("torch.distributed")  # never imports torch for `--help`
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------------- helpers
def _read_config(args: argparse.Namespace) -> Any:
    """The command's config with its flags applied, read and checked (no network, no torch import) before any
    device is chosen or printed."""
    from .spec.config import MergeConfig

    return _with_text_data(_with_selection(MergeConfig.from_yaml(args.config), args), args)


def _check_environment() -> None:
    """The variables a run reads (``HF_MLOSS_THREADS``, ``HF_MLOSS_DIRECT_WRITES``, the launch variables), checked
    before any work."""
    from .distributed import check_launch_environment
    from .output.shards import direct_writes
    from .parallel import env_threads

    env_threads()
    direct_writes()
    check_launch_environment()


def _subparser(subparsers: Any, name: str, description: str, parents: Sequence[argparse.ArgumentParser] = ()):
    if subparsers is not None:
        return subparsers.add_parser(name, help=description.split(". ")[0].rstrip("."), description=description,
                                     parents=list(parents))
    return argparse.ArgumentParser(f"hf-mloss {name}", description=description, parents=list(parents))


def _selection_parent() -> argparse.ArgumentParser:
    parent = argparse.ArgumentParser(add_help=False)
    group = parent.add_argument_group("label-free selection (overrides the config's `select:` section)")
    group.add_argument("--select", choices=("unlabeled",), default=None,
                       help="Choose the method's parameters in --grid on the config's unlabeled data (merge: then "
                            "merge with them; score: print every candidate's criteria and write nothing).")
    group.add_argument("--grid", metavar="PARAM=V1,V2,...", action="append", default=None,
                       help="Candidate values of one parameter, read as in a config file (1e-1 is a number; "
                            "PARAM=[V1,V2] works too). Repeat: every combination is a candidate (at most 1024).")
    group.add_argument("--criterion", choices=("mloss", "output", "entropy", "disagreement"), default=None,
                       help="What ranks the candidates (default output; entropy and disagreement need heads in the "
                            "config, except for causal LMs).")
    group.add_argument("--select-samples", type=int, metavar="N", default=None,
                       help="Unlabeled samples (images, or texts for text families) each candidate is scored on "
                            "(default 32).")
    group.add_argument("--select-in-sample", action="store_true",
                       help="A method fitted on the data (M-TIES, RegMean): fit and compare its settings on the same "
                            "samples (default: compare them on samples held out of the fit, then merge the chosen "
                            "setting on all).")
    return parent


def _text_data_parent() -> argparse.ArgumentParser:
    parent = argparse.ArgumentParser(add_help=False)
    group = parent.add_argument_group("text tower of a whole CLIPModel, language model of a LLaVA / Qwen2-VL "
                                      "(overrides the config's `text_data:`)")
    group.add_argument("--text-data", metavar="PATH_OR_ID", default=None,
                       help="Unlabeled text for the text tower or language model: a .txt file (one sample per "
                            "line), a .jsonl/.csv/.parquet file, a folder of .txt files, or a Hub dataset id. Both "
                            "towers are then scored (the images of the config's `data:` feed the vision tower).")
    group.add_argument("--text-column", metavar="NAME", default=None, help="Column with the text (auto-detected).")
    group.add_argument("--text-split", metavar="SPLIT", default=None, help="Dataset split of --text-data (train).")
    group.add_argument("--text-num-samples", type=int, metavar="N", default=None,
                       help="Texts to use (default 128).")
    group.add_argument("--text-max-length", type=int, metavar="N", default=None,
                       help="Tokens per text at most (default 128, at most the model's positions).")
    return parent


def _with_text_data(config: Any, args: argparse.Namespace) -> Any:
    """The config with ``--text-data`` (and its options) applied: a new ``text_data`` section, or the options laid
    over the config's own."""
    import dataclasses

    from .spec.config import DataSpec, parse_text_data

    options = {"text_column": args.text_column, "split": args.text_split, "num_samples": args.text_num_samples,
               "max_length": args.text_max_length}
    options = {k: v for k, v in options.items() if v is not None}
    if args.text_data is not None:
        return config.replace(text_data=parse_text_data(args.text_data, **options))
    if options:
        if config.text_data is None:
            raise InvalidParameterError("--text-column, --text-split, --text-num-samples and --text-max-length "
                                        "describe the text tower's text: add --text-data PATH_OR_ID (or a "
                                        "`text_data:` section to the config).")
        fields = {f.name: getattr(config.text_data, f.name) for f in dataclasses.fields(DataSpec)}
        return config.replace(text_data=DataSpec(**{**fields, **options}))
    return config


def _with_selection(config: Any, args: argparse.Namespace) -> Any:
    """The config with the selection flags applied (``--grid``/``--criterion`` need ``--select`` or a `select:`)."""
    import dataclasses

    flags: dict[str, Any] = {"criterion": args.criterion, "num_samples": args.select_samples,
                             "held_out": False if args.select_in_sample else None}
    if args.grid:
        flags["grid"] = dict(_parse_grid_item(item) for item in args.grid)
    flags = {k: v for k, v in flags.items() if v is not None}
    if not args.select and config.select is None and config.method == "auto" and set(flags) == {"criterion"}:
        return config.replace(parameters={**config.parameters, "criterion": flags["criterion"]})  # auto's own
    if not args.select and config.select is None:
        if flags:
            raise InvalidParameterError("--grid, --criterion, --select-samples and --select-in-sample configure "
                                        "label-free selection: add --select unlabeled (or a `select:` section to the "
                                        "config).")
        return config
    if config.select is None and "grid" not in flags:
        raise InvalidParameterError("--select unlabeled needs candidates: add --grid PARAM=V1,V2,... (e.g. --grid "
                                    "k=0.2,0.5,0.8 --grid lam=0.5,1,1.5) or a `select: {grid: ...}` section.")
    from .spec.selection import SelectionOptions

    select = config.select.recorded() if config.select is not None else SelectionOptions(grid=flags["grid"])
    return config.replace(select=dataclasses.replace(select, **flags))


def _parse_grid_item(item: str) -> tuple[str, list[Any]]:
    """``PARAM=V1,V2,...`` or ``PARAM=[V1, V2]``, each value read by the config files' YAML rules (``1e-1`` is a
    float, ``true`` a bool); anything else is refused in one line."""
    from ._yaml import parse_yaml

    key, _, text = item.partition("=")
    key, text = key.strip(), text.strip()
    usage = "write PARAM=V1,V2,... or PARAM=[V1,V2,...] (e.g. --grid lam=0.3,0.5,1)"
    if not key or not text:
        raise InvalidParameterError(f"--grid {item!r}: {usage}.")
    where = f"--grid {key}"
    try:
        if text.startswith("["):
            values = parse_yaml(text, where=where)
        else:
            values = [parse_yaml(v.strip(), where=where) for v in text.split(",") if v.strip()]
    except HfMLossError as err:
        raise InvalidParameterError(f"{err} ({usage}).") from None
    if not isinstance(values, list) or not values or any(isinstance(v, (list, dict)) or v is None for v in values):
        raise InvalidParameterError(f"{where}: each value must be one number, true/false or a word; {usage}.")
    return key, values


def _quiet_parent() -> argparse.ArgumentParser:
    parent = argparse.ArgumentParser(add_help=False)
    parent.add_argument("-q", "--quiet", action="store_true", help="Disable progress bars.")
    return parent


@contextmanager
def _plain_warnings() -> Iterator[None]:
    """Show the library's warnings as one line each (``hf-mloss: warning: ...``), without a source line."""
    import warnings

    def show(message, category, filename, lineno, file=None, line=None):
        if filename.startswith(str(Path(__file__).parent)) and issubclass(category, UserWarning):
            print(f"hf-mloss: warning: {' '.join(str(message).split())}", file=file or sys.stderr)
        else:
            previous(message, category, filename, lineno, file, line)

    previous = warnings.showwarning
    warnings.showwarning = show
    try:
        yield
    finally:
        warnings.showwarning = previous


@contextmanager
def _progress_bars(enabled: bool, *, datasets_too: bool = False) -> Iterator[None]:
    """Unless ``enabled``, switch off the progress bars of transformers, huggingface_hub (and datasets) in the block."""
    if enabled:
        yield
        return
    from huggingface_hub import utils as hub_utils
    from transformers.utils import logging as transformers_logging

    restore = []
    if transformers_logging.is_progress_bar_enabled():
        transformers_logging.disable_progress_bar()
        restore.append(transformers_logging.enable_progress_bar)
    if not hub_utils.are_progress_bars_disabled():
        hub_utils.disable_progress_bars()
        restore.append(hub_utils.enable_progress_bars)
    if datasets_too:
        import datasets

        if datasets.is_progress_bar_enabled():
            datasets.disable_progress_bars()
            restore.append(datasets.enable_progress_bars)
    try:
        yield
    finally:
        for enable in restore:
            enable()


if __name__ == "__main__":
    sys.exit(main())
