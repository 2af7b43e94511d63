"""Vocabulary merges: the output tokenizer of ``tokenizer_source`` and every input's token rows aligned to it.

Fine-tunes that added tokens (a chat template's special tokens, domain words) have embedding and LM-head rows the
base lacks, at ids that differ between them. ``tokenizer_source`` (mergekit's ``tokenizer_source`` / ``tokenizer:``
section, read as mergekit 0.1.5 reads them) names the output vocabulary:

* ``union``: the base's tokenizer, then every token the models add, the models taken in the config's order (their
  ordinary vocabulary entries first, then their added tokens, each model's by id, as mergekit builds it; mergekit
  takes the models in a set's iteration order, which varies between runs, so only the order among new tokens of
  different models can differ from its);
* ``base``: the base's tokenizer (tokens the models added are dropped);
* a model (its index into ``[base, *models]``, or its name as given): that model's tokenizer.

Each input's vocabulary-indexed tensors (input embeddings, LM head and its bias) are then read through
:class:`AlignedStore` with one row per output token, so the merge method sees equal shapes. A model that has the
token gives its own row; a model that lacks it gets mergekit's fallback, the same for every such model: the row of
the only model that has it, else the base's row (when the base is a reference the merge starts from, not merely one
of the averaged models), else the mean of the rows of the models that have it; zeros if no model has it (in a
``passthrough``, which reads each tensor from one model, zeros wherever that model lacks the token). The
``tokens`` section overrides that fallback per token (``source``: a model, ``{kind: model_token, model, token |
token_id}`` or ``{kind: zero}``; ``force: true`` gives it to every model, even those that have the token) and adds
the tokens it names to the vocabulary. ``pad_to_multiple_of`` rounds the row count up (to at most twice the
vocabulary); each model's extra rows hold the mean of its aligned rows (mergekit's rule). The merged tokenizer is saved with the model, whose ``vocab_size``
is the new row count.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from .._validation import short
from ..errors import IncompatibleCheckpointsError, InvalidParameterError
from .store import TensorStore

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from ..adapters import ModelAdapter

SOURCES = ("union", "base")
ZERO = "zero"
MAX_PAD_FACTOR = 2
"""``pad_to_multiple_of`` may at most double the merged vocabulary's rows (padding is for alignment, 8 to 128)."""


# ------------------------------------------------------------------------------------------------------ the options
@dataclasses.dataclass(frozen=True)
class TokenRule:
    """The ``tokens`` section's entry for one token: where its row comes from for the models that need one."""

    source: int | str | None = None
    """An input index (0 = base), ``"zero"``, or None (the token is only added to the vocabulary)."""
    token: str | None = None
    """``model_token``: the source model's token whose row is taken (else the same token's row)."""
    token_id: int | None = None
    """``model_token``: the source model's row index."""
    force: bool = False

    def to_dict(self) -> dict[str, Any]:
        if self.source == ZERO:
            source: Any = {"kind": "zero"}
        elif self.token is not None or self.token_id is not None:
            source = {"kind": "model_token", "model": self.source,
                      **({"token": self.token} if self.token is not None else {"token_id": self.token_id})}
        else:
            source = self.source
        return {**({"source": source} if source is not None else {}), **({"force": True} if self.force else {})}


