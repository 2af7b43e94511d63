"""Red team, round 4: ``--overwrite`` only over hf_mloss's own output, adapters read exactly as PEFT reads them,
fine-tuned heads never dropped, every knob bounded.

Cases are built the way a user meets them: real PEFT adapters saved with ``save_pretrained`` and then edited, a real
tied base and untied fine-tune saved with ``save_pretrained``, real folders holding unrelated files. Tiny decoders
(2 layers, width 16), offline.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch
import yaml
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

import hf_mloss
from hf_mloss import CorruptCheckpointError, IncompatibleCheckpointsError, InvalidParameterError, OutputExistsError
from hf_mloss.cli import main

peft = pytest.importorskip("peft")
from peft import LoraConfig, PeftModel, get_peft_model  # noqa: E402

LLAMA = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=2, max_position_embeddings=32)


def _llama(tie: bool = False, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**LLAMA, tie_word_embeddings=tie)).eval()


def _finetune(model, seed: int, scale: float = 0.02):
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(scale * torch.randn(param.shape, generator=generator))
    return model


def _randomise_lora(model, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(0.1 * torch.randn(param.shape, generator=generator))


def _adapter(base_dir: Path, out: Path, seed: int = 1, model_class=LlamaForCausalLM, **lora) -> Path:
    """A trained-looking PEFT LoRA adapter of ``base_dir``, saved with PEFT's save_pretrained."""
    kwargs = {"r": 2, "lora_alpha": 4, "target_modules": ["q_proj", "v_proj"], **lora}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = get_peft_model(model_class.from_pretrained(base_dir), LoraConfig(**kwargs))
    _randomise_lora(model, seed)
    model.save_pretrained(out)
    _edit(out, base_model_name_or_path=str(base_dir))
    return out


def _edit(adapter: Path, **changes) -> Path:
    config = json.loads((adapter / "adapter_config.json").read_text())
    config.update(changes)
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    return adapter


def _peft_merged(base_dir: Path, adapter: Path, model_class=LlamaForCausalLM) -> dict[str, torch.Tensor]:
    """What PEFT itself makes of the (edited) adapter: merge_and_unload()."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = PeftModel.from_pretrained(model_class.from_pretrained(base_dir), adapter).merge_and_unload()
    return {k: v.float() for k, v in model.state_dict().items()}


def _ours(base_dir: Path, adapter: Path) -> dict[str, torch.Tensor]:
    """hf_mloss's reading of the adapter: base + 1·ΔW (task arithmetic of the one adapter)."""
    result = hf_mloss.merge(str(base_dir), [str(adapter)], "task_arithmetic", lam=1.0, weights=[1.0], progress=False)
    return {k: v.float() for k, v in result.model.state_dict().items()}


