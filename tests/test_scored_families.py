"""Scored families beyond the CLIP / ViT / DINOv2 image towers: SigLIP vision, BERT-family encoders, LLaMA-family
decoders and the CLIP text tower.

Every family is a tiny random model built here, saved with ``save_pretrained`` and loaded back through its adapter.
The adapter's block walk (``embed`` -> ``forward_to_target`` -> ``forward_from_target``) must reproduce the model's
own forward block by block on padded batches (left and right padding for decoders), give the scored linears exactly
the inputs a forward hook sees, name every tensor of the checkpoint, and keep data-free merges working. For the
gated decoders, a brute-force reference of the gated node / layer M-Loss (SPEC 1b) is computed by hooks on each
model's own forward; ``hf_mloss.score(prefix="own")`` is compared with it once the block walk passes a
``BlockContext`` to the adapters.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import transformers
from safetensors import safe_open
from transformers import AutoModel, AutoModelForCausalLM

import hf_mloss
from examples import tiny as testing
from hf_mloss.adapters import adapter_for
from hf_mloss.adapters.base import EMBEDDING_STAGE, BlockContext, ScoredUnit
from hf_mloss.adapters.clip_text import CLIPTextAdapter

VOCAB = 64
PAD = 3
SEQ = 7
LENGTHS = (7, 4, 5)  # the first sequence fills the batch; the others are padded
ENCODER = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
           "num_attention_heads": 4, "max_position_embeddings": 64, "pad_token_id": PAD}
DECODER = {**testing.TINY_DECODER, "num_hidden_layers": 3}
SMALL_HEADS = {"head_dim": 8}


# ------------------------------------------------------------------------------------------------- the families
@dataclass(frozen=True)
class Family:
    build: Callable[[], transformers.PreTrainedModel]
    kind: str  # "image" | "encoder" | "decoder" | "clip_text"
    auto: type = AutoModel

    @property
    def sides(self) -> tuple[str, ...]:
        """Padding sides the model's own forward supports with its own positions (absolute positions: right)."""
        return ("right", "left") if self.kind == "decoder" else ("right",) if self.kind != "image" else ("none",)


def _decoder(name: str, **extra) -> Callable[[], transformers.PreTrainedModel]:
    def build():
        config = getattr(transformers, f"{name}Config")(**{**DECODER, **extra})
        return getattr(transformers, f"{name}ForCausalLM")(config)
    return build


def _siglip():
    from transformers import SiglipVisionConfig, SiglipVisionModel

    return SiglipVisionModel(SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                                num_attention_heads=2, image_size=16, patch_size=8))


def _clip_text_config():
    from transformers import CLIPTextConfig

    return CLIPTextConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                          vocab_size=520, max_position_embeddings=16, bos_token_id=512, eos_token_id=513,
                          pad_token_id=513)


