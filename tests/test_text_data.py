"""Text scoring data: every source (strings, files, folders, saved / Hub datasets) tokenised with the base's
tokenizer, right-padded with the attention mask carried; ``ModelInputs``; wrong-modality errors; the config fields."""

from __future__ import annotations

import io
import sys
import uuid
import warnings
from pathlib import Path

import pytest
import torch
from PIL import Image
from transformers import AutoTokenizer

from hf_mloss.spec.config import DataSpec, MergeConfig
from hf_mloss.loading.data import DEFAULT_MAX_LENGTH, load_model_inputs, load_pixel_values, load_token_ids
from hf_mloss.errors import ConfigError, DataError, InvalidParameterError
from hf_mloss.loading.model_inputs import ModelInputs
from examples.tiny import save_with_finetunes, tiny_decoder, tiny_processor, word_tokenizer

sys.path.insert(0, str(Path(__file__).parent))
from fake_hub import fake_hub  # noqa: E402,F401  (fixture re-export)

pytestmark = pytest.mark.filterwarnings("ignore:Asked for .* scoring texts:UserWarning")  # small samples on purpose
SENTENCES = ["w1 w2 w3", "w4", "w5 w6 w7 w8 w9", "w10 w11", "w12 w13 w14 w15"]


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    """A word-level tokenizer (``<pad>`` = 3, ``</s>`` = 2, no special tokens added) saved with save_pretrained."""
    folder = tmp_path_factory.mktemp("tokenizer")
    word_tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir):
    return AutoTokenizer.from_pretrained(tokenizer_dir)


@pytest.fixture(scope="session")
def bert_tokenizer(tmp_path_factory):
    """A WordPiece tokenizer that adds [CLS] ... [SEP], built from a vocabulary file."""
    from transformers import BertTokenizerFast

    folder = tmp_path_factory.mktemp("bert_tokenizer")
    words = [f"w{i}" for i in range(40)]
    (folder / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]) + "\n")
    BertTokenizerFast(vocab_file=str(folder / "vocab.txt")).save_pretrained(folder)
    return AutoTokenizer.from_pretrained(folder)


def ids_of(tokenizer, text: str, **kwargs) -> list[int]:
    return tokenizer(text, **kwargs)["input_ids"]


def rows(inputs: ModelInputs) -> list[list[int]]:
    """Each sequence's real tokens (mask 1), in order."""
    return [ids[mask.bool()].tolist() for ids, mask in zip(inputs["input_ids"], inputs["attention_mask"])]


def check_right_padded(inputs: ModelInputs, pad_id: int) -> None:
    ids, mask = inputs["input_ids"], inputs["attention_mask"]
    lengths = mask.sum(1)
    for row, n in enumerate(lengths.tolist()):
        assert mask[row, :n].eq(1).all() and mask[row, n:].eq(0).all(), mask[row]
        assert ids[row, n:].eq(pad_id).all(), ids[row]
    assert ids.shape[1] == int(lengths.max())  # padded to the longest sequence, no further


