"""Large tensors merged in flat pieces (`TensorMerger._merge_in_chunks`): the same bits as merging them whole.

The tensor merger (``hf_mloss.merging.merger``) merges a tensor whose q sources hold ≥ ``CHUNKED_MIN_NUMEL`` entries
piece by piece when the method allows (TIES): per-tensor thresholds come from :func:`streamed_thresholds`, the rest is element-wise. These tests lower the
size limits so that a tiny decoder's tensors take that path, and compare every output bit with the whole-tensor path.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

import hf_mloss
from examples.tiny import save_with_finetunes, tiny_decoder
from hf_mloss.errors import CorruptCheckpointError
from hf_mloss.merging import driver
from hf_mloss.merging import merger as tensor_merger
from hf_mloss.methods.ops import magnitude_threshold, sample_positions, streamed_thresholds

# An embedding of 3001 x 96 entries: pieces of 32768 entries (q = 4) cut it inside rows, and its last piece is short.
MERGE_IN_CHUNKS = tensor_merger.TensorMerger._merge_in_chunks
SHAPE = dict(vocab_size=3001, hidden_size=96, intermediate_size=200, num_attention_heads=4, num_key_value_heads=2)


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(-1).view(torch.uint8)


def _pieces(tensors: list[torch.Tensor], step: int):
    """``chunks`` for streamed_thresholds: the task vectors in consecutive flat pieces."""
    def chunks():
        for start in range(0, tensors[0].numel(), step):
            yield [t.reshape(-1)[start:start + step].clone() for t in tensors]
    return chunks


@pytest.mark.parametrize("step", [1000, 4096, 10**6])
def test_streamed_thresholds_equal_the_whole_tensor_selection(step) -> None:
    generator = torch.Generator().manual_seed(0)
    # bf16-rounded values: many equal magnitudes, as in a real bf16 task vector
    taus = [(torch.randn(300, 70, generator=generator) * 1e-3).bfloat16().float() for _ in range(3)]
    numel = taus[0].numel()
    samples = [t.reshape(-1)[sample_positions(numel)].abs() for t in taus]
    for counts in ([int(numel * 0.2)] * 3, [1, numel // 2, numel - 1], [0, numel, 5]):
        got = streamed_thresholds(_pieces(taus, step), counts, numel, samples)
        want = [magnitude_threshold(t.abs(), m) for t, m in zip(taus, counts)]
        assert got == want


def test_streamed_thresholds_fall_back_when_the_sample_misses() -> None:
    generator = torch.Generator().manual_seed(1)
    taus = [torch.randn(50_000, generator=generator) for _ in range(2)]
    counts = [10_000, 40_000]
    # samples far from the target quantile: the bracket misses, the exact radix selection takes over
    wrong = [torch.full((16384,), 100.0), torch.zeros(16384)]
    got = streamed_thresholds(_pieces(taus, 7000), counts, 50_000, wrong)
    assert got == [magnitude_threshold(t.abs(), m) for t, m in zip(taus, counts)]


@pytest.fixture(scope="module")
def decoder_sets(tmp_path_factory):
    """bf16, tied embeddings, q = 4; fp32, untied, q = 3 (pieces of 40960 entries); and a set whose fine-tunes all
    kept the base's embedding (a frozen tensor: the merge copies the base)."""
    sets = {}
    root = tmp_path_factory.mktemp("chunked")
    base = tiny_decoder("qwen2", tie=True, **SHAPE).to(torch.bfloat16)
    sets["bf16_tied"] = save_with_finetunes(base, root / "bf16", q=4)
    base = tiny_decoder("llama", tie=False, **SHAPE)
    sets["fp32_untied"] = save_with_finetunes(base, root / "fp32", q=3)
    b, models = save_with_finetunes(tiny_decoder("qwen2", tie=True, **SHAPE), root / "frozen", q=2)
    embed = load_file(b / "model.safetensors")["model.embed_tokens.weight"]
    for folder in models:
        state = load_file(folder / "model.safetensors")
        state["model.embed_tokens.weight"] = embed.clone()
        save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    sets["frozen_embedding"] = (b, models)
    return sets