@dataclasses.dataclass(frozen=True)
class VocabularyOptions:
    """A validated ``tokenizer_source``: the output vocabulary, per-token overrides and the row padding."""

    source: str | int
    """``"union"``, ``"base"`` or an input index (0 = base)."""
    tokens: dict[str, TokenRule] = dataclasses.field(default_factory=dict)
    pad_to_multiple_of: int | None = None

    @classmethod
    def parse(cls, value: Any, names: Sequence[str | None]) -> VocabularyOptions:
        """From a config value: ``"union"``, ``"base"``, a model (index into ``[base, *models]``, its name as given,
        or ``model:<name>``), or a mapping ``{source, tokens, pad_to_multiple_of}`` (mergekit's ``tokenizer:``
        section; ``source`` defaults to ``union`` there). ``names``: the inputs' names, base first.

        Raises:
            InvalidParameterError: naming the key and the accepted forms.
        """
        if isinstance(value, VocabularyOptions):
            return value
        if not isinstance(value, Mapping):
            return cls(source=_source(value, names, "tokenizer_source"))
        unknown = sorted(set(value) - {"source", "tokens", "pad_to_multiple_of"})
        if unknown:
            raise InvalidParameterError(f"tokenizer_source keys {unknown} are unknown; it takes source, tokens and "
                                        "pad_to_multiple_of (mergekit's tokenizer: section).")
        pad = value.get("pad_to_multiple_of")
        if pad is not None and (isinstance(pad, bool) or not isinstance(pad, int) or pad < 1):
            raise InvalidParameterError(f"tokenizer_source.pad_to_multiple_of must be a positive integer, got "
                                        f"{short(pad)}.")
        tokens = value.get("tokens") or {}
        if not isinstance(tokens, Mapping):
            raise InvalidParameterError(f"tokenizer_source.tokens must map tokens to {{source: ..., force: ...}}, got "
                                        f"{short(tokens)}.")
        rules = {}
        for token, entry in tokens.items():
            where = f"tokenizer_source.tokens[{token!r}]"
            if not isinstance(token, str) or not token:
                raise InvalidParameterError(f"tokenizer_source.tokens keys are tokens (strings), got {short(token)}.")
            rules[token] = _token_rule(entry, names, where)
        return cls(source=_source(value.get("source", "union"), names, "tokenizer_source.source"), tokens=rules,
                   pad_to_multiple_of=pad)

    def to_plain(self) -> str | int | dict[str, Any]:
        """The config's value (``"union"``, or the mapping when tokens or padding are set)."""
        if not self.tokens and self.pad_to_multiple_of is None:
            return self.source
        out: dict[str, Any] = {"source": self.source}
        if self.tokens:
            out["tokens"] = {token: rule.to_dict() for token, rule in self.tokens.items()}
        if self.pad_to_multiple_of is not None:
            out["pad_to_multiple_of"] = self.pad_to_multiple_of
        return out

    def models(self) -> list[int]:
        """Every input index the options name."""
        named = [self.source] if isinstance(self.source, int) else []
        return named + [r.source for r in self.tokens.values() if isinstance(r.source, int)]


def _source(value: Any, names: Sequence[str | None], where: str) -> str | int:
    if value in SOURCES:
        return value
    return _model_index(value, names, where, kinds="union, base or ")


def _model_index(value: Any, names: Sequence[str | None], where: str, kinds: str = "") -> int:
    """An input index from an index, a model's name as given, or ``model:<name>`` (older mergekit's spelling)."""
    if isinstance(value, int) and not isinstance(value, bool):
        if 0 <= value < len(names):
            return value
    elif isinstance(value, str) and value.strip():
        name = value.removeprefix("model:")
        for i, given in enumerate(names):
            if given is not None and (given == name or _same_path(given, name)):
                return i
    listed = [n for n in names if n is not None]
    raise InvalidParameterError(f"{where} must be {kinds}a model of the merge (an index into [base, *models], 0 = "
                                f"base, or the model's name as given: {listed[:4]}), got {short(value)}.")


def _same_path(a: str, b: str) -> bool:
    from .hub import expand, looks_local

    return looks_local(a) and looks_local(b) and os.path.realpath(expand(a)) == os.path.realpath(expand(b))


def _token_rule(entry: Any, names: Sequence[str | None], where: str) -> TokenRule:
    if entry is None:
        return TokenRule()
    if not isinstance(entry, Mapping) or set(entry) - {"source", "force"}:
        raise InvalidParameterError(f"{where} must be {{source: ..., force: true|false}}, got {short(entry)}.")
    force = entry.get("force", False)
    if not isinstance(force, bool):
        raise InvalidParameterError(f"{where}.force must be true or false, got {short(force)}.")
    source = entry.get("source")
    if source is None:
        if force:
            raise InvalidParameterError(f"{where}: force gives every model the token's source row; name a source.")
        return TokenRule()
    if not isinstance(source, Mapping):
        return TokenRule(source=_model_index(source, names, f"{where}.source"), force=force)
    kind = source.get("kind")
    if kind == "zero" and set(source) == {"kind"}:
        return TokenRule(source=ZERO, force=force)
    if kind == "model_token" and "model" in source and set(source) - {"kind", "model"} in ({"token"}, {"token_id"}):
        model = _model_index(source["model"], names, f"{where}.source.model")
        token, token_id = source.get("token"), source.get("token_id")
        if token is not None and not isinstance(token, str) or token_id is not None and (
                isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0):
            raise InvalidParameterError(f"{where}.source: token must be a string, token_id a row index >= 0; got "
                                        f"{short(dict(source))}.")
        return TokenRule(source=model, token=token, token_id=token_id, force=force)
    raise InvalidParameterError(f"{where}.source must be a model, {{kind: zero}} or {{kind: model_token, model: ..., "
                                f"token: ... (or token_id: ...)}}, got {short(source)}.")


