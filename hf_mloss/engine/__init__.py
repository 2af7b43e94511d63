"""The M-Loss engine: one gap kernel (kernel), one block walk (walk), scoring (score), the compatibility
report (compatibility) and the second-order theory (theory)."""
