#!/usr/bin/env python
"""The 26-architecture table (issue 58): what a Hub user gets from ``ties`` and ``m_ties`` on each family, and from
the data-free ``wudi``, ``cart`` and TIES calibrated by Singular Value Calibration (``ties`` with ``calibrate="svc"``).

Each architecture is built in-process from a tiny config of the installed transformers, saved with
``save_pretrained`` (with a tokenizer or image processor where it takes one) beside two perturbed fine-tunes
(``examples/tiny.py``), and merged with each method of :data:`METHODS`: ``ties`` and ``m_ties`` (text data for text models, images for image
models, both for vision-language models: ``data=`` images for the vision tower, ``text_data=`` texts for the
language model; none for speech), ``wudi``, ``cart`` and ``svc`` (data-free); texts are tokenised with the base's saved tokenizer, a byte-level one that
transformers 5 reads the same whatever class it picks for the family). Each output is saved, loaded with its Auto
class (nothing may be missing, unexpected or of another shape) and run once. A cell is ``ok``, ``refused:
<hf_mloss's message>`` (an ``HfMLossError``: the library said why) or ``error: <exception>`` (anything else: a
crash, or an output that does not load or run).

Examples::

    python benchmarks/families_table.py                          # all 26, writes benchmarks/results/families_table.*
    python benchmarks/families_table.py --only Llama,GPT2 --results families-out

Writes ``families_table.md`` / ``.json`` under ``--results`` (default ``benchmarks/results``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402
import transformers as T  # noqa: E402

import hf_mloss  # noqa: E402
from examples import tiny  # noqa: E402

VOCAB = 64
IDS = dict(bos_token_id=1, eos_token_id=2, pad_token_id=3)
L = dict(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
         num_key_value_heads=1, max_position_embeddings=64, **IDS)
VISION = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, image_size=8,
              patch_size=4)
CLIP_TEXT = dict(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                 max_position_embeddings=16, **IDS)
ENCODER = dict(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
               max_position_embeddings=64, **IDS)
TEXTS = [" ".join(f"w{(7 * i + 3 * j) % 55}" for j in range(4 + i % 5)) for i in range(8)]
PIXELS = torch.randn(8, 3, 8, 8, generator=torch.Generator().manual_seed(0))


def _text(batch: int = 1) -> dict[str, torch.Tensor]:
    return {"input_ids": torch.tensor([[1, 5, 9, 17, 33, 2]] * batch)}


def _seq2seq() -> dict[str, torch.Tensor]:
    return {**_text(), "decoder_input_ids": torch.tensor([[0, 5, 9]])}


def _image() -> dict[str, torch.Tensor]:
    return {"pixel_values": PIXELS[:1]}


def _text_image() -> dict[str, torch.Tensor]:
    return {"input_ids": torch.tensor([[1, 5, 9, 17, 33, 2]]), "pixel_values": PIXELS[:1]}


def _llava() -> dict[str, torch.Tensor]:
    return {"input_ids": torch.tensor([[1, 63, 63, 63, 63, 5, 9, 17]]), "pixel_values": PIXELS[:1]}


def _qwen2_vl() -> dict[str, torch.Tensor]:
    return {"input_ids": torch.tensor([[62, 60, 5, 9, 17]]),
            "pixel_values": torch.randn(4, 24, generator=torch.Generator().manual_seed(0)),
            "image_grid_thw": torch.tensor([[1, 2, 2]]), "mm_token_type_ids": torch.tensor([[0, 1, 0, 0, 0]])}


def _whisper() -> dict[str, torch.Tensor]:
    return {"input_features": torch.randn(1, 8, 32, generator=torch.Generator().manual_seed(0)),
            "decoder_input_ids": torch.tensor([[1, 5, 9]])}


@dataclass(frozen=True)
class Architecture:
    build: Callable[[], T.PreTrainedModel]
    auto: str
    """The Auto class the output is loaded with."""
    inputs: Callable[[], dict[str, torch.Tensor]]
    data: str | None
    """What ``m_ties`` is given: ``"text"``, ``"image"``, ``"image+text"`` (``data=`` images and ``text_data=``
    texts) or ``None`` (not run: no data of the model's kind)."""
    kind: str
    """decoder, encoder, image, vision-language, speech, MoE (the issue's groups)."""


def _clip_config(**extra):
    return T.CLIPConfig(vision_config=VISION, text_config=CLIP_TEXT, projection_dim=16, **extra)


def _siglip_config():
    return T.SiglipConfig(vision_config=VISION, text_config={**CLIP_TEXT, "max_position_embeddings": 16})


def _llava_config():
    return T.LlavaConfig(vision_config=T.CLIPVisionConfig(**VISION, projection_dim=16), text_config=T.LlamaConfig(**L),
                         image_token_index=63, projector_hidden_act="gelu", vision_feature_layer=-2)


def _qwen2_vl_config():
    return T.Qwen2VLConfig(
        text_config=dict(**L, rope_parameters=dict(rope_type="default", mrope_section=[1, 1, 2], rope_theta=1e4)),
        vision_config=dict(depth=2, embed_dim=16, hidden_size=16, num_heads=2, mlp_ratio=2, patch_size=2,
                           spatial_merge_size=2, temporal_patch_size=2, in_channels=3),
        image_token_id=60, video_token_id=61, vision_start_token_id=62, **IDS)


def _whisper_config():
    return T.WhisperConfig(vocab_size=VOCAB, num_mel_bins=8, d_model=16, encoder_layers=2, decoder_layers=2,
                           encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
                           decoder_ffn_dim=32, max_source_positions=16, max_target_positions=32,
                           decoder_start_token_id=1, suppress_tokens=[], begin_suppress_tokens=[], **IDS)


MOE = dict(num_experts_per_tok=1)
ARCHITECTURES: dict[str, Architecture] = {
    "Llama": Architecture(lambda: T.LlamaForCausalLM(T.LlamaConfig(**L)), "AutoModelForCausalLM", _text, "text",
                          "decoder"),
    "Mistral": Architecture(lambda: T.MistralForCausalLM(T.MistralConfig(**L)), "AutoModelForCausalLM", _text, "text",
                            "decoder"),
    "Qwen2": Architecture(lambda: T.Qwen2ForCausalLM(T.Qwen2Config(**L)), "AutoModelForCausalLM", _text, "text",
                          "decoder"),
    "Qwen3": Architecture(lambda: T.Qwen3ForCausalLM(T.Qwen3Config(**L, head_dim=8)), "AutoModelForCausalLM", _text,
                          "text", "decoder"),
    "Gemma2": Architecture(lambda: T.Gemma2ForCausalLM(T.Gemma2Config(**L, head_dim=8)), "AutoModelForCausalLM",
                           _text, "text", "decoder"),
    "Gemma3 (text)": Architecture(lambda: T.Gemma3ForCausalLM(T.Gemma3TextConfig(**L, head_dim=8)),
                                  "AutoModelForCausalLM", _text, "text", "decoder"),
    "Phi3": Architecture(lambda: T.Phi3ForCausalLM(T.Phi3Config(**{**L, "num_key_value_heads": 2})),
                         "AutoModelForCausalLM", _text, "text", "decoder"),
    "GPT2": Architecture(lambda: T.GPT2LMHeadModel(T.GPT2Config(vocab_size=VOCAB, n_embd=16, n_layer=2, n_head=2,
                                                                n_positions=64, bos_token_id=1, eos_token_id=2)),
                         "AutoModelForCausalLM", _text, "text", "decoder"),
    "Olmo": Architecture(lambda: T.OlmoForCausalLM(T.OlmoConfig(**L)), "AutoModelForCausalLM", _text, "text",
                         "decoder"),
    "ModernBert": Architecture(
        lambda: T.ModernBertForMaskedLM(T.ModernBertConfig(
            vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
            max_position_embeddings=64, global_attn_every_n_layers=2, local_attention=16, bos_token_id=1,
            eos_token_id=2, pad_token_id=3, cls_token_id=1, sep_token_id=2)),
        "AutoModelForMaskedLM", _text, "text", "encoder"),
    "GPTNeoX": Architecture(lambda: T.GPTNeoXForCausalLM(T.GPTNeoXConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        max_position_embeddings=64, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)),
        "AutoModelForCausalLM", _text, "text", "decoder"),
    "Llava": Architecture(lambda: T.LlavaForConditionalGeneration(_llava_config()), "AutoModelForImageTextToText",
                          _llava, "image+text", "vision-language"),
    "Qwen2-VL": Architecture(lambda: T.Qwen2VLForConditionalGeneration(_qwen2_vl_config()),
                             "AutoModelForImageTextToText", _qwen2_vl, "image+text", "vision-language"),
    "ViTForImageClassification": Architecture(
        lambda: T.ViTForImageClassification(T.ViTConfig(**VISION, num_labels=3)), "AutoModelForImageClassification",
        _image, "image", "image"),
    "Bert": Architecture(lambda: T.BertForMaskedLM(T.BertConfig(**ENCODER)), "AutoModelForMaskedLM", _text, "text",
                         "encoder"),
    "Roberta": Architecture(lambda: T.RobertaForMaskedLM(T.RobertaConfig(**{**ENCODER, "max_position_embeddings": 70})),
                            "AutoModelForMaskedLM", _text, "text", "encoder"),
    "T5": Architecture(lambda: T.T5ForConditionalGeneration(T.T5Config(
        vocab_size=VOCAB, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_heads=2, decoder_start_token_id=0,
        pad_token_id=0, eos_token_id=1)), "AutoModelForSeq2SeqLM", _seq2seq, "text", "encoder-decoder"),
    "Whisper": Architecture(lambda: T.WhisperForConditionalGeneration(_whisper_config()),
                            "AutoModelForSpeechSeq2Seq", _whisper, None, "speech"),
    "CLIPModel": Architecture(lambda: T.CLIPModel(_clip_config()), "AutoModel", _text_image, "image", "image"),
    "SigLIP": Architecture(lambda: T.SiglipModel(_siglip_config()), "AutoModel", _text_image, "image", "image"),
    "DINOv2": Architecture(lambda: T.Dinov2Model(T.Dinov2Config(**VISION)), "AutoModel", _image, "image", "image"),
    "Mixtral": Architecture(lambda: T.MixtralForCausalLM(T.MixtralConfig(**L, num_local_experts=2, **MOE)),
                            "AutoModelForCausalLM", _text, "text", "MoE"),
    "Qwen2-MoE": Architecture(lambda: T.Qwen2MoeForCausalLM(T.Qwen2MoeConfig(
        **L, num_experts=2, moe_intermediate_size=8, shared_expert_intermediate_size=8, decoder_sparse_step=1,
        mlp_only_layers=[], **MOE)), "AutoModelForCausalLM", _text, "text", "MoE"),
    "Qwen3-MoE": Architecture(lambda: T.Qwen3MoeForCausalLM(T.Qwen3MoeConfig(
        **L, head_dim=8, num_experts=2, moe_intermediate_size=8, decoder_sparse_step=1, mlp_only_layers=[], **MOE)),
        "AutoModelForCausalLM", _text, "text", "MoE"),
    "OLMoE": Architecture(lambda: T.OlmoeForCausalLM(T.OlmoeConfig(**L, num_experts=2, **MOE)),
                          "AutoModelForCausalLM", _text, "text", "MoE"),
    "DeepSeek-V3": Architecture(lambda: T.DeepseekV3ForCausalLM(T.DeepseekV3Config(
        **{**L, "num_key_value_heads": 2}, moe_intermediate_size=8, n_shared_experts=1, n_routed_experts=2,
        first_k_dense_replace=1, n_group=1, topk_group=1, kv_lora_rank=8, q_lora_rank=8, qk_rope_head_dim=4,
        qk_nope_head_dim=4, v_head_dim=8, **MOE)), "AutoModelForCausalLM", _text, "text", "MoE"),
}


