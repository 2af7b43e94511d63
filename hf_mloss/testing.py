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
