"""The gap kernel (hf_mloss.engine.kernel) against the plain definition, computed by brute force with forward hooks on the
q sources' own linears: element-wise and gated units, padded batches (padding never counted), m rows of A at once,
and the sums of 2 processes reduced by accelerate."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn
from transformers.activations import ACT2FN

from hf_mloss.adapters import BlockContext, ScoredUnit
from hf_mloss.engine.kernel import GapSums, StackedTarget, reduce_sums
from hf_mloss.engine.walk import as_batch, embed_batches, own_walk, shared_walk

Q, D, N = 3, 12, 20


class Store(dict):
    """A source's tensors, as the kernel reads them."""

    reads_rows = False

    @property
    def shapes(self):
        return {name: tuple(t.shape) for name, t in self.items()}

    def get_float(self, name, device="cpu"):
        return self[name].float().to(device)

    def get(self, name):
        return self[name]

    def read_into(self, name, out):
        return out.copy_(self[name])


def units(gated: bool, seed: int = 0) -> list[nn.Module]:
    """q sources' units: ``gate`` (and ``up``) linears of the same shape."""
    torch.manual_seed(seed)
    out = []
    for _ in range(Q):
        unit = nn.Module()
        unit.gate = nn.Linear(D, N)
        if gated:
            unit.up = nn.Linear(D, N)
        out.append(unit.eval())
    return out


def brute_force(sources: list[nn.Module], u: torch.Tensor, alpha: torch.Tensor, activation, *,
                reduction: str = "abs", eps: float = 1e-4) -> dict[str, torch.Tensor]:
    """The plain definition, position by position, in float64, with the pre-activations captured by forward hooks
    on each source's own linears (u: ``[positions, d]``, every position counts)."""
    captured: dict[tuple[int, str], torch.Tensor] = {}
    hooks = []
    for p, unit in enumerate(sources):
        for name, module in unit.named_children():
            hooks.append(module.register_forward_hook(
                lambda m, i, o, key=(p, name): captured.__setitem__(key, o.detach().double())))
    with torch.no_grad():
        for unit in sources:
            unit.gate(u)
            if hasattr(unit, "up"):
                unit.up(u)
    for hook in hooks:
        hook.remove()
    a = alpha.double()

    def f(x: torch.Tensor) -> torch.Tensor:  # σ as the model computes it (float32)
        return activation(x.float()).double()

    gates = [captured[(p, "gate")] for p in range(Q)]
    if hasattr(sources[0], "up"):
        ups = [captured[(p, "up")] for p in range(Q)]
        merged = f(sum(w * g for w, g in zip(a, gates))) * sum(w * b for w, b in zip(a, ups))
        ensemble = sum(w * f(g) * b for w, g, b in zip(a, gates, ups))
    else:
        merged = f(sum(w * g for w, g in zip(a, gates)))
        ensemble = sum(w * f(g) for w, g in zip(a, gates))
    g = merged - ensemble
    reduced = g.abs() if reduction == "abs" else g.square()
    norm, merged_norm = g.norm(dim=-1), merged.norm(dim=-1)
    return {"node": reduced.sum(0), "node_normalized": (g.abs() / (merged.abs() + eps)).sum(0),
            "merged": merged.abs().sum(0), "layer": norm.sum(), "layer_normalized": (norm / (merged_norm + eps)).sum(),
            "layer_merged": merged_norm.sum(), "count": torch.tensor(float(u.shape[0]))}


def kernel_view(sums: GapSums, row: int = 0) -> dict[str, torch.Tensor]:
    return {"node": sums.node[0, row], "node_normalized": sums.node[1, row], "merged": sums.node[2, row],
            "layer": sums.layer[0, row], "layer_normalized": sums.layer[1, row], "layer_merged": sums.layer[2, row],
            "count": sums.layer[3, row]}


def add(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: a[k] + b[k] for k in a} if a else b


def stores_of(sources: list[nn.Module]) -> list[Store]:
    return [Store({f"unit.{k}": v for k, v in unit.state_dict().items()}) for unit in sources]