# ------------------------------------------------------------------------------------------------- ModelInputs
def test_model_inputs_len_select_split_shard_and_num_tokens():
    ids = torch.tensor([[5, 6, 7, 3], [8, 3, 3, 3], [9, 3, 3, 3], [4, 5, 6, 7], [10, 11, 3, 3]])
    mask = (ids != 3).long()
    inputs = ModelInputs({"input_ids": ids, "attention_mask": mask})
    assert len(inputs) == 5 and inputs.num_tokens == 11 and inputs.modality == "text"
    assert set(dict(inputs)) == {"input_ids", "attention_mask"}
    batches = inputs.split(2)
    assert [len(b["input_ids"]) for b in batches] == [2, 2, 1]
    # each batch is cut to its own longest sequence: [4, 4] -> 3 columns, [1, 4] -> 4 columns, [2] -> 2 columns
    assert [b["input_ids"].shape[1] for b in batches] == [3, 4, 2]
    assert torch.equal(batches[0]["input_ids"], ids[:2, :3])
    assert torch.equal(batches[0]["attention_mask"], mask[:2, :3])
    assert sum(int(b["attention_mask"].sum()) for b in batches) == inputs.num_tokens  # no token lost
    picked = inputs.select([4, 0])
    assert torch.equal(picked["input_ids"], ids[[4, 0]]) and len(picked) == 2
    shares = [inputs.shard(rank, 2) for rank in range(2)]
    assert [len(s) for s in shares] == [3, 2]
    assert sorted(r for s in shares for r in map(tuple, s["input_ids"].tolist())) == sorted(map(tuple, ids.tolist()))
    assert torch.equal(shares[1]["input_ids"], ids[1::2])
    pixels = ModelInputs({"pixel_values": torch.zeros(3, 3, 4, 4)})
    assert pixels.num_tokens is None and pixels.modality == "image"
    assert [b["pixel_values"].shape for b in pixels.split(2)] == [torch.Size([2, 3, 4, 4]), torch.Size([1, 3, 4, 4])]
    # a process's share of a model that holds fewer samples than processes: no batch, not one empty batch
    assert pixels.shard(3, 4).split(2) == [] and inputs.select([]).split(2) == []
    with pytest.raises(DataError, match="same number of samples"):
        ModelInputs({"input_ids": ids, "attention_mask": mask[:3]})
    with pytest.raises(DataError, match="must match"):
        ModelInputs({"input_ids": ids, "attention_mask": mask[:, :2]})
    with pytest.raises(ValueError, match="process_index"):
        inputs.shard(2, 2)


# ------------------------------------------------------------------------------------------------- sources
def test_list_of_strings_tokenised_one_by_one_right_padded(tokenizer):
    inputs, info = load_model_inputs(SENTENCES, modality="text", tokenizer=tokenizer, num_samples=10)
    # the padded batch holds exactly what tokenising each text alone gives, in the given order
    assert rows(inputs) == [ids_of(tokenizer, t) for t in SENTENCES]
    check_right_padded(inputs, pad_id=tokenizer.pad_token_id)
    assert inputs["input_ids"].dtype == torch.long and inputs["attention_mask"].dtype == torch.long
    assert set(inputs.keys()) == {"input_ids", "attention_mask"}
    assert (info.source, info.sampling, info.num_samples) == ("texts", "as given", 5)
    assert info.num_tokens == sum(len(t.split()) for t in SENTENCES) == inputs.num_tokens
    assert info.max_length == DEFAULT_MAX_LENGTH and info.truncated == 0 and info.padding == "right"
    assert info.sample_stats()["num_tokens"] == info.num_tokens
    first_two, _ = load_token_ids(SENTENCES, tokenizer, num_samples=2)
    assert rows(first_two) == rows(inputs)[:2]


def test_empty_and_non_text_items_are_refused_or_skipped(tokenizer):
    inputs, info = load_token_ids(["w1 w2", "   ", "", "w3"], tokenizer)
    assert rows(inputs) == [[5, 6], [7]] and info.skipped == 2
    with pytest.raises(DataError, match="item 1 is a int"):
        load_token_ids(["w1", 3], tokenizer)
    with pytest.raises(DataError, match="empty"):
        load_token_ids([], tokenizer)
    with pytest.raises(DataError, match="Only 0 usable text"):
        load_token_ids(["", " "], tokenizer)


def test_max_length_truncates_and_keeps_the_closing_special_token(bert_tokenizer):
    texts = ["w1 w2 w3 w4 w5 w6 w7", "w8 w9", "w10 w11 w12 w13"]
    inputs, info = load_token_ids(texts, bert_tokenizer, max_length=5)
    cls, sep = bert_tokenizer.cls_token_id, bert_tokenizer.sep_token_id
    assert rows(inputs) == [ids_of(bert_tokenizer, t, truncation=True, max_length=5) for t in texts]
    assert rows(inputs)[0] == [cls, *ids_of(bert_tokenizer, "w1 w2 w3", add_special_tokens=False), sep]
    assert rows(inputs)[1] == [cls, *ids_of(bert_tokenizer, "w8 w9", add_special_tokens=False), sep]
    assert inputs["input_ids"].shape == (3, 5) and info.truncated == 2  # 9 and 6 tokens cut at 5; 4 fits
    check_right_padded(inputs, pad_id=bert_tokenizer.pad_token_id)
    exact, info = load_token_ids(["w1 w2 w3"], bert_tokenizer, max_length=5)  # 5 tokens exactly: not cut
    assert info.truncated == 0 and len(rows(exact)[0]) == 5
    with pytest.raises(DataError, match="max_length must be a positive integer"):
        load_token_ids(texts, bert_tokenizer, max_length=0)