def _assert_same(ours: dict, theirs: dict) -> None:
    for key, tensor in theirs.items():
        assert key in ours, key
        assert torch.allclose(ours[key], tensor, atol=1e-6, rtol=1e-5), (key, (ours[key] - tensor).abs().max())


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A tiny untied Llama base and one full fine-tune, saved with save_pretrained."""
    root = tmp_path_factory.mktemp("round4")
    base = root / "base"
    _llama().save_pretrained(base)
    fine = root / "fine"
    _finetune(_llama(), seed=5).save_pretrained(fine)
    return root, base, fine


def _tree(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _config(tmp: Path, base: Path, models: list[Path], **extra) -> Path:
    path = tmp / "merge.yaml"
    path.write_text(yaml.safe_dump({"base": str(base), "models": [str(m) for m in models],
                                    "method": "task_arithmetic", **extra}))
    return path


# ============================================================================================ --overwrite
def test_overwrite_refuses_a_folder_hf_mloss_did_not_write(llama, tmp_path, capsys):
    """A folder with .git/, an ssh key and notes (or a home folder reached through "$HOME/$UNSET") is never wiped."""
    _, base, fine = llama
    config = _config(tmp_path, base, [fine])
    victim = tmp_path / "home"
    (victim / ".git").mkdir(parents=True)
    (victim / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (victim / ".ssh").mkdir()
    (victim / ".ssh" / "id_rsa").write_text("PRIVATE KEY")
    (victim / "notes.txt").write_text("my notes")
    before = _tree(victim)
    assert main(["merge", str(config), str(victim), "-q", "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert "not written by hf_mloss" in err and "'.git/'" in err and "'notes.txt'" in err and "Traceback" not in err
    assert _tree(victim) == before


def test_overwrite_replaces_only_what_hf_mloss_listed(llama, tmp_path, capsys):
    """An earlier merge is replaced; once the user adds something to it, that is named and nothing is replaced."""
    _, base, fine = llama
    config = _config(tmp_path, base, [fine])
    out = tmp_path / "merged"
    out.mkdir()  # an empty folder is fine
    assert main(["merge", str(config), str(out), "-q"]) == 0
    assert main(["merge", str(config), str(out), "-q", "--overwrite"]) == 0  # hf_mloss's own output
    (out / ".git").mkdir()
    (out / ".git" / "config").write_text("[core]\n")
    (out / "eval.txt").write_text("my results")
    before = _tree(out)
    assert main(["merge", str(config), str(out), "-q", "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert "'.git/'" in err and "'eval.txt'" in err and "did not write" in err
    assert _tree(out) == before


def test_overwrite_onto_the_base_an_adapter_names_is_refused(llama, tmp_path):
    """The folder in base_model_name_or_path is read by the run (checked against the base): never an output."""
    _, base, _ = llama
    named_base = tmp_path / "named_base"
    shutil.copytree(base, named_base)
    adapter = _adapter(named_base, tmp_path / "adapter")
    result = hf_mloss.merge(str(base), [str(adapter)], "task_arithmetic", progress=False)
    before = _tree(named_base)
    with pytest.raises(InvalidParameterError, match="overlaps an input"):
        result.save_pretrained(named_base, overwrite=True)
    assert _tree(named_base) == before


# ============================================================================================ tied heads
def test_untied_finetune_of_a_tied_base_is_refused(tmp_path):
    """transformers reads the fine-tune's own trained lm_head; a merge saved tied would drop it: refused, with how
    to untie the base (which then merges the head)."""
    base = _llama(tie=True)
    base.save_pretrained(tmp_path / "base")
    fine = _llama(tie=False)
    fine.load_state_dict(base.state_dict(), strict=False)
    with torch.no_grad():
        fine.lm_head.weight.copy_(base.lm_head.weight + 0.1)
        fine.model.embed_tokens.weight.add_(0.01)
    fine.save_pretrained(tmp_path / "fine")
    with pytest.raises(IncompatibleCheckpointsError, match=r"(?s)'fine' has its own \['lm_head.weight'\].*"
                                                           r"tie_word_embeddings=false.*Untie the base"):
        hf_mloss.merge(str(tmp_path / "base"), [str(tmp_path / "fine")], "task_arithmetic", progress=False)
    # the fix the message gives: an untied copy of the base, onto which the fine-tune's head is merged
    untied = LlamaForCausalLM.from_pretrained(tmp_path / "base")
    untied.config.tie_word_embeddings = False
    untied.lm_head.weight = torch.nn.Parameter(untied.get_input_embeddings().weight.clone())
    untied.save_pretrained(tmp_path / "untied")
    merged = hf_mloss.merge(str(tmp_path / "untied"), [str(tmp_path / "fine")], "task_arithmetic", lam=1.0,
                            weights=[1.0], progress=False).model
    assert torch.allclose(merged.lm_head.weight, fine.lm_head.weight, atol=1e-6)


# ============================================================================================ adapters as PEFT reads them
@pytest.mark.parametrize("edit", [
    pytest.param({"target_modules": ["q_proj"]}, id="target_modules_narrower_than_the_factors"),
    pytest.param({"layers_to_transform": [1]}, id="layers_to_transform_narrower_than_the_factors"),
    pytest.param({"target_modules": ["q_proj", "v_proj"], "exclude_modules": ["layers.0.self_attn.v_proj"]},
                 id="exclude_modules"),
    pytest.param({"fan_in_fan_out": True}, id="fan_in_fan_out_on_nn_linear"),
])
def test_edited_adapter_is_read_as_peft_merge_and_unload_reads_it(llama, tmp_path, edit):
    _, base, _ = llama
    adapter = _edit(_adapter(base, tmp_path / "adapter"), **edit)
    theirs = _peft_merged(base, adapter)
    with pytest.warns(UserWarning, match="PEFT"):
        ours = _ours(base, adapter)
    _assert_same(ours, theirs)
    if "fan_in_fan_out" not in edit:  # some factors were really left out, as PEFT leaves them
        reference = LlamaForCausalLM.from_pretrained(base).state_dict()
        assert any(torch.equal(theirs[k], reference[k].float()) for k in theirs if "v_proj" in k)


@pytest.mark.parametrize("fan_in_fan_out", [True, False])
def test_gpt2_conv1d_adapter_is_read_with_the_layer_s_layout(tmp_path, fan_in_fan_out):
    """GPT-2's Conv1D stores [in, out]: PEFT uses that layout whatever the config says, and so does hf_mloss."""
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=16, n_layer=2, n_head=2, n_positions=32)).save_pretrained(
        tmp_path / "base")
    adapter = _adapter(tmp_path / "base", tmp_path / "adapter", model_class=GPT2LMHeadModel,
                       target_modules=["c_attn"], fan_in_fan_out=True)
    _edit(adapter, fan_in_fan_out=fan_in_fan_out)
    theirs = _peft_merged(tmp_path / "base", adapter, GPT2LMHeadModel)
    ours = _ours(tmp_path / "base", adapter)
    _assert_same(ours, theirs)


