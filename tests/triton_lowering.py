"""Lowering Pallas kernels to Triton IR on a machine without a GPU (kernel tests)."""

import types


def verify_triton_lowering(monkeypatch) -> list:
    """Patch jax so that `.lower(lowering_platforms=("cuda",))` builds the Triton modules of
    Pallas kernels without a GPU (the registration only needs the GPU's compute capability),
    and verify each module as it is built. Returns the list collecting the verification
    results, one per module."""
    # Private jax API; jax is pinned (pyproject), so a change here must fail, not skip silently.
    from jax._src.pallas.triton import pallas_call_registration as registration

    lowering = registration.lowering
    assert hasattr(registration, "gpu_info_lib"), "jax's Triton registration moved: update this helper"
    fake_gpu = types.SimpleNamespace(get_gpu_info=lambda: types.SimpleNamespace(compute_capability=90))
    monkeypatch.setattr(registration, "gpu_info_lib", fake_gpu)
    verified = []
    lower_module = lowering.lower_jaxpr_to_triton_module

    def lower_and_verify(*args, **kwargs):
        result = lower_module(*args, **kwargs)
        verified.append(result.module.operation.verify())
        return result

    monkeypatch.setattr(lowering, "lower_jaxpr_to_triton_module", lower_and_verify)
    return verified
