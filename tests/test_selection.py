"""Label-free selection: candidates equal direct merges, every criterion against brute force, the record in the
saved config and card, re-runs, refusals, the CLI and Hub ids."""

from __future__ import annotations

import hashlib
import shutil

import pytest
import torch
import yaml
from safetensors.torch import save_file
from transformers import CLIPVisionModel

import hf_mloss
from hf_mloss import MergeConfig
from hf_mloss.cli import main
from hf_mloss.loading.data import load_pixel_values
from hf_mloss.merging.selection import candidate_groups, spread_sample
from hf_mloss.spec.selection import SelectionOptions, selection_options
from examples.tiny import make_base, make_finetune, save_model, tiny_processor

NUM = 8


@pytest.fixture(scope="module")
def pixels(image_folder):
    values, _ = load_pixel_values(str(image_folder), tiny_processor(), num_samples=NUM)
    return values


@pytest.fixture(scope="module")
def loaded(tiny_paths):
    base, models = tiny_paths
    return CLIPVisionModel.from_pretrained(base).eval(), [CLIPVisionModel.from_pretrained(m).eval() for m in models]


def max_diff(a, b) -> float:
    a, b = a.state_dict(), b.state_dict()
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a if a[k].is_floating_point())


def run(paths, method, pixels, grid, select="unlabeled", **kwargs):
    base, models = paths
    return hf_mloss.merge(base, models, method, data=pixels, batch_size=3, progress=False, select=select, grid=grid,
                          **kwargs)


# which λ the tiny data pick is incidental here (the grid-edge warning: tests/test_auto.py, tests/test_surface.py)
@pytest.mark.filterwarnings("ignore:The label-free selection .*chose a grid edge:UserWarning")
@pytest.mark.parametrize(("method", "grid", "fixed"), [
    ("task_arithmetic", {"lam": [0.2, 0.5, 1.0]}, {}),
    ("ties", {"k": [0.2, 0.6], "lam": [0.5, 1.0]}, {"scope": "tensor"}),
    ("ties", {"k": [0.3, 0.7], "lam": [0.7, 1.3]}, {}),
    ("m_ties", {"k": [0.3, 0.6], "lam": [0.5, 1.0]}, {"e": 0.1, "prefix": "base"}),
    ("dare_ties", {"p": [0.5, 0.9]}, {}),
])
def test_chosen_candidate_equals_a_direct_merge(tiny_paths, pixels, method, grid, fixed) -> None:
    """λ rescaling of one merge per setting (and replayed M-Loss ranks, which with prefix='base' do not depend on the
    setting) give exactly the direct merge; the candidates are the grid in order."""
    result = run(tiny_paths, method, pixels, grid, **fixed)
    select = result.config.select
    assert [c["setting"] for c in select.candidates] == SelectionOptions(grid=grid).settings()
    assert select.criterion == "output"  # the default
    assert select.chosen == min(select.candidates, key=lambda c: c["output"])["setting"]
    assert result.config.parameters == {**fixed, **select.chosen}
    base, models = tiny_paths
    direct = hf_mloss.merge(base, models, method, data=pixels, batch_size=3, progress=False, **fixed,
                            **select.chosen)
    assert max_diff(result.model, direct.model) < 1e-6


def test_m_ties_reference_candidate_is_the_live_merge(tiny_paths, pixels) -> None:
    """With the merged prefix, candidates reuse the reference's ranks; the reference itself is the live M-TIES."""
    result = run(tiny_paths, "m_ties", pixels, {"k": [0.4], "lam": [0.8]}, e=0.1)
    assert result.config.select.reference == {"k": 0.4, "lam": 0.8}
    base, models = tiny_paths
    direct = hf_mloss.merge(base, models, "m_ties", data=pixels, batch_size=3, progress=False, k=0.4, lam=0.8, e=0.1)
    assert max_diff(result.model, direct.model) < 1e-5
    assert result.report is not None and result.report.prefix == "merged"


def fc1_io(model, pixels, layer):
    captured = {}
    hook = model.encoder.layers[layer].mlp.fc1.register_forward_hook(
        lambda m, i, o: captured.update(u=i[0].detach(), h=o.detach()))
    with torch.no_grad():
        model(pixel_values=pixels)
    hook.remove()
    return captured["u"], captured["h"]


