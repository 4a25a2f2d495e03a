"""The PNG: effective training time against the job's GPUs (log x), one line per strategy,
and the spare GPUs each pooled strategy needs. matplotlib is optional."""

from __future__ import annotations

from pathlib import Path

INSTALL_HINT = ("--png needs matplotlib: pip install matplotlib (or pip install -e .[report]); "
                "the table and the JSON need nothing more")


def draw(entries: list[dict], path: Path, title: str) -> None:
    """`entries`: report.entry dicts over several scales."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise RuntimeError(INSTALL_HINT) from e
    names = list(dict.fromkeys(e["name"] for e in entries))
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 8), sharex=True,
                                      gridspec_kw={"height_ratios": [3, 1.4]})
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, name in enumerate(names):
        pts = sorted((e["gpus"], e["effective_training_time"], e["spare_gpus"])
                     for e in entries if e["name"] == name)
        look = {"linestyle": "-" if name.startswith("deadpool") else "--",
                "marker": "x" if name.endswith("spread") else "o",
                "color": colours[i % len(colours)], "label": name}
        top.plot([p[0] for p in pts], [p[1] for p in pts], **look)
        if any(p[2] for p in pts):
            bottom.plot([p[0] for p in pts], [p[2] for p in pts], **look)
    top.set_xscale("log")
    top.set_ylabel("effective training time")
    top.grid(True, which="both", alpha=0.3)
    top.legend(fontsize=8, loc="lower left")
    top.set_title(title, fontsize=9)
    bottom.set_xscale("log")
    bottom.set_yscale("log")
    bottom.set_xlabel("GPUs")
    bottom.set_ylabel("spare GPUs needed")
    bottom.grid(True, which="both", alpha=0.3)
    bottom.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