def test_a_tokenizer_without_pad_token_pads_with_eos_and_is_left_unchanged(tokenizer_dir):
    no_pad = AutoTokenizer.from_pretrained(tokenizer_dir)
    no_pad.pad_token = None
    assert no_pad.pad_token_id is None
    inputs, info = load_token_ids(SENTENCES, no_pad)
    check_right_padded(inputs, pad_id=no_pad.eos_token_id)
    assert rows(inputs) == [ids_of(no_pad, t) for t in SENTENCES]
    assert "end-of-sequence" in info.padding and "'</s>'" in info.padding and "no pad token" in info.padding
    assert no_pad.pad_token is None  # the caller's tokenizer is not modified
    no_pad.eos_token = None
    with pytest.raises(DataError, match="neither a pad token nor an end-of-sequence token"):
        load_token_ids(SENTENCES, no_pad)


def test_text_file_gives_one_sample_per_non_blank_line(tokenizer, tmp_path):
    lines = [f"w{i} w{i + 1}" for i in range(1, 21)]
    path = tmp_path / "corpus.txt"
    path.write_text("\n\n".join(lines[:10]) + "\n   \n" + "\n".join(lines[10:]) + "\n", encoding="utf-8")
    with pytest.warns(UserWarning, match="Asked for 50 scoring texts; 'corpus.txt' has only 20"):
        everything, info = load_token_ids(str(path), tokenizer, num_samples=50)
    assert sorted(rows(everything)) == sorted(ids_of(tokenizer, line) for line in lines)  # every line once
    assert (info.source, info.id, info.sampling) == ("textfile", "corpus.txt", "whole split")
    sample, _ = load_token_ids(path, tokenizer, num_samples=8, seed=3)
    again, _ = load_token_ids(path, tokenizer, num_samples=8, seed=3)
    other, _ = load_token_ids(path, tokenizer, num_samples=8, seed=4)
    assert rows(sample) == rows(again) and rows(sample) != rows(other)  # a seeded uniform sample of the lines
    assert all(r in [ids_of(tokenizer, line) for line in lines] for r in rows(sample))
    with pytest.raises(DataError, match="text_column='text' does not apply"):
        load_token_ids(path, tokenizer, text_column="text")
    latin = tmp_path / "latin1.txt"
    latin.write_bytes("w1 caf\xe9\n".encode("latin-1"))
    with pytest.raises(DataError, match="not UTF-8"):
        load_token_ids(latin, tokenizer)


def test_folder_of_text_files_gives_one_sample_per_file(tokenizer, tmp_path):
    docs = {"a.txt": "w1 w2\nw3", "b.md": "w4\n\nw5 w6 w7", "sub/c.txt": "w8"}
    for name, text in docs.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text, encoding="utf-8")
    (tmp_path / ".hidden.txt").write_text("w30 w31", encoding="utf-8")
    inputs, info = load_token_ids(tmp_path, tokenizer)
    assert sorted(rows(inputs)) == sorted(ids_of(tokenizer, text) for text in docs.values())
    assert (info.source, info.num_samples, info.num_tokens) == ("textfolder", 3, 8)


