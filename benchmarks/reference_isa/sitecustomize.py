"""Imported by every Python process of the reference engine when `conveyor bench reference` runs
under CONVEYOR_CPU_ISA=avx2 (this folder is put first on its PYTHONPATH; see runtime/cpu_isa.py).

vLLM's CPU build chooses between its AVX2 and AVX-512 kernel libraries, and its attention and
GEMM variants, from torch's CPU feature queries, which read the hardware: they are answered here
as on an AVX2-only CPU, so it loads and runs what it runs on one. torch, oneDNN and MKL are held
to AVX2 by the environment variables the benchmark passes down, as for conveyor.
"""

try:
    import torch.cpu
except ImportError:  # a Python of that venv that is not the engine: nothing to hold back
    torch = None

for _query in (
    "_is_avx512_supported",
    "_is_avx512_bf16_supported",
    "_is_avx512_vnni_supported",
    "_is_amx_tile_supported",
    "_is_amx_fp16_supported",
):
    if torch is not None and hasattr(torch.cpu, _query):
        setattr(torch.cpu, _query, lambda: False)
