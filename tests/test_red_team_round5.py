"""Red team, round 5 (issue 57): the newest surfaces refuse cleanly, learned recipes re-run, mergekit's edge values.

Each hostile input is run the way a user meets it (a YAML file through ``hf-mloss``, or a Python call) on tiny saved
decoders (2 layers, width 32) or the tiny CLIP towers of the suite; a refusal is one line on stderr, exit status 2,
and nothing written. Parity with ``mergekit-yaml`` for the mergekit rows is in ``test_peers.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from hf_mloss.cli import main


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> tuple[str, list[str]]:
    """A tiny Llama base (64 positions, 64 words) and two fine-tunes, each with its tokenizer."""
    from examples.tiny import save_with_finetunes, tiny_decoder, word_tokenizer

    base, models = save_with_finetunes(tiny_decoder("llama"), tmp_path_factory.mktemp("llama"), 2,
                                       tokenizer=word_tokenizer())
    return str(base), [str(m) for m in models]


def _write(tmp: Path, config: dict, name: str = "recipe.yaml") -> Path:
    path = tmp / name
    path.write_text(yaml.safe_dump(config))
    return path


def _refused(capsys, argv: list[str], *words: str) -> str:
    """Run the CLI: exit 2, one line on stderr naming ``words``, no traceback."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("hf-mloss: error:") and len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err
    for word in words:
        assert word in err, (word, err)
    return err


# ============================================================================================ environment
def test_hf_mloss_threads_of_thousands_of_digits_exits_2_and_writes_nothing(llama, tmp_path, monkeypatch, capsys):
    base, models = llama
    recipe = _write(tmp_path, {"base": base, "models": models, "method": "task_arithmetic"})
    monkeypatch.setenv("HF_MLOSS_THREADS", "1" * 5000)
    _refused(capsys, ["merge", str(recipe), str(tmp_path / "out"), "-q"], "HF_MLOSS_THREADS", "5000 characters")
    assert not (tmp_path / "out").exists()


# ============================================================================================ vocabulary
def test_a_huge_pad_to_multiple_of_is_refused_before_any_allocation(llama, tmp_path, capsys):
    base, models = llama
    recipe = _write(tmp_path, {"merge_method": "task_arithmetic", "base_model": base, "dtype": "float32",
                               "tokenizer": {"source": "union", "pad_to_multiple_of": 1_000_000_000},
                               "models": [{"model": m, "parameters": {"weight": 1.0}} for m in models]})
    _refused(capsys, ["merge", str(recipe), str(tmp_path / "out"), "-q"], "pad_to_multiple_of=1000000000",
             "64 tokens", "at most 128")
    assert not (tmp_path / "out").exists()


def test_pad_to_multiple_of_up_to_doubling_the_rows_is_accepted(llama):
    import hf_mloss

    base, models = llama
    result = hf_mloss.merge(base, models, "task_arithmetic", lam=1.0, progress=False,
                            tokenizer_source={"source": "union", "pad_to_multiple_of": 128})
    assert result.model.get_input_embeddings().weight.shape[0] == 128  # 64 tokens, padded to twice as many


# ============================================================================================ data
@pytest.mark.parametrize(("value", "words"), [
    (0, ("data.max_length", "[1, 1000000]", "got 0")),
    (-5, ("data.max_length", "got -5")),
    (2.5, ("data.max_length", "integer", "2.5")),
    (1_000_000, ("data.max_length=1000000", "64 positions", "max_length <= 64")),
])
def test_max_length_out_of_range_exits_2(llama, tmp_path, capsys, value, words):
    base, models = llama
    texts = tmp_path / "prompts.txt"
    texts.write_text("\n".join(" ".join(f"w{(i * 7 + j) % 60}" for j in range(6)) for i in range(8)))
    recipe = _write(tmp_path, {"base": base, "models": models, "method": "ties",
                               "data": {"path": str(texts), "num_samples": 8, "max_length": value}})
    _refused(capsys, ["score", str(recipe), "-q", "--json", str(tmp_path / "report.json")], *words)
    assert not (tmp_path / "report.json").exists()


