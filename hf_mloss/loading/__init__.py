"""The input side: Hub and local checkpoints (hub), lazy tensor stores (store), LoRA adapters read as
checkpoints (lora), unlabeled data as model inputs (data), and a run's opened inputs (inputs)."""
