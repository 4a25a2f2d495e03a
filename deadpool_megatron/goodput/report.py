"""A run's results as JSON-ready dicts and as the printed tables."""

from __future__ import annotations

from deadpool_megatron.goodput.simulate import Outcome, ScaleRun
from deadpool_megatron.goodput.strategies import CLASSES, ReplicaDrop, Rollback

DAY_S = 86400.0


def entry(run: ScaleRun, s: Rollback | ReplicaDrop, o: Outcome) -> dict:
    """One strategy at one scale."""
    h, n = run.sample.horizon_s, run.job.gpus
    spares = run.spares.get(s.name, 0)
    e = {
        "name": s.name, "gpus": n, "summary": s.summary,
        "effective_training_time": o.effective,
        "gpu_hours_lost_per_day": (1.0 - o.effective) * n * 24.0,
        "spare_gpus": spares, "spare_gpu_hours_per_day": spares * 24.0,
        "fractions": {"saving": o.save_s / h, "downtime": o.downtime_s / h,
                      "lost_work": o.lost_s / h, "reduced_throughput": o.reduced_s / h},
        "failures_interrupting": o.failures, "pool_empty": o.pool_empty,
    }
    if isinstance(s, Rollback):
        e.update(save_interval_s=s.interval_s, save_cost_s=s.save_s,
                 failure_free_overhead=s.save_s / (s.interval_s + s.save_s),
                 downtime_per_class_s=dict(zip(CLASSES, s.downtime_s)),
                 fallback_per_class_s=dict(zip(CLASSES, s.fallback_s)))
        if s.phases:
            e["recovery_phases_s"] = s.phases
    else:
        e.update(detect_per_class_s=dict(zip(CLASSES, s.detect_s)), reconfig_s=s.reconfig_s,
                 back_after_per_class_s=dict(zip(CLASSES, s.back_after_s)))
    return e


def scale_info(run: ScaleRun) -> dict:
    job = run.job
    return {"gpus": job.gpus, "nodes": run.sample.node_count, "replicas": job.replicas,
            "layout": f"TP{job.tp} x PP{job.pp} x DP{job.replicas}",
            "model_params": job.model_params, "iteration_s": job.iteration_s,
            "job_mtbf_s": run.mtbf_s, "horizon_s": run.sample.horizon_s,
            "failures": run.sample.counts(), "failures_total": len(run.sample)}


def scale_table(run: ScaleRun) -> str:
    info = scale_info(run)
    lines = [f"{run.job.gpus:,} GPUs ({info['nodes']:,} nodes, {info['layout']}), "
             f"{run.job.model_params / 1e9:g}B parameters, iteration {run.job.iteration_s:.2f} s; "
             f"{info['failures_total']} failures in {run.sample.horizon_s / DAY_S:g} days "
             f"(job MTBF {run.mtbf_s / 3600:.2f} h; " +
             ", ".join(f"{k} {v}" for k, v in info["failures"].items()) + ")",
             f"{'strategy':<28} | effective | GPU-h lost/day | saving | downtime | lost work "
             f"| fewer replicas | interval s | spare GPUs | pool empty"]
    for s, o in zip(run.strategies, run.outcomes):
        e = entry(run, s, o)
        f = e["fractions"]
        interval = f"{e['save_interval_s']:10.0f}" if "save_interval_s" in e else f"{'-':>10}"
        lines.append(f"{s.name:<28} | {o.effective:9.4f} | {e['gpu_hours_lost_per_day']:14,.0f} "
                     f"| {f['saving']:6.4f} | {f['downtime']:8.4f} | {f['lost_work']:9.4f} "
                     f"| {f['reduced_throughput']:14.4f} | {interval} | "
                     f"{e['spare_gpus'] or '-':>10} | {o.pool_empty:10d}")
    return "\n".join(lines)


def summary_table(runs: list[ScaleRun]) -> str:
    """Effective training time, strategies by scale."""
    head = f"{'effective training time':<28} | " + " | ".join(f"{r.job.gpus:>9,}" for r in runs)
    lines = [head]
    for i, s in enumerate(runs[0].strategies):
        lines.append(f"{s.name:<28} | " + " | ".join(f"{r.outcomes[i].effective:9.4f}"
                                                     for r in runs))
    return "\n".join(lines)
