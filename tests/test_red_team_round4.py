"""Red team, round 4: ``--overwrite`` only over hf_mloss's own output, adapters read exactly as PEFT reads them,
fine-tuned heads never dropped, every knob bounded.

Cases are built the way a user meets them: real PEFT adapters saved with ``save_pretrained`` and then edited, a real
tied base and untied fine-tune saved with ``save_pretrained``, real folders holding unrelated files. Tiny decoders
(2 layers, width 16), offline.
"""

from __future__ import annotations

import json
import shutil
import sys
import warnings
from pathlib import Path

import pytest
import torch
import yaml
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

import hf_mloss
from hf_mloss import CorruptCheckpointError, IncompatibleCheckpointsError, InvalidParameterError
from hf_mloss.cli import main

sys.path.insert(0, str(Path(__file__).parent))
from fake_hub import fake_hub  # noqa: E402,F401  (fixture re-export)

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
    if fan_in_fan_out:
        ours = _ours(tmp_path / "base", adapter)
    else:  # said, as PEFT says it
        with pytest.warns(UserWarning, match=r"fan_in_fan_out=False does not fit .* \(Conv1D layers\)"):
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
    with pytest.raises(CorruptCheckpointError, match="r is '0'"):
        hf_mloss.merge(str(base), [str(adapter)], "task_arithmetic", progress=False)


# ============================================================================================ Medium: one clear line
def _copy_with(folder: Path, out: Path, **tensors) -> Path:
    """A copy of a saved model with some tensors replaced (names with dots as keys)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(folder, out)
    state = load_file(out / "model.safetensors")
    for name, fill in tensors.items():
        state[name] = torch.full_like(state[name], fill) if isinstance(fill, float) else fill(state[name])
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    return out


UP = "model.layers.0.mlp.up_proj.weight"


@pytest.mark.parametrize("rope", [{"rope_type": "bogus", "factor": 2.0}, "linear"], ids=["unknown_type", "a_string"])
def test_junk_rope_scaling_in_the_base_is_named(llama, tmp_path, rope):
    _, base, fine = llama
    junk = tmp_path / "junk"
    shutil.copytree(base, junk)
    config = json.loads((junk / "config.json").read_text())
    config["rope_scaling"] = rope
    (junk / "config.json").write_text(json.dumps(config))
    with pytest.raises(CorruptCheckpointError, match=r"config.json of 'junk'"):
        hf_mloss.merge(str(junk), [str(fine)], "task_arithmetic", progress=False)


@pytest.mark.parametrize("method", ["tsv_m", "iso_c", "iso_cts"])
def test_svd_methods_report_an_overflowing_task_vector_as_every_method_does(llama, tmp_path, method):
    """Finite weights whose difference overflows float32: the clean non-finite error, not LAPACK's."""
    _, base, fine = llama
    low = _copy_with(base, tmp_path / "low", **{UP: -3e38})
    high = _copy_with(fine, tmp_path / "high", **{UP: 3e38})
    with pytest.raises(InvalidParameterError, match=rf"non-finite values in '{UP}'"):
        hf_mloss.merge(str(low), [str(high), str(fine)], method, progress=False)


def test_nan_in_the_base_is_reported_as_the_base_s(llama, tmp_path):
    _, base, fine = llama

    def poison(t):
        t = t.clone()
        t[0, 0] = float("nan")
        return t

    bad = _copy_with(base, tmp_path / "bad_base", **{UP: poison})
    with pytest.raises(CorruptCheckpointError, match=rf"'{UP}' of the base 'bad_base' holds 1 non-finite"):
        hf_mloss.merge(str(bad), [str(fine)], "ties", progress=False)


def test_hf_mloss_threads_of_thousands_of_digits_is_refused(monkeypatch):
    """Round 5 (issue 57): thousands of digits are a mistake, not a request for the machine's cores."""
    from hf_mloss.parallel import MAX_THREADS, env_threads, machine_cores

    for value in ("9" * 5000, "0" * 5000, str(MAX_THREADS + 1)):
        monkeypatch.setenv("HF_MLOSS_THREADS", value)
        with pytest.raises(InvalidParameterError, match="HF_MLOSS_THREADS"):
            env_threads()
    monkeypatch.setenv("HF_MLOSS_THREADS", "0" * 5000 + "64")  # leading zeros: 64, clamped to the cores
    assert env_threads() == min(64, machine_cores())