FAMILIES: dict[str, Family] = {
    "siglip_vision": Family(_siglip, "image"),
    "bert": Family(lambda: transformers.BertModel(transformers.BertConfig(**ENCODER)), "encoder"),
    "bert_for_classification": Family(
        lambda: transformers.BertForSequenceClassification(transformers.BertConfig(**ENCODER, num_labels=3)),
        "encoder", transformers.AutoModelForSequenceClassification),
    "roberta": Family(lambda: transformers.RobertaModel(transformers.RobertaConfig(**{**ENCODER, "pad_token_id": 1})),
                      "encoder"),
    "xlm_roberta": Family(
        lambda: transformers.XLMRobertaModel(transformers.XLMRobertaConfig(**{**ENCODER, "pad_token_id": 1})),
        "encoder"),
    "llama": Family(_decoder("Llama"), "decoder", AutoModelForCausalLM),
    "llama_tied": Family(_decoder("Llama", tie_word_embeddings=True), "decoder", AutoModelForCausalLM),
    "mistral": Family(_decoder("Mistral", sliding_window=4), "decoder", AutoModelForCausalLM),
    "qwen2": Family(_decoder("Qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=1),
                    "decoder", AutoModelForCausalLM),
    "qwen3": Family(_decoder("Qwen3", **SMALL_HEADS), "decoder", AutoModelForCausalLM),
    "qwen2_for_classification": Family(
        lambda: transformers.Qwen2ForSequenceClassification(transformers.Qwen2Config(**DECODER, num_labels=2)),
        "decoder", transformers.AutoModelForSequenceClassification),
    "gemma": Family(_decoder("Gemma", **SMALL_HEADS), "decoder", AutoModelForCausalLM),
    "gemma2": Family(_decoder("Gemma2", **SMALL_HEADS, sliding_window=4, query_pre_attn_scalar=8),
                     "decoder", AutoModelForCausalLM),
    "clip_text": Family(lambda: transformers.CLIPTextModel(_clip_text_config()), "clip_text"),
}


def _processor(name: str):
    """What the pipeline of the family needs beside the weights (saved with every checkpoint of it)."""
    if name == "siglip_vision":
        from transformers import SiglipImageProcessorPil

        return SiglipImageProcessorPil(size={"height": 16, "width": 16})
    return testing.tiny_tokenizer() if name == "clip_text" else testing.word_tokenizer(VOCAB)


@pytest.fixture(scope="module", params=list(FAMILIES))
def saved(request, tmp_path_factory):
    """(family name, base folder, fine-tune folders): a tiny random model and 2 perturbed copies."""
    torch.manual_seed(0)
    base = FAMILIES[request.param].build().eval()
    base_dir, models = testing.save_with_finetunes(base, tmp_path_factory.mktemp(request.param), 2,
                                                   tokenizer=_processor(request.param))
    return request.param, base_dir, models


def load(folder: Path):
    """(adapter, model) of a saved folder, through the adapter as a user's merge loads it."""
    config = transformers.AutoConfig.from_pretrained(folder)
    adapter = adapter_for(config)
    return adapter, adapter.load_model(str(folder), dtype=torch.float32)


# --------------------------------------------------------------------------------------------------- batches
def padded_batch(kind: str, side: str, *, seed: int = 0, vocab: int = VOCAB) -> dict[str, torch.Tensor]:
    """A batch of 3 sequences of LENGTHS tokens padded to SEQ on ``side`` (3 images for an image family)."""
    generator = torch.Generator().manual_seed(seed)
    if kind == "image":
        return {"pixel_values": torch.randn(3, 3, 16, 16, generator=generator)}
    ids = torch.randint(4, vocab - 8, (len(LENGTHS), SEQ), generator=generator)
    mask = torch.zeros_like(ids)
    for row, length in enumerate(LENGTHS):
        if side == "left":
            mask[row, SEQ - length:] = 1
        else:
            mask[row, :length] = 1
    return {"input_ids": ids.masked_fill(mask == 0, PAD), "attention_mask": mask}


def pad_aware_positions(mask: torch.Tensor) -> torch.Tensor:
    return (mask.cumsum(-1) - 1).clamp(min=0)


def own_forward(model, kind: str, batch: dict[str, torch.Tensor]):
    """The model's own forward on ``batch`` (decoders: positions counted from each sequence's first real token, as
    ``generate`` numbers them)."""
    if kind == "decoder":
        return model(**batch, position_ids=pad_aware_positions(batch["attention_mask"]))
    return model(**batch)


def positions(context: BlockContext, hidden: torch.Tensor) -> torch.Tensor:
    """The rows of ``hidden`` [B, T, ...] that count (padding excluded), as [N, ...]."""
    return hidden.reshape(-1, *hidden.shape[2:]) if context.mask is None else hidden[context.mask]


@dataclass
class Walk:
    context: BlockContext
    outputs: list[torch.Tensor]     # each block's output
    inputs: list[torch.Tensor]      # each block's u (input of the unit's gate / up)
    down_inputs: list[torch.Tensor]  # each block's input of the unit's down linear


def walk(adapter, model, batch) -> Walk:
    """Run the adapter's block walk over every block."""
    act = adapter.activation(model)
    with torch.no_grad():
        hidden, context = adapter.embed(model, batch)
        outputs, inputs, down_inputs = [], [], []
        for block in adapter.layers(model):
            residual, u = adapter.forward_to_target(block, hidden, context)
            unit = act(block.get_submodule(adapter.unit.gate)(u))
            if adapter.unit.up is not None:
                unit = unit * block.get_submodule(adapter.unit.up)(u)
            hidden = adapter.forward_from_target(block, residual, u, context)
            outputs.append(hidden)
            inputs.append(u)
            down_inputs.append(unit)
    return Walk(context, outputs, inputs, down_inputs)


def hooked_forward(adapter, model, kind: str, batch) -> dict[str, list[torch.Tensor]]:
    """Each block's output and the inputs of the unit's linears, captured by hooks on the model's own forward."""
    captured: dict[str, list[torch.Tensor]] = {"outputs": [], "gate": [], "up": [], "down": []}
    handles = []
    for block in adapter.layers(model):
        handles.append(block.register_forward_hook(
            lambda m, args, out: captured["outputs"].append(out[0] if isinstance(out, tuple) else out)))
        for role in ("gate", "up", "down"):
            suffix = getattr(adapter.unit, role)
            if suffix is not None:
                handles.append(block.get_submodule(suffix).register_forward_pre_hook(
                    lambda m, args, role=role: captured[role].append(args[0])))
    try:
        with torch.no_grad():
            own_forward(model, kind, batch)
    finally:
        for handle in handles:
            handle.remove()
    return captured


# -------------------------------------------------------------------------------------------- (a) + (b) the walk
def test_the_adapters_are_chosen_by_model_type(saved):
    name, base_dir, _ = saved
    adapter, model = load(base_dir)
    expected = {"bert_for_classification": "bert", "xlm_roberta": "xlm-roberta", "llama_tied": "llama",
                "qwen2_for_classification": "qwen2"}.get(name, name)
    assert adapter.name == expected
    assert isinstance(model, adapter.model_class) and type(model).__name__ == model.config.architectures[0]
    assert isinstance(adapter.unit, ScoredUnit) and adapter.target_suffix == adapter.unit.gate
    assert adapter.modality == ("image" if FAMILIES[name].kind == "image" else "text")
    batch = padded_batch(FAMILIES[name].kind, FAMILIES[name].sides[0])
    assert set(adapter.input_names) == set(batch)


@pytest.mark.parametrize("side_index", [0, 1], ids=["first-side", "second-side"])
def test_the_walk_reproduces_the_models_own_forward_block_by_block(saved, side_index):
    name, base_dir, _ = saved
    family = FAMILIES[name]
    if side_index >= len(family.sides):
        pytest.skip(f"{name}: absolute positions, the model's own forward is defined for right padding only")
    adapter, model = load(base_dir)
    batch = padded_batch(family.kind, family.sides[side_index])
    walked = walk(adapter, model, batch)
    hooked = hooked_forward(adapter, model, family.kind, batch)
    assert len(walked.outputs) == len(hooked["outputs"]) == adapter.num_layers
    if family.kind != "image":
        assert torch.equal(walked.context.mask, batch["attention_mask"].bool())
        assert int(walked.context.mask.sum()) == sum(LENGTHS)
    for layer in range(adapter.num_layers):
        mine = positions(walked.context, walked.outputs[layer])
        theirs = positions(walked.context, hooked["outputs"][layer])
        torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-5, msg=f"{name} block {layer} output")
        # (b) the scored linears read exactly what they read in the model's own forward
        torch.testing.assert_close(positions(walked.context, walked.inputs[layer]),
                                   positions(walked.context, hooked["gate"][layer]), rtol=0, atol=1e-5)
        if adapter.unit.up is not None:
            assert torch.equal(hooked["up"][layer], hooked["gate"][layer])
        torch.testing.assert_close(positions(walked.context, walked.down_inputs[layer]),
                                   positions(walked.context, hooked["down"][layer]), rtol=0, atol=1e-5)


def test_the_last_block_feeds_the_models_own_tail(saved):
    """The walk's last hidden states, through the family's tail, are the model's ``last_hidden_state``."""
    name, base_dir, _ = saved
    family = FAMILIES[name]
    adapter, model = load(base_dir)
    batch = padded_batch(family.kind, family.sides[0])
    walked = walk(adapter, model, batch)
    tails = {"decoder": lambda: model.base_model.norm, "encoder": lambda: torch.nn.Identity(),
             "clip_text": lambda: model.final_layer_norm, "image": lambda: model.post_layernorm}
    with torch.no_grad():
        out = own_forward(model.base_model, family.kind, batch)
        last = tails[family.kind]()(walked.outputs[-1])
    torch.testing.assert_close(positions(walked.context, last), positions(walked.context, out.last_hidden_state),
                               rtol=0, atol=1e-5)