def padded_batch(lengths: list[int], seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """u ``[batch, T, d]`` with garbage (large values) in the padding, and the mask."""
    generator = torch.Generator().manual_seed(seed)
    u = 1e3 * torch.randn(len(lengths), max(lengths), D, generator=generator)
    mask = torch.zeros(len(lengths), max(lengths), dtype=torch.bool)
    for i, n in enumerate(lengths):
        u[i, :n] = torch.randn(n, D, generator=generator)
        mask[i, :n] = True
    return u, mask


def assert_sums_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    """Equal up to float32 rounding; the normalised node sums divide g (a difference of close numbers) by
    |μ| + ε with ε = 1e-4, which amplifies it where μ ≈ 0: an absolute tolerance of 1e-7 / ε there."""
    for key, value in want.items():
        atol = 1e-3 if key == "node_normalized" else 1e-6
        torch.testing.assert_close(got[key].double(), value.double(), rtol=2e-5, atol=atol, msg=key)


@pytest.mark.parametrize("gated", [False, True], ids=["element-wise", "gated"])
@pytest.mark.parametrize("name", ["quick_gelu", "gelu", "silu", "gelu_pytorch_tanh"])
@pytest.mark.parametrize("reduction", ["abs", "sq"])
def test_padded_batch_equals_the_plain_definition_on_each_unpadded_sequence(gated, name, reduction):
    """Both kernel paths (stacked GEMM over u; given pre-activations) on a padded batch give the sums of the plain
    definition over the unpadded sequences taken one at a time: the padding (values ~1e3) never enters a sum."""
    activation = ACT2FN[name]
    sources = units(gated)
    alpha = torch.tensor([0.2, 0.3, 0.5])
    lengths = [5, 2, 7]
    u, mask = padded_batch(lengths)
    want: dict[str, torch.Tensor] = {}
    for i, n in enumerate(lengths):
        want = add(want, brute_force(sources, u[i, :n], alpha, activation, reduction=reduction))

    target = StackedTarget(stores_of(sources), "unit.gate", up="unit.up" if gated else None, mix=alpha[None],
                           activation=activation, reduction=reduction)
    assert_sums_close(kernel_view(target.sums(u, mask=mask)), want)

    with torch.no_grad():
        gate = torch.stack([s.gate(u) for s in sources], dim=-2).view(-1, Q, N)
        up = torch.stack([s.up(u) for s in sources], dim=-2).view(-1, Q, N) if gated else None
    given = GapSums(1, N, reduction=reduction)
    given.add_preactivations(gate, alpha[None], activation, up=up, mask=mask.reshape(-1))
    assert_sums_close(kernel_view(given), want)
    assert int(given.count) == sum(lengths)


@pytest.mark.parametrize("gated", [False, True], ids=["element-wise", "gated"])
def test_m_rows_equal_m_separate_single_row_calls(gated, monkeypatch):
    """A mixing matrix of m rows (subsets, candidates) gives each row the sums of its own m = 1 pass, over uneven
    blocks of positions."""
    from hf_mloss.engine import kernel

    monkeypatch.setattr(kernel, "ROWS_BLOCK_ELEMENTS", 5 * 4 * N)  # 4 positions per chunk of the 5-row pass
    activation = ACT2FN["quick_gelu"]
    sources = units(gated, seed=3)
    mix = torch.tensor([[0.5, 0.5, 0.0], [0.0, 0.25, 0.75], [1 / 3, 1 / 3, 1 / 3], [0.2, 0.3, 0.5],
                        [0.9, 0.0, 0.1]])
    u = torch.randn(23, D)
    with torch.no_grad():
        gate = torch.stack([s.gate(u) for s in sources], dim=1)
        up = torch.stack([s.up(u) for s in sources], dim=1) if gated else None
    together = GapSums(len(mix), N, reduction="sq")
    together.add_preactivations(gate.clone(), mix, activation, up=None if up is None else up.clone())
    target = StackedTarget(stores_of(sources), "unit.gate", up="unit.up" if gated else None, mix=mix,
                           activation=activation, reduction="sq")
    stacked = target.sums(u)
    for row in range(len(mix)):
        alone = GapSums(1, N, reduction="sq")
        alone.add_preactivations(gate.clone(), mix[row:row + 1], activation, up=None if up is None else up.clone())
        layer_and_gap = {k: v for k, v in kernel_view(alone).items() if k not in ("node_normalized", "merged")}
        assert_sums_close(kernel_view(together, row), layer_and_gap)  # the several-row path keeps node[0] only
        assert_sums_close(kernel_view(stacked, row), kernel_view(alone))
        assert_sums_close(kernel_view(alone), brute_force(sources, u, mix[row], activation, reduction="sq"))


def test_a_candidates_own_unit_replaces_the_mixed_pre_activations():
    """``merged=``: the merge's own linear (a candidate) instead of A·h; with the mixed weights it is A·h again."""
    activation = ACT2FN["gelu"]
    sources = units(False, seed=5)
    alpha = torch.tensor([0.2, 0.3, 0.5])
    target = StackedTarget(stores_of(sources), "unit.gate", mix=alpha[None], activation=activation)
    mixed = nn.Linear(D, N)
    with torch.no_grad():
        mixed.weight.copy_(sum(a * s.gate.weight for a, s in zip(alpha, sources)))
        mixed.bias.copy_(sum(a * s.gate.bias for a, s in zip(alpha, sources)))
    u = torch.randn(9, D)
    with torch.no_grad():
        assert_sums_close(kernel_view(target.sums(u, merged=mixed)), kernel_view(target.sums(u)))
        other = nn.Linear(D, N)
        got = kernel_view(target.sums(u, merged=other, per_node=False))
        h = torch.stack([s.gate(u) for s in sources], 1)
        g = activation(other(u)) - torch.einsum("q,pqn->pn", alpha, activation(h))
    torch.testing.assert_close(got["layer"].double(), g.double().norm(dim=-1).sum(), rtol=2e-5, atol=0)


class RowStore(Store):
    """A store that reads rows without the rest of the tensor, as a checkpoint does; it logs every read."""

    reads_rows = True

    def __init__(self, tensors, log):
        super().__init__(tensors)
        self.log = log

    def get_float(self, name, device="cpu"):
        self.log.append((name, None))
        return super().get_float(name, device)

    def get_rows(self, name, start, stop):
        self.log.append((name, stop - start))
        return self[name][start:stop]


@pytest.mark.parametrize("layout", ["element-wise", "gated", "fused"])
def test_large_units_read_their_rows_per_block_with_the_stacked_sums(layout, monkeypatch):
    """A unit past ``STACKED_MAX_BYTES`` keeps no stacked weights: each block of nodes reads its rows from every
    source (gate, up, or both halves of a fused gate_up) when a batch reaches it, and the sums are the stacked
    path's, bit for bit (the same float32 rows in the same GEMM)."""
    from hf_mloss.engine import kernel

    monkeypatch.setattr(kernel, "GEMM_BLOCK_ELEMENTS", 1024 * Q * 7)  # blocks of 7 nodes: 3 blocks of N = 20
    activation = ACT2FN["silu"]
    sources = units(layout != "element-wise", seed=11)
    tensors = [{f"unit.{k}": v for k, v in unit.state_dict().items()} for unit in sources]
    if layout == "fused":  # one [2N, D] tensor: the gate rows, then the up rows
        tensors = [{"unit.gate.weight": torch.cat([t["unit.gate.weight"], t["unit.up.weight"]]),
                    "unit.gate.bias": torch.cat([t["unit.gate.bias"], t["unit.up.bias"]])} for t in tensors]
    up = "unit.up" if layout == "gated" else None
    u, mask = padded_batch([6, 3, 8], seed=4)
    alpha = torch.tensor([0.5, 0.2, 0.3])[None]

    def target(threshold: int, log: list) -> StackedTarget:
        monkeypatch.setattr(kernel, "STACKED_MAX_BYTES", threshold)
        return StackedTarget([RowStore(t, log) for t in tensors], "unit.gate", up=up, fused=layout == "fused",
                             mix=alpha, activation=activation, reduction="sq")

    stacked_log, streamed_log = [], []
    stacked, streamed = target(1 << 40, stacked_log), target(0, streamed_log)
    assert not stacked.streams_weights and streamed.streams_weights and streamed.weight == []
    assert not any(name.endswith(".weight") for name, _ in streamed_log)  # nothing read before a batch
    want, got = stacked.sums(u, mask=mask), streamed.sums(u, mask=mask)
    assert torch.equal(got.node, want.node) and torch.equal(got.layer, want.layer)
    reads = [n for name, n in streamed_log if name.endswith(".weight")]
    parts = 1 if layout == "element-wise" else 2
    assert streamed.blocks == [(0, 7), (7, 14), (14, 20)]
    assert reads == [n for n in (7, 7, 6) for _ in range(Q * parts)]  # per block: its rows of each source only
    assert int(got.count) == 17


# --------------------------------------------------------------------------------------------------- the walk
class GatedBlocks(nn.Module):
    """A toy family: token embeddings, blocks ``x + down(silu(gate(n(x))) · up(n(x)))`` (position-wise, so a
    sequence's states do not depend on its padding), and a context carrying the padding mask."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(16, D)
        self.blocks = nn.ModuleList()
        for _ in range(2):
            block = nn.Module()
            block.norm = nn.LayerNorm(D)
            block.mlp = nn.Module()
            block.mlp.gate_proj, block.mlp.up_proj = nn.Linear(D, N), nn.Linear(D, N)
            block.mlp.down_proj = nn.Linear(N, D)
            self.blocks.append(block)


class GatedAdapter:
    unit = ScoredUnit(gate="mlp.gate_proj", up="mlp.up_proj", down="mlp.down_proj")
    num_layers = 2

    def __init__(self) -> None:
        self.contexts: list[BlockContext] = []

    def embed(self, model, batch):
        context = BlockContext(mask=batch["attention_mask"].bool(), extras={"id": len(self.contexts)})
        self.contexts.append(context)
        return model.embed(batch["input_ids"]), context

    def layers(self, model):
        return list(model.blocks)

    def check(self, hidden, context):
        """The batch's own context, carried from embed (the very object)."""
        assert any(context is c for c in self.contexts) and context.mask.shape == hidden.shape[:2]

    def layer_prefix(self, layer):
        return f"blocks.{layer}."

    def stage_of(self, name):
        return int(name.split(".")[1]) if name.startswith("blocks.") else -1

    def canonical_key(self, key):
        return key

    def forward_to_target(self, block, hidden, context=None):
        self.check(hidden, context)
        return hidden, block.norm(hidden)

    def forward_from_target(self, block, residual, u, context=None):
        self.check(residual, context)
        mlp = block.mlp
        return residual + mlp.down_proj(nn.functional.silu(mlp.gate_proj(u)) * mlp.up_proj(u))


class Setup:
    def __init__(self, model, sources, batches):
        self.adapter, self.model, self.batches, self.device = GatedAdapter(), model, batches, "cpu"
        self.sources = [Store(m.state_dict()) for m in sources]

    def autocast(self):
        import contextlib

        return contextlib.nullcontext()


def token_batches(lengths: list[int]) -> tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor]]]:
    """One padded batch (pad id 0) and the same sequences alone, unpadded."""
    generator = torch.Generator().manual_seed(7)
    ids = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.randint(1, 16, (n,), generator=generator)
        mask[i, :n] = 1
    alone = [{"input_ids": ids[i:i + 1, :n], "attention_mask": mask[i:i + 1, :n]} for i, n in enumerate(lengths)]
    return {"input_ids": ids, "attention_mask": mask}, alone


