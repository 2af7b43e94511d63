"""Small, fully offline fixtures: tiny CLIP vision towers with realistic task vectors, and image folders.

Used by the test-suite, the examples and the offline demo. Everything is seeded.
"""

from __future__ import annotations

from pathlib import Path

import torch
from PIL import Image
from transformers import CLIPConfig, CLIPImageProcessorPil, CLIPModel, CLIPVisionConfig, CLIPVisionModel

TINY_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                   image_size=32, patch_size=8)  # fmt: skip


def tiny_vision_config(**overrides) -> CLIPVisionConfig:
    return CLIPVisionConfig(**{**TINY_VISION, **overrides})


def tiny_processor(image_size: int = 32) -> CLIPImageProcessorPil:
    return CLIPImageProcessorPil(size={"shortest_edge": image_size}, crop_size={"height": image_size, "width": image_size})


def make_base(seed: int = 0, **config_overrides) -> CLIPVisionModel:
    torch.manual_seed(seed)
    return CLIPVisionModel(tiny_vision_config(**config_overrides)).eval()


def make_finetune(base: CLIPVisionModel, seed: int, scale: float = 1e-2) -> CLIPVisionModel:
    """A "fine-tune" of ``base``: base + a random task vector whose scale varies per tensor (as in real fine-tunes)."""
    generator = torch.Generator().manual_seed(10_000 + seed)
    model = CLIPVisionModel(base.config).eval()
    state = {}
    for key, tensor in base.state_dict().items():
        if tensor.is_floating_point():
            spread = float(torch.empty(()).uniform_(0.3, 3.0, generator=generator))
            tensor = tensor + scale * spread * torch.randn(tensor.shape, generator=generator)
        state[key] = tensor
    model.load_state_dict(state)
    return model


def save_model(model: CLIPVisionModel, path: str | Path, *, image_size: int | None = None,
               prefixed: bool = False, max_shard_size: str | int = "5GB") -> Path:
    """Save with ``save_pretrained`` + an image processor; ``prefixed=True`` writes v4-style ``vision_model.`` keys."""
    path = Path(path)
    if prefixed:
        from safetensors.torch import save_file

        path.mkdir(parents=True, exist_ok=True)
        model.config.save_pretrained(path)
        save_file({f"vision_model.{k}": v.contiguous() for k, v in model.state_dict().items()},
                  str(path / "model.safetensors"), metadata={"format": "pt"})
    else:
        model.save_pretrained(path, max_shard_size=max_shard_size)
    tiny_processor(image_size or model.config.image_size).save_pretrained(path)
    return path


def tiny_tokenizer():
    """A CLIP BPE tokenizer whose vocabulary is the 256 byte symbols (+ end-of-word forms): 514 ids, no merges."""
    from transformers import CLIPTokenizer

    symbols = list(_bytes_to_unicode().values())
    vocab = {symbol: i for i, symbol in enumerate(symbols + [s + "</w>" for s in symbols])}
    vocab.update({"<|startoftext|>": len(vocab), "<|endoftext|>": len(vocab) + 1})
    return CLIPTokenizer(vocab=vocab, merges=[])


def _bytes_to_unicode() -> dict[int, str]:
    """The byte-to-symbol table of GPT-2/CLIP byte-level BPE."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    codes, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            codes.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, codes)))


def save_clip_model(vision: CLIPVisionModel, path: str | Path, seed: int = 0) -> Path:
    """Save a full ``CLIPModel`` (text tower + projections) whose vision tower is ``vision``, with a ``CLIPProcessor``
    (image processor + tokenizer), so zero-shot classification runs on it."""
    from transformers import CLIPProcessor

    torch.manual_seed(seed)
    config = CLIPConfig(
        vision_config=vision.config.to_dict(),
        text_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                         vocab_size=520, max_position_embeddings=32, bos_token_id=512, eos_token_id=513,
                         pad_token_id=513),
        projection_dim=16,
    )
    clip = CLIPModel(config).eval()
    clip.vision_model.load_state_dict(vision.state_dict())
    clip.save_pretrained(path)
    CLIPProcessor(image_processor=tiny_processor(vision.config.image_size),
                  tokenizer=tiny_tokenizer()).save_pretrained(path)
    return Path(path)


def make_image_folder(path: str | Path, n: int = 12, size: int = 40, seed: int = 0, classes: int = 2) -> Path:
    """An ``imagefolder`` layout (``train/<class>/<i>.png``) of random RGB images, ``n`` in total."""
    generator = torch.Generator().manual_seed(seed)
    path = Path(path)
    for i in range(n):
        folder = path / "train" / f"class{i % classes}"
        folder.mkdir(parents=True, exist_ok=True)
        pixels = (torch.rand(size, size, 3, generator=generator) * 255).to(torch.uint8).numpy()
        Image.fromarray(pixels).save(folder / f"{i}.png")
    return path


def make_tiny_setup(root: str | Path, q: int = 3, seed: int = 0, **config_overrides) -> tuple[Path, list[Path]]:
    """Write a tiny base and ``q`` fine-tunes under ``root``; return their folders."""
    root = Path(root)
    base = make_base(seed, **config_overrides)
    base_dir = save_model(base, root / "base")
    model_dirs = [save_model(make_finetune(base, seed * 100 + i), root / f"ft{i}") for i in range(q)]
    return base_dir, model_dirs


# ----------------------------------------------------------------------------- text families (decoders, encoders)
TINY_DECODER = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=64, bos_token_id=1, eos_token_id=2,
                    pad_token_id=3)  # fmt: skip


def word_tokenizer(vocab_size: int = 64, extra_tokens: tuple[str, ...] = ()):
    """A word-level fast tokenizer built in-process (no Hub): ``<unk> <s> </s> <pad>`` and words ``w0, w1, ...``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "<pad>": 3, **{f"w{i}": 4 + i for i in range(vocab_size - 4)}}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>",
                                        eos_token="</s>", pad_token="<pad>")
    if extra_tokens:
        tokenizer.add_tokens(list(extra_tokens))
    return tokenizer