def test_padding_never_changes_a_sequences_hidden_states(saved):
    """Every padded sequence walks to the hidden states it has alone, unpadded (both sides for decoders)."""
    name, base_dir, _ = saved
    family = FAMILIES[name]
    if family.kind == "image":
        pytest.skip("images have no padding")
    adapter, model = load(base_dir)
    for side in family.sides:
        batch = padded_batch(family.kind, side)
        walked = walk(adapter, model, batch)
        for row in range(len(LENGTHS)):
            keep = batch["attention_mask"][row].bool()
            alone = walk(adapter, model, {"input_ids": batch["input_ids"][row:row + 1, keep],
                                          "attention_mask": batch["attention_mask"][row:row + 1, keep]})
            for layer in range(adapter.num_layers):
                torch.testing.assert_close(walked.outputs[layer][row, keep], alone.outputs[layer][0], rtol=0,
                                           atol=1e-5, msg=f"{name} {side} row {row} block {layer}")
                torch.testing.assert_close(walked.inputs[layer][row, keep], alone.inputs[layer][0], rtol=0,
                                           atol=1e-5)


# ----------------------------------------------------------------------------------- (c) + (d) names and groups
def checkpoint_shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    shapes = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), "pt") as handle:
            shapes.update({key: tuple(handle.get_slice(key).get_shape()) for key in handle.keys()})  # noqa: SIM118
    return shapes


def assert_names_cover(adapter, file_shapes: dict[str, tuple[int, ...]], *, outside_prefix: str | None = None):
    """Every tensor of the file has a canonical name with the expected shape and a stage; the file holds every
    expected tensor. ``outside_prefix``: keys of a whole model outside the adapter's tower (named None)."""
    expected = adapter.expected_shapes()
    tied = adapter.tied_names() if hasattr(adapter, "tied_names") else frozenset()
    named = {}
    for key, shape in file_shapes.items():
        name = adapter.canonical_key(key)
        if name is None:
            assert outside_prefix is not None and not key.startswith(outside_prefix), key
            continue
        assert expected.get(name) == shape, (key, name, shape, expected.get(name))
        named[name] = key
    assert set(expected) - tied == set(named) - tied
    stages = {name: adapter.stage_of(name) for name in expected}
    assert set(stages.values()) == {EMBEDDING_STAGE, *range(adapter.num_layers), adapter.num_layers}
    for name, stage in stages.items():
        if 0 <= stage < adapter.num_layers:
            assert name.startswith(adapter.layer_prefix(stage)), name
        else:
            assert not any(name.startswith(adapter.layer_prefix(layer)) for layer in range(adapter.num_layers))
    for layer in range(adapter.num_layers):
        for suffix in filter(None, (adapter.unit.gate, adapter.unit.up, adapter.unit.down)):
            assert f"{adapter.layer_prefix(layer)}{suffix}.weight" in expected
        assert adapter.target_name(layer) == f"{adapter.layer_prefix(layer)}{adapter.unit.gate}"


def test_canonical_names_cover_every_tensor_of_the_checkpoint(saved):
    _, base_dir, _ = saved
    adapter, model = load(base_dir)
    assert_names_cover(adapter, checkpoint_shapes(base_dir))
    # a block copy is filled from a store by ``layer_prefix(l) + key``: every parameter of a block has its name
    expected = adapter.expected_shapes()
    for layer, block in enumerate(adapter.layers(model)):
        for key, value in block.named_parameters():
            assert expected[f"{adapter.layer_prefix(layer)}{key}"] == tuple(value.shape), (layer, key)
    # and the model's own state dict is named alike (the worker model of a scoring pass)
    own = {adapter.canonical_key(k): tuple(v.shape) for k, v in model.state_dict().items()}
    assert all(own.get(name) == shape for name, shape in expected.items())


def test_node_groups_line_up(saved):
    """Slice i of every member of a node group exists: rows of the gate (and up) linears, column of down."""
    _, base_dir, _ = saved
    adapter, model = load(base_dir)
    expected = adapter.expected_shapes()
    for layer in range(adapter.num_layers):
        block = adapter.layers(model)[layer]
        n = block.get_submodule(adapter.unit.gate).out_features
        groups = adapter.node_groups(layer)
        prefix = adapter.layer_prefix(layer)
        assert (f"{prefix}{adapter.unit.gate}.weight", 0) in groups
        if adapter.unit.up is not None:
            assert set(groups) >= {(f"{prefix}{adapter.unit.up}.weight", 0),
                                   (f"{prefix}{adapter.unit.down}.weight", 1)}
        for tensor_name, dim in groups:
            shape = expected[tensor_name]
            assert shape[dim if len(shape) > 1 else 0] == n, (tensor_name, dim, shape, n)
        assert len(set(groups)) == len(groups)


def test_prefixed_and_unprefixed_encoder_files_share_names(tmp_path):
    """A BertForSequenceClassification file read under a BertModel base (heads left out) and a BertModel file read
    under a BertForSequenceClassification base (encoder keys given the ``bert.`` prefix)."""
    torch.manual_seed(0)
    classifier = transformers.BertForSequenceClassification(transformers.BertConfig(**ENCODER, num_labels=3))
    classifier.save_pretrained(tmp_path / "cls")
    classifier.bert.save_pretrained(tmp_path / "bare")
    bare_adapter, _ = load(tmp_path / "bare")
    cls_adapter, _ = load(tmp_path / "cls")
    cls_shapes, bare_shapes = checkpoint_shapes(tmp_path / "cls"), checkpoint_shapes(tmp_path / "bare")
    assert_names_cover(bare_adapter, {k: v for k, v in cls_shapes.items() if k.startswith("bert.")})
    assert {bare_adapter.canonical_key(k) for k in cls_shapes if not k.startswith("bert.")} == {None}
    assert {cls_adapter.canonical_key(k) for k in bare_shapes} == {k for k in cls_shapes if k.startswith("bert.")}
    assert cls_adapter.layer_prefix(1) == "bert.encoder.layer.1."
    assert bare_adapter.layer_prefix(1) == "encoder.layer.1."