# ------------------------------------------------------------------------------------------------------- the plan
@dataclasses.dataclass
class VocabularyPlan:
    """The output tokenizer and, per input, where each output row comes from."""

    tokenizer: Any
    """The output tokenizer (saved with the merge)."""
    size: int
    """Rows of the output's vocabulary tensors (the tokenizer's length, padded)."""
    names: frozenset[str]
    """The vocabulary-indexed tensors (canonical names): input embeddings, LM head weight and bias."""
    own: list[torch.Tensor]
    """Per input: for each output token id, the input's own row, or -1 where it takes the fallback."""
    fills: dict[int, tuple[str, list[tuple[int, int]]]]
    """Output token id -> ``("zero", [])``, ``("row", [(input, row)])`` or ``("mean", [(input, row), ...])``."""
    identity: list[bool]
    """Per input: whether its rows are the output's as they are (no read is then re-mapped)."""
    added: list[str] = dataclasses.field(default_factory=list)
    """The tokens the output has beyond the base's tokenizer (said on the card)."""
    _stores: list[TensorStore] = dataclasses.field(default_factory=list, repr=False)
    """The inputs as opened (set by :meth:`wrap`): the fallback rows are read from them."""
    _dtypes: dict[str, torch.dtype] = dataclasses.field(default_factory=dict, repr=False)
    """Each vocabulary tensor's dtype, promoted over the inputs (as mergekit aligns them)."""
    _defaults: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict, repr=False)
    _pad_rows: dict[tuple[int, str], torch.Tensor] = dataclasses.field(default_factory=dict, repr=False)

    def describe(self) -> str:
        """One sentence for the card: the vocabulary and the tokens it adds to the base's."""
        shown = ", ".join(repr(t) for t in self.added[:5]) + (", ..." if len(self.added) > 5 else "")
        return (f"Vocabulary: {self.vocab_len} tokens ({self.size} rows)" +
                (f", {len(self.added)} beyond the base's tokenizer ({shown})" if self.added else "") +
                "; embedding and LM-head rows aligned to it as mergekit aligns them.")

    @property
    def vocab_len(self) -> int:
        return int(self.own[0].numel())

    def wrap(self, stores: list[TensorStore]) -> list[TensorStore]:
        """The stores with their vocabulary tensors read aligned to the output (the others as they are)."""
        dtypes = {}
        for name in self.names:
            dtype = stores[0].dtypes[name]
            for store in stores[1:]:
                dtype = torch.promote_types(dtype, store.dtypes[name])
            dtypes[name] = dtype
        self._stores = list(stores)
        self._dtypes = dtypes
        return [AlignedStore(store, self, i) for i, store in enumerate(stores)]

    def default_rows(self, name: str) -> torch.Tensor:
        """The fallback rows of ``name`` (one per token of :attr:`fills`, in id order), read once per tensor."""
        if name not in self._defaults:
            store = self._stores[0]
            rows = torch.zeros((len(self.fills), *store.shapes[name][1:]), dtype=self._dtypes[name])
            for k, (kind, reads) in enumerate(self.fills.values()):
                if kind == "zero":
                    continue
                total = torch.zeros_like(rows[k])
                for i, row in reads:  # summed in the stored dtype, in the models' order, as mergekit does
                    total = total + self._stores[i].get_rows(name, row, row + 1)[0].to(rows.dtype)
                rows[k] = total / len(reads) if kind == "mean" else total
            self._defaults[name] = rows
        return self._defaults[name]

    def fit_model(self, model: PreTrainedModel, adapter: ModelAdapter, base: TensorStore) -> None:
        """Resize ``model`` (the base, loaded) to the output vocabulary and give it the base's aligned rows; its
        config's ``vocab_size`` follows (tied heads stay tied)."""
        if model.get_input_embeddings().weight.shape[0] != self.size:
            model.resize_token_embeddings(self.size, mean_resizing=False)
        with torch.no_grad():
            for key, tensor in model.state_dict().items():
                name = adapter.canonical_key(key)
                if name in self.names:
                    tensor.copy_(base.get(name))


