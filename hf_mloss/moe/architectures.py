"""The MoE classes an MoE is written as (Mixtral, Qwen2-MoE, Qwen3-MoE), chosen as mergekit-moe chooses, and what
each holds: its config, its tensor names (the per-expert layout transformers' ``save_pretrained`` writes, which
transformers 4.x loads as is and 5.x fuses on load) and the order in which mergekit draws each expert's noise.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from .._validation import short
from ..errors import ConfigError, UnsupportedModelError
from .config import MoEConfig

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class OutputArchitecture:
    """One of mergekit-moe's output architectures (``name`` is mergekit's, matched by ``architecture:``)."""

    name: str
    model_type: str
    pretty: str
    inputs: tuple[str, ...]
    """Model types of the dense models it takes (all of one type)."""
    aliases: tuple[str, ...] = ()
    writable: bool = True

    def matches(self, wanted: str) -> bool:
        """mergekit's rule (a case-insensitive prefix of the name), or hf_mloss's aliases (``qwen2_moe``...)."""
        wanted = wanted.lower()
        return self.name.lower().startswith(wanted) or wanted in (self.model_type, *self.aliases)

    def why_not(self, config: MoEConfig, types: list[str]) -> str | None:
        """Why it cannot hold these experts (mergekit's ``supports_config``), or ``None``; ``types``: the model
        types of the base, the experts and the shared experts, in that order."""
        shared = config.shared_experts
        routed = types[: 1 + len(config.experts)]
        if self.model_type == "mixtral":
            if shared:
                return "it holds no shared expert"
            return _one_family(routed, self.inputs)
        if self.model_type == "deepseek":
            if shared and (shared[0].positive_prompts or shared[0].negative_prompts):
                return "it gates no shared expert"
            return _one_family(types, self.inputs)
        if self.model_type == "qwen2_moe":
            if len(shared) != 1:
                return "it needs exactly one shared expert (shared_experts)"
            if config.gate_mode != "random" and not shared[0].positive_prompts:
                return "its shared expert's gate row needs the shared expert's positive_prompts"
            return _one_family(types, self.inputs)
        if shared:
            return "it holds no shared expert"
        if any(t != "qwen3" for t in types):
            return f"it takes Qwen3 models only, got {sorted(set(types))}"
        return None


def _one_family(types: list[str], accepted: tuple[str, ...]) -> str | None:
    if len(set(types)) != 1:
        return f"its base and experts must be of one family, got model types {list(dict.fromkeys(types))}"
    if types[0] not in accepted:
        return f"it takes {' or '.join(accepted)} models, got {types[0]!r}"
    return None


MIXTRAL = OutputArchitecture("Mixtral", "mixtral", "Mixtral", ("llama", "mistral"))
DEEPSEEK = OutputArchitecture("DeepSeek MoE", "deepseek", "DeepSeek MoE", ("llama", "mistral"), writable=False)
QWEN2_MOE = OutputArchitecture("Qwen MoE", "qwen2_moe", "Qwen2-MoE", ("llama", "mistral", "qwen2"),
                               aliases=("qwen2", "qwen2-moe", "qwen2moe"))
QWEN3_MOE = OutputArchitecture("Qwen3 MoE", "qwen3_moe", "Qwen3-MoE", ("qwen3",), aliases=("qwen3-moe", "qwen3moe"))
ARCHITECTURES = (MIXTRAL, DEEPSEEK, QWEN2_MOE, QWEN3_MOE)
"""In mergekit's order, which decides between two that fit (Mixtral always wins)."""
WRITTEN = "mixtral (Mixtral), qwen (Qwen2-MoE) and qwen3 (Qwen3-MoE)"


def select_architecture(config: MoEConfig, types: list[str]) -> OutputArchitecture:
    """mergekit-moe's choice: the architectures ``architecture:`` names (all when unset) that can hold the experts;
    Mixtral if it is one of them, else the first. DeepSeek MoE, which mergekit writes as remote code, is refused.

    Raises:
        ConfigError: ``architecture`` names no output, or names DeepSeek MoE.
        UnsupportedModelError: no output can hold these experts (each one's reason given), or mergekit would write
            DeepSeek MoE.
    """
    candidates = list(ARCHITECTURES)
    if config.architecture:
        candidates = [a for a in candidates if a.matches(config.architecture)]
        if not candidates:
            raise ConfigError(f"architecture {short(config.architecture)} names no MoE output; hf_mloss writes "
                              f"{WRITTEN}.")
        if all(not a.writable for a in candidates):
            raise ConfigError(f"architecture {short(config.architecture)}: DeepSeek MoE is loaded from remote code "
                              f"on the Hub (trust_remote_code), which hf_mloss does not write; it writes {WRITTEN}.")
    reasons = {a: a.why_not(config, types) for a in candidates}
    fitting = [a for a in candidates if reasons[a] is None]
    if not fitting:
        said = "; ".join(f"{a.pretty}: {reasons[a]}" for a in candidates if a.writable)
        raise UnsupportedModelError(f"No MoE architecture can hold these experts ({said}).")
    choice = MIXTRAL if MIXTRAL in fitting else fitting[0]
    if not choice.writable:
        raise UnsupportedModelError(
            "A shared expert without prompts makes mergekit-moe write a DeepSeek MoE, which is loaded from remote "
            "code (trust_remote_code) and which hf_mloss does not write: give the shared expert positive_prompts "
            "for a Qwen2-MoE (or set architecture: qwen with gate_mode: random).")
    return choice


# -------------------------------------------------------------------------------------------------------- config
DROPPED_KEYS = ("architectures", "model_type", "transformers_version", "dtype", "torch_dtype", "_name_or_path",
                "auto_map")


def output_config(arch: OutputArchitecture, base_config: Any, num_experts: int, experts_per_token: int,
                  dtype: Any) -> Any:
    """The MoE's config: the base's, as the MoE class, with the expert counts mergekit writes."""
    import transformers

    values = {k: v for k, v in base_config.to_dict().items() if k not in DROPPED_KEYS}
    if arch is MIXTRAL:
        config = transformers.MixtralConfig(**values)
        config.num_local_experts = num_experts
        config.sliding_window = None
    elif arch is QWEN2_MOE:
        config = transformers.Qwen2MoeConfig(**values)
        config.num_experts = num_experts
        config.decoder_sparse_step = 1
        config.norm_topk_prob = True
        config.sliding_window = None
        config.use_sliding_window = False
        config.shared_expert_intermediate_size = base_config.intermediate_size
        config.moe_intermediate_size = base_config.intermediate_size
    else:
        config = transformers.Qwen3MoeConfig(**values)
        config.num_experts = num_experts
        config.decoder_sparse_step = 1
        config.norm_topk_prob = True
        config.moe_intermediate_size = base_config.intermediate_size
    config.num_experts_per_tok = experts_per_token
    config.architectures = [{"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                             "qwen3_moe": "Qwen3MoeForCausalLM"}[arch.model_type]]
    if dtype is not None:
        config.dtype = dtype
    return config


def legacy_keys(arch: OutputArchitecture, config: Any) -> dict[str, Any]:
    """Keys transformers 4.x reads where 5.x renamed them, added to ``config.json`` so both load it alike."""
    extra: dict[str, Any] = {}
    if arch is not MIXTRAL:
        extra["num_experts"] = config.num_experts
    rope = getattr(config, "rope_parameters", None)
    if isinstance(rope, dict) and "rope_theta" in rope:
        extra["rope_theta"] = rope["rope_theta"]
        if rope.get("rope_type", "default") != "default":
            extra["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    dtype = getattr(config, "dtype", None)
    if dtype is not None:
        extra["torch_dtype"] = str(dtype).removeprefix("torch.")
    return extra


# -------------------------------------------------------------------------------------------------------- tensors
def expert_tensor_name(arch: OutputArchitecture, layer: int, expert: int | None, projection: str) -> str:
    """Where expert ``expert``'s ``projection`` goes (``expert=None``: the shared expert), as transformers saves it."""
    if arch is MIXTRAL:
        short_name = {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}[projection]
        return f"model.layers.{layer}.block_sparse_moe.experts.{expert}.{short_name}.weight"
    if expert is None:
        return f"model.layers.{layer}.mlp.shared_expert.{projection}.weight"
    return f"model.layers.{layer}.mlp.experts.{expert}.{projection}.weight"


def router_names(arch: OutputArchitecture, layer: int) -> tuple[str, str | None]:
    """The router's tensor and the shared expert's gate (Qwen2-MoE) of ``layer``."""
    if arch is MIXTRAL:
        return f"model.layers.{layer}.block_sparse_moe.gate.weight", None
    shared = f"model.layers.{layer}.mlp.shared_expert_gate.weight" if arch is QWEN2_MOE else None
    return f"model.layers.{layer}.mlp.gate.weight", shared


def expert_order(arch: OutputArchitecture, num_experts: int, shared: bool) -> Iterator[tuple[int | None, str]]:
    """(expert, projection) of one layer in the order mergekit-moe reads them, which is the order of its noise
    draws: Mixtral per expert gate, down, up; Qwen3-MoE per expert gate, up, down; Qwen2-MoE per projection down,
    gate, up, each over the experts and then the shared expert."""
    if arch is QWEN2_MOE:
        for projection in ("down_proj", "gate_proj", "up_proj"):
            yield from ((j, projection) for j in range(num_experts))
            if shared:
                yield None, projection
        return
    order = ("gate_proj", "down_proj", "up_proj") if arch is MIXTRAL else ("gate_proj", "up_proj", "down_proj")
    for j in range(num_experts):
        yield from ((j, projection) for projection in order)
