"""How far RegMean and RegMean++ merged on a CUDA device land from the same merge on the CPU, and why.

A diagnostic, run where a GPU exists: a tiny CLIP vision tower and 3 fine-tunes (``examples.tiny``), 6 random
32 px images, pooled or each model on its own share; each run prints the largest absolute difference of any merged
tensor and how many tensors fall outside rtol 1e-3 / atol 1e-5. Then RegMean++ on each model's own 2 images with
one thing changed at a time: float64 Gram products on the GPU, no reused block buffers, cuDNN off, the plain
attention kernel. ``results/cuda_gram_precision_h200.json`` holds one run's printed output (before the Gram
products became float64 on data-centre GPUs; ``hf_mloss.engine.gram.FULL_RATE_FLOAT64``).

    python benchmarks/cuda_gram_precision.py
"""

from __future__ import annotations

import tempfile

import torch

import hf_mloss
from examples.tiny import make_tiny_setup
from hf_mloss.engine import gram, walk


def main() -> None:
    print("tf32 matmul", torch.backends.cuda.matmul.allow_tf32, "cudnn", torch.backends.cudnn.allow_tf32, flush=True)
    base, models = make_tiny_setup(tempfile.mkdtemp(prefix="cuda_gram_precision_"), q=3, seed=0)
    base, models = str(base), [str(m) for m in models]
    pixels = torch.rand(6, 3, 32, 32, generator=torch.Generator().manual_seed(0))

    def run(method: str, own: bool, device: str, per: int = 2) -> dict[str, torch.Tensor]:
        if own:
            entries = [{"model": m, "data": pixels[per * i % 6: per * i % 6 + per] if per < 6 else pixels}
                       for i, m in enumerate(models)]
            return hf_mloss.merge(base, entries, method, device=device, progress=False).model.state_dict()
        return hf_mloss.merge(base, models, method, data=pixels, device=device, progress=False).model.state_dict()

    def compare(label: str, cpu: dict[str, torch.Tensor], cuda: dict[str, torch.Tensor]) -> None:
        diffs = [(k, (cpu[k].float() - cuda[k].cpu().float()).abs().max().item()) for k in cpu
                 if cpu[k].is_floating_point()]
        off = [(k, d) for k, d in diffs
               if not torch.allclose(cuda[k].cpu().float(), cpu[k].float(), rtol=1e-3, atol=1e-5)]
        worst = max(diffs, key=lambda t: t[1])
        print(f"{label}: {len(off)} keys off; worst {worst[0]} {worst[1]:.3e}; first off {off[:3]}", flush=True)

    for method, own, per in [("regmean_plusplus", True, 2), ("regmean", True, 2), ("regmean_plusplus", False, 2),
                             ("regmean", False, 2), ("regmean_plusplus", True, 6), ("regmean_plusplus", True, 4)]:
        compare(f"{method} own={own} per={per}", run(method, own, "cpu", per), run(method, own, "cuda", per))
    reference = run("regmean_plusplus", True, "cpu")
    dtypes, views = gram.gram_dtypes, walk.BlockArena.views
    gram.gram_dtypes = lambda device: (torch.float64, torch.float64)
    compare("rm++ own, float64 products on cuda", reference, run("regmean_plusplus", True, "cuda"))
    gram.gram_dtypes = dtypes
    walk.BlockArena.views = lambda self, like, device: {k: torch.empty_like(t, device=device) for k, t in like.items()}
    compare("rm++ own, no arena", reference, run("regmean_plusplus", True, "cuda"))
    walk.BlockArena.views = views
    torch.backends.cudnn.enabled = False
    compare("rm++ own, cudnn off", reference, run("regmean_plusplus", True, "cuda"))
    torch.backends.cudnn.enabled = True
    torch.backends.cuda.enable_flash_sdp(False)
    torch.backends.cuda.enable_mem_efficient_sdp(False)
    torch.backends.cuda.enable_cudnn_sdp(False)
    compare("rm++ own, math sdpa", reference, run("regmean_plusplus", True, "cuda"))


if __name__ == "__main__":
    main()
