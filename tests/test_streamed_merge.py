"""Merges written block by block (:mod:`hf_mloss.merging.streamed`): the same bits as the in-memory container, a
folder that loads, and a peak that does not grow with the depth of the model.

The size threshold is lowered so that tiny decoders take the streamed path; each test also runs the in-memory path
on the same inputs, so a change that breaks either shows here.
"""

from __future__ import annotations

import gc
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import hf_mloss
import hf_mloss.merging.memory as memory
import hf_mloss.merging.streamed as streamed
from examples.tiny import save_with_finetunes, tiny_decoder
from hf_mloss.errors import InvalidParameterError
from memory_peak import malloc_in_use, peak_bytes

pytestmark = pytest.mark.filterwarnings("ignore:The merged folder has no tokenizer")

DATA_METHODS = ("m_ties", "regmean", "regmean_plusplus")


def _texts(vocab: int = 64, n: int = 4, length: int = 12) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    ids = torch.randint(0, vocab, (n, length), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, -3:] = 0  # one padded sequence: the walks skip its last positions
    return {"input_ids": ids, "attention_mask": mask}


@pytest.fixture(scope="module")
def decoders(tmp_path_factory) -> dict[str, tuple[Path, list[Path]]]:
    """bf16 decoders as published: an untied Llama and a Qwen2 with tied embeddings, 3 blocks, 2 fine-tunes."""
    root = tmp_path_factory.mktemp("streamed")
    return {
        "llama": save_with_finetunes(tiny_decoder("llama", num_hidden_layers=3).to(torch.bfloat16), root / "llama",
                                     q=2),
        "qwen2": save_with_finetunes(tiny_decoder("qwen2", tie=True, num_hidden_layers=3).to(torch.bfloat16),
                                     root / "qwen2", q=2),
    }


def _merge(decoder, method: str, *, stream: bool, monkeypatch, fits: bool | None = None,
           **params) -> hf_mloss.MergeResult:
    """``stream``: the size threshold at 0; ``fits`` (default: not ``stream``): whether a held model and its copies
    fit the machine (auto's search is compared block by block only where they do not)."""
    base, models = decoder
    monkeypatch.setattr(streamed, "STREAMED_MIN_BYTES", 0 if stream else 1 << 62)
    monkeypatch.setattr(memory, "memory_limit", (lambda device: None) if (not stream if fits is None else fits)
                        else (lambda device: 1))
    data = dict(data=_texts(), batch_size=2) if method in DATA_METHODS else {}
    return hf_mloss.merge(str(base), [str(m) for m in models], method, progress=False, **data, **params)


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(folder.glob("model*.safetensors")):
        with safe_open(str(file), "pt") as handle:
            out.update({key: handle.get_tensor(key) for key in handle.keys()})
    return out


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("method, params", [
    ("ties", {}), ("ties", {"scope": "global"}), ("dare", {"p": 0.5}), ("task_arithmetic", {"lam": 0.4}),
    ("m_ties", {}), ("m_ties", {"prefix": "own"}), ("regmean", {}), ("regmean_plusplus", {}),
])
def test_streamed_merge_writes_the_bits_of_the_in_memory_merge(decoders, monkeypatch, tmp_path, family, method,
                                                               params) -> None:
    whole = _merge(decoders[family], method, stream=False, monkeypatch=monkeypatch, **params)
    assert whole.spilled is None
    written = _merge(decoders[family], method, stream=True, monkeypatch=monkeypatch, **params)
    assert written.spilled is not None
    a = whole.save_pretrained(tmp_path / "whole")
    b = written.save_pretrained(tmp_path / "streamed", max_shard_size="40KB")  # the writer's own shards
    ta, tb = _tensors(a), _tensors(b)
    assert sorted(ta) == sorted(tb)  # a tied head saved once, as save_pretrained saves it
    assert all(torch.equal(ta[key], tb[key]) and ta[key].dtype == tb[key].dtype for key in ta)
    assert json.loads((a / "config.json").read_text()) == json.loads((b / "config.json").read_text())
    assert (a / "README.md").read_text().replace("whole", "X") == (b / "README.md").read_text().replace(
        "streamed", "X")
    if method in ("m_ties",):
        assert whole.report.layer == written.report.layer
    loaded = written.model  # read from the written files on first access
    state = loaded.state_dict()
    assert all(torch.equal(state[key], ta[key]) for key in ta)
    assert next(loaded.parameters()).dtype == torch.bfloat16