@pytest.mark.parametrize("prefix", ["shared", "own"])
def test_the_walk_carries_the_context_and_the_mask_to_the_kernel(prefix):
    """Both walks give a padded batch of token sequences the sums of the sequences walked one at a time."""
    models = [GatedBlocks(seed) for seed in range(Q)]
    alpha = torch.tensor([0.2, 0.3, 0.5])
    activation = nn.SiLU()
    padded, alone = token_batches([4, 1, 6])

    def run(batches: list[dict[str, torch.Tensor]]) -> dict[int, GapSums]:
        setup = Setup(GatedBlocks(0), models, batches)
        out: dict[int, GapSums] = {}

        def keep(layer: int, sums: GapSums) -> None:
            if layer in out:
                out[layer].merge(sums)
            else:
                out[layer] = sums

        if prefix == "shared":
            def measure(layer: int):
                target = StackedTarget(setup.sources, f"blocks.{layer}.mlp.gate_proj",
                                       up=f"blocks.{layer}.mlp.up_proj", mix=alpha[None], activation=activation)
                return lambda u, context: target.sums(u, mask=context.mask)

            shared_walk(setup, embed_batches(setup, setup.model), [0, 1], measure=measure,
                        collect=lambda layer, sums: [keep(layer, s) for s in sums])
        else:
            def visit(layer, inputs):
                sums = GapSums(1, N)
                gate, up = inputs.stacked()
                sums.add_preactivations(gate, alpha[None], activation, up=up, mask=inputs.mask)
                keep(layer, sums)

            own_walk(setup, [0, 1], visit)
        assert len(setup.adapter.contexts) == len(batches) * (1 if prefix == "shared" else Q)
        return out

    padded_sums, alone_sums = run([padded]), run(alone)
    for layer in (0, 1):
        assert int(padded_sums[layer].count) == 11
        assert_sums_close(kernel_view(padded_sums[layer]), kernel_view(alone_sums[layer]))