METHODS: dict[str, tuple[str, dict]] = {
    "ties": ("ties", {}), "m_ties": ("m_ties", {}), "wudi": ("wudi", {}), "cart": ("cart", {}),
    "svc": ("ties", {"calibrate": "svc"}),
}
"""The table's columns: label -> (method, parameters); ``m_ties`` is given the architecture's data."""


def _first_line(err: BaseException, limit: int = 240) -> str:
    text = " ".join(f"{type(err).__name__}: {err}".split())
    return text if len(text) <= limit else text[:limit].rsplit(" ", 1)[0] + " …"


def _cell(err: BaseException | None) -> dict[str, str]:
    """``{"status": ok | refused | error, "detail": ...}``: a refusal is hf_mloss's own error class."""
    if err is None:
        return {"status": "ok", "detail": ""}
    if isinstance(err, hf_mloss.errors.HfMLossError):
        return {"status": "refused", "detail": _first_line(err)}
    return {"status": "error", "detail": _first_line(err)}


def save_inputs(name: str, arch: Architecture, root: Path) -> tuple[str, list[str]]:
    """The tiny base and two perturbed fine-tunes, saved with ``save_pretrained`` and their tokenizer / processor."""
    torch.manual_seed(0)
    base = arch.build().eval()
    base.config.architectures = [type(base).__name__]
    folder, models = tiny.save_with_finetunes(base, root / name.replace(" ", "_"), 2)
    for each in [folder, *models]:
        if arch.inputs in (_image, _text_image):
            tiny.tiny_processor(8).save_pretrained(each)
        if arch.inputs is not _image and arch.inputs is not _whisper:
            tiny.char_tokenizer().save_pretrained(each)
    return str(folder), [str(m) for m in models]