class AlignedStore(TensorStore):
    """An input's tensors with its vocabulary tensors read as the output's rows (see the module docstring)."""

    def __init__(self, inner: TensorStore, plan: VocabularyPlan, index: int) -> None:
        self.inner, self.plan, self.index = inner, plan, index
        self.ref = inner.ref
        self.shapes = dict(inner.shapes)
        self.dtypes = dict(inner.dtypes)
        if not plan.identity[index]:
            for name in plan.names:
                self.shapes[name] = (plan.size, *inner.shapes[name][1:])
                self.dtypes[name] = plan._dtypes[name]

    def __getattr__(self, attribute: str) -> Any:  # what else the wrapped store offers (is_pickle, adapter...)
        if attribute == "inner":
            raise AttributeError(attribute)
        return getattr(self.inner, attribute)

    @property
    def reads_rows(self) -> bool:
        return self.inner.reads_rows

    def get(self, name: str) -> torch.Tensor:
        if name not in self.plan.names or self.plan.identity[self.index]:
            return self.inner.get(name)
        return self.get_rows(name, 0, self.plan.size)

    def get_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        if name not in self.plan.names or self.plan.identity[self.index]:
            return self.inner.get_rows(name, start, stop)
        plan, shape = self.plan, self.shapes[name]
        start, stop = max(0, min(start, plan.size)), max(0, min(stop, plan.size))
        out = torch.zeros((max(stop - start, 0), *shape[1:]), dtype=self.dtypes[name])
        end = min(stop, plan.vocab_len)
        if start < end:
            rows = plan.own[self.index][start:end]
            have = rows >= 0
            if bool(have.any()):
                lo, hi = int(rows[have].min()), int(rows[have].max()) + 1
                read = self.inner.get_rows(name, lo, hi)
                out[: end - start][have] = read[rows[have] - lo].to(out.dtype)
            ids = list(plan.fills)
            wanted = [(k, t) for k, t in enumerate(ids) if start <= t < end and not bool(have[t - start])]
            if wanted:
                defaults = plan.default_rows(name)
                for k, t in wanted:
                    out[t - start] = defaults[k]
        if stop > plan.vocab_len:  # padding rows: the mean of this model's aligned rows (mergekit's rule)
            key = (self.index, name)
            if key not in plan._pad_rows:
                plan._pad_rows[key] = torch.mean(self.get_rows(name, 0, plan.vocab_len), dim=0)
            out[max(plan.vocab_len, start) - start:] = plan._pad_rows[key]
        return out

    def get_float(self, name: str, device: torch.device | str = "cpu") -> torch.Tensor:
        return self.get(name).to(device=device, dtype=torch.float32)

    def close(self) -> None:
        self.inner.close()

    def __repr__(self) -> str:
        return f"AlignedStore({self.inner!r})"


# ------------------------------------------------------------------------------------------------------ building
def vocabulary_names(adapter: ModelAdapter, base: TensorStore) -> frozenset[str]:
    """The base's tensors indexed by token id: its input embeddings, LM head weight and bias (canonical names; a
    head tied to the embeddings is not a tensor of its own).

    Raises:
        InvalidParameterError: the model has no token embeddings (a vision model).
    """
    import json

    model_class = getattr(adapter, "merged_class", adapter.model_class)
    config = model_class.config_class.from_dict(json.loads(adapter.config.to_json_string(use_diff=False)))
    with torch.device("meta"):
        model = model_class(config)
    try:
        embeddings = model.get_input_embeddings()
    except (NotImplementedError, AttributeError):
        embeddings = None
    if not isinstance(embeddings, torch.nn.Embedding):
        raise InvalidParameterError(f"tokenizer_source aligns the token embeddings of a text model; a "
                                    f"{adapter.config.model_type!r} {model_class.__name__} has none. Drop "
                                    "tokenizer_source.")
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    wanted = {id(embeddings.weight)}
    if head is not None:
        wanted |= {id(p) for p in (getattr(head, "weight", None), getattr(head, "bias", None)) if p is not None}
    names = {name for key, p in model.named_parameters(remove_duplicate=False)
             if id(p) in wanted and (name := adapter.canonical_key(key)) is not None and name in base.shapes}
    return frozenset(names)