def test_streamed_merge_saves_twice_and_cleans_up(decoders, monkeypatch, tmp_path) -> None:
    result = _merge(decoders["llama"], "ties", stream=True, monkeypatch=monkeypatch)
    first, second = result.save_pretrained(tmp_path / "a"), result.save_pretrained(tmp_path / "b")
    ta, tb = _tensors(first), _tensors(second)
    assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)
    spill = result.spilled.folder
    assert spill.is_dir()
    del result
    gc.collect()
    assert not spill.exists()  # the temporary files go with the result
    assert _tensors(first).keys() == ta.keys()  # the saved folders keep theirs


def test_saving_spilled_weights_on_their_file_system_needs_no_room_for_them(decoders, monkeypatch, tmp_path) -> None:
    """The spilled files are hard linked into a folder on their file system: the free-space check does not ask for
    their size there (a 7B merge that just fit its spill was refused at the save), but still does elsewhere."""
    import collections

    from hf_mloss import saving
    from hf_mloss.output import spill as spill_module

    monkeypatch.setenv(spill_module.SPILL_DIR_ENV, str(tmp_path))
    streamed_result = _merge(decoders["llama"], "ties", stream=True, monkeypatch=monkeypatch)
    in_memory = _merge(decoders["llama"], "ties", stream=False, monkeypatch=monkeypatch)
    spilled = streamed_result.spilled
    assert spilled.bytes_to_save(tmp_path / "out" / "deeper") == 0 and spilled.bytes_to_save() == spilled.total_bytes
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(saving.shutil, "disk_usage", lambda path: usage(1 << 40, 1 << 40, 1024))
    folder = streamed_result.save_pretrained(tmp_path / "linked")
    assert _tensors(folder).keys() == _tensors(spilled.folder).keys()
    with pytest.raises(hf_mloss.InvalidParameterError, match="Not enough free space"):
        in_memory.save_pretrained(tmp_path / "copied")
    assert not (tmp_path / "copied").exists()


def test_a_killed_merges_spill_is_removed_by_the_next_streamed_merge(decoders, monkeypatch, tmp_path) -> None:
    """A merge killed with SIGKILL (the out-of-memory killer, a timeout) leaves its spill folder: the next streamed
    merge removes it. A running process's folder and one without a process id stay."""
    import subprocess
    import sys

    from hf_mloss.output import spill as spill_module

    monkeypatch.setenv(spill_module.SPILL_DIR_ENV, str(tmp_path))
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True)
    folders = {"killed": tmp_path / f"hf_mloss-spill-{child.pid}-abc", "dead": tmp_path / f"hf_mloss-spill-"
               f"{dead.stdout.strip()}-def", "running": tmp_path / f"hf_mloss-spill-{os.getpid()}-ghi",
               "unnamed": tmp_path / "hf_mloss-spill-xyz", "other": tmp_path / "keep-me"}
    for folder in folders.values():
        folder.mkdir()
        (folder / "model-00001-of-00002.safetensors").write_bytes(b"x" * 64)
    child.kill()
    child.wait()
    result = _merge(decoders["llama"], "ties", stream=True, monkeypatch=monkeypatch)
    assert not folders["killed"].exists() and not folders["dead"].exists()
    assert all(folders[k].is_dir() for k in ("running", "unnamed", "other"))
    assert result.spilled.folder.parent == tmp_path
    assert result.spilled.folder.name.startswith(f"hf_mloss-spill-{os.getpid()}-")