def check_output(arch: Architecture, result, folder: Path, base_class: str) -> None:
    """Save the merge, load it with the Auto class (the base's class, nothing missing, unexpected or mismatched) and
    run it once."""
    result.save_pretrained(folder)
    model, info = getattr(T, arch.auto).from_pretrained(folder, output_loading_info=True)
    if type(model).__name__ != base_class:
        raise AssertionError(f"the merge loads as a {type(model).__name__}, the base is a {base_class}")
    broken = {k: sorted(map(str, v))[:3] for k, v in info.items() if v and k != "error_msgs"}
    if broken:
        raise AssertionError(f"{type(model).__name__} loads with {broken}")
    with torch.no_grad():
        out = model.eval()(**arch.inputs())
    logits = getattr(out, "logits", None)
    if logits is None:
        logits = getattr(out, "last_hidden_state", None)
    if logits is None:
        logits = getattr(out, "logits_per_image", None)
    if logits is None or not torch.isfinite(logits).all():
        raise AssertionError(f"{type(model).__name__}'s forward gave no finite output")


def run_one(name: str, arch: Architecture, root: Path) -> dict:
    """One row: the class built, one cell per method of :data:`METHODS`, seconds."""
    start = time.perf_counter()
    row = {"architecture": name, "kind": arch.kind, "auto": arch.auto, "m_ties_data": arch.data}
    try:
        base, models = save_inputs(name, arch, root)
        row["class"] = json.loads((Path(base) / "config.json").read_text())["architectures"][0]
    except Exception as err:  # noqa: BLE001 - the row records it
        row.update({"class": "?", **{label: _cell(err) for label in METHODS}})
        row["seconds"] = round(time.perf_counter() - start, 2)
        return row
    for label, (method, parameters) in METHODS.items():
        if method == "m_ties" and arch.data is None:
            row[label] = {"status": "not run", "detail": "no data of the model's kind (speech)"}
            continue
        err = None
        try:
            data = {} if method != "m_ties" else {"data": PIXELS, "text_data": TEXTS} if arch.data == "image+text" \
                else {"data": PIXELS if arch.data == "image" else TEXTS}
            result = hf_mloss.merge(base, models, method, progress=False, **parameters, **data)
            check_output(arch, result, root / f"{name.replace(' ', '_')}_{label}", row["class"])
        except Exception as caught:  # noqa: BLE001 - the row records it
            err = caught
            if os.environ.get("FAMILIES_TABLE_TRACEBACK"):
                traceback.print_exc()
        row[label] = _cell(err)
    row["seconds"] = round(time.perf_counter() - start, 2)
    return row


