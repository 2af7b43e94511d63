"""The data-guided and streamed paths on a CUDA device give what they give on the CPU.

Run where a GPU exists (skipped otherwise; CI has none). Each test runs one path on both devices with the same
inputs. ``HF_MLOSS_TEST_GPU=cpu`` runs them CPU against CPU, to check the tests themselves on a machine without one. They cover what a GPU run of ``benchmarks/merge_speed.py`` once found broken: the streamed scoring model
kept buffers built in ``__init__`` (CLIP's ``position_ids``) on the CPU, and the piecewise threshold search built its
quantile levels on the CPU while the samples were on the GPU. The merges written since (WUDI's Adam iterations, CART,
Singular Value Calibration, Iso-CTS, RegMean++ and `auto` on each model's own data) are checked the same way.
"""

from __future__ import annotations

import os

import pytest
import torch

import hf_mloss
from examples.tiny import save_with_finetunes, tiny_decoder
from hf_mloss.engine import compatibility as compat_module
from hf_mloss.engine.gram import gram_dtypes
from hf_mloss.merging import merger as tensor_merger

GPU = os.environ.get("HF_MLOSS_TEST_GPU", "cuda")
pytestmark = pytest.mark.skipif(GPU.startswith("cuda") and not torch.cuda.is_available(), reason="needs a CUDA device")

SHAPE = dict(vocab_size=3001, hidden_size=96, intermediate_size=200, num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture(scope="module")
def pixels():
    return torch.rand(6, 3, 32, 32, generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def decoder(tmp_path_factory):
    base = tiny_decoder("qwen2", tie=True, **SHAPE).to(torch.bfloat16)
    return save_with_finetunes(base, tmp_path_factory.mktemp("cuda_decoder"), q=3)


def _close(cpu: dict, cuda: dict, rtol: float = 1e-4, atol: float = 1e-6) -> None:
    assert cpu.keys() == cuda.keys()
    for key in cpu:
        torch.testing.assert_close(cuda[key].cpu().float(), cpu[key].float(), rtol=rtol, atol=atol,
                                   msg=lambda detail, key=key: f"{key}: {detail}")


def test_score_streams_the_base_onto_the_gpu(tiny_paths, pixels):
    base, models = tiny_paths
    on = {d: hf_mloss.score(base, models, pixels, batch_size=3, device=d, progress=False) for d in ("cpu", GPU)}
    _close({k: torch.tensor(v) for k, v in on["cpu"].layer.items()},
           {k: torch.tensor(v) for k, v in on[GPU].layer.items()})
    _close(on["cpu"].node, on[GPU].node)


def test_compatibility_streams_large_tensors_on_the_gpu(tiny_paths, pixels, monkeypatch):
    monkeypatch.setattr(compat_module, "STREAM_MIN_NUMEL", 1)  # every tensor read in pieces
    base, models = tiny_paths
    rows = {d: hf_mloss.compatibility(base, models, pixels, batch_size=3, device=d, progress=False)
            for d in ("cpu", GPU)}
    assert rows["cpu"].subsets == rows[GPU].subsets
    _close(rows["cpu"].values, rows[GPU].values)
    _close({k: torch.tensor(v) for k, v in rows["cpu"].baselines.items()},
           {k: torch.tensor(v) for k, v in rows[GPU].baselines.items()})


@pytest.mark.parametrize("method", ["ties", "m_ties"])
def test_large_tensors_merge_in_pieces_on_the_gpu(decoder, monkeypatch, method):
    monkeypatch.setattr(tensor_merger, "CHUNKED_MIN_NUMEL", 1)  # the embedding (and every tensor) in pieces
    base, models = decoder
    ids = torch.randint(0, SHAPE["vocab_size"], (4, 12), generator=torch.Generator().manual_seed(3))
    data = {"input_ids": ids, "attention_mask": torch.ones_like(ids)} if method == "m_ties" else None
    merged = {d: hf_mloss.merge(str(base), [str(m) for m in models], method, data=data, device=d,
                                progress=False).model.state_dict() for d in ("cpu", GPU)}
    _close(merged["cpu"], merged[GPU], rtol=1e-3, atol=1e-5)


@pytest.mark.parametrize("method, params", [("wudi", {}), ("cart", {}), ("tsv_m", {"calibrate": "svc"}),
                                            ("task_arithmetic", {"calibrate": "svc"}), ("iso_cts", {})])
def test_data_free_matrix_merges_on_the_gpu(tiny_paths, method, params):
    base, models = tiny_paths
    merged = {d: hf_mloss.merge(base, models, method, device=d, progress=False, **params).model.state_dict()
              for d in ("cpu", GPU)}
    _close(merged["cpu"], merged[GPU], rtol=1e-3, atol=1e-5)


@pytest.mark.parametrize("method", ["regmean_plusplus", "auto"])
def test_each_models_own_data_on_the_gpu(tiny_paths, pixels, method):
    base, models = tiny_paths
    entries = [{"model": m, "data": pixels[2 * i:2 * i + 2]} for i, m in enumerate(models)]
    results = {d: hf_mloss.merge(base, entries, method, device=d, progress=False) for d in ("cpu", GPU)}
    if method == "auto":  # the same candidate chosen on both devices
        assert results["cpu"].config.method == results[GPU].config.method
    # where the GPU forms the Grams' products in float32 (engine.gram.gram_dtypes: float64 on data-centre GPUs, as on
    # the CPU) the solve amplifies their rounding: 1.4e-5 to 2.9e-5 on one H200 made to, 2.5e-7 in float64
    atol = 1e-5 if gram_dtypes(GPU)[0] == torch.float64 else 5e-5
    _close(results["cpu"].model.state_dict(), results[GPU].model.state_dict(), rtol=1e-3, atol=atol)
