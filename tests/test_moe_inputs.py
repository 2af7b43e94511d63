"""Mixture-of-experts checkpoints as inputs: read as transformers loads them (each layer's experts fused into one
tensor), merged, written back in the per-expert layout the Hub's repos hold, and loaded with nothing missing.
Parity with mergekit-yaml on Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE is in tests/test_peers.py."""

from __future__ import annotations

import torch
import transformers
from safetensors import safe_open
from transformers import AutoModelForCausalLM

import hf_mloss
from examples import tiny as testing


def test_deepseek_v3_with_dense_first_layers_keeps_every_expert(tmp_path):
    """mergekit-yaml drops the routed experts of such a model (its dense and MoE layers make every MLP tensor
    optional); here every tensor is merged and the output loads with nothing missing."""
    config = transformers.DeepseekV3Config(
        **{**testing.TINY_DECODER, "num_hidden_layers": 3, "num_key_value_heads": 4}, moe_intermediate_size=8,
        n_shared_experts=1, n_routed_experts=3, num_experts_per_tok=2, first_k_dense_replace=1, n_group=1,
        topk_group=1, kv_lora_rank=8, q_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8)
    torch.manual_seed(0)
    base = transformers.DeepseekV3ForCausalLM(config).eval()
    base_dir, models = testing.save_with_finetunes(base, tmp_path, 2, tokenizer=testing.word_tokenizer())
    result = hf_mloss.merge(str(base_dir), [str(m) for m in models], "ties", k=0.3, progress=False)
    result.save_pretrained(tmp_path / "out")
    written = set(safe_open(str(tmp_path / "out" / "model.safetensors"), "pt").keys())
    assert {f"model.layers.{layer}.mlp.experts.{e}.gate_proj.weight" for layer in (1, 2) for e in range(3)} <= written
    merged, info = AutoModelForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not any(info.values()), info
    fused = merged.state_dict()["model.layers.1.mlp.experts.gate_up_proj"]
    assert not torch.equal(fused, base.state_dict()["model.layers.1.mlp.experts.gate_up_proj"])
    merged.generate(torch.tensor([[1, 5, 9]]), max_new_tokens=3, do_sample=False)