def test_a_masked_lm_file_with_pretraining_heads_merges_as_its_class(tmp_path):
    """``bert-base-uncased`` is a ``BertForMaskedLM`` whose file also holds the pooler and the next-sentence head of
    pre-training: the merge is a ``BertForMaskedLM`` (those tensors are not part of it, as transformers loads it),
    and it is scored on the encoder."""
    import json

    torch.manual_seed(0)
    pretraining = transformers.BertForPreTraining(transformers.BertConfig(**ENCODER)).eval()
    folders = []
    for i, model in enumerate([pretraining, testing.perturbed(pretraining, 0), testing.perturbed(pretraining, 1)]):
        folder = tmp_path / f"m{i}"
        model.save_pretrained(folder)
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, "architectures": ["BertForMaskedLM"]}))
        testing.word_tokenizer(VOCAB).save_pretrained(folder)
        folders.append(folder)
    adapter, _ = load(folders[0])
    file_shapes = checkpoint_shapes(folders[0])
    dropped = sorted(k for k in file_shapes if adapter.canonical_key(k) is None)
    assert dropped == ["bert.pooler.dense.bias", "bert.pooler.dense.weight", "cls.seq_relationship.bias",
                       "cls.seq_relationship.weight"]
    assert_names_cover(adapter, {k: v for k, v in file_shapes.items() if k not in dropped})
    result = hf_mloss.merge(str(folders[0]), [str(f) for f in folders[1:]], "average", progress=False)
    assert type(result.model) is transformers.BertForMaskedLM
    sources = [_float_state(f) for f in folders[1:]]
    for key, value in result.model.state_dict().items():
        if key in sources[0]:
            torch.testing.assert_close(value, (sources[0][key] + sources[1][key]) / 2, rtol=0, atol=1e-6)
    loaded = transformers.AutoModelForMaskedLM.from_pretrained(result.save_pretrained(tmp_path / "merged"))
    assert type(loaded) is transformers.BertForMaskedLM


def test_towers_of_whole_models_are_named(tmp_path):
    """The SigLIP vision tower of a SiglipModel and the CLIP text tower of a CLIPModel (the other keys: None)."""
    from transformers import CLIPConfig, CLIPModel, SiglipConfig, SiglipModel

    from hf_mloss.adapters.siglip_vision import SiglipVisionAdapter

    torch.manual_seed(0)
    siglip = SiglipModel(SiglipConfig(
        text_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
                     "vocab_size": 64, "max_position_embeddings": 16},
        vision_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
                       "image_size": 16, "patch_size": 8}))
    siglip.save_pretrained(tmp_path / "siglip")
    adapter = adapter_for(siglip.config)
    assert isinstance(adapter, SiglipVisionAdapter) and adapter.num_layers == 2
    assert_names_cover(adapter, checkpoint_shapes(tmp_path / "siglip"), outside_prefix="vision_model.")
    clip = CLIPModel(CLIPConfig(text_config=_clip_text_config().to_dict(),
                                vision_config=testing.tiny_vision_config().to_dict(), projection_dim=16))
    clip.save_pretrained(tmp_path / "clip")
    assert adapter_for(clip.config).name == "clip_vision"  # a whole CLIPModel is still matched by its vision tower
    text = CLIPTextAdapter(clip.config)
    assert text.config.model_type == "clip_text_model" and text.output_class("auto") is CLIPModel
    assert_names_cover(text, checkpoint_shapes(tmp_path / "clip"), outside_prefix="text_model.")
    # the text tower of the whole model walks as the CLIPModel's own text forward
    batch = padded_batch("text", "right", vocab=500)
    walked = walk(text, clip.text_model.eval(), batch)
    hooked = hooked_forward(text, clip.text_model, "clip_text", batch)
    for mine, theirs in zip(walked.outputs, hooked["outputs"]):
        torch.testing.assert_close(positions(walked.context, mine), positions(walked.context, theirs), rtol=0,
                                   atol=1e-5)


def test_decoder_configs_without_architectures_are_causal_lms():
    config = transformers.Qwen2Config(**DECODER)
    assert not config.architectures
    adapter = adapter_for(config)
    assert adapter.model_class is transformers.Qwen2ForCausalLM and adapter.layer_prefix(0) == "model.layers.0."
    assert not config.architectures  # the caller's config is left as it was


def test_activations_are_the_models_own():
    from transformers.activations import ACT2FN

    for name, act in (("llama", "silu"), ("gemma", "gelu_pytorch_tanh"), ("gemma2", "gelu_pytorch_tanh"),
                      ("bert", "gelu"), ("clip_text", "quick_gelu"), ("siglip_vision", "gelu_pytorch_tanh")):
        model = FAMILIES[name].build()
        adapter = adapter_for(model.config)
        x = torch.linspace(-4, 4, 41)
        torch.testing.assert_close(adapter.activation(model)(x), ACT2FN[act](x), rtol=0, atol=0)
        torch.testing.assert_close(adapter.activation()(x), ACT2FN[act](x), rtol=0, atol=0)