def _merge(paths, monkeypatch, chunked: bool, method: str = "ties", **kwargs) -> tuple[dict, list[str]]:
    base, models = paths
    used: list[str] = []

    def spy(self, name, *args):
        used.append(name)
        return MERGE_IN_CHUNKS(self, name, *args)

    monkeypatch.setattr(tensor_merger.TensorMerger, "_merge_in_chunks", spy)
    monkeypatch.setattr(tensor_merger, "CHUNKED_MIN_NUMEL", 1 if chunked else 1 << 60)
    monkeypatch.setattr(tensor_merger, "MERGE_CHUNK_NUMEL", 1)  # one elect_and_merge chunk per piece: many pieces
    result = hf_mloss.merge(str(base), [str(m) for m in models], method, progress=False, **kwargs)
    return result.model.state_dict(), used


@pytest.mark.parametrize("which", ["bf16_tied", "fp32_untied", "frozen_embedding"])
@pytest.mark.parametrize("kwargs", [dict(k=0.2, scope="tensor"), dict(k=0.2, scope="global"),
                                    dict(k=0.3, convention="peft"), dict(k=0.2, convention="fusion_bench"),
                                    dict(k=0.1, scope="tensor", lam=0.7, weights="ramp")],
                         ids=["tensor", "global", "peft", "fusion_bench", "weights_lam"])
def test_pieces_give_the_bits_of_the_whole_tensor_merge(decoder_sets, monkeypatch, which, kwargs) -> None:
    paths = decoder_sets[which]
    if kwargs.get("weights") == "ramp":
        kwargs = dict(kwargs, weights=[0.5 + i for i in range(len(paths[1]))])
    whole, used_whole = _merge(paths, monkeypatch, chunked=False, **kwargs)
    pieces, used = _merge(paths, monkeypatch, chunked=True, **kwargs)
    assert used_whole == [] and "model.embed_tokens.weight" in used
    assert whole.keys() == pieces.keys()
    assert [k for k in whole if not torch.equal(_bits(whole[k]), _bits(pieces[k]))] == []
    if which == "frozen_embedding":  # no fine-tune changed it: the base's bits, whatever the method computes
        base = load_file(paths[0] / "model.safetensors")["model.embed_tokens.weight"]
        assert torch.equal(_bits(pieces["model.embed_tokens.weight"].to(base.dtype)), _bits(base))


@pytest.mark.parametrize("which", ["bf16_tied", "frozen_embedding"])
@pytest.mark.parametrize("method, kwargs", [("task_arithmetic", dict(lam=0.7, weights="ramp")), ("average", {})])
def test_entry_by_entry_merges_take_pieces_with_the_bits_of_the_whole_tensor(decoder_sets, monkeypatch, which,
                                                                             method, kwargs) -> None:
    paths = decoder_sets[which]
    if kwargs.get("weights") == "ramp":
        kwargs = dict(kwargs, weights=[0.5 + i for i in range(len(paths[1]))])
    whole, used_whole = _merge(paths, monkeypatch, chunked=False, method=method, **kwargs)
    pieces, used = _merge(paths, monkeypatch, chunked=True, method=method, **kwargs)
    assert used_whole == [] and "model.embed_tokens.weight" in used
    assert [k for k in whole if not torch.equal(_bits(whole[k]), _bits(pieces[k]))] == []


