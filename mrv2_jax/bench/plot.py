"""A picture of a runner A/B report (mrv2_jax.bench.ab): needs matplotlib, drawn with Agg."""


def plot_ab(report: dict, path: str) -> str:
    """Write a PNG at `path`: left, output tok/s per arm (labelled with the ratio to v1, or to the
    first arm without v1); right, the steady-decode step's wall time vs device time per arm that
    has them (V2 arms). Returns `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = report["arms"]
    names = [r["arm"] for r in arms]
    tps = [r["output_tokens_per_s"] for r in arms]
    base = next((r for r in arms if r["arm"] == "v1"), arms[0])
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))

    bars = left.bar(names, tps, color=[f"C{i}" for i in range(len(arms))])
    for bar, r in zip(bars, arms):
        left.annotate(f"{r['output_tokens_per_s'] / base['output_tokens_per_s']:.2f}x vs {base['arm']}",
                      (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom",
                      xytext=(0, 3), textcoords="offset points", fontsize=9)
    left.set_ylabel("output tokens / s")
    left.set_title("throughput")
    left.set_ylim(0, max(tps) * 1.15)

    timed = [r for r in arms if r.get("steady_step_wall_ms") is not None
             or r.get("steady_step_device_ms") is not None]
    if timed:
        xs = range(len(timed))
        width = 0.38
        wall = [r.get("steady_step_wall_ms") or 0.0 for r in timed]
        dev = [r.get("steady_step_device_ms") or 0.0 for r in timed]
        right.bar([x - width / 2 for x in xs], wall, width, label="engine wall / step")
        right.bar([x + width / 2 for x in xs], dev, width, label="device (replayed)")
        for x, r in zip(xs, timed):
            if r.get("gpu_busy_fraction") is not None:
                right.annotate(f"busy {r['gpu_busy_fraction']:.0%}", (x, max(wall[x], dev[x])), ha="center",
                               va="bottom", xytext=(0, 3), textcoords="offset points", fontsize=9)
        right.set_xticks(list(xs), [r["arm"] for r in timed])
        right.set_ylabel("ms")
        right.set_ylim(0, max(wall + dev) * 1.35 or 1.0)
        right.legend(fontsize=8, loc="upper center", ncol=2)
        rows = timed[0].get("steady_decode_rows")
        right.set_title(f"steady-decode step ({rows} rows)" if rows else "steady-decode step")
    else:
        right.text(0.5, 0.5, "no steady-decode step captured\n(V2 arms only; raise the workload\n"
                   "or lower --capture-step)", ha="center", va="center", transform=right.transAxes)
        right.set_axis_off()

    s = report.get("settings", {})
    fig.suptitle(f"{s.get('model') or 'demo'} · in {s.get('input_len')} / out {s.get('output_len')} · "
                 f"{s.get('num_prompts')} prompts · max_num_seqs {s.get('max_num_seqs')} · "
                 f"{report.get('device', '?')} · {report.get('git_sha', '?')}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