# ------------------------------------------------------------------------------------------ (e) data-free merges
def _float_state(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    state = {}
    for file in sorted(folder.glob("*.safetensors")):
        state.update({k: v.float() for k, v in load_file(str(file)).items() if v.is_floating_point()})
    return state


def test_data_free_merges_still_work(saved, tmp_path):
    name, base_dir, models = saved
    family = FAMILIES[name]
    adapter, _ = load(base_dir)
    sources = [_float_state(m) for m in models]
    average = hf_mloss.merge(str(base_dir), [str(m) for m in models], "average", progress=False)
    state = {adapter.canonical_key(k): v for k, v in average.model.state_dict().items()}
    for key in sources[0]:
        canonical = adapter.canonical_key(key)
        torch.testing.assert_close(state[canonical].float(), sum(s[key] for s in sources) / len(sources), rtol=0,
                                   atol=1e-6, msg=key)
    ties = hf_mloss.merge(str(base_dir), [str(m) for m in models], "ties", k=0.5, progress=False)
    for result, label in ((average, "average"), (ties, "ties")):
        folder = result.save_pretrained(tmp_path / label)
        loaded, info = family.auto.from_pretrained(folder, output_loading_info=True)
        assert type(loaded).__name__ == type(result.model).__name__ and not info["missing_keys"], info
        for key, value in result.model.state_dict().items():
            assert torch.equal(loaded.state_dict()[key], value), key
        if name == "llama_tied":
            assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()


def test_a_merged_tiny_llama_generates(saved, tmp_path):
    name, base_dir, models = saved
    if FAMILIES[name].auto is not AutoModelForCausalLM:
        pytest.skip("causal LMs only")
    result = hf_mloss.merge(str(base_dir), [str(m) for m in models], "ties", k=0.5, progress=False)
    folder = result.save_pretrained(tmp_path / "merged")
    generator = transformers.pipeline("text-generation", model=str(folder), tokenizer=str(folder))
    text = generator("w1 w2 w3", max_new_tokens=3, do_sample=False)[0]["generated_text"]
    assert text.startswith("w1 w2 w3") and len(text) > len("w1 w2 w3")
    prompt = torch.tensor([[5, 6, 7]])
    tokens = generator.model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=3,
                                      do_sample=False, min_new_tokens=3)
    with torch.no_grad():  # greedy: each new token is the argmax of the merged model's next-token logits
        for step in range(3):
            logits = result.model(tokens[:, :3 + step]).logits[0, -1]
            assert int(tokens[0, 3 + step]) == int(logits.argmax())


def test_tower_output_is_refused_for_families_without_towers(saved):
    name, base_dir, models = saved
    if FAMILIES[name].kind not in ("decoder", "encoder"):
        pytest.skip("families without a tower")
    with pytest.raises(hf_mloss.InvalidParameterError, match="output='tower'.*model has none"):
        hf_mloss.merge(str(base_dir), [str(m) for m in models], "average", output="tower", progress=False)


def test_two_decoder_families_never_merge_together(tmp_path):
    torch.manual_seed(0)
    base, _ = testing.save_with_finetunes(FAMILIES["llama"].build(), tmp_path / "llama", 0)
    other, _ = testing.save_with_finetunes(FAMILIES["qwen3"].build(), tmp_path / "qwen3", 0)
    with pytest.raises(hf_mloss.IncompatibleCheckpointsError, match="'qwen3' model.*the base is 'llama'"):
        hf_mloss.merge(str(base), [str(other)], "average", progress=False)


# -------------------------------------------------------------------------------- (f) gated M-Loss, brute force
def brute_force_gated_mloss(models: list, sequences: list[list[int]], weights: list[float] | None = None, *,
                            side: str = "right", pad_id: int = PAD, eps: float = 1e-4) -> dict[str, dict]:
    """Gated node and layer M-Loss (SPEC 1b, prefix "own") by hooks on each model's own forward.

    For every decoder block, a_p and b_p are the outputs of model p's ``mlp.gate_proj`` and ``mlp.up_proj`` on its
    OWN hidden states (model p runs its whole forward); only the real tokens count (padding excluded, on either
    side). g = f(Σα a)·(Σα b) − Σα f(a)·b with α the normalised weights and f the models' activation.
    Returns, per scored linear (``model.layers.N.mlp.gate_proj``): node ``abs`` / ``sq`` / ``normalized`` [n],
    layer ``layer`` / ``layer_normalized`` and the number of positions.
    """
    q = len(models)
    alpha = torch.tensor(weights or [1.0] * q, dtype=torch.float64)
    alpha = alpha / alpha.sum()
    width = max(map(len, sequences))
    ids = torch.full((len(sequences), width), pad_id)
    mask = torch.zeros_like(ids)
    for row, seq in enumerate(sequences):
        cols = slice(width - len(seq), width) if side == "left" else slice(0, len(seq))
        ids[row, cols] = torch.tensor(seq)
        mask[row, cols] = 1
    keep = mask.bool()
    gates, ups = [], []  # [q][layer] -> [N, n]
    for model in models:
        captured: dict[str, list[torch.Tensor]] = {"gate": [], "up": []}
        handles = []
        for block in model.model.layers:
            for role, linear in (("gate", block.mlp.gate_proj), ("up", block.mlp.up_proj)):
                handles.append(linear.register_forward_hook(
                    lambda m, a, out, into=captured[role]: into.append(out[keep].double())))
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0))
        for handle in handles:
            handle.remove()
        gates.append(captured["gate"])
        ups.append(captured["up"])
    f = models[0].model.layers[0].mlp.act_fn
    out = {}
    for layer in range(len(gates[0])):
        a = torch.stack([g[layer] for g in gates])  # [q, N, n]
        b = torch.stack([u[layer] for u in ups])
        w = alpha.view(q, 1, 1)
        merged = f((w * a).sum(0)) * (w * b).sum(0)
        gap = merged - (w * f(a) * b).sum(0)
        out[f"model.layers.{layer}.mlp.gate_proj"] = {
            "abs": gap.abs().mean(0), "sq": gap.pow(2).mean(0),
            "normalized": (gap.abs() / (merged.abs() + eps)).mean(0),
            "layer": gap.norm(dim=-1).mean(),
            "layer_normalized": (gap.norm(dim=-1) / (merged.norm(dim=-1) + eps)).mean(),
            "positions": gap.shape[0]}
    return out


SEQUENCES = [[5, 9, 13, 21, 8, 40], [7, 7, 30], [11, 4, 52, 19, 23, 6, 44, 17], [33]]


@pytest.fixture(scope="module")
def gated_setup(tmp_path_factory):
    """A tiny Llama base and q=2 fine-tunes, saved with the word tokenizer."""
    torch.manual_seed(0)
    base = FAMILIES["llama"].build().eval()
    return testing.save_with_finetunes(base, tmp_path_factory.mktemp("gated"), 2,
                                       tokenizer=testing.word_tokenizer(VOCAB), scale=5e-2)