def test_streamed_merge_refuses_an_overflow_and_writes_nothing(decoders, monkeypatch, tmp_path) -> None:
    # A λ float32 holds, whose merged weights float16 cannot: refused at the first tensor, streamed or not.
    with pytest.raises(InvalidParameterError, match="overflow"):
        _merge(decoders["llama"], "task_arithmetic", stream=True, monkeypatch=monkeypatch, lam=1e30, dtype="float16")
    with pytest.raises(InvalidParameterError, match="overflow"):  # the in-memory path says the same
        _merge(decoders["llama"], "task_arithmetic", stream=False, monkeypatch=monkeypatch, lam=1e30, dtype="float16")


AUTO_CANDIDATES = {"ties": {"lam": [0.5, 1.0]}, "task_arithmetic": {"lam": [0.3, 1.0]},
                   "tsv_m": {"calibrate": ["svc"], "lam": [1.0, 1.5]}, "iso_c": {}}
"""λ grids rescaled from one merge, a calibrated merge merged per λ, and a method without a λ grid."""


def _auto(decoder, *, stream: bool, monkeypatch, fits: bool | None = None, **params) -> hf_mloss.MergeResult:
    params = {"candidates": AUTO_CANDIDATES, "data": _texts(), "batch_size": 2, **params}
    return _merge(decoder, "auto", stream=stream, fits=fits, monkeypatch=monkeypatch, **params)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("share", ["auto", "all"])
def test_streamed_auto_scores_and_writes_what_the_in_memory_search_does(decoders, monkeypatch, tmp_path, family,
                                                                        share) -> None:
    """On a model too large to hold twice, ``auto`` compares its candidates block by block: every candidate's
    criteria equal the in-memory search's (the walk's blocks, the model's own head), and the chosen merge is written
    with the same bits."""
    whole = _auto(decoders[family], stream=False, monkeypatch=monkeypatch, share=share)
    with pytest.warns(UserWarning, match="compared block by block"):
        walked = _auto(decoders[family], stream=True, monkeypatch=monkeypatch, share=share)
    assert whole.spilled is None and walked.spilled is not None
    expected, got = whole.config.parameters["scored"], walked.config.parameters["scored"]
    assert [(c["method"], c["setting"]) for c in got] == [(c["method"], c["setting"]) for c in expected]
    assert len(got) == 7 and len({c["output"] for c in got}) > 3  # the candidates differ
    for a, b in zip(expected, got):
        assert b["output"] == pytest.approx(a["output"], rel=1e-5, abs=1e-9), (a, b)
    assert walked.config.parameters["chosen"] == whole.config.parameters["chosen"]
    assert "compared block by block" in walked.method_description
    ta = _tensors(whole.save_pretrained(tmp_path / "whole"))
    tb = _tensors(walked.save_pretrained(tmp_path / "streamed", max_shard_size="40KB"))
    assert sorted(ta) == sorted(tb) and all(torch.equal(ta[key], tb[key]) for key in ta)


def test_streamed_auto_compares_each_model_on_its_own_data(decoders, monkeypatch) -> None:
    base, models = decoders["llama"]
    own = [{"model": str(m), "data": _texts(n=3, length=10 + i)} for i, m in enumerate(models)]
    runs = {}
    for stream in (False, True):
        monkeypatch.setattr(streamed, "STREAMED_MIN_BYTES", 0 if stream else 1 << 62)
        monkeypatch.setattr(memory, "memory_limit", (lambda device: 1) if stream else (lambda device: None))
        runs[stream] = hf_mloss.merge(str(base), own, "auto", candidates=AUTO_CANDIDATES, batch_size=2,
                                      progress=False)
    assert runs[True].spilled is not None
    expected, got = runs[False].config.parameters["scored"], runs[True].config.parameters["scored"]
    assert [b["output"] for b in got] == pytest.approx([a["output"] for a in expected], rel=1e-5, abs=1e-9)
    assert runs[True].config.parameters["chosen"] == runs[False].config.parameters["chosen"]


@pytest.mark.parametrize("chosen", [{"method": "task_arithmetic", "parameters": {"lam": 0.7}},
                                    {"method": "tsv_m", "parameters": {"calibrate": "svc", "lam": 1.5}}])