@pytest.mark.parametrize("suffix", [".jsonl", ".csv", ".parquet", ".tsv"])
def test_data_files_find_the_text_column(tokenizer, tmp_path, suffix):
    import datasets

    table = datasets.Dataset.from_dict({"text": SENTENCES, "label": [0, 1, 0, 1, 1]})
    path = tmp_path / f"data{suffix}"
    if suffix == ".jsonl":
        table.to_json(path)
    elif suffix == ".csv":
        table.to_csv(path, index=False)
    elif suffix == ".tsv":
        table.to_csv(path, index=False, sep="\t")
    else:
        table.to_parquet(path)
    inputs, info = load_token_ids(str(path), tokenizer, num_samples=5)
    assert sorted(rows(inputs)) == sorted(ids_of(tokenizer, t) for t in SENTENCES)
    assert (info.source, info.text_column, info.sampling) == ("file", "text", "whole split")
    assert info.to_dict()["text_column"] == "text" and info.to_dict()["max_length"] == DEFAULT_MAX_LENGTH


def test_text_column_is_detected_or_asked_for(tokenizer, tmp_path):
    import datasets

    two = datasets.Dataset.from_dict({"prompt": SENTENCES, "answer": SENTENCES[::-1], "n": list(range(5))})
    with pytest.raises(DataError, match=r"several text columns \['prompt', 'answer'\]; pass text_column="):
        load_token_ids(two, tokenizer)
    inputs, info = load_token_ids(two, tokenizer, text_column="answer")
    assert sorted(rows(inputs)) == sorted(ids_of(tokenizer, t) for t in SENTENCES) and info.text_column == "answer"
    with pytest.raises(DataError, match=r"Column 'n' .* holds int64 values, not text"):
        load_token_ids(two, tokenizer, text_column="n")
    with pytest.raises(DataError, match=r"Text column 'body' not found.*\['prompt', 'answer', 'n'\]"):
        load_token_ids(two, tokenizer, text_column="body")
    preferred = datasets.Dataset.from_dict({"title": ["w1", "w2"], "text": ["w3 w4", "w5"]})
    assert load_token_ids(preferred, tokenizer)[1].text_column == "text"  # several: the one named `text`
    numbers = datasets.Dataset.from_dict({"x": [1, 2]})
    with pytest.raises(DataError, match=r"No text column found .*\['x'\].*text_column="):
        load_token_ids(numbers, tokenizer)


def test_saved_dataset_folder_with_splits_and_labels(tokenizer, tmp_path):
    import datasets

    train = datasets.Dataset.from_dict({"sentence": SENTENCES, "label": [0, 1, 0, 1, 2]})
    test = datasets.Dataset.from_dict({"sentence": ["w20 w21", "w22"], "label": [0, 0]})
    datasets.DatasetDict({"train": train, "test": test}).save_to_disk(tmp_path / "dict")
    train.save_to_disk(tmp_path / "single")
    inputs, info = load_token_ids(tmp_path / "dict", tokenizer, split="test")
    assert sorted(rows(inputs)) == [[24, 25], [26]] and (info.source, info.split) == ("folder", "test")
    assert (info.label_column, info.labels_covered) == ("label", 1)
    whole, info = load_token_ids(tmp_path / "single", tokenizer, num_samples=5)
    assert sorted(rows(whole)) == sorted(ids_of(tokenizer, t) for t in SENTENCES)
    assert (info.sampling, info.labels_covered, info.text_column, info.split) == ("shuffled", 3, "sentence", None)
    with pytest.raises(DataError, match=r"Split 'validation' is not in the saved dataset .*\['train', 'test'\]"):
        load_token_ids(tmp_path / "dict", tokenizer, split="validation")
    in_memory, _ = load_token_ids(datasets.DatasetDict({"train": train}), tokenizer, num_samples=5)
    assert sorted(rows(in_memory)) == sorted(rows(whole))


def test_folder_of_data_files_is_laid_out_by_datasets(tokenizer, tmp_path):
    import datasets

    datasets.Dataset.from_dict({"text": SENTENCES[:3]}).to_json(tmp_path / "train.jsonl")
    datasets.Dataset.from_dict({"text": SENTENCES[3:]}).to_json(tmp_path / "test.jsonl")
    inputs, info = load_token_ids(tmp_path, tokenizer, split="test")
    assert sorted(rows(inputs)) == sorted(ids_of(tokenizer, t) for t in SENTENCES[3:]) and info.source == "folder"