# ============================================================================================ learned merges: heads
def _learned(tiny_paths, data, **kwargs):
    import hf_mloss

    base, models = tiny_paths
    options = {"data": data, "progress": False, "steps": 1, "batch_size": 4, "max_samples": 8,
               "objective": "entropy", **kwargs}
    return hf_mloss.merge(base, models, options.pop("method", "adamerging"), **options)


@pytest.fixture(scope="module")
def pixels():
    import torch

    return torch.randn(8, 3, 32, 32, generator=torch.Generator().manual_seed(5))


@pytest.mark.parametrize("method", ["adamerging", "adarank_tsv"])
def test_python_heads_of_the_wrong_width_are_refused_before_training(tiny_paths, pixels, records, method):
    import torch

    from hf_mloss import InvalidParameterError

    heads = [torch.nn.Linear(16, 5) for _ in range(3)]  # the tiny towers pool 32 features
    with pytest.raises(InvalidParameterError, match=r"heads\[0\] \(Linear\) reads 16 features, but the tower's "
                                                    r"pooled output has 32"):
        _learned(tiny_paths, pixels, heads=heads, method=method)
    assert records == []  # no training started

    def narrow(features):  # a callable that declares no width: asked to read the tower's width
        return features @ torch.ones(16, 5)

    with pytest.raises(InvalidParameterError, match=r"heads\[0\] \(function\) cannot read the tower's 32 pooled"):
        _learned(tiny_paths, pixels, heads=[narrow] * 3, method=method)
    with pytest.raises(InvalidParameterError, match=r"heads\[1\] \(Linear\) gives NaN or Inf logits"):
        bad = [torch.nn.Linear(32, 5) for _ in range(3)]
        with torch.no_grad():
            bad[1].weight[0, 0] = float("nan")
        _learned(tiny_paths, pixels, heads=bad, method=method)


def _head_file(folder: Path, name: str, **tensors) -> str:
    from safetensors.torch import save_file

    path = folder / f"{name}.safetensors"
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
    return str(path)


def _head_cases(folder: Path) -> dict[str, tuple[list[str], tuple[str, ...]]]:
    import torch

    good = _head_file(folder, "good", weight=torch.randn(5, 32), bias=torch.zeros(5))
    nan = torch.randn(5, 32)
    nan[2, 3] = float("nan")
    return {
        "narrow": ([_head_file(folder, "narrow", weight=torch.randn(5, 16))] + [good] * 2,
                   ("heads[0]", "narrow.safetensors", "reads 16 features", "has 32")),
        "one_d": ([good, _head_file(folder, "flat", weight=torch.randn(32))] + [good],
                  ("heads[1]", "flat.safetensors", "[classes, features]", "shape [32]")),
        "bias_7": ([good] * 2 + [_head_file(folder, "bias7", weight=torch.randn(5, 32), bias=torch.zeros(7))],
                   ("heads[2]", "bias7.safetensors", "one float per class (5", "shape [7]")),
        "no_weight": ([_head_file(folder, "noweight", w=torch.randn(5, 32))] + [good] * 2,
                      ("heads[0]", "noweight.safetensors", "needs `weight`")),
        "nan": ([good, _head_file(folder, "nan", weight=nan)] + [good],
                ("heads[1]", "nan.safetensors", "NaN or Inf")),
    }


@pytest.mark.parametrize("case", ["narrow", "one_d", "bias_7", "no_weight", "nan"])
def test_a_recipes_bad_head_files_exit_2_naming_the_file(tiny_paths, image_folder, tmp_path, capsys, case):
    base, models = tiny_paths
    files, words = _head_cases(tmp_path)[case]
    recipe = _write(tmp_path, {"base": base, "models": models, "method": "adamerging", "batch_size": 4,
                               "data": {"path": str(image_folder), "num_samples": 8},
                               "parameters": {"objective": "entropy", "steps": 1, "max_samples": 8, "heads": files}})
    err = _refused(capsys, ["merge", str(recipe), str(tmp_path / "out"), "-q"], *words)
    assert "select.heads" not in err
    assert not (tmp_path / "out").exists()


