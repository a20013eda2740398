"""Side by side with vLLM on the same GPU: one random-dataset workload through vLLM 0.22.1
(Model Runner V2 and V1) and through mrv2-jax (v1, v2-sync, v2-async), arms alternating, each in
its own process; one JSON, one table, one plot (output tok/s per arm, ratio to vLLM MRV2).

    mrv2-jax bench compare --settings s1-256,s2 --output-json compare.json --plot compare.png

Settings (Qwen3-0.6B architecture, dummy bf16 weights, block size 16, prefix caching on, token
budget 8192, the same prompts in every arm):
    s1-256    input 128 / output 512, 1000 prompts, max_num_seqs 256
    s1-1024   input 128 / output 512, 1000 prompts, max_num_seqs 1024
    s2        input 1024 / output 128, 1000 prompts, max_num_seqs 1024
    batch1    input 128 / output 512, 10 prompts, max_num_seqs 1 (1000 would take 20 minutes)
Sampling: temperature 1.0, top_p 1, ignore_eos, as `vllm bench throughput` (--temperature 0 for
greedy in every arm). No detokenization in any arm unless --detokenize (the preset has no
tokenizer; vLLM then uses the one in --vllm-model).

vLLM runs only where it imports: `pip install vllm==0.22.1` beside the project, or on a machine
without a registry the payload of ../shared/peers/vllm (then --vllm-site /tmp/site --vllm-model
/tmp/qwen3-0.6b). Where it does not import, its arms are reported as skipped with the reason.
Each arm prints its progress; --settings and --arms keep one call short, and --merge joins the
JSON files of several calls into one table and plot.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from mrv2_jax import envs
from mrv2_jax.bench.environment import describe_environment, write_report

REPO_ROOT = str(Path(__file__).resolve().parents[2])

SETTINGS = {  # name -> (input_len, output_len, num_prompts, max_num_seqs)
    "s1-256": (128, 512, 1000, 256),
    "s1-1024": (128, 512, 1000, 1024),
    "s2": (1024, 128, 1000, 1024),
    "batch1": (128, 512, 10, 1),
}
# Alternating engines, so that drift of the machine (clocks, neighbours) spreads over both.
ARMS = ("vllm-mrv2", "mrv2-v2-async", "vllm-v1", "mrv2-v1", "mrv2-v2-sync")
MRV2_ARMS = {"mrv2-v1": ["--runner", "v1"], "mrv2-v2-sync": ["--runner", "v2", "--no-async-scheduling"],
             "mrv2-v2-async": ["--runner", "v2"]}
VLLM_ARMS = {"vllm-mrv2": "1", "vllm-v1": "0"}
BASELINE = "vllm-mrv2"
NOTES = [
    ("Same prompts (token ids), sampling, dtype, max_num_seqs, max_num_batched_tokens, max_model_len, "
     "block size and prefix caching in every arm; weights are random (dummy) in both engines."),
    ("vLLM runs with torch.compile + CUDA graphs (its defaults) and FlashAttention (--attention-backend "
     "FLASH_ATTN); mrv2-jax with its compiled buckets and its Pallas attention kernel."),
    "mrv2-jax pads a step to its bucket (powers of two from 8 tokens): batch 1 decodes in an 8-row bucket.",
    "mrv2-jax's v2-sync arm has no vLLM counterpart (vLLM's runners both schedule asynchronously).",
]


def vllm_env(args, runner_flag: str) -> dict:
    """The environment of a vLLM process: its packages first, then this repository (for the arm's
    module), and the switches ../shared/peers/vllm/README.md names."""
    path = os.pathsep.join(filter(None, [args.vllm_site, REPO_ROOT, envs.read_external("PYTHONPATH")]))
    return envs.subprocess_env(PYTHONPATH=path, VLLM_USE_V2_MODEL_RUNNER=runner_flag, HF_HUB_OFFLINE="1",
                               VLLM_NO_USAGE_STATS="1", VLLM_USE_FLASHINFER_SAMPLER="0")


def vllm_available(args) -> tuple[bool, str]:
    """Whether vLLM imports in its environment; (False, why) if not."""
    try:
        run = subprocess.run([args.vllm_python, "-c", "import vllm; print(vllm.__version__)"], capture_output=True,
                             text=True, timeout=300, env=vllm_env(args, "1"), check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        return False, f"could not run {args.vllm_python}: {e}"
    if run.returncode != 0:
        last = (run.stderr.strip().splitlines() or ["(no output)"])[-1]
        return False, f"vllm does not import ({last}); see `bench compare --help`"
    return True, run.stdout.strip()


def max_model_len(input_len: int, output_len: int) -> int:
    """Room for the prompt and the output, rounded up to a multiple of 256."""
    return -(-(input_len + output_len) // 256) * 256


def arm_command(arm: str, setting: str, args, out_json: str) -> tuple[list[str], dict]:
    input_len, output_len, num_prompts, max_num_seqs = SETTINGS[setting] if setting != "custom" else args.custom
    common = ["--input-len", str(input_len), "--output-len", str(output_len), "--num-prompts", str(num_prompts),
              "--max-num-seqs", str(max_num_seqs), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
              "--max-model-len", str(max_model_len(input_len, output_len)), "--temperature", str(args.temperature),
              "--warmup-prompts", str(args.warmup_prompts), "--output-json", out_json]
    if not args.prefix_caching:
        common.append("--no-prefix-caching")
    if args.structured_outputs:
        common.append(f"--structured-outputs={args.structured_outputs}")
    if arm in VLLM_ARMS:
        cmd = [args.vllm_python, "-m", "mrv2_jax.bench.vllm_throughput", "--model", args.vllm_model, *common,
               *(["--detokenize"] if args.detokenize else []), *[f"--vllm-arg={a}" for a in args.vllm_arg or []]]
        return cmd, vllm_env(args, VLLM_ARMS[arm])
    cmd = [sys.executable, "-m", "mrv2_jax.bench.throughput", "--model", args.model, "--load-format", "dummy",
           "--dtype", "bfloat16", *MRV2_ARMS[arm], *common,
           *(["--tokenizer", args.vllm_model] if args.detokenize or args.structured_outputs else []),
           *(args.mrv2_arg or [])]
    path = os.pathsep.join(filter(None, [REPO_ROOT, envs.read_external("PYTHONPATH")]))
    return cmd, envs.subprocess_env(PYTHONPATH=path)


def run_arm(arm: str, setting: str, args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "arm.json")
        cmd, env = arm_command(arm, setting, args, out)
        t0 = time.perf_counter()
        try:
            run = subprocess.run(cmd, env=env, timeout=args.arm_timeout, check=False)
            rc = run.returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        wall = time.perf_counter() - t0
        if rc != 0 or not os.path.exists(out):
            return {"error": f"exit {rc} after {wall:.0f} s (output above)", "process_s": wall}
        with open(out) as f:
            result = json.load(f)
    keep = ("output_tokens_per_s", "total_tokens_per_s", "requests_per_s", "elapsed_s", "startup_s",
            "num_output_tokens", "num_input_tokens", "vllm_version", "runner", "async_scheduling", "engine_argv",
            "num_fused_calls", "startup_split", "structured_validity")
    return {k: result[k] for k in keep if k in result} | {"process_s": wall}


def summarize(runs: list[dict]) -> dict:
    """Median over the repeats of an arm (a failed repeat is reported, not averaged in)."""
    ok = [r for r in runs if "output_tokens_per_s" in r]
    if not ok:
        return {"error": runs[0].get("error") or runs[0].get("skipped"), "repeats": runs} if runs else {}
    med = {k: statistics.median(r[k] for r in ok) for k in ("output_tokens_per_s", "total_tokens_per_s",
                                                            "requests_per_s", "elapsed_s", "startup_s")}
    return med | {"repeats": runs}


def table_rows(results: dict) -> list[dict]:
    rows = []
    for setting, arms in results.items():
        base = arms.get(BASELINE, {}).get("output_tokens_per_s")
        for arm in ARMS:
            r = arms.get(arm)
            if r is None:
                continue
            tps = r.get("output_tokens_per_s")
            rows.append({"setting": setting, "arm": arm, "output_tokens_per_s": tps,
                         "total_tokens_per_s": r.get("total_tokens_per_s"), "startup_s": r.get("startup_s"),
                         "vs_vllm_mrv2": tps / base if (tps and base) else None,
                         "status": r.get("skipped") and f"skipped: {r['skipped']}" or
                                   (r.get("error") and f"failed: {r['error']}") or "ok"})
    return rows


def print_table(rows: list[dict], temperature) -> None:
    fmt = lambda v, f: format(v, f) if v is not None else "-"
    print(f"\n{'setting':9} {'arm':14} {'out tok/s':>10} {'total tok/s':>12} {'vs vLLM MRV2':>13} {'startup s':>10}"
          f"   (temperature {temperature})")
    for r in rows:
        line = (f"{r['setting']:9} {r['arm']:14} {fmt(r['output_tokens_per_s'], '10.0f')} "
                f"{fmt(r['total_tokens_per_s'], '12.0f')} {fmt(r['vs_vllm_mrv2'], '12.2f')}x "
                f"{fmt(r['startup_s'], '10.1f')}")
        print(line if r["status"] == "ok" else f"{line}  {r['status']}")


def plot(report: dict, path: str) -> str:
    """Output tok/s bars per arm, one panel per setting, each bar labelled with its ratio to
    vLLM MRV2."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = list(report["results"])
    fig, axes = plt.subplots(1, len(settings), figsize=(4.2 * len(settings), 4.2), squeeze=False)
    colors = {arm: f"C{i}" for i, arm in enumerate(ARMS)}
    for ax, setting in zip(axes[0], settings):
        rows = [r for r in report["table"] if r["setting"] == setting and r["output_tokens_per_s"]]
        bars = ax.bar([r["arm"] for r in rows], [r["output_tokens_per_s"] for r in rows],
                      color=[colors[r["arm"]] for r in rows])
        for bar, r in zip(bars, rows):
            if r["vs_vllm_mrv2"] is not None:
                ax.annotate(f"{r['vs_vllm_mrv2']:.2f}x", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                            ha="center", va="bottom", xytext=(0, 3), textcoords="offset points", fontsize=9)
        i, o, n, seqs = SETTINGS.get(setting) or report.get("settings", {}).get("custom") or ("?",) * 4
        ax.set_title(f"{setting}: in {i} / out {o}, {n} prompts, {seqs} seqs", fontsize=9)
        ax.set_ylabel("output tokens / s")
        ax.tick_params(axis="x", labelrotation=30, labelsize=8)
        if rows:
            ax.set_ylim(0, max(r["output_tokens_per_s"] for r in rows) * 1.15)
    fig.suptitle(f"mrv2-jax vs vLLM {report.get('vllm_version') or ''} (ratio to vLLM MRV2) · "
                 f"{report.get('device', '?')} · {report.get('git_sha', '?')}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def run_all(args) -> dict:
    ok, vllm_version = vllm_available(args) if any(a in VLLM_ARMS for a in args.arms) else (False, "not asked for")
    if not ok:
        print(f"vLLM arms skipped: {vllm_version}", flush=True)
    results = {s: {a: [] for a in args.arms} for s in args.settings}
    plan = [(s, a) for s in args.settings for _ in range(args.repeats) for a in args.arms]
    runnable = [(s, a) for s, a in plan if ok or a not in VLLM_ARMS]
    t_start = time.perf_counter()
    for n, (setting, arm) in enumerate(runnable, 1):
        print(f"\n=== [{n}/{len(runnable)}] {setting} {arm} ({time.perf_counter() - t_start:.0f} s so far)",
              flush=True)
        result = run_arm(arm, setting, args)
        results[setting][arm].append(result)
        shown = (f"{result['output_tokens_per_s']:.0f} output tok/s (startup {result.get('startup_s', 0):.0f} s, "
                 f"process {result['process_s']:.0f} s)" if "output_tokens_per_s" in result else result["error"])
        if result.get("structured_validity"):
            shown += f", structured outputs {result['structured_validity']}"
        print(f"=== {setting} {arm}: {shown}", flush=True)
    summary = {s: {a: (summarize(runs) if runs else {"skipped": vllm_version}) for a, runs in arms.items()}
               for s, arms in results.items()}
    return {"vllm_version": vllm_version if ok else None, "results": summary}


def merge_reports(paths: list[str]) -> dict:
    """Join the `results` of several compare reports (later files win per setting and arm)."""
    merged: dict = {}
    for path in paths:
        with open(path) as f:
            report = json.load(f)
        base = {k: v for k, v in report.items() if k not in ("results", "table")}
        merged = base | {"results": merged.get("results", {})} | {"merged_from": merged.get("merged_from", []) + [path]}
        for setting, arms in report["results"].items():
            merged["results"].setdefault(setting, {}).update(arms)
    return merged


def parse_args(argv=None, prog=None):
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--settings", default="s1-256", type=lambda s: s.split(","),
                   help=f"comma-separated, from {', '.join(SETTINGS)} (default s1-256)")
    p.add_argument("--arms", default=",".join(ARMS), type=lambda s: s.split(","),
                   help=f"comma-separated, run in this order (default {','.join(ARMS)})")
    p.add_argument("--repeats", type=int, default=1, help="rounds over the arms; the table shows medians")
    p.add_argument("--model", default="qwen3-0.6b", help="mrv2-jax's model (a preset; dummy weights)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--detokenize", action="store_true", help="detokenize in every arm (tokenizer of --vllm-model)")
    p.add_argument("--warmup-prompts", type=int, default=32, help="untimed prompts of their own before each run")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false")
    p.add_argument("--structured-outputs", default=None, metavar="JSON",
                   help="StructuredOutputsParams fields given to every timed request in every arm (vLLM: its "
                        "default backend, xgrammar for JSON schemas); mrv2-jax's arms need --vllm-model's tokenizer")
    p.add_argument("--vllm-python", default=sys.executable, help="the Python that has vLLM (default: this one)")
    p.add_argument("--vllm-site", default=envs.read("MRV2_VLLM_SITE"),
                   help="a folder put first on vLLM's PYTHONPATH, e.g. /tmp/site (default $MRV2_VLLM_SITE)")
    p.add_argument("--vllm-model", default=envs.read("MRV2_VLLM_MODEL"),
                   help="a Qwen3-0.6B directory for vLLM: config.json (+ tokenizer), the same architecture as "
                        "--model (default $MRV2_VLLM_MODEL or /tmp/qwen3-0.6b)")
    p.add_argument("--vllm-arg", action="append", help="one more vLLM engine argument (repeatable)")
    p.add_argument("--mrv2-arg", action="append", help="one more mrv2-jax engine argument (repeatable), e.g. "
                   "--mrv2-arg=--num-gpu-blocks --mrv2-arg=256")
    p.add_argument("--custom", default=None, metavar="IN,OUT,N,SEQS",
                   type=lambda s: tuple(int(x) for x in s.split(",")),
                   help="the 'custom' setting: input len, output len, prompts, max_num_seqs")
    p.add_argument("--arm-timeout", type=float, default=900.0, help="seconds before an arm's process is killed")
    p.add_argument("--output-json", default=None)
    p.add_argument("--plot", default=None, metavar="PATH", help="write the bars as a PNG")
    p.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                   help="run nothing: join these compare reports into one table (+ --plot, --output-json)")
    args = p.parse_args(argv)
    if ("custom" in args.settings) != (args.custom is not None) or (args.custom and len(args.custom) != 4):
        p.error("--settings custom and --custom IN,OUT,N,SEQS go together")
    for name, given, known in (("setting", args.settings, [*SETTINGS, "custom"]), ("arm", args.arms, ARMS)):
        unknown = set(given) - set(known)
        if unknown:
            p.error(f"unknown {name}(s): {', '.join(sorted(unknown))}")
    return args


def main(argv=None, prog=None):
    args = parse_args(argv, prog)
    if args.merge:
        report = merge_reports(args.merge)
    else:
        settings = {k: v for k, v in vars(args).items() if k not in ("merge",)}
        report = {**describe_environment(probe_device=False), "settings": settings, "notes": NOTES,
                  **run_all(args)}
    report["table"] = table_rows(report["results"])
    print_table(report["table"], report.get("settings", {}).get("temperature"))
    if args.output_json:
        write_report(report, args.output_json)
    if args.plot:
        print(f"wrote {plot(report, args.plot)}")
    return report


if __name__ == "__main__":
    main()
