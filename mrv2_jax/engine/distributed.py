"""One engine over several processes (hosts): multi-controller JAX (docs/parallelism.md, "Several
hosts").

Every process runs the same offline program on the same requests; its scheduler makes the same
steps in the same order, and each step is one SPMD program over the devices of every process
(tensor parallelism spanning them). `start` brings up `jax.distributed` once per process, before
anything asks JAX for its devices; the engine configuration calls it while it is built."""

from mrv2_jax import envs


def requested_processes(num_processes: int | None) -> int:
    """The run's process count: the argument, else $MRV2_NUM_PROCESSES, else 1."""
    return num_processes if num_processes is not None else envs.read("MRV2_NUM_PROCESSES") or 1


def check(num_processes: int, coordinator_address: str | None, process_id: int | None,
          tensor_parallel_size: int) -> None:
    """What a multi-process run needs, checked before any process waits for the others."""
    if not isinstance(num_processes, int) or isinstance(num_processes, bool) or num_processes < 1:
        raise ValueError(f"num_processes must be an int >= 1, got {num_processes!r}")
    if num_processes == 1:
        if coordinator_address is not None or process_id is not None:
            raise ValueError("coordinator_address / process_id need num_processes > 1 (a multi-process run)")
        return
    if process_id is not None and (not isinstance(process_id, int) or not 0 <= process_id < num_processes):
        raise ValueError(f"process_id must be an int in [0, {num_processes}), got {process_id!r}")
    if tensor_parallel_size % num_processes:
        raise ValueError(f"num_processes={num_processes}: the processes run one model split over all of their "
                         f"devices, so tensor_parallel_size must be a multiple of {num_processes} (that many "
                         f"devices from each process); got tensor_parallel_size={tensor_parallel_size}")


def start(num_processes: int, coordinator_address: str | None, process_id: int | None) -> int:
    """Start `jax.distributed` for this process (once: a later engine in the same process must name
    the same run) -> this process's id. An address or id left None is JAX's to find: its own
    JAX_COORDINATOR_ADDRESS, or a cluster it detects (SLURM, Open MPI, ...)."""
    import jax

    if not jax.distributed.is_initialized():
        # CPU devices reach other processes' through gloo (JAX's default), named so that a
        # version or setting with no cross-process CPU collectives cannot slip in.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        try:
            jax.distributed.initialize(coordinator_address, num_processes, process_id)
        except RuntimeError as e:
            raise ValueError(f"num_processes={num_processes}: jax.distributed did not start ({e}); build the "
                             "engine before anything else in this process uses JAX") from e
    if jax.process_count() != num_processes or process_id not in (None, jax.process_index()):
        raise ValueError(f"num_processes={num_processes}, process_id={process_id}: this process already runs as "
                         f"process {jax.process_index()} of {jax.process_count()}")
    return jax.process_index()


def refuse_serving(num_processes: int | None) -> None:
    """Serving across processes would need every process to see the same requests in the same
    order; only the offline API runs multi-process for now."""
    n = requested_processes(num_processes)
    if n > 1:
        raise ValueError(f"num_processes={n}: serving (mrv2-jax serve, AsyncLLM) is not supported across processes "
                         "yet; only the offline API (LLM.generate, mrv2-jax generate) runs multi-process")