@torch.no_grad()
def brute_mloss(merged, experts, pixels) -> float:
    act = experts[0].encoder.layers[0].mlp.activation_fn
    total = 0.0
    for layer in range(len(merged.encoder.layers)):
        u, h = fc1_io(merged, pixels, layer)
        ensemble = sum(act(e.encoder.layers[layer].mlp.fc1(u)) for e in experts) / len(experts)
        gap = (act(h) - ensemble).reshape(-1, h.shape[-1]).double()
        total += float(gap.norm(dim=1).mean())
    return total / len(merged.encoder.layers)


def pooled(model, x):
    with torch.no_grad():
        return model(pixel_values=x).pooler_output


def test_mloss_and_output_criteria_match_brute_force(tiny_paths, loaded, pixels) -> None:
    base_model, experts = loaded
    result = run(tiny_paths, "task_arithmetic", pixels, {"lam": [0.25, 1.0 / 3]},
                 select={"num_samples": 6, "criterion": "mloss", "compare": ["output"]})
    images = spread_sample(pixels, 6, 0)  # the seeded spread sample of the merge (seed 0)
    base, models = tiny_paths
    feats = [pooled(e, images) for e in experts]
    move = torch.stack([(f - pooled(base_model, images)).norm(dim=-1) for f in feats])
    owner = (move / move.mean(1, keepdim=True)).argmax(0)
    for candidate in result.config.select.candidates:
        merged = hf_mloss.merge(base, models, "task_arithmetic", progress=False, **candidate["setting"]).model
        assert candidate["mloss"] == pytest.approx(brute_mloss(merged, experts, images), rel=1e-4)
        distance = torch.stack([(pooled(merged, images) - f).square().sum(-1) / f.square().sum(-1) for f in feats])
        assert candidate["output"] == pytest.approx(float(distance.gather(0, owner[None]).mean()), rel=1e-4)
    # λ = 1/q with α = 1 is the plain average: the criterion is then the layer M-Loss on the merged prefix
    average = result.config.select.candidates[1]
    direct = hf_mloss.merge(base, models, "average", progress=False).model
    assert average["mloss"] == pytest.approx(brute_mloss(direct, experts, images), rel=1e-4)