def test_the_own_walk_reuses_one_buffer_per_role_for_every_batch_and_block(monkeypatch):
    """Every batch and block of the own walk is stacked into the same gate and up buffers (grown only for a longer
    batch), and the several-row kernel, which overwrites them in place chunk by chunk, gives sequences of different
    lengths walked one at a time the sums of their padded batch."""
    from hf_mloss.engine import kernel

    monkeypatch.setattr(kernel, "ROWS_BLOCK_ELEMENTS", 4 * 3 * N)  # chunks of 3 positions
    models = [GatedBlocks(seed) for seed in range(Q)]
    mix = torch.tensor([[0.5, 0.5, 0.0], [0.0, 0.25, 0.75], [0.2, 0.3, 0.5], [1.0, 0.0, 0.0]])
    padded, alone = token_batches([4, 1, 6])

    def run(batches):
        setup = Setup(GatedBlocks(0), models, batches)
        out: dict[int, GapSums] = {}
        buffers: list[tuple[int, tuple[int, int]]] = []

        def visit(layer, inputs):
            buffers.append((layer, (inputs.gate.data_ptr(), inputs.up.data_ptr())))
            sums = GapSums(len(mix), N)
            gate, up = inputs.stacked(sources_first=True)
            sums.add_preactivations(gate, mix, nn.SiLU(), up=up, mask=inputs.mask, sources_first=True)
            if layer in out:
                out[layer].merge(sums)
            else:
                out[layer] = sums

        own_walk(setup, [0, 1], visit)
        return out, buffers

    padded_sums, _ = run([padded])
    alone_sums, buffers = run(alone)
    longest = buffers[2][1]  # the 6-token sequence grew the buffers; every later batch reuses them
    assert buffers[1][1] == buffers[0][1]
    assert [pointers for layer, pointers in buffers if layer == 1] == [longest] * 3
    for layer in (0, 1):
        assert int(alone_sums[layer].count) == 11
        for row in range(len(mix)):
            assert_sums_close(kernel_view(alone_sums[layer], row), kernel_view(padded_sums[layer], row))