def test_hub_text_dataset_is_streamed(tokenizer, fake_hub, monkeypatch):
    import datasets
    import datasets.config

    monkeypatch.setattr(datasets.config, "SLEEP_TIME_ON_THREADS_SHUTDOWN", 0)
    texts = [f"w{i % 50} w{(3 * i) % 50}" for i in range(40)]
    buffer = io.BytesIO()
    datasets.Dataset.from_dict({"text": texts, "label": [i % 4 for i in range(40)]}).to_parquet(buffer)
    repo = f"org/texts-{uuid.uuid4().hex[:8]}"
    fake_hub.add_repo(repo, {"data/train-00000-of-00001.parquet": buffer.getvalue()}, repo_type="dataset")
    inputs, info = load_model_inputs(repo, modality="text", tokenizer=tokenizer, num_samples=12, seed=1)
    assert len(inputs) == 12 and all(r in [ids_of(tokenizer, t) for t in texts] for r in rows(inputs))
    assert (info.source, info.id, info.text_column, info.label_column) == ("hub", repo, "text", "label")
    assert info.sampling == "shuffled shards" and info.num_tokens == 24
    again, _ = load_model_inputs(repo, modality="text", tokenizer=tokenizer, num_samples=12, seed=1)
    assert rows(again) == rows(inputs)


def test_a_stream_whose_columns_are_unknown_until_read(tokenizer):
    import datasets

    def rows_of():
        for i, text in enumerate(SENTENCES):
            yield {"id": i, "body": text}

    stream = datasets.IterableDataset.from_generator(rows_of)
    assert not stream.features  # typed from its first row
    inputs, info = load_token_ids(stream, tokenizer, num_samples=5)
    assert sorted(rows(inputs)) == sorted(ids_of(tokenizer, t) for t in SENTENCES)
    assert (info.text_column, info.sampling) == ("body", "shuffled shards")


def test_pretokenised_inputs_pass_through(tokenizer):
    encoded = tokenizer(SENTENCES, padding=True, return_tensors="pt")
    inputs, info = load_token_ids(encoded, None, num_samples=3)
    assert torch.equal(inputs["input_ids"], encoded["input_ids"][:3])
    assert torch.equal(inputs["attention_mask"], encoded["attention_mask"][:3])
    assert (info.source, info.num_tokens) == ("tokens", int(encoded["attention_mask"][:3].sum()))
    with pytest.raises(DataError, match="integer tensor"):
        load_token_ids({"input_ids": torch.zeros(2, 3)}, None)
    padding_only = {"input_ids": encoded["input_ids"][:3], "attention_mask": encoded["attention_mask"][:3].clone()}
    padding_only["attention_mask"][1] = 0  # a sequence of padding alone would add nothing, or NaN in attention
    with pytest.raises(DataError, match=r"1 of the 3 token sequences hold no token .*the first: row 1"):
        load_token_ids(padding_only, None)
    with pytest.raises(DataError, match="2 of the 2 token sequences hold no token"):
        load_token_ids({"input_ids": torch.zeros(2, 0, dtype=torch.long)}, None)


# ------------------------------------------------------------------------------------------------- wrong modality
def test_text_handed_to_an_image_family_is_refused_by_name(tmp_path):
    processor = tiny_processor()
    (tmp_path / "t.txt").write_text("w1 w2\n", encoding="utf-8")
    for data, what in [(["a cat on a mat", "a dog"], "strings that name no image file"),
                       (str(tmp_path / "t.txt"), "a text file"),
                       ({"input_ids": torch.ones(2, 3, dtype=torch.long)}, "token ids")]:
        with pytest.raises(DataError, match=f"The clip_vision family is scored on images, but data= holds .*{what}"):
            load_model_inputs(data, modality="image", processor=processor, family="clip_vision")