def test_streamed_auto_rewrites_a_recorded_choice_with_its_bits(decoders, monkeypatch, tmp_path, chosen) -> None:
    """A recorded choice (the recipe's re-run) is merged block by block as the search would write it."""
    recorded = {"candidates": AUTO_CANDIDATES, "chosen": chosen}
    whole = _auto(decoders["llama"], stream=False, monkeypatch=monkeypatch, **recorded)
    walked = _auto(decoders["llama"], stream=True, monkeypatch=monkeypatch, **recorded)
    assert walked.spilled is not None and walked.config.parameters["chosen"] == chosen
    ta = _tensors(whole.save_pretrained(tmp_path / "whole"))
    tb = _tensors(walked.save_pretrained(tmp_path / "streamed"))
    assert sorted(ta) == sorted(tb) and all(torch.equal(ta[key], tb[key]) for key in ta)


def test_streamed_auto_without_data_streams_its_fallback(decoders, monkeypatch, tmp_path) -> None:
    whole = _merge(decoders["qwen2"], "auto", stream=False, monkeypatch=monkeypatch)
    walked = _merge(decoders["qwen2"], "auto", stream=True, monkeypatch=monkeypatch)
    assert walked.spilled is not None and walked.config.parameters["chosen"]["method"] == "tsv_m"
    ta, tb = _tensors(whole.save_pretrained(tmp_path / "a")), _tensors(walked.save_pretrained(tmp_path / "b"))
    assert sorted(ta) == sorted(tb) and all(torch.equal(ta[key], tb[key]) for key in ta)


def test_streamed_auto_leaves_out_the_candidates_fitted_on_a_merged_prefix(decoders, monkeypatch, tmp_path) -> None:
    """On a model whose search does not fit, RegMean++ (fitted on the data through forwards a block-by-block search
    does not make) leaves the default candidates with a warning and is refused by name before the model is read;
    the M-Loss criterion, which needs the scratch copy, is refused for memory."""
    with pytest.warns(UserWarning, match="regmean_plusplus left out of the default candidates"):
        result = _merge(decoders["llama"], "auto", stream=True, monkeypatch=monkeypatch, data=_texts(),
                        batch_size=2, budget=6)
    assert result.spilled is not None
    assert {c["method"] for c in result.config.parameters["scored"]} == {"tsv_m", "iso_c", "iso_cts", "ties",
                                                                         "task_arithmetic"}
    with pytest.raises(InvalidParameterError, match="regmean_plusplus fit on the data, through forwards a search "
                                                    "compared block by block does not make"):
        _auto(decoders["llama"], stream=True, monkeypatch=monkeypatch, candidates=["ties", "regmean_plusplus"])
    with pytest.raises(InvalidParameterError, match="Not enough memory: method='auto' compares each candidate on a "
                                                    "scratch copy"):  # the M-Loss criterion needs the copy
        _auto(decoders["llama"], stream=True, monkeypatch=monkeypatch, criterion="mloss")


def test_auto_keeps_the_in_memory_search_where_it_fits(decoders, monkeypatch) -> None:
    """Above the streaming size, a search whose scratch copies fit the machine keeps them: its fitted candidates
    and its M-Loss report stay."""
    result = _merge(decoders["llama"], "auto", stream=True, fits=True, monkeypatch=monkeypatch, data=_texts(),
                    batch_size=2, candidates={"ties": {"lam": [1.0]}, "regmean_plusplus": {"lam": [1.0]}})
    assert result.spilled is None and result.model is not None
    assert {c["method"] for c in result.config.parameters["scored"]} == {"ties", "regmean_plusplus"}
    assert result.report.layer  # measured on the scratch copy


def test_a_recorded_choice_fitted_on_the_data_is_refitted_in_memory(decoders, monkeypatch, tmp_path) -> None:
    """A recorded RegMean++ choice is fitted again as the search fitted it (its merged prefix), not written by the
    streamed output's data-free rule."""
    recorded = {"candidates": {"regmean_plusplus": {"lam": [1.5]}},
                "chosen": {"method": "regmean_plusplus", "parameters": {"lam": 1.5}}}
    whole = _auto(decoders["llama"], stream=False, monkeypatch=monkeypatch, **recorded)
    again = _auto(decoders["llama"], stream=True, fits=True, monkeypatch=monkeypatch, **recorded)
    assert again.spilled is None
    ta, tb = _tensors(whole.save_pretrained(tmp_path / "a")), _tensors(again.save_pretrained(tmp_path / "b"))
    assert sorted(ta) == sorted(tb) and all(torch.equal(ta[key], tb[key]) for key in ta)