def _load_tokenizer(path: str | None, name: str, why: str) -> Any:
    from transformers import AutoTokenizer

    from .._logging import quiet_transformers

    if not path or not os.path.isdir(path):
        raise IncompatibleCheckpointsError(f"{why} needs the tokenizer of {name!r}, which was passed as a loaded "
                                           "model; pass its folder (saved with its tokenizer) instead.")
    files = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")
    try:
        with quiet_transformers(True):
            return AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    except Exception as err:  # noqa: BLE001 - transformers raises many kinds for a missing or broken tokenizer
        reason = " ".join(str(err).split())[:200] or type(err).__name__
        if not any(os.path.isfile(os.path.join(path, f)) for f in files):
            reason = "its folder holds no tokenizer files: it was saved with the model's save_pretrained alone"
        raise IncompatibleCheckpointsError(
            f"{why} needs every model's tokenizer, and the one of {name!r} cannot be loaded ({reason}). Save it "
            "beside the weights (tokenizer.save_pretrained(folder)).") from None


def build_vocabulary(options: VocabularyOptions, stores: list[TensorStore], adapter: ModelAdapter, *,
                     base_is_reference: bool, isolated: bool = False) -> VocabularyPlan:
    """The output tokenizer of ``options`` and each input's row alignment (``stores``: the inputs, base first).

    ``base_is_reference``: the base is the model the merge starts from (mergekit's ``base_model``), whose row a model
    lacking a token takes before the other models' mean; False when the base is only one of the merged models.
    ``isolated``: each output tensor is one input's (``passthrough``), so a token that input lacks has no other row
    to take: zeros, as in mergekit (a ``tokens`` source must then be ``{kind: zero}``).

    Raises:
        IncompatibleCheckpointsError: a tokenizer that cannot be loaded or does not fit its model's rows.
        InvalidParameterError: a ``tokens`` entry whose source lacks the token (or the row).
    """
    why = f"tokenizer_source: {options.source if isinstance(options.source, str) else 'a model'}"
    names = vocabulary_names(adapter, stores[0])
    embedding = min(names, key=lambda n: (not adapter.is_embedding(n), n))
    rows = [store.shapes[embedding][0] for store in stores]
    tokenizers = [_load_tokenizer(store.ref.path, store.ref.name, why) for store in stores]
    vocabs = []
    for i, (tokenizer, store) in enumerate(zip(tokenizers, stores)):
        vocab = tokenizer.get_vocab()
        beyond = sorted((t for t, idx in vocab.items() if idx >= rows[i]), key=vocab.get)
        if beyond and i == 0:
            raise IncompatibleCheckpointsError(
                f"The tokenizer of the base {store.ref.name!r} has {len(beyond)} token(s) at ids beyond its "
                f"{rows[i]} embedding rows (e.g. {beyond[:3]}); give the base a tokenizer that fits its weights.")
        vocabs.append({t: idx for t, idx in vocab.items() if idx < rows[i]})  # mergekit: such tokens are absent
    base_vocab = tokenizers[0].get_vocab()
    if options.source == "union":
        output = _union(tokenizers, vocabs, stores[0].ref.path)
    elif options.source == "base":
        output = copy.deepcopy(tokenizers[0])
    else:
        output = copy.deepcopy(tokenizers[options.source])
    known = set(output.get_vocab())
    for token in options.tokens:
        if token not in known:
            output.add_tokens(token)
            known.add(token)
    vocab = output.get_vocab()
    if sorted(vocab.values()) != list(range(len(vocab))):
        raise IncompatibleCheckpointsError(f"The output tokenizer ({why}) numbers its {len(vocab)} tokens with gaps; "
                                           "each id must index one row.")
    tokens_by_id = sorted(vocab, key=vocab.get)
    own = [torch.tensor([v.get(t, -1) for t in tokens_by_id], dtype=torch.long) for v in vocabs]
    members = [*range(1, len(stores)), *([0] if base_is_reference else [])]
    if not members:
        members = [0]
    fills: dict[int, tuple[str, list[tuple[int, int]]]] = {}
    for token_id, token in enumerate(tokens_by_id):
        rule = options.tokens.get(token)
        present = [i for i in members if own[i][token_id] >= 0]
        if isolated:
            if rule is not None and rule.source not in (None, ZERO):
                raise InvalidParameterError(f"tokenizer_source.tokens[{token!r}]: a passthrough takes each tensor "
                                            "from one model, so a token's row cannot come from another (mergekit "
                                            "fails on it); use source: {kind: zero} or drop the entry.")
            if rule is not None and rule.force:
                for table in own:
                    table[token_id] = -1
            elif not any(table[token_id] < 0 for table in own):
                continue
            elif rule is not None and rule.source is None:
                raise InvalidParameterError(f"tokenizer_source.tokens[{token!r}] has no source, and a model lacks the "
                                            "token: use source: {kind: zero}.")
            fills[token_id] = (ZERO, [])
            continue
        if rule is None:
            if len(present) == len(members):
                continue
            if len(present) == 1:
                fills[token_id] = ("row", [(present[0], int(own[present[0]][token_id]))])
            elif not present:
                fills[token_id] = (ZERO, [])
            elif base_is_reference and own[0][token_id] >= 0:
                fills[token_id] = ("row", [(0, int(own[0][token_id]))])
            else:
                fills[token_id] = ("mean", [(i, int(own[i][token_id])) for i in present])
            continue
        if not rule.force and len(present) == len(members):
            continue
        fills[token_id] = _rule_fill(rule, token, token_id, own, vocabs, rows, stores)
        if rule.force:
            for table in own:
                table[token_id] = -1
    size = len(vocab)
    if options.pad_to_multiple_of and size % options.pad_to_multiple_of:
        size += options.pad_to_multiple_of - size % options.pad_to_multiple_of
    if size > MAX_PAD_FACTOR * len(vocab):  # checked before any row is allocated
        raise InvalidParameterError(
            f"tokenizer_source.pad_to_multiple_of={options.pad_to_multiple_of} would give the embedding {size} rows "
            f"for the {len(vocab)} tokens of the merged vocabulary; padding may at most double the rows (use a "
            f"multiple such as 8, 64 or 128, at most {MAX_PAD_FACTOR * len(vocab)} here).")
    identity = [size == rows[i] and bool(torch.equal(own[i], torch.arange(len(vocab)))) for i in range(len(stores))]
    return VocabularyPlan(tokenizer=output, size=size, names=names, own=own, fills=dict(sorted(fills.items())),
                          identity=identity, added=[t for t in tokens_by_id if t not in base_vocab])


