"""bench_gpu's stable figures, issue 19's target for each, and runs from several machines judged together.

Lent machines of one kind differ by more than the changes being measured, so one run can meet a target that the
next machine misses. A comparison therefore lists every run's figures beside what each machine was (its board,
its ceilings, its clocks while the engine ran) and judges each target on the median of the runs. No MLX or torch:
results files are read anywhere.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass

STABLE = ("mfu_lm_prefill", "mfu_lm_prefill_ragged", "mfu_vision", "wall_vs_ideal", "distinct8_vs_transformers_batched",
          "engine_attention_planned_vs_padded_follower")
PROFILE = ("lm_forwards_per_prefill", "lm_layer_ms", "lm_layer_matmuls_share", "lm_layer_attention_share",
           "lm_layer_other_share", "lm_outside_layers_share", "lm_host_build_share", "lm_host_syncs_in_layers",
           "vision_blocks_share", "vision_outside_blocks_share", "vision_other_share", "vision_host_syncs",
           "mlx_vlm_vision_host_syncs", "engine_steps", "engine_forward_share", "engine_vision_graph_host_s",
           "engine_other_host_s", "engine_between_steps_host_s")
# Shown beside the stable figures, with no target of their own: mlx-vlm's forward on the same tokens (the LM
# target's "at least mlx-vlm's contiguous figure"), the LM prefill with its prompts staged as the job stages them,
# the job's wall time against the ceiling the board holds for seconds (power-capped clocks), and the most the
# distinct-clips figure could be (its 8 requests in their ideal time).
COMPANIONS = ("mfu_lm_mlx_vlm_contiguous", "mfu_lm_prefill_staged", "mfu_lm_prefill_ragged_staged",
              "wall_vs_ideal_sustained_ceiling", "distinct8_ideal_vs_transformers_batched")
# Where the job's wall time beyond its ideal goes, each a share of the ideal (the three sum to wall_vs_ideal - 1).
WALL_GAP = ("wall_gap_towers", "wall_gap_lm", "wall_gap_rest")
MODELS = {"qwen2_5_vl": "", "qwen3_vl": "qwen3_vl."}   # model -> the prefix of its figures' keys


@dataclass(frozen=True)
class Target:
    at_least: bool
    value: float

    def met(self, figure: float) -> bool:
        return figure >= self.value if self.at_least else figure <= self.value

    def __str__(self) -> str:
        return f"{'>=' if self.at_least else '<='} {self.value:g}"


_TARGETS = {"mfu_lm_prefill": Target(True, 0.88), "mfu_lm_prefill_ragged": Target(True, 0.88),
            "wall_vs_ideal": Target(False, 1.3), "distinct8_vs_transformers_batched": Target(True, 3.0),
            "engine_attention_planned_vs_padded_follower": Target(True, 1.0)}
_VISION = {"qwen2_5_vl": Target(True, 0.50), "qwen3_vl": Target(True, 0.45)}


def target(model: str, key: str) -> Target | None:
    """Issue 19's target for a stable figure of `model` (the vision tower's differs by model)."""
    return _VISION[model] if key == "mfu_vision" else _TARGETS.get(key)


def wall_gap(row: dict, ceiling: float) -> dict:
    """The 64 x 4 job's time beyond its ideal (`ceiling` in FLOP/s), split three ways, each a share of the ideal:
    the towers at their pipelined rate against their FLOPs at the ceiling; the LM's FLOPs at the profiled forward's
    MFU against the ceiling; and the rest, which neither explains (the device waiting on the host, the first
    step's start, the calls' own work). A model row of a bench_gpu results file is enough: older files get it too."""
    eng, vis = row["engine"], row["vision"]
    clips, ideal = row["workload"]["clips"], eng["ideal_s"]
    towers_ideal = clips * vis["flops_per_clip"] / ceiling
    towers = clips * vis["ms_per_clip"] / 1e3
    lm_ideal = ideal - towers_ideal
    lm = lm_ideal / row["lm_profile"]["mfu_forward"]
    return {"wall_gap_towers": (towers - towers_ideal) / ideal, "wall_gap_lm": (lm - lm_ideal) / ideal,
            "wall_gap_rest": (eng["wall_s"] - towers - lm) / ideal}


def _figure(report: dict, model: str, key: str) -> float | None:
    """A run's figure; the wall-time split computed from the run's rows where the file predates it."""
    got = report.get("figures", {}).get(MODELS[model] + key)
    if got is None and key in WALL_GAP:
        try:
            row = report if model == "qwen2_5_vl" else report[model]
            got = wall_gap(row, report["matmul_ceiling_tflops"]["mlx"] * 1e12)[key]
        except (KeyError, TypeError, ZeroDivisionError):
            return None
    return got


def _section_clock(sections: dict, names: tuple[str, ...]) -> float | None:
    clocks = [sections[n]["sm_mhz_median"] for n in names if sections.get(n, {}).get("sm_mhz_median") is not None]
    return statistics.median(clocks) if clocks else None


def machine(report: dict) -> dict:
    """What a run's machine was: its board, the ceilings measured in the run, and its SM clock while the engine ran
    (None where the file predates what is asked)."""
    env = report.get("environment", {})
    details = env.get("gpu_details", {})
    sections = report.get("gpu_monitor", {}).get("sections", {})
    reasons = report.get("gpu_monitor", {}).get("whole_run", {}).get("reasons")   # None: no samples in the file
    engine_sections = tuple(f"{m} {s}" for m in MODELS for s in ("vision", "lm_prefill", "end_to_end"))
    return {"gpu": env.get("gpu"), "uuid": details.get("uuid"), "power_limit": details.get("enforced.power.limit"),
            "ceiling_tflops": report.get("matmul_ceiling_tflops", {}).get("mlx"),
            "ceiling_at_end_tflops": report.get("matmul_ceiling_tflops", {}).get("mlx_at_end"),
            "ceiling_sustained_tflops": report.get("matmul_ceiling_tflops", {}).get("mlx_sustained"),
            "memory_gbps": report.get("memory_bandwidth_gbps", {}).get("mlx_copy"),
            "sm_mhz_engine": _section_clock(sections, engine_sections),
            "sm_mhz_ceilings": _section_clock(sections, ("ceilings",)),
            "slowdowns": None if reasons is None else {k: v for k, v in reasons.items() if k != "gpu_idle" and v > 0}}


def compare(reports: list[dict]) -> dict:
    """Each model's stable figures (with their COMPANIONS and WALL_GAP) over the runs: the runs' values, their
    median and spread, and the target judged on the median (a run without the figure is left out of its median)."""
    out: dict = {}
    for model, prefix in MODELS.items():
        for key in STABLE + COMPANIONS + WALL_GAP:
            values = [_figure(r, model, key) for r in reports]
            present = [v for v in values if isinstance(v, (int, float))]
            if not present:
                continue
            med, goal = statistics.median(present), target(model, key)
            out[prefix + key] = {"model": model, "key": key, "runs": values, "median": med,
                                 "spread": max(present) / min(present) if min(present) > 0 else None,
                                 "target": str(goal) if goal else None, "met": goal.met(med) if goal else None}
    return out


def _cell(v, spec: str = ".3f") -> str:
    return "n/a" if v is None else format(v, spec) if isinstance(v, (int, float)) else str(v)


def tables(names: list[str], reports: list[dict]) -> str:
    """The machines' table, then the figures' (markdown)."""
    rows = [machine(r) for r in reports]
    lines = ["| run | GPU | UUID | power limit | MLX ceiling TFLOP/s (at the end; held for seconds) | memory GB/s | "
             "SM MHz: ceilings / engine | slowdowns (share of samples) |", "|---|---|---|---|---|---|---|---|"]
    for name, m in zip(names, rows):
        slow = "n/a" if m["slowdowns"] is None else ", ".join(
            f"{k} {v:.0%}" for k, v in m["slowdowns"].items()) or "none seen"
        lines.append(f"| {name} | {m['gpu']} | {_cell(m['uuid'])} | {_cell(m['power_limit'])} | "
                     f"{_cell(m['ceiling_tflops'], '.0f')} ({_cell(m['ceiling_at_end_tflops'], '.0f')}; "
                     f"{_cell(m['ceiling_sustained_tflops'], '.0f')}) | "
                     f"{_cell(m['memory_gbps'], '.0f')} | {_cell(m['sm_mhz_ceilings'], '.0f')} / "
                     f"{_cell(m['sm_mhz_engine'], '.0f')} | {slow} |")
    lines += ["", "| figure | " + " | ".join(names) + " | median | max / min | target | met on the median |",
              "|---|" + "---|" * (len(names) + 4)]
    for key, got in compare(reports).items():
        met = "n/a" if got["met"] is None else "met" if got["met"] else "missed"
        lines.append(f"| {key} | " + " | ".join(_cell(v) for v in got["runs"]) + f" | {_cell(got['median'])} | "
                     f"{_cell(got['spread'])} | {got['target'] or 'n/a'} | {met} |")
    return "\n".join(lines)
