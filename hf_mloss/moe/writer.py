"""The streaming safetensors writer an MoE build writes its shards with (:mod:`hf_mloss.output.shards`, shared with
a merge whose output is written block by block)."""

from ..output.shards import INDEX, SINGLE, ShardWriter, parse_size

__all__ = ["INDEX", "SINGLE", "ShardWriter", "parse_size"]
