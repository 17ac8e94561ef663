"""The benchmark plot: output tok/s against concurrency for every system, and TTFT percentiles."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from serve_app.bench.stats import BenchRow


def plot_rows(rows: Sequence[BenchRow], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_system: dict[str, list[BenchRow]] = defaultdict(list)
    for row in rows:
        by_system[row.system].append(row)
    fig, (tput, ttft) = plt.subplots(1, 2, figsize=(12, 4.5))
    for system, system_rows in by_system.items():
        system_rows.sort(key=lambda r: r.concurrency)
        x = [r.concurrency for r in system_rows]
        marker = "o-" if len(x) > 1 else "s"
        tput.plot(x, [r.output_tok_s for r in system_rows], marker, label=system)
        line = ttft.plot(x, [r.ttft_p50_s for r in system_rows], marker, label=f"{system} p50")[0]
        ttft.plot(x, [r.ttft_p99_s for r in system_rows], "--" if len(x) > 1 else "^", color=line.get_color(), label=f"{system} p99")
    for axis in (tput, ttft):
        axis.set_xscale("log", base=2)
        axis.set_xlabel("concurrency (requests in flight)")
        axis.grid(True, alpha=0.3)
    tput.set_ylabel("output tokens / s")
    tput.set_title("throughput")
    ttft.set_ylabel("time to first token (s)")
    ttft.set_yscale("log")
    ttft.set_title("TTFT")
    tput.legend(fontsize=8)
    ttft.legend(fontsize=7, ncol=2)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
