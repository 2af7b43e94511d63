"""The input side: Hub and local checkpoints (hub), lazy tensor stores (store), LoRA adapters read as
checkpoints (lora), merged vocabularies (vocab), unlabeled data as model inputs (data), and a run's opened inputs
(inputs)."""