def test_a_text_dataset_handed_to_an_image_family_says_so():
    import datasets

    texts = datasets.Dataset.from_dict({"sentence": SENTENCES})
    with pytest.raises(DataError, match=r"No image column found.*text column\(s\) \['sentence'\].*clip_vision family "
                                        r"is scored on images"):
        load_model_inputs(texts, modality="image", processor=tiny_processor(), family="clip_vision")


def test_images_handed_to_a_text_family_are_refused_by_name(tokenizer, image_folder):
    import datasets

    picture = Image.new("RGB", (8, 8))
    image_file = next(Path(image_folder).rglob("*.png"))
    cases = [(torch.zeros(2, 3, 8, 8), "a tensor of shape"), ([picture], "PIL images"),
             ([str(image_file)], "paths of image files"), ({"pixel_values": torch.zeros(2, 3, 8, 8)}, "pixel values"),
             (str(image_folder / "train" / "class0"), "is a folder of images"),
             (datasets.Dataset.from_dict({"image": [picture]},
                                         features=datasets.Features({"image": datasets.Image()})), "holds images")]
    for data, what in cases:
        with pytest.raises(DataError, match=f"The llama family is scored on text, .*{what}.*Pass text"):
            load_model_inputs(data, modality="text", tokenizer=tokenizer, family="llama")


def test_the_image_path_is_unchanged(image_folder):
    processor = tiny_processor()
    pixels, info = load_pixel_values(str(image_folder), processor, num_samples=6, seed=2)
    inputs, same_info = load_model_inputs(str(image_folder), modality="image", processor=processor, num_samples=6,
                                          seed=2)
    assert torch.equal(inputs["pixel_values"], pixels) and list(inputs.keys()) == ["pixel_values"]
    assert same_info.to_dict() == info.to_dict() and same_info.sample_stats() == info.sample_stats()
    assert "num_tokens" not in info.sample_stats() and "max_length" not in info.to_dict()
    tensor_inputs, _ = load_model_inputs({"pixel_values": pixels}, modality="image", num_samples=4)
    assert torch.equal(tensor_inputs["pixel_values"], pixels[:4])


# ------------------------------------------------------------------------------------------------- open_inputs
@pytest.fixture
def text_family():
    """The scored text family of Llama decoders (hf_mloss.adapters.llama)."""
    from hf_mloss.adapters import LlamaAdapter

    return LlamaAdapter


@pytest.fixture(scope="module")
def llama_folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("llama")
    return save_with_finetunes(tiny_decoder("llama"), root, q=2, tokenizer=word_tokenizer())


def open_text(base, models, data, **kwargs):
    from hf_mloss.loading.inputs import open_inputs

    config = MergeConfig.from_kwargs(str(base), [str(m) for m in models], "ties", data=data, **kwargs)
    return open_inputs(config, needs_data=True, progress=False)


def test_open_inputs_of_a_text_family_yields_token_ids(text_family, llama_folders, tokenizer):
    base, models = llama_folders
    with open_text(base, models, SENTENCES, num_samples=4) as inputs:
        assert isinstance(inputs.adapter, text_family)
        model_inputs = inputs.model_inputs
        assert set(model_inputs.keys()) == {"input_ids", "attention_mask"} and len(model_inputs) == 4
        assert rows(model_inputs) == [ids_of(tokenizer, t) for t in SENTENCES[:4]]
        check_right_padded(model_inputs, pad_id=tokenizer.pad_token_id)
        info = inputs.data_info
        assert info.max_length == 64  # the default 128, lowered to the base's 64 positions
        assert info.num_tokens == model_inputs.num_tokens == 11
        with pytest.raises(AttributeError, match="scored on text.*model_inputs"):
            _ = inputs.pixels
        model = text_family(inputs.adapter.full_config).load_model(str(base))
        with torch.no_grad():  # the batches run through the base as they are
            for batch in model_inputs.split(3):
                assert model(**batch).logits.shape[:2] == batch["input_ids"].shape