# ============================================================================================ learned merges: re-runs
@pytest.mark.parametrize(("method", "options"), [("adamerging", {"steps": 2}),
                                                 ("adarank_tsv", {"steps": 12, "lr": 0.05})])
def test_a_learned_recipe_trained_on_python_data_reruns_without_data(tiny_paths, pixels, records, tmp_path, capsys,
                                                                      method, options):
    """The recorded coefficients / masks are all a re-run needs: data passed from Python (recorded as in_memory) or
    deleted from the recipe is not asked for, nothing trains, and the weights are the same bits."""
    import torch

    import hf_mloss
    from hf_mloss import DataError, MergeConfig

    first = _learned(tiny_paths, pixels, method=method, objective="output_gap", **options)
    recorded = first.config.parameters["coefficients" if method == "adamerging" else "masks"]
    assert recorded and len(records) == 1
    folder = first.save_pretrained(tmp_path / "merged")
    assert "cannot re-run" not in (folder / "README.md").read_text()
    saved = yaml.safe_load((folder / "hf_mloss_config.yaml").read_text())
    assert "in_memory" in saved["data"]  # the recipe still says what the values were learned on

    config = MergeConfig.from_pretrained(folder)
    assert config.data is None and config.replays_recorded()
    deleted = MergeConfig.from_dict({k: v for k, v in saved.items() if k != "data"}, base_dir=folder)
    for again in (hf_mloss.run(config, progress=False), hf_mloss.run(deleted, progress=False)):
        for key, value in first.model.state_dict().items():
            assert torch.equal(value, again.model.state_dict()[key]), key
    assert len(records) == 1  # no training
    assert main(["merge", str(folder / "hf_mloss_config.yaml"), str(tmp_path / "again"), "-q"]) == 0
    assert len(records) == 1
    with pytest.raises(DataError, match="no data was given"):  # training again needs the data
        config.replace(parameters={**config.parameters, "relearn": True})


# ============================================================================================ mergekit's edge values
@pytest.fixture(scope="module")
def deep_llama(tmp_path_factory) -> tuple[str, list[str]]:
    """A tiny Llama with 4 blocks, so that a 3-point gradient reaches between its points (x = 1/3, 2/3)."""
    from examples.tiny import save_with_finetunes, tiny_decoder, word_tokenizer

    base, models = save_with_finetunes(tiny_decoder("llama", num_hidden_layers=4), tmp_path_factory.mktemp("deep"),
                                       1, tokenizer=word_tokenizer())
    return str(base), [str(m) for m in models]


def test_nearswap_t_as_a_gradient_or_filter_list_is_resolved_per_tensor(llama, tmp_path, capsys):
    import hf_mloss
    from hf_mloss import InvalidParameterError

    base, models = llama
    for t in ([0.0001, 0.05], [{"filter": "mlp", "value": 0.05}, {"value": 0.0001}]):
        result = hf_mloss.merge(base, models[:1], "nearswap", t=t, progress=False)
        resolved = {v["t"] for v in result.config.resolved_parameters.values()}
        assert resolved == {0.0001, 0.05}
    with pytest.raises(InvalidParameterError, match="nearswap needs t, the distance"):
        hf_mloss.merge(base, models[:1], "nearswap", progress=False)
    with pytest.raises(InvalidParameterError, match=r"nearswap needs t for '.*'.*end it with a \{value: ...\}"):
        hf_mloss.merge(base, models[:1], "nearswap", t=[{"filter": "mlp", "value": 0.05}], progress=False)
    recipe = _write(tmp_path, {"merge_method": "nearswap", "base_model": base, "dtype": "float32",
                               "parameters": {"t": [{"filter": "mlp", "value": 0.05}]},
                               "models": [{"model": base}, {"model": models[0]}]})
    _refused(capsys, ["merge", str(recipe), str(tmp_path / "out"), "-q"], "nearswap", "needs t for every tensor")
    assert not (tmp_path / "out").exists()


