"""The child process of tests/runner/test_{tensor,pipeline,expert}_parallel.py: started once with 4 virtual
CPU devices, it makes tensor_parallel_run's, pipeline_parallel_run's and expert_parallel_run's runs
one after the other and prints one JSON line, {"tp": ..., "pp": ..., "ep": ...}. One process for the
three spares two process starts, and the tiny model's one-device run serves both tensor and pipeline
parallelism (its engine is the same one at either size 1). Each module also runs alone on GPUs
(scripts/gpu_check.sh)."""

import json
import sys

from tests.runner import expert_parallel_run, pipeline_parallel_run, tensor_parallel_run


def main() -> None:
    tp = tensor_parallel_run.results()
    pp = pipeline_parallel_run.results(one_device_tiny=tp["tiny"][1])
    print(json.dumps({"tp": tp, "pp": pp, "ep": expert_parallel_run.results()}), file=sys.stdout)


if __name__ == "__main__":
    main()