def test_open_inputs_of_a_text_family_refuses_what_cannot_run(text_family, llama_folders, image_folder, tmp_path):
    base, models = llama_folders

    def refused(error, match, base_folder, data, **kwargs):
        with pytest.raises(error, match=match), open_text(base_folder, models, data, **kwargs):
            pass

    refused(DataError, r"data.max_length=100 is past the 64 positions the base embeds .*max_length <= 64", base,
            SENTENCES, max_length=100)  # a given max_length past the positions (issue 57); the default is lowered
    with open_text(base, models, SENTENCES) as inputs:
        assert inputs.model_inputs["input_ids"].shape[1] <= 64
    refused(DataError, r"The llama \('llama'\) family is scored on text.*folder of images", base,
            str(image_folder / "train" / "class1"))
    bare = tmp_path / "bare"
    tiny_decoder("llama").save_pretrained(bare)  # weights and config only, no tokenizer
    refused(InvalidParameterError, "no tokenizer files.*processor=", bare, SENTENCES)
    big = tmp_path / "big_vocab"
    word_tokenizer(vocab_size=200).save_pretrained(big)
    refused(DataError, "vocabulary has 64 ids.*does not belong to the base", base, ["w150 w2"], processor=str(big))
    with open_text(base, models, ["w1 w2"], processor=word_tokenizer()) as inputs:  # a tokenizer object
        assert rows(inputs.model_inputs) == [[5, 6]]
    too_long = {"input_ids": torch.full((2, 65), 5), "attention_mask": torch.ones(2, 65, dtype=torch.long)}
    refused(DataError, "65 tokens long but the base embeds 64 positions", base, too_long)
    tokens = {"input_ids": torch.tensor([[5, 6, 3], [7, 3, 3]]),
              "attention_mask": torch.tensor([[1, 1, 0], [1, 0, 0]])}
    with open_text(bare, models, tokens) as inputs:  # already tokenised: no tokenizer needed
        assert rows(inputs.model_inputs) == [[5, 6], [7]] and inputs.data_info.source == "tokens"


def test_token_ids_are_a_models_own_data_as_they_are_the_shared_data(llama_folders, tokenizer):
    import hf_mloss

    base, models = llama_folders
    encoded = tokenizer(SENTENCES[:2], padding=True, return_tensors="pt")  # a BatchEncoding
    plain = {"input_ids": torch.tensor([[5, 6, 3]]), "attention_mask": torch.tensor([[1, 1, 0]])}
    entries = [{"model": str(models[0]), "data": encoded}, {"model": str(models[1]), "data": plain}]
    result = hf_mloss.merge(str(base), entries, "regmean", progress=False)
    assert [info.num_samples for info in result.model_data_info["data"]] == [2, 1]
    silent = {"input_ids": torch.tensor([[5, 6, 3]]), "attention_mask": torch.tensor([[0, 0, 0]])}
    with pytest.raises(DataError, match=r"models\[1\] \(ft\w*\)\.data: 1 of the 1 token sequences hold no token"):
        hf_mloss.merge(str(base), [entries[0], {"model": str(models[1]), "data": silent}], "regmean", progress=False)


def test_open_inputs_of_an_image_family_keeps_pixels(tiny_paths, image_folder):
    from hf_mloss.loading.inputs import open_inputs

    base, models = tiny_paths
    config = MergeConfig.from_kwargs(base, models, "m_ties", data=str(image_folder), num_samples=6)
    with open_inputs(config, needs_data=True, progress=False) as inputs:
        assert list(inputs.model_inputs.keys()) == ["pixel_values"]
        assert inputs.pixels is inputs.model_inputs["pixel_values"]  # the deprecated alias
        expected, _ = load_pixel_values(str(image_folder), tiny_processor(), num_samples=6)
        assert torch.equal(inputs.pixels, expected)
        with pytest.raises(AttributeError):
            inputs.pixels = expected  # read-only
    text_config = MergeConfig.from_kwargs(base, models, "m_ties", data=SENTENCES)
    with pytest.raises(DataError, match="clip_vision .* family is scored on images.*strings that name no image"), \
            open_inputs(text_config, needs_data=True, progress=False):
        pass