@pytest.mark.parametrize("edit, words", [
    ({"lora_alpha": "sixteen"}, "lora_alpha"),
    ({"lora_alpha": [4]}, "lora_alpha"),
    ({"lora_alpha": {"a": 1}}, "lora_alpha"),
    ({"lora_alpha": float("nan")}, "lora_alpha"),
    ({"lora_alpha": 1e308}, "lora_alpha"),
    ({"r": "two"}, "r is"),
    ({"r": 0}, "r is"),
    ({"rank_pattern": {"q_pro(j": 2}}, "not a valid regular expression"),
    ({"alpha_pattern": {"q_proj": "x"}}, "alpha_pattern"),
    ({"base_model_name_or_path": 12}, "base_model_name_or_path"),
    ({"target_modules": "q_proj(("}, "not a valid regular expression"),
    ({"layers_to_transform": "first"}, "layers_to_transform"),
    ({"fan_in_fan_out": "yes"}, "fan_in_fan_out"),
])
def test_malformed_adapter_config_values_are_named(llama, tmp_path, edit, words):
    _, base, _ = llama
    adapter = _edit(_adapter(base, tmp_path / "adapter"), **edit)
    with pytest.raises(CorruptCheckpointError, match="adapter_config.json") as info:
        hf_mloss.merge(str(base), [str(adapter)], "task_arithmetic", progress=False)
    assert words in str(info.value)


def test_zero_rank_factors_are_named(llama, tmp_path):
    from safetensors.torch import load_file, save_file

    _, base, _ = llama
    adapter = _adapter(base, tmp_path / "adapter")
    file = adapter / "adapter_model.safetensors"
    tensors = {k: (v[:0] if "lora_A" in k else v[:, :0]) for k, v in load_file(file).items()}
    save_file(tensors, file)
    _edit(adapter, r=0)  # as the file says: rank 0 (a ZeroDivisionError before)
    with pytest.raises(CorruptCheckpointError, match="r is 0"):
        hf_mloss.merge(str(base), [str(adapter)], "task_arithmetic", progress=False)