# ------------------------------------------------------------------------------------------------------------ memory
@pytest.mark.parametrize("method", ["m_ties", "regmean_plusplus", "auto"])
def test_the_data_guided_walk_peak_does_not_grow_with_depth(tmp_path, monkeypatch, method) -> None:
    """Two depths of one width: the streamed merge's peak (auto's block-by-block search included) stays within a
    fraction of one block, where the in-memory container's grows by about a block per layer (which shows the measure
    sees what the walk holds)."""
    in_use = malloc_in_use()
    if in_use is None:
        pytest.skip("needs glibc's malloc behind torch (mallinfo2, glibc 2.33+) to count the process's allocated bytes")
    monkeypatch.setenv("HF_MLOSS_THREADS", "1")  # every op on this thread, where the dispatch mode sees it
    shape = dict(hidden_size=128, intermediate_size=512, vocab_size=64)
    block = (4 * 128 * 128 + 3 * 128 * 512) * 4  # one block's float32 weights (the working dtype)
    peaks = {}
    for layers in (2, 6):
        decoder = save_with_finetunes(tiny_decoder("llama", num_hidden_layers=layers, **shape).to(torch.bfloat16),
                                      tmp_path / f"l{layers}", q=2)
        for stream in (True, False):
            extra = {"candidates": {"ties": {"lam": [0.5, 1.0]}, "tsv_m": {}}, "data": _texts(), "batch_size": 2,
                     "share": "all"} if method == "auto" else {}
            run = lambda: _merge(decoder, method, stream=stream, monkeypatch=monkeypatch, **extra)  # noqa: E731
            run()  # warm: the allocator's and the libraries' first-call allocations
            peaks[layers, stream] = peak_bytes(in_use, run)
    assert peaks[6, True] - peaks[2, True] < block / 2, peaks
    assert peaks[6, False] - peaks[2, False] > 3 * block, peaks


def test_m_ties_peak_does_not_grow_with_the_number_of_fine_tunes(tmp_path, monkeypatch) -> None:
    """q = 2 and 6 fine-tunes of one width: with the scored unit read a block of nodes at a time (the path of units
    past ``STACKED_MAX_BYTES``) and the merge taking the sources' own buffer, M-TIES's peak grows by less than one
    source's scored unit over the 4 added sources; with the unit stacked it grows by several (the measure sees it)."""
    import hf_mloss.engine.kernel as kernel

    in_use = malloc_in_use()
    if in_use is None:
        pytest.skip("needs glibc's malloc behind torch (mallinfo2, glibc 2.33+) to count the process's allocated bytes")
    monkeypatch.setenv("HF_MLOSS_THREADS", "1")
    shape = dict(hidden_size=128, intermediate_size=512, vocab_size=64)
    unit = 2 * 128 * 512 * 4  # one source's gate and up weights in float32
    peaks, merged = {}, {}
    for q in (2, 6):
        decoder = save_with_finetunes(tiny_decoder("llama", num_hidden_layers=2, **shape).to(torch.bfloat16),
                                      tmp_path / f"q{q}", q=q)
        for streams in (True, False):
            monkeypatch.setattr(kernel, "STACKED_MAX_BYTES", 0 if streams else 1 << 62)
            run = lambda: _merge(decoder, "m_ties", stream=True, monkeypatch=monkeypatch)  # noqa: E731
            merged[streams] = run().model.state_dict()
            peaks[q, streams] = peak_bytes(in_use, run)
        assert merged[True].keys() == merged[False].keys()
        assert all(torch.equal(merged[True][k], merged[False][k]) for k in merged[True])  # the same merge
    assert peaks[6, True] - peaks[2, True] < unit, peaks
    assert peaks[6, False] - peaks[2, False] > 4 * unit, peaks