def _decoder_data() -> dict[str, torch.Tensor]:
    ids = torch.randint(0, SHAPE["vocab_size"], (4, 12), generator=torch.Generator().manual_seed(3))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def _spied_data_merge(monkeypatch, path: str, base, models, method: str, data):
    """``(run, used)``: ``run(pieces)`` merges with the size limits lowered to 1 entry (every eligible tensor takes
    the piecewise path, one slice or chunk at a time) or raised out of reach, and returns the merged state;
    ``used`` collects the tensors the merger's ``path`` method took."""
    used: list[str] = []
    original = getattr(tensor_merger.TensorMerger, path)

    def spy(self, name, *args):
        used.append(name)
        return original(self, name, *args)

    def run(pieces: bool) -> dict:
        monkeypatch.setattr(tensor_merger.TensorMerger, path, spy)
        monkeypatch.setattr(tensor_merger, "CHUNKED_MIN_NUMEL", 1 if pieces else 1 << 60)
        monkeypatch.setattr(tensor_merger, "MERGE_CHUNK_NUMEL", 1)
        return hf_mloss.merge(str(base), [str(m) for m in models], method, data=data, progress=False,
                              seed=0).model.state_dict()
    return run, used


@pytest.mark.parametrize("method", ["m_ties", "m_dare"])
def test_m_ties_merges_tensors_outside_its_node_groups_in_pieces(decoder_sets, monkeypatch, method) -> None:
    """M-TIES trims every tensor outside its scored node groups per tensor at k, as TIES: a large one (an LLM's
    embedding) is merged in pieces with the same bits; the node-group members (trimmed row by row) stay whole, and
    M-DARE (random drops over the whole tensor) never takes the piecewise path."""
    run, used = _spied_data_merge(monkeypatch, "_merge_in_chunks", *decoder_sets["bf16_tied"], method,
                                  _decoder_data())
    whole = run(False)
    assert used == []
    pieces = run(True)
    assert [k for k in whole if not torch.equal(_bits(whole[k]), _bits(pieces[k]))] == []
    if method == "m_dare":
        assert used == []
    else:
        assert "model.embed_tokens.weight" in used
        assert not any("gate_proj" in n or "up_proj" in n or "down_proj" in n for n in used)  # the node groups


@pytest.mark.parametrize("which", ["fp32_untied", "frozen_embedding"])
@pytest.mark.parametrize("method", ["regmean", "regmean_plusplus"])
def test_regmean_averages_the_embeddings_in_pieces(decoder_sets, monkeypatch, method, which) -> None:
    """RegMean averages what no solve reaches (an LLM's embedding and head): a large one in pieces, with the bits
    of the whole tensor (a frozen one stays the base's exactly); the solved linears are written whole."""
    run, used = _spied_data_merge(monkeypatch, "_merge_in_chunks", *decoder_sets[which], method, _decoder_data())
    whole = run(False)
    assert used == []
    pieces = run(True)
    assert [k for k in whole if not torch.equal(_bits(whole[k]), _bits(pieces[k]))] == []
    assert "model.embed_tokens.weight" in used
    assert not any(n.endswith("proj.weight") for n in used)
    if which == "frozen_embedding":
        base = load_file(decoder_sets[which][0] / "model.safetensors")["model.embed_tokens.weight"]
        assert torch.equal(_bits(pieces["model.embed_tokens.weight"].to(base.dtype)), _bits(base))


def test_mergekit_convention_merges_whole_tensors(decoder_sets, monkeypatch) -> None:
    """mergekit keeps exactly floor(n·k) entries in argsort order, which needs the whole tensor at once."""
    _, used = _merge(decoder_sets["bf16_tied"], monkeypatch, chunked=True, k=0.2, convention="mergekit")
    assert used == []


def test_non_finite_source_is_refused_with_its_count(decoder_sets, monkeypatch, tmp_path) -> None:
    base, models = decoder_sets["bf16_tied"]
    bad = tmp_path / "bad"
    bad.mkdir()
    for file in models[0].iterdir():
        (bad / file.name).write_bytes(file.read_bytes())
    state = load_file(bad / "model.safetensors")
    state["model.embed_tokens.weight"][2999, 5] = float("nan")
    state["model.embed_tokens.weight"][7, 0] = float("inf")
    save_file(state, bad / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CorruptCheckpointError, match=r"embed_tokens.weight.*holds 2 non-finite"):
        _merge((base, [bad, *models[1:]]), monkeypatch, chunked=True, k=0.2, scope="tensor")