def test_kept_spans_are_the_runs_of_the_mask(monkeypatch):
    from hf_mloss.engine import kernel

    mask = torch.tensor([0, 1, 1, 0, 0, 1, 0, 1, 1, 1], dtype=torch.bool)
    assert kernel.kept_spans(mask, 10) == [(1, 3), (5, 6), (7, 10)]
    assert kernel.kept_spans(None, 7) == [(0, 7)]
    assert kernel.kept_spans(torch.ones(4, dtype=torch.bool), 4) == [(0, 4)]
    assert kernel.kept_spans(torch.zeros(4, dtype=torch.bool), 4) == []
    monkeypatch.setattr(kernel, "MAX_MASK_SPANS", 2)
    assert kernel.kept_spans(mask, 10) is None  # too scattered: the caller copies the kept positions out


@pytest.mark.parametrize("rows", [1, 4])
@pytest.mark.parametrize("gated", [False, True], ids=["element-wise", "gated"])
def test_a_mask_walked_as_runs_equals_its_positions_copied_out(gated, rows, monkeypatch):
    """Given pre-activations and a mask, the runs of kept positions (views, blocks cut at run ends) give the sums of
    the kept positions taken out and passed without a mask, on both layouts; so does the copying fallback."""
    from hf_mloss.engine import kernel

    monkeypatch.setattr(kernel, "BLOCK_ELEMENTS", 3 * Q * N)  # blocks of 3 positions cross the runs' ends
    monkeypatch.setattr(kernel, "ROWS_BLOCK_ELEMENTS", 4 * 3 * N)
    generator = torch.Generator().manual_seed(11)
    mix = torch.softmax(torch.randn(rows, Q, generator=generator), dim=1)
    gate = torch.randn(Q, 29, N, generator=generator)
    up = torch.randn(Q, 29, N, generator=generator) if gated else None
    mask = torch.rand(29, generator=generator) > 0.4
    assert len(kernel.kept_spans(mask, 29)) > 3

    def sums(h, u, mask, sources_first):
        out = GapSums(rows, N, per_node=rows == 1)
        if not sources_first:
            h, u = h.transpose(0, 1).contiguous(), None if u is None else u.transpose(0, 1).contiguous()
        out.add_preactivations(h.clone(), mix, nn.SiLU(), up=None if u is None else u.clone(), mask=mask,
                               sources_first=sources_first)
        return out

    want = sums(gate[:, mask], None if up is None else up[:, mask], None, True)
    for sources_first in (True, False):
        for limit in (kernel.MAX_MASK_SPANS, 0):  # runs as views; the copy of the kept positions
            monkeypatch.setattr(kernel, "MAX_MASK_SPANS", limit)
            got = sums(gate, up, mask, sources_first)
            assert int(got.count) == int(mask.sum())
            for row in range(rows):
                assert_sums_close(kernel_view(got, row), kernel_view(want, row))