def test_a_method_fitted_on_the_data_is_compared_on_samples_held_out_of_its_fit(tiny_paths, loaded, pixels,
                                                                               image_folder, tmp_path) -> None:
    """RegMean fits each λ's merge on the data: by default half the samples are held out, each candidate is RegMean
    fitted on the other half and compared on them (by hand below), and the chosen λ is then merged on all of them;
    the recipe records it and re-runs bit for bit. held_out=False fits and compares on the same samples."""
    from hf_mloss.loading.model_inputs import spread_index

    base_model, experts = loaded
    grid = {"lam": [0.5, 1.0, 1.5]}
    base, models = tiny_paths
    result = hf_mloss.merge(base, models, "regmean", data=str(image_folder), num_samples=NUM, batch_size=3,
                            progress=False, select={"share": "all"}, grid=grid)  # a folder: the recipe re-runs
    select = result.config.select
    assert select.held_out and select.fitted == NUM // 2 and select.num_samples == NUM // 2
    compared = spread_index(NUM, NUM // 2, result.config.seed)
    rest = torch.ones(NUM, dtype=torch.bool)
    rest[compared] = False
    images = pixels[compared]
    feats = [pooled(e, images) for e in experts]
    for candidate in select.candidates:
        fitted = hf_mloss.merge(base, models, "regmean", data=pixels[rest], batch_size=3, progress=False,
                                **candidate["setting"]).model
        distance = torch.stack([(pooled(fitted, images) - f).square().sum(-1) / f.square().sum(-1) for f in feats])
        assert candidate["output"] == pytest.approx(float(distance.mean()), rel=1e-4)
    on_all = hf_mloss.merge(base, models, "regmean", data=pixels, batch_size=3, progress=False, **select.chosen)
    assert max_diff(result.model, on_all.model) < 1e-6
    folder = result.save_pretrained(tmp_path / "merged")
    assert f"fitted on {NUM // 2} other images" in (folder / "README.md").read_text()
    assert yaml.safe_load((folder / "hf_mloss_config.yaml").read_text())["select"]["fitted"] == NUM // 2
    again = hf_mloss.run(MergeConfig.from_pretrained(folder), progress=False)
    assert max_diff(again.model, result.model) == 0 and again.config.select.fitted == NUM // 2
    recorded = yaml.safe_load((folder / "hf_mloss_config.yaml").read_text())
    del recorded["select"]["held_out"]  # a recipe from before held_out compared in sample, and re-runs so
    assert MergeConfig.from_dict(recorded, base_dir=folder).select.held_out is False
    in_sample = run(tiny_paths, "regmean", pixels, grid, select={"share": "all", "held_out": False})
    assert in_sample.config.select.fitted is None and in_sample.config.select.num_samples == NUM
    assert [c["output"] for c in in_sample.config.select.candidates] != [c["output"] for c in select.candidates]


def test_a_data_free_method_holds_nothing_out(tiny_paths, pixels) -> None:
    result = run(tiny_paths, "task_arithmetic", pixels, {"lam": [0.5, 1.0]})
    assert result.config.select.fitted is None and result.config.select.num_samples == NUM


def test_heads_given_shares_kl_and_entropy(tiny_paths, loaded, pixels, tmp_path) -> None:
    _, experts = loaded
    generator = torch.Generator().manual_seed(0)
    heads = [torch.randn(3, 32, generator=generator) for _ in experts]
    shares = [pixels[0:3], pixels[3:6], pixels[6:8]]
    result = run(tiny_paths, "task_arithmetic", pixels, {"lam": [0.3, 0.6]}, criterion="entropy", heads=heads,
                 select={"num_samples": 6, "share": "given", "shares": shares,
                         "compare": ["output", "mloss", "disagreement"]})
    base, models = tiny_paths
    for candidate in result.config.select.candidates:
        merged = hf_mloss.merge(base, models, "task_arithmetic", progress=False, **candidate["setting"]).model
        kl, entropy, differs = [], [], []
        for head, expert, share in zip(heads, experts, shares):
            x = share[:2]
            log_m = torch.log_softmax(pooled(merged, x) @ head.T, -1)
            log_e = torch.log_softmax(pooled(expert, x) @ head.T, -1)
            kl.append((log_e.exp() * (log_e - log_m)).sum(-1))
            entropy.append(-(log_m.exp() * log_m).sum(-1))
            differs.append((log_m.argmax(-1) != log_e.argmax(-1)).float())
        assert candidate["output"] == pytest.approx(float(torch.cat(kl).mean()), rel=1e-4, abs=1e-7)
        assert candidate["entropy"] == pytest.approx(float(torch.cat(entropy).mean()), rel=1e-4)
        assert candidate["disagreement"] == pytest.approx(float(torch.cat(differs).mean()), abs=1e-12)
    assert result.config.select.chosen == min(result.config.select.candidates, key=lambda c: c["entropy"])["setting"]
    assert "in_memory" in yaml.safe_dump(result.config.to_dict())


@pytest.fixture(scope="module")
def frozen_lower(tmp_path_factory):
    """Fine-tunes whose embeddings and block 0 equal the base's (as with frozen lower blocks)."""
    root = tmp_path_factory.mktemp("frozen")
    base = make_base(5)
    folders = [str(save_model(base, root / "base"))]
    for i in range(3):
        model = make_finetune(base, 50 + i)
        state = model.state_dict()
        for key, value in base.state_dict().items():
            if key.startswith(("embeddings.", "pre_layrnorm.", "encoder.layers.0.")):
                state[key] = value
        model.load_state_dict(state)
        folders.append(str(save_model(model, root / f"ft{i}")))
    return folders[0], folders[1:]


def test_blocks_equal_to_the_base_are_shared_and_score_zero(frozen_lower, pixels) -> None:
    base, models = frozen_lower
    result = run(frozen_lower, "task_arithmetic", pixels, {"lam": [0.3, 0.7]},
                 select={"num_samples": 5, "criterion": "mloss"})
    experts = [CLIPVisionModel.from_pretrained(m).eval() for m in models]
    for candidate in result.config.select.candidates:
        merged = hf_mloss.merge(base, models, "task_arithmetic", progress=False, **candidate["setting"]).model
        assert candidate["mloss"] == pytest.approx(brute_mloss(merged, experts, spread_sample(pixels, 5, 0)), rel=1e-4)


def test_saved_record_card_and_rerun(tiny_paths, pixels, image_folder, tmp_path) -> None:
    base, models = tiny_paths
    result = hf_mloss.merge(base, models, "ties", data=str(image_folder), num_samples=NUM, batch_size=4,
                            progress=False, select="unlabeled", grid={"k": [0.3, 0.6], "lam": [0.5, 1.0]})
    folder = result.save_pretrained(tmp_path / "merged")
    saved = yaml.safe_load((folder / "hf_mloss_config.yaml").read_text())
    assert saved["select"]["criterion"] == "output" and saved["select"]["grid"] == {"k": [0.3, 0.6], "lam": [0.5, 1.0]}
    assert saved["select"]["chosen"] == result.config.select.chosen and len(saved["select"]["candidates"]) == 4
    card = (folder / "README.md").read_text()
    assert "Parameters chosen without labels" in card and "✓" in card and "`output`" in card
    again = hf_mloss.run(MergeConfig.from_pretrained(folder), progress=False)
    assert max_diff(again.model, result.model) == 0 and again.config.select.chosen == result.config.select.chosen


def test_yaml_select_section_with_head_files(tiny_paths, image_folder, tmp_path) -> None:
    base, models = tiny_paths
    (tmp_path / "heads").mkdir()
    for i in range(3):
        save_file({"weight": torch.randn(4, 32), "bias": torch.zeros(4)}, str(tmp_path / "heads" / f"h{i}.safetensors"))
    config = tmp_path / "select.yaml"
    config.write_text(yaml.safe_dump({
        "base": base, "models": models, "method": "task_arithmetic", "data": {"path": str(image_folder),
                                                                             "num_samples": NUM},
        "select": {"criterion": "entropy", "grid": {"lam": [0.3, 0.5]}, "num_samples": 4,
                   "heads": [f"heads/h{i}.safetensors" for i in range(3)]}}))
    loaded = MergeConfig.from_yaml(config)
    assert loaded.select.heads[0] == str(tmp_path / "heads" / "h0.safetensors")
    assert loaded.to_dict(root=tmp_path)["select"]["heads"][0] == "heads/h0.safetensors"
    result = hf_mloss.run(loaded, progress=False)
    assert result.config.select.chosen in [{"lam": 0.3}, {"lam": 0.5}]
    assert {"entropy"} <= set(result.config.select.candidates[0])


def test_refusals(tiny_paths, pixels) -> None:
    base, models = tiny_paths
    error = hf_mloss.InvalidParameterError
    with pytest.raises(error, match="candidate {'k': 1.5} is invalid"):
        run(tiny_paths, "ties", pixels, {"k": [0.5, 1.5]})
    with pytest.raises(error, match="needs one classification head"):
        run(tiny_paths, "ties", pixels, {"k": [0.5]}, criterion="entropy")
    with pytest.raises(error, match="got 2 for 3 models"):
        run(tiny_paths, "ties", pixels, {"k": [0.5]}, heads=[torch.zeros(2, 32)] * 2, criterion="output")
    with pytest.raises(error, match="pass select='unlabeled'"):
        hf_mloss.merge(base, models, "ties", grid={"k": [0.5]}, progress=False)
    with pytest.raises(error, match="only selection mode"):
        selection_options("labels", grid={"k": [0.5]})
    with pytest.raises(error, match="non-empty list"):
        SelectionOptions(grid={"k": []})
    with pytest.raises(error, match="share='given' needs"):
        SelectionOptions(grid={"k": [0.5]}, share="given")
    with pytest.raises(hf_mloss.DataError, match="no data was given"):
        hf_mloss.merge(base, models, "ties", select="unlabeled", grid={"k": [0.5]}, progress=False)
    with pytest.raises(error, match="reference setting"):
        run(tiny_paths, "m_ties", pixels, {"lam": [0.0]})


def test_groups_rescale_lambda_and_keep_other_settings() -> None:
    options = SelectionOptions(grid={"k": [0.2, 0.5], "lam": [0.5, 1.0, 1.5]})
    assert candidate_groups(options, {"k": 0.2, "lam": 1.0}) == [({"k": 0.2}, [0.5, 1.0, 1.5]),
                                                                  ({"k": 0.5}, [0.5, 1.0, 1.5])]
    assert candidate_groups(SelectionOptions(grid={"p": [0.5, 0.9]}), {"p": 0.7}) == [({"p": 0.5}, [1.0]),
                                                                                       ({"p": 0.9}, [1.0])]
    assert options.reference_setting() == {"k": 0.2, "lam": 1.0}


# ------------------------------------------------------------------------------------------------------- CLI
def test_cli_merge_and_score_select(tiny_paths, image_folder, tmp_path, capsys) -> None:
    base, models = tiny_paths
    config = tmp_path / "ties.yaml"
    config.write_text(yaml.safe_dump({"base": base, "models": models, "method": "ties",
                                      "data": {"path": str(image_folder), "num_samples": NUM}, "batch_size": 4}))
    assert main(["merge", str(config), str(tmp_path / "out"), "--select", "unlabeled", "--grid", "k=0.3,0.6",
                 "--grid", "lam=0.5,1", "--select-samples", "6", "-q"]) == 0
    printed = capsys.readouterr().out
    assert "Label-free selection (output" in printed and " * " in printed  # the default criterion
    saved = yaml.safe_load((tmp_path / "out" / "hf_mloss_config.yaml").read_text())
    assert saved["select"]["grid"] == {"k": [0.3, 0.6], "lam": [0.5, 1]} and saved["select"]["num_samples"] == 6
    assert main(["score", str(config), "--select", "unlabeled", "--grid", "lam=0.5,1", "--criterion", "mloss",
                 "-q"]) == 0
    assert "Label-free selection (mloss" in capsys.readouterr().out
    assert main(["score", str(config), "--grid", "lam=1"]) == 2
    assert "add --select unlabeled" in capsys.readouterr().err
    assert main(["merge", str(config), str(tmp_path / "o2"), "--select", "unlabeled"]) == 2
    assert "needs candidates" in capsys.readouterr().err
    fitted = tmp_path / "regmean.yaml"
    fitted.write_text(config.read_text().replace("method: ties", "method: regmean"))
    for flags, held_out in [([], True), (["--select-in-sample"], False)]:
        out = tmp_path / f"regmean{len(flags)}"
        assert main(["merge", str(fitted), str(out), "--select", "unlabeled", "--grid", "lam=0.5,1", *flags,
                     "-q"]) == 0
        saved = yaml.safe_load((out / "hf_mloss_config.yaml").read_text())["select"]
        assert saved["held_out"] is held_out and ("fitted" in saved) is held_out
    assert main(["score", str(config), "--select-in-sample"]) == 2
    assert "--select-in-sample configure" in capsys.readouterr().err


def test_hub_ids(tiny_paths, pixels, tmp_path, monkeypatch) -> None:
    from huggingface_hub import constants

    base, models = tiny_paths
    repos = ["org/base", "org/ft0", "org/ft1"]
    for repo, src in zip(repos, [base, *models[:2]]):
        storage = tmp_path / f"models--{repo.replace('/', '--')}"
        sha = hashlib.sha1(repo.encode()).hexdigest()
        (storage / "refs").mkdir(parents=True)
        (storage / "refs" / "main").write_text(sha)
        shutil.copytree(src, storage / "snapshots" / sha)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    hub = hf_mloss.merge(repos[0], repos[1:], "ties", data=pixels, batch_size=3, progress=False, select="unlabeled",
                         grid={"k": [0.3, 0.6]})
    local = hf_mloss.merge(base, models[:2], "ties", data=pixels, batch_size=3, progress=False, select="unlabeled",
                           grid={"k": [0.3, 0.6]})
    assert hub.config.select.candidates == local.config.select.candidates
    assert hub.config.models[0].revision == hashlib.sha1(b"org/ft0").hexdigest()