def _md_cell(cell: dict) -> str:
    text = cell["status"] if not cell["detail"] else f"{cell['status']}: {cell['detail']}"
    return text.replace("|", "\\|")


def _revision() -> str:
    """The git commit the table ran on (``+ uncommitted changes`` when the tree differs from it)."""
    import subprocess

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=HERE.parent, capture_output=True, text=True).stdout.strip()

    commit = git("rev-parse", "--short", "HEAD")
    if not commit:
        return "unknown"
    return commit + (" + uncommitted changes" if git("status", "--porcelain", "hf_mloss")
                     else "")


def _library() -> str:
    """Which hf_mloss ran: its folder relative to this checkout, or the installed package (no machine folders)."""
    folder = Path(hf_mloss.__file__).resolve().parent
    return str(folder.relative_to(HERE.parent)) if folder.is_relative_to(HERE.parent) else "installed package"


def write_table(rows: list[dict], results: Path) -> None:
    meta = {"transformers": T.__version__, "torch": torch.__version__, "hf_mloss": hf_mloss.__version__,
            "revision": _revision(), "library": _library(),
            "python": platform.python_version(), "machine": platform.machine(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    results.mkdir(parents=True, exist_ok=True)
    (results / "families_table.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    counts = {m: sum(r[m]["status"] == "ok" for r in rows) for m in METHODS}
    lines = ["# The architectures table (issue 58)", "",
             f"transformers {meta['transformers']}, torch {meta['torch']}, hf_mloss {meta['hf_mloss']} at "
             f"{meta['revision']}; {meta['date']}. `python benchmarks/families_table.py` writes it.", "",
             "Each architecture: a tiny base built from a config and saved with `save_pretrained`, two perturbed "
             "fine-tunes; each merge is saved, loaded with its Auto class (nothing missing, unexpected or "
             "mismatched) and run once. `refused` is hf_mloss's own error (its message), `error` anything else.", "",
             "; ".join(f"{m} ok on {counts[m]} of {len(rows)}" for m in METHODS) + " (`svc`: `ties` with "
             "`calibrate: svc`).", "",
             "| architecture | class | kind | " + " | ".join(f"`{m}`" + " (data)" * (m == "m_ties") for m in METHODS)
             + " | s |", "|---|---|---|" + "---|" * (len(METHODS) + 1)]
    for r in rows:
        data = f" ({r['m_ties_data']})" if r["m_ties_data"] else ""
        cells = " | ".join(_md_cell(r[m]) + (data if m == "m_ties" else "") for m in METHODS)
        lines.append(f"| {r['architecture']} | `{r['class']}` | {r['kind']} | {cells} | {r['seconds']} |")
    (results / "families_table.md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", help="comma-separated architectures (names as in the table)")
    parser.add_argument("--results", type=Path, default=HERE / "results", help="where the .md / .json go")
    args = parser.parse_args(argv)
    names = list(ARCHITECTURES) if not args.only else [n.strip() for n in args.only.split(",")]
    unknown = [n for n in names if n not in ARCHITECTURES]
    if unknown:
        parser.error(f"unknown architectures {unknown}; known: {list(ARCHITECTURES)}")
    warnings.filterwarnings("ignore")
    T.logging.set_verbosity_error()
    rows = []
    with tempfile.TemporaryDirectory(prefix="families_table_") as tmp:
        for name in names:
            row = run_one(name, ARCHITECTURES[name], Path(tmp))
            print(f"{name:28s} " + " ".join(f"{m}: {_md_cell(row[m])[:60]}" for m in METHODS), flush=True)
            rows.append(row)
    write_table(rows, args.results)
    return rows


if __name__ == "__main__":
    main()
