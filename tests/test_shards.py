"""The streaming safetensors writer (:mod:`hf_mloss.output.shards`): the bytes ``save_file`` writes, through
``O_DIRECT`` where the file system allows it and through the page cache where it does not."""

from __future__ import annotations

import errno
import json
import os

import pytest
import torch
from safetensors.torch import save_file

from hf_mloss.output import shards
from hf_mloss.output.shards import BLOCK, DirectFile, ShardWriter


def _tensors(generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Tensors of odd byte sizes (one byte to several blocks), so that their edges fall anywhere in a block."""
    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.bool]
    tensors = {f"layer.{i}.{d}": (torch.randn(3, 4 + i, generator=generator) * 5).to(dtypes[d])
               for i in range(4) for d in range(len(dtypes))}
    tensors["scalar"], tensors["empty"] = torch.tensor(1.5), torch.zeros(0, 3)
    tensors["one_byte"] = torch.ones(1, dtype=torch.bool)
    tensors["blocks"] = torch.randn(3 * BLOCK + 7, generator=generator).to(torch.bfloat16)
    return tensors


def _check_against_save_file(folder, tensors, names, files, limit):
    index = json.loads((folder / files[-1]).read_text()) if len(files) > 1 else None
    groups: dict[str, list[str]] = {}
    for name in names:
        groups.setdefault(index["weight_map"][name] if index else files[0], []).append(name)
    assert list(groups) == (files[:-1] if index else files)
    if index:
        assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    for file, members in groups.items():
        save_file({n: tensors[n] for n in members}, str(folder / "ref.safetensors"), metadata={"format": "pt"})
        assert (folder / file).read_bytes() == (folder / "ref.safetensors").read_bytes(), file
        size = sum(tensors[n].numel() * tensors[n].element_size() for n in members)
        following = names[names.index(members[-1]) + 1:]
        assert size <= limit or len(members) == 1
        assert not following or size + tensors[following[0]].numel() * tensors[following[0]].element_size() > limit


@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("limit", [200, 10**9])
def test_the_writer_streams_the_bytes_save_file_writes(tmp_path, monkeypatch, direct, limit):
    """Each shard is byte for byte ``safetensors.torch.save_file``'s file of the same tensors (data sorted by dtype,
    then name), shards close where the next tensor would not fit, and the plan is enforced; direct or not, and with
    a staging buffer of two blocks (a tensor's whole blocks written in several pieces)."""
    monkeypatch.setattr(shards, "STAGE_BYTES", 2 * BLOCK)
    tensors = _tensors(torch.Generator().manual_seed(0))
    names = list(tensors)
    writer = ShardWriter(tmp_path, [(n, tensors[n].shape, tensors[n].dtype) for n in names], limit, direct=direct)
    for name in names:
        writer.add(name, tensors[name])
    files = writer.finish()
    assert (len(files) > 3) == (limit == 200)
    _check_against_save_file(tmp_path, tensors, names, files, limit)

    single = ShardWriter(tmp_path / "one", [("a", (2,), torch.float32)], direct=direct)
    (tmp_path / "one").mkdir()
    with pytest.raises(ValueError, match="comes where the plan has"):
        single.add("a", torch.zeros(3))
    single.add("a", torch.zeros(2))
    assert single.finish() == ["model.safetensors"]


def test_a_file_system_refusing_o_direct_gets_the_same_bytes_through_the_page_cache(tmp_path, monkeypatch):
    """``O_DIRECT`` refused when the file is opened (tmpfs on older kernels, some network file systems), or when a
    block is written (an alignment the device does not take): the rest of the file goes through the page cache,
    and its bytes are the same."""
    if not hasattr(os, "O_DIRECT"):
        pytest.skip("no O_DIRECT on this platform: the writer never asks for it here")
    tensors = _tensors(torch.Generator().manual_seed(1))
    names = list(tensors)
    real_open, real_pwrite = os.open, shards._pwrite

    def refusing_open(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", refusing_open)
    opened = DirectFile(tmp_path / "probe.bin", 10)
    assert not opened.direct
    opened.close()
    writer = ShardWriter(tmp_path / "a", [(n, tensors[n].shape, tensors[n].dtype) for n in names], 10**9)
    (tmp_path / "a").mkdir()
    for name in names:
        writer.add(name, tensors[name])
    _check_against_save_file(tmp_path / "a", tensors, names, writer.finish(), 10**9)
    monkeypatch.setattr(os, "open", real_open)

    calls = {"direct": 0}

    def refusing_the_second_direct_write(fd, view, offset):
        if _flags(fd) & os.O_DIRECT:
            calls["direct"] += 1
            if calls["direct"] == 2:
                raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwrite(fd, view, offset)

    monkeypatch.setattr(shards, "_pwrite", refusing_the_second_direct_write)
    probe = DirectFile(tmp_path / "probe.bin", 10)
    if not probe.direct:
        probe.close()
        pytest.skip("this file system refuses O_DIRECT: the first part of the test covered it")
    probe.close()
    writer = ShardWriter(tmp_path / "b", [(n, tensors[n].shape, tensors[n].dtype) for n in names], 10**9)
    (tmp_path / "b").mkdir()
    for name in names:
        writer.add(name, tensors[name])
    files = writer.finish()
    assert calls["direct"] == 2  # refused once; the writer went on through the page cache
    _check_against_save_file(tmp_path / "b", tensors, names, files, 10**9)


def _flags(fd: int) -> int:
    """The file status flags of ``fd`` (``O_DIRECT`` among them)."""
    import fcntl

    return fcntl.fcntl(fd, fcntl.F_GETFL)


def test_direct_writes_can_be_turned_off_and_a_bad_value_is_named_before_any_work(tmp_path, monkeypatch, capsys,
                                                                                   tiny_paths):
    """``HF_MLOSS_DIRECT_WRITES=0`` writes through the page cache (the same bytes); a value other than 0 and 1 is
    refused by the CLI before any model is read, naming the variable, and nothing is written."""
    import yaml

    from hf_mloss.cli import main
    from hf_mloss.errors import InvalidParameterError
    from hf_mloss.output.shards import DIRECT_ENV, direct_writes

    monkeypatch.setenv(DIRECT_ENV, "0")
    assert not direct_writes()
    opened = DirectFile(tmp_path / "plain.bin", 10)
    assert not opened.direct
    opened.write(memoryview(b"0123456789"), 0)
    opened.close()
    assert (tmp_path / "plain.bin").read_bytes() == b"0123456789"
    monkeypatch.setenv(DIRECT_ENV, "1")
    assert direct_writes()
    monkeypatch.setenv(DIRECT_ENV, "yes")
    with pytest.raises(InvalidParameterError, match="HF_MLOSS_DIRECT_WRITES='yes' must be 0"):
        direct_writes()
    base, models = tiny_paths
    recipe = tmp_path / "merge.yml"
    recipe.write_text(yaml.safe_dump({"base": base, "models": models, "method": "task_arithmetic"}))
    assert main(["merge", str(recipe), str(tmp_path / "out"), "-q"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hf-mloss: error:") and "HF_MLOSS_DIRECT_WRITES" in err and "Traceback" not in err, err
    assert not (tmp_path / "out").exists()