def test_the_gated_reference_counts_no_padding(gated_setup):
    """Right padding, left padding and one sequence at a time give the same gated M-Loss."""
    _, models = gated_setup
    loaded = [AutoModelForCausalLM.from_pretrained(m).eval() for m in models]
    right = brute_force_gated_mloss(loaded, SEQUENCES, side="right")
    left = brute_force_gated_mloss(loaded, SEQUENCES, side="left")
    alone = [brute_force_gated_mloss(loaded, [seq]) for seq in SEQUENCES]
    total = sum(map(len, SEQUENCES))
    for name, ref in right.items():
        assert ref["positions"] == total and float(ref["abs"].min()) > 0
        for key in ("abs", "sq", "normalized", "layer", "layer_normalized"):
            torch.testing.assert_close(left[name][key], ref[key], rtol=1e-5, atol=1e-9)
            # float32 forwards of other shapes round differently; the normalised gap divides by |f(a)·b| + eps
            pooled = sum(a[name][key] * a[name]["positions"] for a in alone) / total
            torch.testing.assert_close(pooled, ref[key], rtol=1e-4 if "normalized" in key else 1e-5, atol=1e-9)


def test_the_gated_reference_matches_the_adapter_walk_and_a_hand_computation(gated_setup):
    """The adapter's walk (each model on its own stream) gives the reference's gate and up outputs; one position's
    gap is recomputed by hand, and q identical models have no gap."""
    _, models = gated_setup
    loaded = [AutoModelForCausalLM.from_pretrained(m).eval() for m in models]
    ref = brute_force_gated_mloss(loaded, SEQUENCES, [1.0, 3.0], side="left")
    adapter = adapter_for(loaded[0].config)
    width = max(map(len, SEQUENCES))
    ids = torch.full((len(SEQUENCES), width), PAD)
    mask = torch.zeros_like(ids)
    for row, seq in enumerate(SEQUENCES):
        ids[row, width - len(seq):], mask[row, width - len(seq):] = torch.tensor(seq), 1
    walks = [walk(adapter, model, {"input_ids": ids, "attention_mask": mask}) for model in loaded]
    f = adapter.activation(loaded[0])
    with torch.no_grad():
        for layer in range(adapter.num_layers):
            a = [m.model.layers[layer].mlp.gate_proj(w.inputs[layer])[w.context.mask].double()
                 for m, w in zip(loaded, walks)]
            b = [m.model.layers[layer].mlp.up_proj(w.inputs[layer])[w.context.mask].double()
                 for m, w in zip(loaded, walks)]
            merged = f(0.25 * a[0] + 0.75 * a[1]) * (0.25 * b[0] + 0.75 * b[1])
            gap = merged - 0.25 * f(a[0]) * b[0] - 0.75 * f(a[1]) * b[1]
            name = adapter.target_name(layer)
            torch.testing.assert_close(gap.abs().mean(0), ref[name]["abs"], rtol=1e-5, atol=1e-9)
            torch.testing.assert_close(gap.norm(dim=-1).mean(), ref[name]["layer"], rtol=1e-5, atol=1e-9)
            # one position, one node, by hand: silu(x) = x * sigmoid(x)
            a0, a1, b0, b1 = (float(t[0, 0]) for t in (a[0], a[1], b[0], b[1]))
            silu = lambda x: x / (1 + torch.exp(torch.tensor(-x, dtype=torch.float64)))
            by_hand = (silu(0.25 * a0 + 0.75 * a1) * (0.25 * b0 + 0.75 * b1)
                       - 0.25 * silu(a0) * b0 - 0.75 * silu(a1) * b1)
            torch.testing.assert_close(gap[0, 0], by_hand.to(gap.dtype), rtol=1e-6, atol=1e-9)
    same = brute_force_gated_mloss([loaded[0], loaded[0]], SEQUENCES)
    assert all(float(v["abs"].abs().max()) == 0 for v in same.values())


@pytest.mark.parametrize("reduction", ["abs", "sq"])
def test_score_own_prefix_equals_the_brute_force_gated_mloss(gated_setup, reduction):
    base, models = gated_setup
    texts = [" ".join(f"w{i - 4}" for i in seq) for seq in SEQUENCES]
    tokenizer = testing.word_tokenizer(VOCAB)
    assert [tokenizer(t)["input_ids"] for t in texts] == SEQUENCES  # the scorer sees exactly these tokens
    report = hf_mloss.score(str(base), [str(m) for m in models], data=texts, prefix="own", reduction=reduction,
                            progress=False)
    loaded = [AutoModelForCausalLM.from_pretrained(m).eval() for m in models]
    ref = brute_force_gated_mloss(loaded, SEQUENCES)
    assert set(report.node) == set(ref)
    assert report.num_positions == sum(map(len, SEQUENCES))
    for name, expected in ref.items():
        torch.testing.assert_close(report.node[name].double(), expected[reduction], rtol=1e-4, atol=1e-7)
        if reduction == "abs":
            torch.testing.assert_close(report.node_normalized[name].double(), expected["normalized"], rtol=1e-4,
                                       atol=1e-7)
        assert report.layer[name] == pytest.approx(float(expected["layer"]), rel=1e-4)
        assert report.layer_normalized[name] == pytest.approx(float(expected["layer_normalized"]), rel=1e-4)


# ------------------------------------------------------------------------ the encoder's node M-Loss, brute force
def brute_force_encoder_mloss(models: list, sequences: list[list[int]], weights: list[float] | None = None, *,
                              pad_id: int = PAD, eps: float = 1e-4) -> dict[str, dict]:
    """Node and layer M-Loss (SPEC 1, prefix "own") of BERT-family encoders by hooks on each model's own forward.

    h_p is the output of model p's ``intermediate.dense`` on its OWN hidden states, for the real tokens of the
    right-padded batch only; g = f(Σα h) − Σα f(h). Same keys as :func:`brute_force_gated_mloss`.
    """
    q = len(models)
    alpha = torch.tensor(weights or [1.0] * q, dtype=torch.float64)
    alpha = (alpha / alpha.sum()).view(q, 1, 1)
    width = max(map(len, sequences))
    ids = torch.full((len(sequences), width), pad_id)
    mask = torch.zeros_like(ids)
    for row, seq in enumerate(sequences):
        ids[row, :len(seq)], mask[row, :len(seq)] = torch.tensor(seq), 1
    keep = mask.bool()
    pre = []  # [q][layer] -> [N, n]
    for model in models:
        captured: list[torch.Tensor] = []
        handles = [block.intermediate.dense.register_forward_hook(
            lambda m, a, out, into=captured: into.append(out[keep].double()))
            for block in model.base_model.encoder.layer]
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask)
        for handle in handles:
            handle.remove()
        pre.append(captured)
    f = models[0].base_model.encoder.layer[0].intermediate.intermediate_act_fn
    out = {}
    for layer in range(len(pre[0])):
        h = torch.stack([p[layer] for p in pre])  # [q, N, n]
        merged = f((alpha * h).sum(0))
        gap = merged - (alpha * f(h)).sum(0)
        out[f"encoder.layer.{layer}.intermediate.dense"] = {
            "abs": gap.abs().mean(0), "sq": gap.pow(2).mean(0),
            "normalized": (gap.abs() / (merged.abs() + eps)).mean(0),
            "layer": gap.norm(dim=-1).mean(),
            "layer_normalized": (gap.norm(dim=-1) / (merged.norm(dim=-1) + eps)).mean(),
            "positions": gap.shape[0]}
    return out


