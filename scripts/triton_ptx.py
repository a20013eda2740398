"""What a Pallas Triton kernel compiles to on an NVIDIA GPU, found without one: the Triton modules Pallas
lowers a function's kernels to on this machine (the GPU's compute capability given as an H100's), compiled
to PTX for sm_90 by the `triton` package and measured by `ptxas -v` from the same wheel: registers and
spilled bytes a thread, shared memory, global loads by width, tensor-core instructions, async copies.
A kernel's tiling can then be checked (vectorised loads? spills? tensor cores?) before spending GPU time.

    pip install triton==3.6.0   # the GPU machine's version, in the project's venv or a scratch one;
                                # not a dependency of the project
    python scripts/triton_ptx.py gemv --n 1024 --k 2048 --rows 1 --block-n 1 --block-k 1024 --warps 8 \
        --epilogue residual

From Python: `triton_modules(fn, *args)` -> the Triton IR (text) of every Pallas Triton kernel that
`jax.jit(fn)` lowers to for CUDA (args: arrays or `jax.ShapeDtypeStruct`s); `ptx_facts(module, num_warps,
num_stages)` -> the figures above.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import re
import subprocess
import sys
import tempfile
import types
from pathlib import Path

import jax
import jax.numpy as jnp

INSTALL_HINT = "scripts/triton_ptx.py needs the `triton` package: pip install triton==3.6.0"


@contextlib.contextmanager
def _capturing_triton_modules():
    """Pallas's Triton registration asks the GPU for its compute capability (given here as 9.0) and
    lowers each kernel to a Triton module (collected here as text, without locations)."""
    from jax._src.pallas.triton import pallas_call_registration as registration  # private; jax is pinned

    lowering = registration.lowering
    saved = registration.gpu_info_lib, lowering.lower_jaxpr_to_triton_module
    modules = []

    def lower(*args, **kwargs):
        result = saved[1](*args, **kwargs)
        modules.append(result.module.operation.get_asm(enable_debug_info=False))
        return result

    registration.gpu_info_lib = types.SimpleNamespace(
        get_gpu_info=lambda: types.SimpleNamespace(compute_capability=90))
    lowering.lower_jaxpr_to_triton_module = lower
    try:
        yield modules
    finally:
        registration.gpu_info_lib, lowering.lower_jaxpr_to_triton_module = saved


def triton_modules(fn, *args) -> list[str]:
    """The Triton IR of each Pallas Triton kernel in `jax.jit(fn)` lowered for CUDA at `args`."""
    with _capturing_triton_modules() as modules:
        jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    return modules


def compile_module(module: str, num_warps: int, num_stages: int = 1):
    """`module` (Triton IR text) compiled for sm_90: triton's compiled kernel, whose `asm` holds each stage's
    text ("ttgir", "ptx", ...). SystemExit naming the install when `triton` is missing."""
    try:
        import triton
        from triton.backends.compiler import GPUTarget
    except ImportError:
        raise SystemExit(INSTALL_HINT) from None
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp, "kernel.ttir")
        source.write_text(module)
        return triton.compile(str(source), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": num_warps, "num_stages": num_stages})


def ptx_facts(module: str, num_warps: int, num_stages: int = 1) -> dict:
    """`module` (Triton IR text) compiled for sm_90 -> registers, spills, shared memory and instruction
    counts of its PTX. SystemExit naming the install when `triton` is missing."""
    kernel = compile_module(module, num_warps, num_stages)
    import triton  # present: compile_module has used it
    with tempfile.TemporaryDirectory() as tmp:
        ptx = kernel.asm["ptx"]
        ptx_file = Path(tmp, "kernel.ptx")
        ptx_file.write_text(ptx)
        ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
        report = subprocess.run([str(ptxas), "-arch=sm_90a", "-v", str(ptx_file), "-o", os.devnull],
                                capture_output=True, text=True, check=True).stderr

    def number(pattern):
        found = re.search(pattern, report)
        return int(found.group(1)) if found else 0

    widths = (m.group(1) for m in re.finditer(r"ld\.global(?:\.\w+)*?(?:\.(v[248]))?\.b\d+", ptx))
    loads = collections.Counter(width or "scalar" for width in widths)
    return {"registers": number(r"Used (\d+) registers"), "spill_stores": number(r"(\d+) bytes spill stores"),
            "spill_loads": number(r"(\d+) bytes spill loads"), "shared_bytes": kernel.metadata.shared,
            "global_loads": dict(sorted(loads.items())), "mma_sync": ptx.count("mma.sync"),
            "wgmma": ptx.count("wgmma.mma_async"), "cp_async": ptx.count("cp.async.")}


def _projection(args):
    """The projection kernel the arguments name, as fn and its args over a 28-layer stack."""
    S, bf16 = jax.ShapeDtypeStruct, jnp.bfloat16
    residual = args.epilogue == "residual"
    from pallas_kernels.gemv_triton import GemvConfig
    from pallas_kernels.gemv_triton import gemv as kernel
    config = GemvConfig(args.block_n, args.block_k, args.warps)

    def fn(x, w, layer, norm_weight, r):
        return kernel(x, w, layer=layer, norm_weight=norm_weight if args.norm else None, epilogue=args.epilogue,
                      residual=r if residual else None, config=config)

    shapes = (S((args.rows, args.k), bf16), S((28, args.n, args.k), bf16), S((), jnp.int32),
              S((28, args.k), bf16), S((args.rows, args.n), bf16))
    return fn, shapes


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("kernel", choices=("gemv",), help="pallas_kernels/gemv_triton")
    p.add_argument("--n", type=int, required=True, help="the weight's rows (outputs)")
    p.add_argument("--k", type=int, required=True, help="the weight's columns (inputs)")
    p.add_argument("--rows", type=int, default=1, help="rows of x")
    p.add_argument("--block-n", type=int, default=4)
    p.add_argument("--block-k", type=int, default=512)
    p.add_argument("--warps", type=int, default=8)
    p.add_argument("--norm", action="store_true", help="the RMSNorm before the product")
    p.add_argument("--epilogue", choices=("residual", "swiglu"), default=None)
    args = p.parse_args(argv)
    fn, shapes = _projection(args)
    facts = [ptx_facts(module, args.warps, 1) for module in triton_modules(fn, *shapes)]
    for f in facts:
        print(" ".join(f"{key} {value}" for key, value in f.items()), flush=True)
    return facts


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
