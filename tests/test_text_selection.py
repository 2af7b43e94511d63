"""Label-free selection and the output gap on text families: a tiny ``LlamaForCausalLM`` (next-token KL) and a tiny
``BertModel`` (mean-pooled features), each with perturbed fine-tunes saved with ``save_pretrained``.

The criteria are recomputed by hand from each model's own forward on every sequence ALONE (no padding at all): the
next-token KL at every position, the mean of the last hidden states over the tokens, the routing of samples to
experts. Padded batches must give the same values as one sequence at a time.
"""

from __future__ import annotations

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, BertConfig, BertModel

import hf_mloss
from examples import tiny
from hf_mloss.loading.model_inputs import ModelInputs
from hf_mloss.merging.selection import spread_sample

VOCAB, PAD = 64, 3
LENGTHS = (5, 2, 7, 3, 6, 4, 8, 2, 5, 3)
ENCODER = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
           "num_attention_heads": 4, "max_position_embeddings": 64, "pad_token_id": PAD}


def sequences(lengths=LENGTHS, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(4, VOCAB, (n,), generator=generator).tolist() for n in lengths]


def padded(seqs: list[list[int]], side: str = "right") -> dict[str, torch.Tensor]:
    width = max(map(len, seqs))
    ids = torch.full((len(seqs), width), PAD)
    mask = torch.zeros_like(ids)
    for row, seq in enumerate(seqs):
        cols = slice(0, len(seq)) if side == "right" else slice(width - len(seq), width)
        ids[row, cols], mask[row, cols] = torch.tensor(seq), 1
    return {"input_ids": ids, "attention_mask": mask}


def as_text(seq: list[int]) -> str:
    return " ".join(f"w{i - 4}" for i in seq)  # the word tokenizer's ids: w0 is id 4


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    root = tmp_path_factory.mktemp("llama_sel")
    base, models = tiny.save_with_finetunes(tiny.tiny_decoder("llama", seed=0), root, q=3,
                                            tokenizer=tiny.word_tokenizer(VOCAB), scale=5e-2)
    return str(base), [str(m) for m in models]


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    root = tmp_path_factory.mktemp("bert_sel")
    torch.manual_seed(0)
    base, models = tiny.save_with_finetunes(BertModel(BertConfig(**ENCODER)).eval(), root, q=3,
                                            tokenizer=tiny.word_tokenizer(VOCAB), scale=5e-2)
    return str(base), [str(m) for m in models]


def select(paths, data, grid, method="task_arithmetic", batch_size=4, **select_options):
    base, models = paths
    return hf_mloss.merge(base, models, method, data=data, batch_size=batch_size, progress=False,
                          select={"num_samples": 64, **select_options}, grid=grid)


def direct(paths, method="task_arithmetic", **params):
    base, models = paths
    return hf_mloss.merge(base, models, method, progress=False, **params).model


# ------------------------------------------------------------------------------------------ brute force, alone
@torch.no_grad()
def log_probs(model, seq: list[int]) -> torch.Tensor:
    """``[T, vocab]`` next-token log-probabilities of one sequence run alone."""
    return torch.log_softmax(model(input_ids=torch.tensor([seq])).logits[0].double(), -1)