@pytest.fixture(scope="module")
def encoder_setup(tmp_path_factory):
    """A tiny BertModel base and q=2 fine-tunes, saved with the word tokenizer."""
    torch.manual_seed(0)
    base = FAMILIES["bert"].build().eval()
    return testing.save_with_finetunes(base, tmp_path_factory.mktemp("encoder"), 2,
                                       tokenizer=testing.word_tokenizer(VOCAB), scale=5e-2)


def test_the_encoder_reference_counts_no_padding_and_matches_the_adapter_walk(encoder_setup):
    _, models = encoder_setup
    loaded = [AutoModel.from_pretrained(m).eval() for m in models]
    ref = brute_force_encoder_mloss(loaded, SEQUENCES, [2.0, 1.0])
    alone = [brute_force_encoder_mloss(loaded, [seq], [2.0, 1.0]) for seq in SEQUENCES]
    total = sum(map(len, SEQUENCES))
    adapter = adapter_for(loaded[0].config)
    width = max(map(len, SEQUENCES))
    ids = torch.full((len(SEQUENCES), width), PAD)
    mask = torch.zeros_like(ids)
    for row, seq in enumerate(SEQUENCES):
        ids[row, :len(seq)], mask[row, :len(seq)] = torch.tensor(seq), 1
    walks = [walk(adapter, model, {"input_ids": ids, "attention_mask": mask}) for model in loaded]
    f = adapter.activation(loaded[0])
    for layer in range(adapter.num_layers):
        name = adapter.target_name(layer)
        assert ref[name]["positions"] == total and float(ref[name]["abs"].min()) > 0
        for key in ("abs", "sq", "layer"):
            pooled = sum(a[name][key] * a[name]["positions"] for a in alone) / total
            torch.testing.assert_close(pooled, ref[name][key], rtol=1e-5, atol=1e-9)
        with torch.no_grad():
            h = [m.base_model.encoder.layer[layer].intermediate.dense(w.inputs[layer])[w.context.mask].double()
                 for m, w in zip(loaded, walks)]
        gap = f(2 / 3 * h[0] + 1 / 3 * h[1]) - 2 / 3 * f(h[0]) - 1 / 3 * f(h[1])
        torch.testing.assert_close(gap.abs().mean(0), ref[name]["abs"], rtol=1e-5, atol=1e-9)


def test_score_own_prefix_equals_the_brute_force_encoder_mloss(encoder_setup):
    base, models = encoder_setup
    texts = [" ".join(f"w{i - 4}" for i in seq) for seq in SEQUENCES]
    assert [testing.word_tokenizer(VOCAB)(t)["input_ids"] for t in texts] == SEQUENCES
    report = hf_mloss.score(str(base), [str(m) for m in models], data=texts, prefix="own", progress=False)
    ref = brute_force_encoder_mloss([AutoModel.from_pretrained(m).eval() for m in models], SEQUENCES)
    assert set(report.node) == set(ref)
    assert report.num_positions == sum(map(len, SEQUENCES))
    for name, expected in ref.items():
        torch.testing.assert_close(report.node[name].double(), expected["abs"], rtol=1e-4, atol=1e-7)
        assert report.layer[name] == pytest.approx(float(expected["layer"]), rel=1e-4)


# ------------------------------------------------------------------------------ SigLIP node M-Loss, brute force
def brute_force_image_mloss(models: list, pixel_values: torch.Tensor, *, eps: float = 1e-4) -> dict[str, dict]:
    """Node and layer M-Loss (prefix "own", equal weights) of SigLIP vision towers by hooks on each model's
    ``mlp.fc1`` in its own forward: every token of every image counts."""
    pre = []
    for model in models:
        captured: list[torch.Tensor] = []
        handles = [block.mlp.fc1.register_forward_hook(
            lambda m, a, out, into=captured: into.append(out.reshape(-1, out.shape[-1]).double()))
            for block in model.encoder.layers]
        with torch.no_grad():
            model(pixel_values=pixel_values)
        for handle in handles:
            handle.remove()
        pre.append(captured)
    f = models[0].encoder.layers[0].mlp.activation_fn
    out = {}
    for layer in range(len(pre[0])):
        h = torch.stack([p[layer] for p in pre])
        merged = f(h.mean(0))
        gap = merged - f(h).mean(0)
        out[f"encoder.layers.{layer}.mlp.fc1"] = {"abs": gap.abs().mean(0), "layer": gap.norm(dim=-1).mean(),
                                                  "positions": gap.shape[0]}
    return out


def test_the_own_walk_computes_each_sources_gate_and_up_once(gated_setup, monkeypatch):
    """A scored block's gate and up products serve both the gap and the rest of the source's forward: per source,
    scored block and batch, one product each (not a second inside the MLP)."""
    base, models = gated_setup
    config = transformers.AutoConfig.from_pretrained(base)
    shape = (config.intermediate_size, config.hidden_size)
    assert shape[0] != shape[1]  # no other projection of the block has the gate's shape
    calls, forward = [], torch.nn.Linear.forward

    def counting(self, x):
        calls.append(tuple(self.weight.shape) == shape)
        return forward(self, x)

    monkeypatch.setattr(torch.nn.Linear, "forward", counting)
    texts = [" ".join(f"w{i - 4}" for i in seq) for seq in SEQUENCES]
    hf_mloss.score(str(base), [str(m) for m in models], data=texts, prefix="own", batch_size=len(texts),
                   progress=False)
    layers = config.num_hidden_layers
    assert sum(calls) == len(models) * layers * 2  # gate + up, once each per source and scored block