def test_negative_weights_negate_tasks_in_task_arithmetic_in_every_spelling(llama, tmp_path, capsys):
    import torch

    import hf_mloss
    from hf_mloss import InvalidParameterError

    base, models = llama
    negated = hf_mloss.merge(base, models, "task_arithmetic", weights=[-1, 1], lam=1.0, progress=False)
    listed = hf_mloss.MergeConfig.from_dict({"base": base, "method": "task_arithmetic", "parameters": {"lam": 1.0},
                                             "models": [{"model": models[0], "parameters": {"weight": [-1.0]}},
                                                        {"model": models[1], "parameters": {"weight": [1.0]}}]})
    theta = [hf_mloss.merge(base, [m], "task_arithmetic", weights=[1], lam=1.0, progress=False).model.state_dict()
             for m in models]
    zero = hf_mloss.merge(base, models[:1], "task_arithmetic", lam=0.0, progress=False).model.state_dict()
    for key, value in hf_mloss.run(listed, progress=False).model.state_dict().items():
        assert torch.equal(value, negated.model.state_dict()[key]), key
        expected = zero[key] - (theta[0][key] - zero[key]) + (theta[1][key] - zero[key])
        assert torch.allclose(value, expected, atol=1e-6), key
    recipe = _write(tmp_path, {"merge_method": "task_arithmetic", "base_model": base, "dtype": "float32",
                               "models": [{"model": models[0], "parameters": {"weight": -1.0}}]})
    assert main(["merge", str(recipe), str(tmp_path / "negated"), "-q"]) == 0
    capsys.readouterr()
    for weights in ([1.0, -0.5], [{"weight": [-1.0]}, {"weight": [1.0]}]):  # ties: neither spelling
        with pytest.raises(hf_mloss.HfMLossError, match=r"models\[\d\]\.weight is -.*task_arithmetic.*'ties' needs"):
            if isinstance(weights[0], dict):
                hf_mloss.MergeConfig.from_dict({"base": base, "method": "ties", "parameters": {"scope": "tensor",
                                                                                                "convention": "mergekit"},
                                                "models": [{"model": m, "parameters": w}
                                                           for m, w in zip(models, weights)]})
            else:
                hf_mloss.merge(base, models, "ties", weights=weights, progress=False)
    with pytest.raises(InvalidParameterError, match="must not all be 0"):
        hf_mloss.merge(base, models, "task_arithmetic", weights=[0, 0], progress=False)


@pytest.mark.parametrize("bounds", [[1, 5], [2, 0], [-1, 2], [0, 1.5]])
def test_passthrough_layer_ranges_beyond_the_model_exit_2_naming_its_layers(llama, tmp_path, capsys, bounds):
    base, models = llama
    recipe = _write(tmp_path, {"merge_method": "passthrough", "dtype": "float32",
                               "slices": [{"sources": [{"model": models[0], "layer_range": bounds}]}]})
    err = _refused(capsys, ["merge", str(recipe), str(tmp_path / "out"), "-q"], "layer_range", "has 2 layers")
    assert "free space" not in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("t", "seen"), [(1.5, "t=1.5"), (-1, "t=-1"), ([0, 2.5, 1], "t=1.66")])
def test_slerp_t_outside_0_1_extrapolates_with_a_warning_naming_t(deep_llama, t, seen):
    import hf_mloss

    base, models = deep_llama
    with pytest.warns(UserWarning, match=rf"slerp {seen}.* lies outside \[0, 1\]: the merge extrapolates"):
        hf_mloss.merge(base, models, "slerp", t=t, progress=False)