def test_the_own_walk_measures_before_an_in_place_activation_runs():
    """The own walk hands each source's gate output to the rest of its block without a copy (the measurement has
    its own): a block whose activation overwrites its input gives the sums and the next block's inputs of one
    that does not."""
    models = [GatedBlocks(seed) for seed in range(Q)]
    alpha = torch.tensor([0.2, 0.3, 0.5])
    padded, _ = token_batches([4, 1, 6])

    class InPlace(GatedAdapter):
        def forward_from_target(self, block, residual, u, context=None):
            mlp = block.mlp
            return residual + mlp.down_proj(nn.functional.silu(mlp.gate_proj(u), inplace=True) * mlp.up_proj(u))

    def run(adapter) -> dict[int, dict[str, torch.Tensor]]:
        setup = Setup(GatedBlocks(0), models, [padded])
        setup.adapter = adapter
        out = {}

        def visit(layer, inputs):
            sums = GapSums(1, N)
            gate, up = inputs.stacked(sources_first=True)
            sums.add_preactivations(gate, alpha[None], nn.SiLU(), up=up, mask=inputs.mask, sources_first=True)
            out[layer] = kernel_view(sums)

        own_walk(setup, [0, 1], visit)
        return out

    plain, in_place = run(GatedAdapter()), run(InPlace())
    for layer in (0, 1):
        for key, value in plain[layer].items():
            assert torch.equal(in_place[layer][key], value), (layer, key)


def test_a_tensor_batch_is_a_batch_of_pixel_values():
    pixels = torch.zeros(2, 3, 4, 4)
    assert as_batch(pixels)["pixel_values"] is pixels
    assert as_batch({"input_ids": pixels}) == {"input_ids": pixels}


# ------------------------------------------------------------------------------------------- two processes
WORKER = textwrap.dedent(
    """
    import json, sys, torch
    from accelerate import PartialState, debug_launcher
    from transformers.activations import ACT2FN
    from hf_mloss.engine.kernel import GapSums

    out = sys.argv[1]

    def worker():
        PartialState(cpu=True)
        state = PartialState()
        torch.manual_seed(0)
        h = torch.randn(30, 3, 8)
        mix = torch.tensor([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]])
        sums = GapSums(2, 8, reduction="sq")
        share = h[state.process_index :: state.num_processes]
        sums.add_preactivations(share.clone(), mix, ACT2FN["quick_gelu"])
        sums.reduce_across_processes()
        if state.is_main_process:
            torch.save({"node": sums.node, "layer": sums.layer, "processes": state.num_processes}, out)

    debug_launcher(worker, num_processes=2)
    """
)


@pytest.mark.slow
def test_two_processes_reduce_to_the_single_process_sums(tmp_path):
    """Each of 2 gloo processes sums its share of the positions; reduce_sums gives the sums of the whole."""
    out = tmp_path / "reduced.pt"
    proc = subprocess.run([sys.executable, "-c", WORKER, str(out)], capture_output=True, text=True, timeout=300,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    reduced = torch.load(out)
    torch.manual_seed(0)
    h = torch.randn(30, 3, 8)
    mix = torch.tensor([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]])
    whole = GapSums(2, 8, reduction="sq")
    whole.add_preactivations(h.clone(), mix, ACT2FN["quick_gelu"])
    assert reduced["processes"] == 2
    torch.testing.assert_close(reduced["node"], whole.node, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(reduced["layer"], whole.layer, rtol=1e-6, atol=1e-9)
    assert reduced["layer"][3].tolist() == [30.0, 30.0]
    assert [t is s for t, s in zip(reduce_sums(whole.node, whole.layer), (whole.node, whole.layer))] == [True, True]