def right_padded(sequences: list[list[int]], pad_id: int = 3) -> dict:
    """``input_ids`` and ``attention_mask`` of token-id ``sequences``, right-padded with ``pad_id`` (the word
    tokenizer's ``<pad>``) to the longest."""
    import torch

    width = max(map(len, sequences))
    ids, mask = torch.full((len(sequences), width), pad_id), torch.zeros(len(sequences), width, dtype=torch.long)
    for row, seq in enumerate(sequences):
        ids[row, :len(seq)], mask[row, :len(seq)] = torch.tensor(seq), 1
    return {"input_ids": ids, "attention_mask": mask}


def char_tokenizer():
    """A byte-level BPE tokenizer over ``w`` and the digits (no merges: one token per character) built in-process:
    transformers 5 reads a Qwen2 model's tokenizer as ``Qwen2Tokenizer`` whatever its folder says, which drops the
    words of :func:`word_tokenizer` but keeps these tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = ["w", "Ġ", *"0123456789"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "<pad>": 3, **{c: 4 + i for i, c in enumerate(chars)}}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>")


def tiny_decoder(family: str = "llama", *, seed: int = 0, tie: bool = False, **overrides):
    """A tiny random ``LlamaForCausalLM`` / ``MistralForCausalLM`` / ``Qwen2ForCausalLM`` / ``Qwen3ForCausalLM``
    (hidden 32, 2 blocks)."""
    import transformers

    names = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3"}
    head = {}
    if family == "qwen3":  # Qwen3's head_dim defaults to 128
        head["head_dim"] = TINY_DECODER["hidden_size"] // TINY_DECODER["num_attention_heads"]
    config = getattr(transformers, f"{names[family]}Config")(**{**TINY_DECODER, **head, "tie_word_embeddings": tie,
                                                                 **overrides})
    torch.manual_seed(seed)
    return getattr(transformers, f"{names[family]}ForCausalLM")(config).eval()


def perturbed(model, seed: int, scale: float = 2e-2):
    """A "fine-tune" of any model: every float tensor moved by a random task vector whose size varies per tensor
    (tied tensors stay tied)."""
    generator = torch.Generator().manual_seed(1000 + seed)
    state = {}
    for key, tensor in model.state_dict().items():
        if tensor.is_floating_point():
            spread = float(torch.empty(()).uniform_(0.3, 3.0, generator=generator))
            tensor = tensor + scale * spread * torch.randn(tensor.shape, generator=generator).to(tensor.dtype)
        state[key] = tensor
    tuned = type(model)(model.config).to(next(model.parameters()).dtype).eval()
    tuned.load_state_dict(state)
    if getattr(model.config, "tie_word_embeddings", False):
        tuned.tie_weights()
    return tuned


def save_with_finetunes(base, root: str | Path, q: int = 3, *, tokenizer=None, ft_tokenizer=None,
                        max_shard_size: str | int | None = None, scale: float = 2e-2) -> tuple[Path, list[Path]]:
    """Save ``base`` and ``q`` perturbed fine-tunes of it under ``root`` (``base``, ``ft1``...), each with a
    tokenizer (``ft_tokenizer`` for the fine-tunes if given); return their folders."""
    root = Path(root)
    folders = []
    for i, model in enumerate([base, *[perturbed(base, i, scale) for i in range(q)]]):
        folder = root / ("base" if i == 0 else f"ft{i}")
        model.save_pretrained(folder, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
        chosen = ft_tokenizer if ft_tokenizer is not None and i > 0 else tokenizer
        if chosen is not None:
            chosen.save_pretrained(folder)
        folders.append(folder)
    return folders[0], folders[1:]


def save_finetune_with_tokens(base, folder: str | Path, seed: int, *, tokens: tuple[str, ...] = (),
                              special: tuple[str, ...] = (), words: int | None = None) -> Path:
    """Save a perturbed fine-tune of the tiny decoder ``base`` whose tokenizer (``word_tokenizer``) adds ``tokens``
    and ``special`` tokens (a chat template's), its embedding and untied head grown by one seeded random row per new
    token, as ``resize_token_embeddings`` + training leave them; ``words``: a word vocabulary of that size instead of
    the base's (fewer tokens: the model's rows shrink with it)."""
    import copy

    tuned = perturbed(base, seed)
    tuned.config = copy.deepcopy(base.config)
    tokenizer = word_tokenizer(words or base.config.vocab_size, extra_tokens=tokens)
    if special:
        tokenizer.add_special_tokens({"additional_special_tokens": list(special)})
    old = base.config.vocab_size if words is None else min(words, base.config.vocab_size)
    tuned.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    generator = torch.Generator().manual_seed(2000 + seed)
    with torch.no_grad():
        for weights in {id(w): w for w in (tuned.get_input_embeddings().weight,
                                           tuned.get_output_embeddings().weight)}.values():
            weights[old:] = torch.randn(weights[old:].shape, generator=generator)
    tuned.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return Path(folder)
