"""benchmarks.pyspy_tree: the call tree below one function, against counts made by hand from the stacks."""

from benchmarks.pyspy_tree import call_tree, flat_shares, frame_name, stacks_below, tree_rows

ROOT = "ModelRunnerV2.call_step (/r/v2.py:437)"
RUN_GPU_ASYNC = "xla::RunGpuAsync(xla::LocalExecutable&, int) (xla_cuda_plugin.so)"
PROFILE = [
    # the call: jax's fast path into XLA's execute (C++ frames as py-spy --native writes them)
    f"process 7;<module> (loop.py:12);{ROOT};Compiled.__call__ (/j/stages.py:9);"
    f"jax::PjitFunction::Call (jaxlib/libjax_common.so);{RUN_GPU_ASYNC} 60\n",
    f"process 7;<module> (loop.py:12);{ROOT};Compiled.__call__ (/j/stages.py:9);"
    "jax::PjitFunction::Call (jaxlib/libjax_common.so) 20\n",
    # the old state's arrays freed, and a frame lost by the unwinder (PjitFunction::Call missing)
    f"process 7;<module> (loop.py:12);{ROOT};PyArray_tp_dealloc (jaxlib/libjax_common.so) 15\n",
    f"process 7;<module> (loop.py:12);{ROOT};Compiled.__call__ (/j/stages.py:9);"
    f"{RUN_GPU_ASYNC} 5\n",
    # waiting for the device: outside the root
    "process 7;<module> (loop.py:13);block_until_ready (/j/api.py:3) 300\n",
]


def test_frame_names_drop_files_and_keep_cpp_signatures():
    assert frame_name("Compiled.__call__ (/j/stages.py:9)") == "Compiled.__call__"
    assert frame_name("xla::RunGpuAsync(xla::LocalExecutable&, int) (xla_cuda_plugin.so)") == \
        "xla::RunGpuAsync(xla::LocalExecutable&, int)"


def test_tree_shares_are_the_stacks_counts():
    stacks = stacks_below(PROFILE, "ModelRunnerV2.call_step")
    assert sum(n for _, n in stacks) == 100  # the wait outside the root is left out
    rows = {(depth, name): (inc, own) for depth, name, inc, own in tree_rows(call_tree(stacks), 100, 0.0)}
    assert rows[(0, "ModelRunnerV2.call_step")] == (100.0, 0.0)
    assert rows[(1, "Compiled.__call__")] == (85.0, 0.0)
    assert rows[(2, "jax::PjitFunction::Call")] == (80.0, 20.0)
    assert rows[(3, "xla::RunGpuAsync(xla::LocalExecutable&, int)")] == (60.0, 60.0)
    assert rows[(2, "xla::RunGpuAsync(xla::LocalExecutable&, int)")] == (5.0, 5.0)  # hung one level high
    assert rows[(1, "PyArray_tp_dealloc")] == (15.0, 15.0)
    # --min-share leaves out the small nodes only
    kept = {name for _, name, _, _ in tree_rows(call_tree(stacks), 100, 10.0)}
    assert "PyArray_tp_dealloc" in kept and "xla::RunGpuAsync(xla::LocalExecutable&, int)" in kept
    assert len(tree_rows(call_tree(stacks), 100, 10.0)) == 5


def test_flat_shares_count_a_function_once_wherever_it_sits():
    flat = flat_shares(stacks_below(PROFILE, "ModelRunnerV2.call_step"))
    assert flat["xla::RunGpuAsync(xla::LocalExecutable&, int)"] == 65
    assert flat["Compiled.__call__"] == 85
    assert "block_until_ready" not in flat
