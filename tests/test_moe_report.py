"""``hf-mloss moe``'s report at a bounded cost: ``--no-report`` builds alone, and ``report_positions`` cuts each prompt
to its first tokens when the prompts hold more positions than the budget (exact at those positions: the routing of a
cut prompt equals the whole prompt's there, read from the whole MoE)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hf_mloss.cli import main
from hf_mloss.errors import InvalidParameterError
from hf_mloss.moe import build_moe

PROMPTS = [["w1 w2 w3 w4 w5 w6", "w4 w5 w7 w8"], ["w10 w11 w12 w13 w14"], ["w20 w21 w22 w23 w24 w25 w26"]]


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> tuple[str, list[str]]:
    from examples.tiny import save_with_finetunes, tiny_decoder, word_tokenizer

    base, models = save_with_finetunes(tiny_decoder("llama"), tmp_path_factory.mktemp("moe_report") / "llama", 3,
                                       tokenizer=word_tokenizer())
    return str(base), [str(m) for m in models]


def _config(llama) -> dict:
    base, models = llama
    return {"base_model": base, "experts": [{"source_model": m, "positive_prompts": list(PROMPTS[i])}
                                            for i, m in enumerate(models)]}


def test_no_report_builds_alone(llama, tmp_path):
    full = build_moe(_config(llama), tmp_path / "full", progress=False, mloss=False, report_positions=None)
    alone = build_moe(_config(llama), tmp_path / "alone", progress=False, report=False)
    assert alone.routing is None and alone.mloss is None and "without a report" in alone.mloss_note
    assert not (alone.path / "routing.json").exists()
    card = (alone.path / "README.md").read_text()
    assert "Not measured: the model was built without a report (`--no-report`)." in card
    for name in ("model.safetensors", "config.json"):  # the same model
        assert (alone.path / name).read_bytes() == (full.path / name).read_bytes()


def test_the_cli_builds_alone(llama, tmp_path):
    path = tmp_path / "moe.yaml"
    path.write_text(json.dumps(_config(llama)))
    assert main(["moe", str(path), str(tmp_path / "out"), "-q", "--no-report"]) == 0
    assert not (tmp_path / "out" / "routing.json").exists()
    assert main(["moe", str(path), str(tmp_path / "bad"), "-q", "--report-positions", "0"]) == 2
    assert not (tmp_path / "bad").exists()


def test_report_positions_cut_each_prompt_exactly(llama, tmp_path):
    """With a budget below the prompts' positions, each prompt is read to its first t tokens: the routing there is
    the whole MoE's on the same cut prompts, and the card says which positions were read."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_mloss.moe.gates import encode, prompt_tokenizer
    from hf_mloss.moe.routing import _route

    result = build_moe(_config(llama), tmp_path / "cut", progress=False, report_positions=12)
    tokens = result.report_tokens
    read, total = result.report_positions
    assert tokens is not None and read <= 12 < total
    assert result.mloss is not None and all(v > 0 for v in result.mloss.values())
    model = AutoModelForCausalLM.from_pretrained(result.path).eval()
    tokenizer = prompt_tokenizer(AutoTokenizer.from_pretrained(result.path))
    captured: dict[int, torch.Tensor] = {}
    for i, layer in enumerate(model.model.layers):
        layer.post_attention_layernorm.register_forward_hook(lambda m, a, out, i=i: captured.__setitem__(i, out))
    report = result.routing
    assert any(encode(tokenizer, [prompt])["input_ids"].shape[1] > tokens for prompt in report.prompts)
    for p, prompt in enumerate(report.prompts):
        whole = encode(tokenizer, [prompt])
        batch = {k: v[:, :tokens] for k, v in whole.items()}
        positions = (batch["attention_mask"].cumsum(-1) - 1).clamp(min=0)
        with torch.no_grad():
            model(**batch, position_ids=positions, use_cache=False)
        for i, layer in enumerate(model.model.layers):
            weights, _ = _route(captured[i], layer.mlp.gate.weight, batch["attention_mask"].bool() & (positions > 0),
                                2, True)
            torch.testing.assert_close(report.weights[p, i].float(), weights[0].float(), atol=1e-6, rtol=0)
    card = (result.path / "README.md").read_text()
    assert f"the first {tokens} tokens of each prompt" in card and f"{read} of the prompts' {total}" in card


def test_a_budget_the_prompts_fit_reads_every_token(llama, tmp_path):
    result = build_moe(_config(llama), tmp_path / "fits", progress=False, mloss=False, report_positions=10_000)
    assert result.report_tokens is None and result.report_positions[0] == result.report_positions[1]
    assert "tokens of each prompt" not in (result.path / "README.md").read_text()


@pytest.mark.parametrize("value", [0, -3, 2.5, True, "8"])
def test_report_positions_is_checked_before_any_work(llama, tmp_path, value):
    with pytest.raises(InvalidParameterError, match="report_positions"):
        build_moe(_config(llama), tmp_path / "never", progress=False, report_positions=value)
    assert not Path(tmp_path / "never").exists()


