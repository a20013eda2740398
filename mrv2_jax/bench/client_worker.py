"""A benchmark client process that stays up between runs: it imports its client once, then runs it
once per line on stdin (a JSON list: the client's command-line arguments) and answers each with one
JSON line, {"ok": true} or {"ok": false, "error": ...}. `bench serve-compare` keeps a few of these
(bench/client_pool.py) instead of starting a client process per concurrency level: vLLM's client
imports torch and vLLM, which took it tens of seconds a level.

    python -m mrv2_jax.bench.client_worker vllm|mrv2

The client's own printing goes to /dev/null; only the answers reach stdout. It runs under vLLM's
Python for the vLLM client, so it imports only the client it runs (and this package's light
`__init__`, which imports no JAX).
"""

import json
import os
import sys
import traceback


def vllm_client():
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    def run(argv):
        parser = FlexibleArgumentParser()
        add_cli_args(parser)
        main(parser.parse_args(argv))

    return run


def mrv2_client():
    from mrv2_jax.bench.serve import main

    return main


CLIENTS = {"vllm": vllm_client, "mrv2": mrv2_client}


def serve(kind: str) -> None:
    answers = os.fdopen(os.dup(1), "w")  # the protocol's channel; fd 1 itself goes to /dev/null
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    sys.stdout = open(1, "w", closefd=False)
    run = CLIENTS[kind]()
    answers.write(json.dumps({"ok": True, "ready": True}) + "\n")
    answers.flush()
    for line in sys.stdin:
        try:
            run(json.loads(line))
            answer = {"ok": True}
        except SystemExit as e:  # argparse and some clients exit instead of raising
            answer = {"ok": e.code in (0, None), "error": f"exited with {e.code}"}
        except Exception:
            answer = {"ok": False, "error": traceback.format_exc()[-1500:]}
        sys.stdout.flush()
        answers.write(json.dumps(answer) + "\n")
        answers.flush()


if __name__ == "__main__":
    serve(sys.argv[1])