def _rule_fill(rule: TokenRule, token: str, token_id: int, own: list[torch.Tensor], vocabs: list[dict[str, int]],
               rows: list[int], stores: list[TensorStore]) -> tuple[str, list[tuple[int, int]]]:
    where = f"tokenizer_source.tokens[{token!r}]"
    if rule.source is None:
        lacking = [stores[i].ref.name for i, table in enumerate(own) if table[token_id] < 0]
        raise InvalidParameterError(f"{where} has no source, and {lacking[:3]} lack(s) the token: name the row it "
                                    "takes (source: a model, {kind: model_token, ...} or {kind: zero}).")
    if rule.source == ZERO:
        return (ZERO, [])
    i = rule.source
    name = stores[i].ref.name
    if rule.token_id is not None:
        row = rule.token_id
        if row >= rows[i]:
            raise InvalidParameterError(f"{where}.source.token_id {row} is beyond the {rows[i]} rows of {name!r}.")
    else:
        wanted = rule.token if rule.token is not None else token
        if wanted not in vocabs[i]:
            raise InvalidParameterError(f"{where} takes the row of {wanted!r} from {name!r}, whose tokenizer has no "
                                        "such token.")
        row = vocabs[i][wanted]
    return ("row", [(i, row)])


def _union(tokenizers: list[Any], vocabs: list[dict[str, int]], base_path: str) -> Any:
    """The base's tokenizer plus every token the others add: first their ordinary vocabulary entries, then their
    added tokens (with the first model's settings for each), models in order, each model's tokens by id."""
    from transformers import AutoTokenizer

    from .._logging import quiet_transformers

    with quiet_transformers(True):  # a fresh copy: the base's tokenizer itself stays the base's
        out = AutoTokenizer.from_pretrained(base_path, trust_remote_code=False)
    added: dict[str, Any] = {}
    for tokenizer, vocab in zip(tokenizers, vocabs):
        for idx, info in sorted(tokenizer.added_tokens_decoder.items()):
            if vocab.get(info.content) == idx and info.content not in added:
                added[info.content] = info
    base_vocab = tokenizers[0].get_vocab()
    ordinary: dict[str, None] = {}
    for vocab in vocabs:
        for token in sorted(vocab, key=vocab.get):
            if token not in base_vocab and token not in added:
                ordinary.setdefault(token)
    for token in ordinary:
        out.add_tokens(token)
    for info in added.values():
        out.add_tokens(info)
    return out