def kl(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    return (log_p.exp() * (log_p - log_q)).sum(-1)


@torch.no_grad()
def mean_pooled(model, seq: list[int]) -> torch.Tensor:
    return model(input_ids=torch.tensor([seq])).last_hidden_state[0].double().mean(0)


def route(moves: torch.Tensor) -> torch.Tensor:
    """``[q, samples]`` moves -> each sample's expert (the largest move relative to the expert's mean move)."""
    return (moves / moves.mean(1, keepdim=True)).argmax(0)


def brute_causal(merged, experts, base, seqs, share: str) -> float:
    """Σ KL(P_p ‖ P_m) over the real positions of every compared (sample, expert) / their number."""
    merged_lp = [log_probs(merged, s) for s in seqs]
    expert_lp = [[log_probs(e, s) for s in seqs] for e in experts]
    pairs = [(x, p) for x in range(len(seqs)) for p in range(len(experts))]
    if share == "auto":
        base_lp = [log_probs(base, s) for s in seqs]
        moves = torch.tensor([[float(kl(expert_lp[p][x], base_lp[x]).mean()) for x in range(len(seqs))]
                              for p in range(len(experts))])
        pairs = [(x, int(p)) for x, p in enumerate(route(moves))]
    total = sum(float(kl(expert_lp[p][x], merged_lp[x]).sum()) for x, p in pairs)
    return total / sum(len(seqs[x]) for x, _ in pairs)


def brute_pooled(merged, experts, base, seqs, share: str) -> float:
    """Mean over compared (sample, expert) of ‖f_m − f_p‖² / ‖f_p‖², f the mean of the last hidden states."""
    f_m = [mean_pooled(merged, s) for s in seqs]
    f_e = [[mean_pooled(e, s) for s in seqs] for e in experts]
    pairs = [(x, p) for x in range(len(seqs)) for p in range(len(experts))]
    if share == "auto":
        f_0 = [mean_pooled(base, s) for s in seqs]
        moves = torch.tensor([[float((f_e[p][x] - f_0[x]).norm()) for x in range(len(seqs))]
                              for p in range(len(experts))])
        pairs = [(x, int(p)) for x, p in enumerate(route(moves))]
    values = [float((f_m[x] - f_e[p][x]).square().sum() / f_e[p][x].square().sum()) for x, p in pairs]
    return sum(values) / len(values)


# ------------------------------------------------------------------------------------------------- (a) values
@pytest.mark.parametrize("share", ["all", "auto"])
def test_causal_lm_output_is_the_masked_next_token_kl(llama, share) -> None:
    seqs = sequences()
    result = select(llama, padded(seqs), {"lam": [0.3, 0.8]}, share=share, compare=["entropy", "disagreement"])
    base = AutoModelForCausalLM.from_pretrained(llama[0]).eval()
    experts = [AutoModelForCausalLM.from_pretrained(m).eval() for m in llama[1]]
    for candidate in result.config.select.candidates:
        merged = direct(llama, **candidate["setting"])
        assert candidate["output"] == pytest.approx(brute_causal(merged, experts, base, seqs, share), abs=1e-5)
        lp = [log_probs(merged, s) for s in seqs]
        entropy = sum(float(-(p.exp() * p).sum(-1).sum()) for p in lp) / sum(map(len, seqs))
        assert candidate["entropy"] == pytest.approx(entropy, abs=1e-5)
        if share == "all":  # every (position, expert): how often the top next token differs from the expert's
            top = [[log_probs(e, s).argmax(-1) for s in seqs] for e in experts]
            differs = sum(int((t[x] != lp[x].argmax(-1)).sum()) for t in top for x in range(len(seqs)))
            assert candidate["disagreement"] == pytest.approx(differs / (3 * sum(map(len, seqs))), abs=1e-9)
    if share == "all":  # every expert sees every position: the mean over experts of each one's mean KL
        merged = direct(llama, **result.config.select.candidates[0]["setting"])
        per_expert = [brute_causal(merged, [e], base, seqs, "all") for e in experts]
        assert result.config.select.candidates[0]["output"] == pytest.approx(sum(per_expert) / 3, abs=1e-5)


@pytest.mark.parametrize("share", ["all", "auto"])
def test_bert_output_is_the_mean_pooled_relative_distance(bert, share) -> None:
    seqs = sequences()
    result = select(bert, padded(seqs), {"lam": [0.3, 0.8]}, share=share)
    base = BertModel.from_pretrained(bert[0]).eval()
    experts = [BertModel.from_pretrained(m).eval() for m in bert[1]]
    for candidate in result.config.select.candidates:
        merged = direct(bert, **candidate["setting"])
        assert candidate["output"] == pytest.approx(brute_pooled(merged, experts, base, seqs, share), abs=1e-5)


def test_given_text_shares_compare_each_share_with_its_model(llama) -> None:
    seqs = sequences()
    shares = [[as_text(s) for s in seqs[0:3]], [as_text(s) for s in seqs[3:6]], [as_text(s) for s in seqs[6:9]]]
    result = select(llama, [as_text(s) for s in seqs], {"lam": [0.5]}, share="given", shares=shares,
                    num_samples=9)
    experts = [AutoModelForCausalLM.from_pretrained(m).eval() for m in llama[1]]
    merged = direct(llama, lam=0.5)
    total = sum(float(kl(log_probs(e, s), log_probs(merged, s)).sum())
                for p, e in enumerate(experts) for s in seqs[3 * p:3 * p + 3])
    expected = total / sum(map(len, seqs[:9]))
    assert result.config.select.candidates[0]["output"] == pytest.approx(expected, abs=1e-5)


# ------------------------------------------------------------------------------------------------ (b) padding
@pytest.mark.parametrize("family", ["llama", "bert"])
def test_padding_never_counts(llama, bert, family) -> None:
    """Right-padded batches (and, for the decoder, left-padded ones) give what one sequence at a time gives."""
    paths = {"llama": llama, "bert": bert}[family]
    seqs = sequences(seed=3)
    criteria = ["output", "mloss"] + (["entropy"] if family == "llama" else [])
    grid = {"lam": [0.4, 1.0]}
    alone = select(paths, padded(seqs), grid, batch_size=1, compare=criteria[1:])
    sides = ["right", "left"] if family == "llama" else ["right"]
    for side in sides:
        batched = select(paths, padded(seqs, side), grid, batch_size=5, compare=criteria[1:])
        for a, b in zip(alone.config.select.candidates, batched.config.select.candidates):
            for name in criteria:
                assert b[name] == pytest.approx(a[name], rel=1e-5, abs=1e-7), (side, name)
    # more padding columns than any batch needs change nothing either
    wide = padded(seqs)
    wide = {k: torch.nn.functional.pad(v, (0, 5), value=PAD if k == "input_ids" else 0) for k, v in wide.items()}
    extra = select(paths, wide, grid, batch_size=10, compare=criteria[1:])
    for a, b in zip(alone.config.select.candidates, extra.config.select.candidates):
        assert b["output"] == pytest.approx(a["output"], rel=1e-5, abs=1e-7)


# ---------------------------------------------------------------------------------------- (c) choice and saving
# which λ the tiny data pick is incidental here (the grid-edge warning: tests/test_auto.py, tests/test_surface.py)
@pytest.mark.filterwarnings("ignore:The label-free selection .*chose a grid edge:UserWarning")
@pytest.mark.parametrize("family", ["llama", "bert"])
def test_select_picks_the_lowest_records_it_and_saves_the_direct_merge(llama, bert, family, tmp_path) -> None:
    paths = {"llama": llama, "bert": bert}[family]
    texts = [as_text(s) for s in sequences(seed=5)]
    grid = {"k": [0.3, 0.8], "lam": [0.5, 1.0, 1.5]}
    base, models = paths
    result = hf_mloss.merge(base, models, "ties", data=texts, batch_size=3, progress=False, select="unlabeled",
                            grid=grid)
    record = result.config.select
    assert [c["setting"] for c in record.candidates] == record.settings()
    assert record.chosen == min(record.candidates, key=lambda c: c["output"])["setting"]
    assert len({c["output"] for c in record.candidates}) == 6  # the criterion tells the candidates apart
    folder = result.save_pretrained(tmp_path / "merged")
    saved = yaml.safe_load((folder / "hf_mloss_config.yaml").read_text())
    assert saved["select"]["chosen"] == record.chosen and len(saved["select"]["candidates"]) == 6
    card = (folder / "README.md").read_text()
    assert "Parameters chosen without labels" in card and "unlabeled texts" in card and "✓" in card
    reference = direct(paths, "ties", **record.chosen).state_dict()
    cls = AutoModelForCausalLM if family == "llama" else BertModel
    loaded = cls.from_pretrained(folder).state_dict()
    assert set(loaded) == set(reference)
    for key, value in reference.items():
        torch.testing.assert_close(loaded[key].float(), value.float(), rtol=0, atol=1e-6)


# ------------------------------------------------------------------------------------------ (d) sample spread
def test_text_samples_are_spread_over_the_whole_data(llama) -> None:
    """Data ordered task by task (here: by length, a different length per task) is sampled in every task."""
    tasks = [3, 5, 7, 9]
    seqs = [s for n in tasks for s in sequences([n] * 6, seed=n)]
    data = padded(seqs)
    picked = spread_sample(ModelInputs(data), 8, 0)
    lengths = picked["attention_mask"].sum(1).tolist()
    assert sorted(set(lengths)) == tasks and lengths == sorted(lengths)
    result = select(llama, data, {"lam": [0.5]}, num_samples=8, share="all")
    assert result.config.select.num_samples == 8
    base = AutoModelForCausalLM.from_pretrained(llama[0]).eval()
    experts = [AutoModelForCausalLM.from_pretrained(m).eval() for m in llama[1]]
    chosen = [seq[:n] for seq, n in zip(picked["input_ids"].tolist(), lengths)]
    expected = brute_causal(direct(llama, lam=0.5), experts, base, chosen, "all")
    assert result.config.select.candidates[0]["output"] == pytest.approx(expected, abs=1e-5)


# -------------------------------------------------------------------------------------------- (e) refusals
def test_refusals(llama, bert) -> None:
    data = padded(sequences())
    error = hf_mloss.InvalidParameterError
    with pytest.raises(error, match=r"'entropy' needs one classification head.*'bert' model's output is the mean"):
        select(bert, data, {"lam": [0.5]}, criterion="entropy")
    with pytest.raises(error, match=r"'disagreement' needs one classification head"):
        select(bert, data, {"lam": [0.5]}, criterion="disagreement")
    with pytest.raises(error, match="causal LM, whose LM head is its own head"):
        select(llama, data, {"lam": [0.5]}, heads=[torch.zeros(2, 32)] * 3)
    with pytest.raises(hf_mloss.DataError, match="texts for text families"):
        hf_mloss.merge(llama[0], llama[1], "ties", select="unlabeled", grid={"k": [0.5]}, progress=False)


# -------------------------------------------------------------------------------------- the compatibility gap
def test_output_gap_of_a_causal_lm_is_the_kl_of_the_mixture(llama) -> None:
    seqs = sequences(seed=7)
    base, models = llama
    report = hf_mloss.compatibility(base, models, data=padded(seqs), batch_size=4, output_gap=True,
                                    progress=False)
    experts = [AutoModelForCausalLM.from_pretrained(m).eval() for m in models]
    for subset, gap in zip(report.subsets, report.baselines["output_gap"]):
        merged = hf_mloss.merge(base, [models[p] for p in subset], "average", progress=False).model
        total = 0.0
        for s in seqs:
            mixture = torch.logsumexp(torch.stack([log_probs(experts[p], s) for p in subset]), 0) \
                - torch.log(torch.tensor(float(len(subset)), dtype=torch.float64))
            total += float(kl(mixture, log_probs(merged, s)).sum())
        assert gap == pytest.approx(total / sum(map(len, seqs)), abs=1e-5)


def test_output_gap_of_bert_is_the_pooled_gap(bert) -> None:
    seqs = sequences(seed=8)
    base, models = bert
    report = hf_mloss.compatibility(base, models, data=padded(seqs), batch_size=4, output_gap=True,
                                    progress=False)
    experts = [BertModel.from_pretrained(m).eval() for m in models]
    for subset, gap in zip(report.subsets, report.baselines["output_gap"]):
        merged = hf_mloss.merge(base, [models[p] for p in subset], "average", progress=False).model
        ensembles = [sum(mean_pooled(experts[p], s) for p in subset) / len(subset) for s in seqs]
        diff = sum(float((mean_pooled(merged, s) - e).norm()) for s, e in zip(seqs, ensembles))
        assert gap == pytest.approx(diff / sum(float(e.norm()) for e in ensembles), rel=1e-5)


# ---------------------------------------------------------------------------------------------- CLIP text tower
@pytest.fixture(scope="module")
def clip_text(tmp_path_factory):
    from transformers import CLIPTextConfig, CLIPTextModel

    config = CLIPTextConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                            vocab_size=520, max_position_embeddings=16, bos_token_id=512, eos_token_id=513,
                            pad_token_id=513)
    torch.manual_seed(0)
    base, models = tiny.save_with_finetunes(CLIPTextModel(config).eval(), tmp_path_factory.mktemp("clip_text"), q=2,
                                            scale=5e-2)
    return str(base), [str(m) for m in models]