def test_score_own_prefix_equals_the_brute_force_siglip_mloss(tmp_path):
    torch.manual_seed(0)
    base_dir, models = testing.save_with_finetunes(_siglip().eval(), tmp_path, 2, scale=5e-2,
                                                   tokenizer=_processor("siglip_vision"))
    pixels = torch.randn(5, 3, 16, 16, generator=torch.Generator().manual_seed(3))
    report = hf_mloss.score(str(base_dir), [str(m) for m in models], pixels, prefix="own", batch_size=2,
                            progress=False)
    loaded = [transformers.SiglipVisionModel.from_pretrained(m).eval() for m in models]
    ref = brute_force_image_mloss(loaded, pixels)
    assert set(report.node) == set(ref) and report.activation == "gelu_pytorch_tanh"
    assert report.num_positions == 5 * 4
    for name, expected in ref.items():
        torch.testing.assert_close(report.node[name].double(), expected["abs"], rtol=1e-4, atol=1e-7)
        assert report.layer[name] == pytest.approx(float(expected["layer"]), rel=1e-4)


def test_the_siglip_reference_matches_the_adapter_walk(tmp_path):
    torch.manual_seed(0)
    base = _siglip().eval()
    models = [testing.perturbed(base, i, 5e-2) for i in range(2)]
    pixels = torch.randn(5, 3, 16, 16, generator=torch.Generator().manual_seed(3))
    ref = brute_force_image_mloss(models, pixels)
    adapter = adapter_for(base.config)
    walks = [walk(adapter, model, {"pixel_values": pixels}) for model in models]
    f = adapter.activation(models[0])
    for layer in range(adapter.num_layers):
        with torch.no_grad():
            h = [m.encoder.layers[layer].mlp.fc1(w.inputs[layer]).reshape(-1, 64).double()
                 for m, w in zip(models, walks)]
        gap = f((h[0] + h[1]) / 2) - (f(h[0]) + f(h[1])) / 2
        name = adapter.target_name(layer)
        assert ref[name]["positions"] == 5 * 4 and float(ref[name]["abs"].min()) > 0
        torch.testing.assert_close(gap.abs().mean(0), ref[name]["abs"], rtol=1e-6, atol=1e-10)


@pytest.mark.parametrize("prefix", ["base", "own"])
def test_a_streamed_scoring_model_gives_the_numbers_of_the_whole_one(gated_setup, prefix, monkeypatch):
    """score() walks a model whose blocks stay on the meta device, filled from the lazy stores block by block (the
    base for a shared walk, each source for the own walk) and emptied after: the same report, bit for bit, as the
    whole base model; the compatibility report too."""
    from hf_mloss.loading.inputs import RunInputs

    base, models = gated_setup
    texts = [" ".join(f"w{i - 4}" for i in seq) for seq in SEQUENCES]
    built, real = [], RunInputs._scoring_skeleton

    def spy(self):
        model = real(self)
        built.append(model)
        return model

    monkeypatch.setattr(RunInputs, "_scoring_skeleton", spy)
    streamed = hf_mloss.score(str(base), [str(m) for m in models], data=texts, prefix=prefix, progress=False)
    assert built and built[0] is not None
    blocks = built[0].model.layers
    assert all(p.is_meta for block in blocks for p in block.parameters())  # emptied again after the walk
    assert not built[0].model.embed_tokens.weight.is_meta
    monkeypatch.setattr(RunInputs, "_scoring_skeleton", lambda self: None)  # the whole base model instead
    whole = hf_mloss.score(str(base), [str(m) for m in models], data=texts, prefix=prefix, progress=False)
    for name in whole.node:
        assert torch.equal(streamed.node[name], whole.node[name]), name
        assert streamed.layer[name] == whole.layer[name]
    if prefix == "own":
        compat_whole = hf_mloss.compatibility(str(base), [str(m) for m in models], texts, progress=False)
        monkeypatch.setattr(RunInputs, "_scoring_skeleton", real)
        compat_streamed = hf_mloss.compatibility(str(base), [str(m) for m in models], texts, progress=False)
        for metric, values in compat_whole.values.items():
            assert torch.equal(compat_streamed.values[metric], values), metric


def test_a_large_base_filled_from_its_store_merges_as_from_pretrained(gated_setup, monkeypatch, tmp_path):
    """Above STREAMED_LOAD_MIN_BYTES the merge container is built on meta and filled tensor by tensor from the base's
    lazy store instead of ``from_pretrained`` (which maps the file beside the float32 copy): the same M-TIES merge
    and the same saved files."""
    from hf_mloss.loading import inputs as inputs_module

    base, models = gated_setup
    texts = [" ".join(f"w{i - 4}" for i in seq) for seq in SEQUENCES]
    built, real = [], inputs_module.RunInputs._streamed_output_model

    def spy(self, output, dtype):
        model = real(self, output, dtype)
        built.append(model)
        return model

    monkeypatch.setattr(inputs_module.RunInputs, "_streamed_output_model", spy)
    ordinary = hf_mloss.merge(str(base), [str(m) for m in models], "m_ties", data=texts, progress=False)
    assert built == [None]  # a tiny base: from_pretrained
    monkeypatch.setattr(inputs_module, "STREAMED_LOAD_MIN_BYTES", 0)
    streamed = hf_mloss.merge(str(base), [str(m) for m in models], "m_ties", data=texts, progress=False)
    assert built[-1] is not None
    a, b = ordinary.model.state_dict(), streamed.model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ordinary.save_pretrained(tmp_path / "a")
    streamed.save_pretrained(tmp_path / "b")
    for name in ("config.json", "generation_config.json"):
        if (tmp_path / "a" / name).is_file() or (tmp_path / "b" / name).is_file():
            assert (tmp_path / "a" / name).read_text() == (tmp_path / "b" / name).read_text(), name