__all__ = ["AlignedStore", "TokenRule", "VocabularyOptions", "VocabularyPlan", "build_vocabulary",
           "vocabulary_names"]


def plan_for_run(value: Any, stores: list[TensorStore], adapter: ModelAdapter, *, base_is_reference: bool,
                 isolated: bool = False, loaded: Sequence[bool] = ()) -> VocabularyPlan | None:
    """The vocabulary plan of a run's ``tokenizer_source`` (None: the inputs are read as they are).

    ``tokenizer_source: base`` with no ``tokens`` or padding is the base's vocabulary as it is where the model has
    no token embeddings (a vision merge keeps the base's processor), or where every input shares the base's rows
    and tokenizer; otherwise every input's tokenizer is read and the rows aligned.

    Raises:
        IncompatibleCheckpointsError / InvalidParameterError: see :func:`build_vocabulary`; LoRA adapter or loaded
            model inputs (their tokenizers are not folders of their own).
    """
    options = VocabularyOptions.parse(value, [s.ref.name for s in stores])
    keeps_base = options.source == "base" and not options.tokens and options.pad_to_multiple_of is None
    whole = getattr(adapter, "whole_model", False) and not getattr(adapter, "vocabulary_merges", False)
    if keeps_base and (whole or getattr(adapter, "modality", "image") != "text"):
        return None
    if whole:
        raise InvalidParameterError("tokenizer_source aligns the vocabulary of a text model (Llama, Qwen2, Mistral, "
                                    "BERT...); a whole two-tower model is not one. Drop tokenizer_source.")
    for store, is_loaded in zip(stores, [*loaded, *[False] * len(stores)]):
        if is_loaded or hasattr(store.ref, "open_store"):
            kind = "a loaded model" if is_loaded else "a LoRA adapter"
            raise InvalidParameterError(f"tokenizer_source reads every input's tokenizer from its folder, and "
                                        f"{store.ref.name!r} is {kind}; pass model folders saved with their "
                                        "tokenizers (merge a LoRA adapter into its model first).")
    if keeps_base:
        names = vocabulary_names(adapter, stores[0])
        rows = stores[0].shapes[min(names, key=lambda n: (not adapter.is_embedding(n), n))][0]
        if all(store.shapes.get(n) == stores[0].shapes[n] for store in stores[1:] for n in names):
            base_vocab = tokenizer_file_vocab(stores[0].ref.path)
            if base_vocab is not None and max(base_vocab.values(), default=-1) + 1 == rows and \
                    all(tokenizer_file_vocab(s.ref.path) in (None, base_vocab) for s in stores[1:]):
                return None  # every model has the base's rows and tokens: the base's vocabulary as it is
    return build_vocabulary(options, stores, adapter, base_is_reference=base_is_reference, isolated=isolated)


TOKENIZER_FILE = "tokenizer.json"


def tokenizer_file_vocab(path: str | None) -> dict[str, int] | None:
    """token -> id of a folder's ``tokenizer.json`` (model vocabulary + added tokens), or None (no such file, or one
    this reader does not understand)."""
    import json
    from pathlib import Path

    file = Path(path) / TOKENIZER_FILE if path else None
    if file is None or not file.is_file():
        return None
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
        model_vocab = (data.get("model") or {}).get("vocab") or {}
        if isinstance(model_vocab, list):  # Unigram: [[piece, score], ...]
            vocab = {entry[0]: i for i, entry in enumerate(model_vocab)}
        else:
            vocab = {str(token): int(i) for token, i in model_vocab.items()}
        for added in data.get("added_tokens") or []:
            vocab[str(added["content"])] = int(added["id"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError, IndexError):
        return None
    return vocab