# ------------------------------------------------------------------------------------------------- config
def test_data_spec_text_fields_are_validated_and_written_only_when_set(tmp_path):
    spec = DataSpec.parse(SENTENCES, text_column="body", max_length=32)
    assert spec.objects == SENTENCES and (spec.text_column, spec.max_length) == ("body", 32)
    written = spec.to_dict()
    assert written["text_column"] == "body" and written["max_length"] == 32
    assert written["content"].startswith("xxh3-128:")  # a re-run can tell whether it got the same texts
    assert DataSpec.parse(list(SENTENCES)).to_dict()["content"] == written["content"]
    assert DataSpec.parse(SENTENCES[::-1]).to_dict()["content"] != written["content"]
    plain = DataSpec(id="org/texts").to_dict()
    assert "text_column" not in plain and "max_length" not in plain
    for bad in (0, -1, 2.5, "128", True):
        with pytest.raises(DataError, match="max_length"):
            DataSpec(id="org/texts", max_length=bad)
    with pytest.raises(DataError, match="text_column"):
        DataSpec(id="org/texts", text_column=3)
    text_file = tmp_path / "corpus.jsonl"
    text_file.write_text('{"text": "w1"}\n', encoding="utf-8")
    assert DataSpec.parse(str(text_file)).path == str(text_file)  # a data file is a valid path
    config_file = tmp_path / "merge.yaml"
    config_file.write_text("x: 1\n", encoding="utf-8")
    with pytest.raises(DataError, match="is a file, not a folder or a text/data file"):
        DataSpec.parse(str(config_file))
    tokens = {"input_ids": torch.ones(2, 3, dtype=torch.long), "attention_mask": torch.ones(2, 3, dtype=torch.long)}
    assert DataSpec.parse(tokens).objects is tokens  # tokenised inputs are data, not a data section
    assert DataSpec.parse(tokens).to_dict()["content"].startswith("xxh3-128:")
    pixels = torch.rand(2, 3, 4, 4)
    assert DataSpec.parse({"pixel_values": pixels}).to_dict()["content"] == DataSpec.parse(pixels).to_dict()["content"]


def test_merge_config_threads_text_fields_through_kwargs_and_yaml(tmp_path):
    from hf_mloss.api import RunOptions

    assert {"text_column", "max_length"} <= set(RunOptions.__annotations__)  # declared once for the three entry points
    (tmp_path / "corpus.txt").write_text("w1 w2\n", encoding="utf-8")
    config = MergeConfig.from_kwargs("org/base", ["org/a", "org/b"], "m_ties", data=str(tmp_path / "corpus.txt"),
                                     max_length=48, text_column=None)
    assert config.data.max_length == 48 and config.data.path == str(tmp_path / "corpus.txt")
    config.to_yaml(tmp_path / "merge.yaml")
    text = (tmp_path / "merge.yaml").read_text()
    assert "max_length: 48" in text and "text_column" not in text
    again = MergeConfig.from_yaml(tmp_path / "merge.yaml")
    assert again.data == config.data
    (tmp_path / "relative.yaml").write_text("base: org/base\nmodels: [org/a, org/b]\nmethod: m_ties\n"
                                            "data: corpus.txt\n", encoding="utf-8")
    assert MergeConfig.from_yaml(tmp_path / "relative.yaml").data.path == str(tmp_path / "corpus.txt")
    with pytest.raises(ConfigError, match="max_length"):
        MergeConfig.from_dict({"base": "org/base", "models": ["org/a"], "data": {"id": "org/t", "max_length": 0}})


def test_report_line_counts_sequences_and_tokens():
    from hf_mloss.output.report import describe_data

    line = describe_data({"source": "texts", "num_samples": 5, "num_tokens": 17, "sampling": "as given"})
    assert line == "texts, 5 sequences, 17 tokens, sampled: as given"
    image_line = describe_data({"id": "org/images", "split": "train", "num_samples": 8})
    assert image_line == "org/images (split train), 8 images"


def test_no_warning_on_a_full_text_sample(tokenizer):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_token_ids(SENTENCES, tokenizer, num_samples=5)