def test_clip_text_output_is_the_pooled_end_token_and_padding_never_counts(clip_text) -> None:
    from transformers import CLIPTextModel

    eos = 513
    seqs = [[512, *s, eos] for s in sequences((3, 1, 6, 2, 4), seed=9)]  # <bos> words <eos>, padded with <eos>
    width = max(map(len, seqs))
    data = {"input_ids": torch.tensor([s + [eos] * (width - len(s)) for s in seqs]),
            "attention_mask": torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])}
    alone = select(clip_text, data, {"lam": [0.4, 0.9]}, batch_size=1, share="all")
    batched = select(clip_text, data, {"lam": [0.4, 0.9]}, batch_size=5, share="all")
    experts = [CLIPTextModel.from_pretrained(m).eval() for m in clip_text[1]]

    def pooled(model, seq):
        with torch.no_grad():
            return model(input_ids=torch.tensor([seq])).pooler_output[0].double()

    for a, b in zip(alone.config.select.candidates, batched.config.select.candidates):
        assert b["output"] == pytest.approx(a["output"], rel=1e-5)
        merged = direct(clip_text, **a["setting"])
        values = [float((pooled(merged, s) - pooled(e, s)).square().sum() / pooled(e, s).square().sum())
                  for e in experts for s in seqs]
        assert a["output"] == pytest.approx(sum(values) / len(values), abs=1e-5)