def test_checkpoint_store_reads_row_ranges(decoder_sets) -> None:
    from transformers import AutoConfig

    from hf_mloss.adapters.registry import adapter_for
    from hf_mloss.loading.hub import ModelRef
    from hf_mloss.loading.store import CheckpointStore

    base, _ = decoder_sets["bf16_tied"]
    store = CheckpointStore(ModelRef(path=str(base)), adapter_for(AutoConfig.from_pretrained(base)))
    name = "model.embed_tokens.weight"
    whole = store.get(name)
    assert torch.equal(store.get_rows(name, 5, 1234), whole[5:1234])
    assert torch.equal(store.get_rows(name, 2990, 3001), whole[2990:])


def test_finalize_drops_the_mergers_float32_references_before_the_cast(decoder_sets) -> None:
    """The cast to the output dtype frees each float32 tensor as its copy is made: the merger's references are
    dropped first (kept for an adapter output, which still reads them); the overflow check reads max |x| without
    an |x| copy and gives the same value."""
    from types import SimpleNamespace

    for keep in (False, True):
        model = torch.nn.Linear(3, 2)
        with torch.no_grad():
            model.weight.copy_(torch.tensor([[1.0, -7.5, 2.0], [0.5, 3.0, -1.0]]))
        targets = {"weight": model.weight.data, "bias": model.bias.data}
        merger = SimpleNamespace(names=list(targets), targets=dict(targets), checked=set(targets),
                                 ctx=SimpleNamespace(params=None))
        out = driver.finalize(model, merger, torch.bfloat16, keep_targets=keep)
        assert out.weight.dtype == torch.bfloat16
        assert (merger.targets == targets) if keep else merger.targets == {}
    tensor = torch.tensor([[0.25, -9.0], [4.0, 1.0]])
    assert tensor_merger.largest_magnitude(tensor) == float(tensor.abs().max()) == 9.0
    assert tensor_merger.largest_magnitude(torch.empty(0)) == 0.0


@pytest.mark.parametrize("method", ["m_ties", "m_dare"])
@pytest.mark.parametrize("family", ["qwen2", "clip"])
def test_m_ties_merges_its_node_group_tensors_a_block_of_slices_at_a_time(decoder_sets, tmp_path, monkeypatch,
                                                                          method, family) -> None:
    """A large tensor of a scored node group (trimmed slice by slice: rows of gate / up / fc1, columns of down)
    is merged a block of whole slices at a time, so the q float32 copies held are of one block: the same bits
    as whole, the 1-D members (CLIP's fc1 bias, trimmed against fc1's per-row thresholds) included. One slice per
    block here (the smallest blocks)."""
    from examples.tiny import make_image_folder, make_tiny_setup

    if family == "qwen2":
        (base, models), data = decoder_sets["bf16_tied"], _decoder_data()
        grouped = ("gate_proj", "up_proj", "down_proj")
    else:
        base, models = make_tiny_setup(tmp_path / "clip", q=3)
        data = str(make_image_folder(tmp_path / "images", n=6))
        grouped = ("fc1.weight",)  # CLIP's group: fc1's rows, and its bias against their thresholds
    run, used = _spied_data_merge(monkeypatch, "_merge_in_slices", base, models, method, data)
    whole = run(False)
    assert used == []
    sliced = run(True)
    assert [k for k in whole if not torch.equal(_bits(whole[k]), _bits(sliced[k]))] == []
    assert used and all(any(g in n for g in grouped) for n in used)
    assert {g for g in grouped if any(g in n for n in used)} == set(grouped)  # rows, and columns (down_proj)