def _whole_moe_router_inputs(path, prompts, tokens, dtype):
    """Per prompt (cut to its first ``tokens`` tokens, BOS left out): each layer's router input and experts module,
    from the whole MoE loaded with ``from_pretrained(path, dtype=dtype)``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_mloss.moe.gates import encode, prompt_tokenizer

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    tokenizer = prompt_tokenizer(AutoTokenizer.from_pretrained(path))
    captured: dict[int, torch.Tensor] = {}
    for i, layer in enumerate(model.model.layers):
        layer.post_attention_layernorm.register_forward_hook(lambda m, a, out, i=i: captured.__setitem__(i, out))
    inputs = []
    for prompt in prompts:
        batch = {k: v[:, :tokens] for k, v in encode(tokenizer, [prompt]).items()}
        with torch.no_grad():
            model(**batch, use_cache=False)
        inputs.append([captured[i][0, 1:] for i in range(len(model.model.layers))])
    return model, inputs


def test_each_expert_pairs_mloss_is_the_gap_on_the_moes_own_expert_inputs(llama, tmp_path):
    """The M-Loss of expert pair (a, b), measured in the routing pass: at every layer and token read, the router's
    input through both experts' gate and up projections, the gated node gap of their average against their mean
    activation, its L2 norm over the nodes averaged over the tokens, then over the layers. Computed here by hand in
    float64 from hooks on the whole MoE, without the kernel."""
    config = _config(llama)
    config["experts"][2]["noise_scale"] = 0.05
    result = build_moe(config, tmp_path / "moe", progress=False, report_positions=12)
    assert result.report_tokens is not None  # the prompts were cut: the M-Loss reads the cut prompts
    model, inputs = _whole_moe_router_inputs(result.path, result.routing.prompts, result.report_tokens, torch.float32)
    silu = torch.nn.functional.silu
    for (a, b), value in result.mloss.items():
        per_layer = []
        for i, layer in enumerate(model.model.layers):
            weight = layer.mlp.experts.gate_up_proj.detach().double()
            x = torch.cat([prompt[i] for prompt in inputs]).double()
            (ga, ua), (gb, ub) = ((x @ weight[e].T).chunk(2, dim=-1) for e in (a, b))
            gap = silu((ga + gb) / 2) * (ua + ub) / 2 - (silu(ga) * ua + silu(gb) * ub) / 2
            per_layer.append(gap.norm(dim=-1).mean())
        assert value == pytest.approx(float(torch.stack(per_layer).mean()), rel=1e-5)
    assert len(result.mloss) == 3 and min(result.mloss.values()) > 0
    card = (result.path / "README.md").read_text()
    assert "router's input" in card and f"the first {result.report_tokens} tokens of each prompt" in card
    assert "mloss" not in result.timings  # measured in the routing pass: no forward of its own


def test_a_bfloat16_moe_is_routed_in_float32(llama, tmp_path):
    """The report reads a bfloat16 MoE's weights in float32: its routing weights are those of
    ``from_pretrained(path, dtype=torch.float32)``, not of a bfloat16 forward (which rounds every activation)."""
    from hf_mloss.moe.routing import _route

    result = build_moe({**_config(llama), "dtype": "bfloat16"}, tmp_path / "moe", progress=False,
                       report_positions=None)
    report = result.routing
    model, inputs = _whole_moe_router_inputs(result.path, report.prompts, None, torch.float32)
    for p, prompt_inputs in enumerate(inputs):
        for i, layer in enumerate(model.model.layers):
            hidden = prompt_inputs[i][None]
            weights, _ = _route(hidden, layer.mlp.gate.weight, torch.ones(hidden.shape[:2], dtype=torch.bool), 2, True)
            torch.testing.assert_close(report.weights[p, i].float(), weights[0].float(), atol=1e-6, rtol=0)
    assert all(v > 0 for v in result.mloss.values())


def test_pair_gaps_of_no_token_are_not_a_value():
    """Prompts that hold no token past the BOS give the pairs no M-Loss (``None``, which the card explains), never 0."""
    from types import SimpleNamespace

    from hf_mloss.moe.routing import ExpertPairGaps

    experts = SimpleNamespace(gate_up_proj=torch.randn(3, 8, 4), act_fn=torch.nn.functional.silu)
    gaps = ExpertPairGaps(3)
    gaps.add(0, experts, torch.empty(0, 4))
    assert gaps.values() is None
    gaps.add(1, experts, torch.randn(5, 4))
    assert set(gaps.values()) == {(0, 1), (0, 2), (1, 2)} and min(gaps.values().values()) > 0


def test_pair_gaps_reuse_their_buffers_and_give_the_sums_of_fresh_ones(monkeypatch):
    """The pair gaps write their products and gate / up halves into buffers kept from layer to layer (and chunk to
    chunk); the sums are those of the kernel given fresh copies, bit for bit."""
    from types import SimpleNamespace

    from hf_mloss.engine.kernel import GapSums
    from hf_mloss.moe import routing

    monkeypatch.setattr(routing, "POSITION_CHUNK", 16)  # two chunks in the first layer, one in the second
    generator = torch.Generator().manual_seed(3)
    experts = SimpleNamespace(gate_up_proj=torch.randn(3, 12, 5, generator=generator), act_fn=torch.nn.SiLU())
    gaps = routing.ExpertPairGaps(3)
    pointers = []
    for layer, tokens in ((0, 23), (1, 9)):
        hidden = torch.randn(tokens, 5, generator=generator)
        gaps.add(layer, experts, hidden)
        pointers.append(gaps._scratch["pre"].buffer.data_ptr())
        want = GapSums(3, 6, per_node=False)
        for part in hidden.split(16):
            pre = torch.matmul(part, experts.gate_up_proj.transpose(1, 2))
            want.add_preactivations(pre[..., :6].clone(), gaps.matrix, experts.act_fn, up=pre[..., 6:].clone(),
                                    sources_first=True)
        assert torch.equal(gaps.per_layer[layer].layer, want.layer)
    assert pointers[0] == pointers[1]