def test_a_bare_decoder_compares_its_last_real_token(tmp_path) -> None:
    """A LLaMA-family model without an LM head (``LlamaModel``) has no next-token distribution: its output is the
    final hidden state of the last real token, and entropy needs heads as for encoders."""
    from transformers import LlamaModel

    bare = LlamaModel(tiny.tiny_decoder("llama", seed=1).config).eval()
    base, models = tiny.save_with_finetunes(bare, tmp_path, q=2, scale=5e-2)
    paths = (str(base), [str(m) for m in models])
    seqs = sequences((4, 2, 6, 3), seed=11)
    result = select(paths, padded(seqs), {"lam": [0.5]}, share="all")
    experts = [LlamaModel.from_pretrained(m).eval() for m in paths[1]]
    merged = direct(paths, lam=0.5)

    def last(model, seq):
        with torch.no_grad():
            return model(input_ids=torch.tensor([seq])).last_hidden_state[0, -1].double()

    values = [float((last(merged, s) - last(e, s)).square().sum() / last(e, s).square().sum())
              for e in experts for s in seqs]
    assert result.config.select.candidates[0]["output"] == pytest.approx(sum(values) / len(values), abs=1e-5)
    with pytest.raises(hf_mloss.InvalidParameterError, match="final hidden state of the last real token"):
        select(paths, padded(seqs), {"lam": [0.5]}, criterion="entropy")