@pytest.mark.parametrize("env, words", [
    ({"WORLD_SIZE": "abc"}, "WORLD_SIZE='abc'"),
    ({"WORLD_SIZE": "9" * 5000}, "WORLD_SIZE="),
    ({"WORLD_SIZE": "2", "RANK": "0"}, "MASTER_ADDR, MASTER_PORT are not set"),
    ({"WORLD_SIZE": "2", "RANK": "x", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}, "RANK='x'"),
    ({"WORLD_SIZE": "2", "RANK": "5", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}, "RANK=5 is not below"),
])
def test_launch_variables_are_named_in_one_line(llama, tmp_path, monkeypatch, capsys, env, words):
    _, base, fine = llama
    for name in ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert main(["merge", str(_config(tmp_path, base, [fine])), str(tmp_path / "out"), "-q"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hf-mloss: error:") and words in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_a_merged_adapter_folder_can_be_pushed(llama, tmp_path, fake_hub):
    from hf_mloss.output.push import push_folder

    _, base, _ = llama
    adapters = [str(_adapter(base, tmp_path / f"adapter{i}", seed=i)) for i in range(2)]
    result = hf_mloss.merge(str(base), adapters, "task_arithmetic", output="adapter", progress=False)
    folder = result.save_pretrained(tmp_path / "merged_adapter")
    push_folder(folder, "tester/merged-adapter")
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(fake_hub.commits[-1].files)


def test_della_with_k_below_one_on_a_model_holding_a_0d_tensor(tmp_path):
    """A whole CLIPModel holds logit_scale, a 0-D tensor: kept or dropped as one entry, as any other."""
    from examples.tiny import make_base, make_finetune, save_clip_model

    vision = make_base(seed=0)
    base = save_clip_model(vision, tmp_path / "base")
    models = [save_clip_model(make_finetune(vision, seed=i), tmp_path / f"ft{i}", seed=0) for i in range(2)]
    for i, folder in enumerate(models):
        _copy_with(folder, tmp_path / f"scaled{i}", logit_scale=lambda t, i=i: t + 0.5 * (i + 1))
    result = hf_mloss.merge(str(base), [str(tmp_path / f"scaled{i}") for i in range(2)], "della", k=0.5, e=0.1,
                            seed=0, progress=False)
    assert result.model.logit_scale.dim() == 0 and torch.isfinite(result.model.logit_scale)


def test_bert_without_its_pooler_is_merged_with_a_note(tmp_path):
    """BertModel(add_pooling_layer=False) saves (as *ForMaskedLM / *ForTokenClassification do) lack the pooler
    that the config's class has: every input lacks it, transformers initialises it, the rest is merged."""
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    config = BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=40)
    base = BertModel(config, add_pooling_layer=False)
    base.save_pretrained(tmp_path / "base")
    states = []
    for i in range(2):
        fine = _finetune(BertModel(config, add_pooling_layer=False), seed=i)
        fine.load_state_dict({k: v + 0.01 * (i + 1) for k, v in base.state_dict().items()})
        fine.save_pretrained(tmp_path / f"ft{i}")
        states.append(fine.state_dict())
    with pytest.warns(UserWarning, match=r"Every input lacks 2 tensor\(s\).*pooler.dense"):
        result = hf_mloss.merge(str(tmp_path / "base"), [str(tmp_path / f"ft{i}") for i in range(2)], "average",
                                progress=False)
    key = "encoder.layer.1.attention.self.query.weight"
    assert torch.allclose(result.model.state_dict()[key], (states[0][key] + states[1][key]) / 2, atol=1e-6)
    assert "pooler.dense" in result.method_description
    # a fine-tune that holds the pooler the base lacks is still refused: not every input lacks it
    full = BertModel(config)
    full.load_state_dict(states[0], strict=False)
    full.save_pretrained(tmp_path / "with_pooler")
    with pytest.raises(IncompatibleCheckpointsError, match="pooler"):
        hf_mloss.merge(str(tmp_path / "base"), [str(tmp_path / "with_pooler")], "average", progress=False)


# ============================================================================================ Low
def test_lora_rank_is_clamped_to_the_layers_rank(llama, tmp_path):
    from safetensors import safe_open

    _, base, _ = llama
    adapters = [str(_adapter(base, tmp_path / f"adapter{i}", seed=i)) for i in range(2)]
    with pytest.warns(UserWarning, match="lora_rank=4096 exceeds the rank of every adapted layer"):
        result = hf_mloss.merge(str(base), adapters, "ties", output="adapter", combination="svd", lora_rank=4096,
                                progress=False)
    assert result.lora.rank == 16  # q_proj / v_proj are 16 x 16
    folder = result.save_pretrained(tmp_path / "merged")
    with safe_open(folder / "adapter_model.safetensors", "pt") as handle:
        assert max(handle.get_slice(k).get_shape()[0] for k in handle.keys() if "lora_A" in k) == 16


def test_slerp_t_outside_0_1_warns(llama):
    _, base, fine = llama
    with pytest.warns(UserWarning, match=r"slerp t=1.5 lies outside \[0, 1\]"):
        hf_mloss.merge(str(base), [str(fine)], "slerp", t=1.5, weights=None, progress=False)


def test_free_space_check_counts_the_layers_a_passthrough_stacks(llama, tmp_path, monkeypatch, capsys):
    import collections

    _, base, _ = llama
    size = (base / "model.safetensors").stat().st_size
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr("hf_mloss.saving.shutil.disk_usage", lambda path: usage(10 * size, 8 * size, 2 * size))
    monkeypatch.setattr("hf_mloss.api.run", lambda *a, **k: pytest.fail("merged before checking the free space"))
    config = tmp_path / "stack.yaml"
    config.write_text(yaml.safe_dump({"base": str(base), "models": [], "method": "passthrough", "slices": [
        {"sources": [{"model": 0, "layer_range": [0, 2]}]} for _ in range(3)]}))  # 6 layers of a 2-layer base
    assert main(["merge", str(config), str(tmp_path / "out"), "-q"]) == 2
    assert "Not enough free space" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_auto_map_of_the_base_is_left_out_and_said(llama, tmp_path):
    _, base, fine = llama
    custom = tmp_path / "custom_base"
    shutil.copytree(base, custom)
    config = json.loads((custom / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_custom.CustomLlama"}
    (custom / "config.json").write_text(json.dumps(config))
    with pytest.warns(UserWarning, match="auto_map"):
        result = hf_mloss.merge(str(custom), [str(fine)], "task_arithmetic", progress=False)
    with pytest.warns(UserWarning, match="no tokenizer"):  # the tiny base is saved without one
        folder = result.save_pretrained(tmp_path / "merged")
    assert "auto_map" not in json.loads((folder / "config.json").read_text())
    assert "auto_map" in (folder / "README.md").read_text()
    LlamaForCausalLM.from_pretrained(folder)  # loads with the transformers class


def test_float8_tensors_are_refused_by_name(llama, tmp_path):
    _, base, fine = llama
    quantised = _copy_with(fine, tmp_path / "fp8", **{UP: lambda t: t.to(torch.float8_e4m3fn)})
    with pytest.raises(hf_mloss.UnsupportedModelError, match=rf"'fp8' holds 1 float8 tensor\(s\) \(e.g. '{UP}'"):
        hf_mloss.merge(str(base), [str(quantised)], "ties", progress=False)


# ============================================================================================ adapter outputs at PEFT's cost
@pytest.mark.parametrize("combination", ["cat", "svd"])
def test_linear_adapter_output_reads_only_the_adapted_modules_factors(llama, tmp_path, monkeypatch, combination):
    """As PEFT's add_weighted_adapter: no base tensor is read for a linear merge of LoRA adapters; the merged model
    (result.model) is built only when asked for, and equals the full-model merge."""
    from hf_mloss.loading.store import CheckpointStore

    _, base, _ = llama
    adapters = [str(_adapter(base, tmp_path / f"adapter{i}", seed=i)) for i in range(2)]
    reads: list[str] = []
    real_get = CheckpointStore.get
    monkeypatch.setattr(CheckpointStore, "get", lambda self, name: (reads.append(name), real_get(self, name))[1])
    result = hf_mloss.merge(str(base), adapters, "task_arithmetic", weights=[0.7, 0.4], output="adapter",
                            combination=combination, lora_rank=4 if combination == "svd" else None, progress=False)
    folder = result.save_pretrained(tmp_path / "merged")
    assert reads == []  # neither the merge nor the save read a tensor of the base
    assert (folder / "adapter_model.safetensors").is_file() and "LlamaForCausalLM" in (folder / "README.md").read_text()
    full = hf_mloss.merge(str(base), adapters, "task_arithmetic", weights=[0.7, 0.4], progress=False)
    _assert_same({k: v.float() for k, v in result.model.state_dict().items()},
                 {k: v.float() for k, v in full.model.state_dict().items()})
