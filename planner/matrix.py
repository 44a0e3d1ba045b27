"""`helm-plan matrix`: every model planned on every machine, in one table.

For a team choosing where a model will run: each cell is a full plan (the same `make_plan` as
`helm-plan plan`, so a cell and a plan made alone agree), summarized as its split, speed, time to
first token and longest context, or why no split fits. With an output directory every plan is
written, so `helm-plan diff` of any two cells is one command.
"""
from __future__ import annotations

import math
import re
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from planner.config import read_config
from planner.errors import InfeasibleError, PlanError
from planner.machine import MachineProfile, is_machine_profile, load_machine
from planner.plan import Plan, model_label
from planner.planning import make_plan
from planner.serial import to_dict
from planner.plotting import pyplot, save
from planner.yamlio import read_yaml


@dataclass(frozen=True)
class Cell:
    model: str                          # label of the model (its config's stem or directory name)
    machine: str                        # machine profile name
    machine_source: str                 # measured | datasheet | manual | placeholder
    feasible: bool
    reason: str                         # why no split fits ("" when feasible)
    split_k: int | None
    num_units: int | None
    ms_per_token: float | None
    tokens_per_s: float | None
    ttft_ms: float | None
    context_tokens: int | None          # the context the cell was planned at
    longest_context: int | None         # without KV offload
    longest_context_offload: int | None
    plan_file: str | None               # where the cell's plan was written (with an output directory)


def load_machines(paths: list[str]) -> list[MachineProfile]:
    """Every machine profile named: files as given (each must load), directories by their *.yaml
    files that are machine profiles (plans beside them are skipped)."""
    machines, names = [], {}
    for p in map(Path, paths):
        if p.is_dir():
            found = sorted(x for x in p.iterdir() if x.suffix in (".yaml", ".yml") and x.is_file())
            files = [f for f in found if _is_machine_profile(f)]
            if not files:
                raise PlanError(f"--machines {p}: no machine profiles (*.yaml) in this directory")
        elif p.is_file():
            files = [p]
        else:
            raise PlanError(f"--machines {p}: no such file or directory")
        for f in files:
            m = load_machine(f)
            if m.name in names:
                raise PlanError(f"--machines: {f} and {names[m.name]} are both named {m.name!r}")
            names[m.name] = f
            machines.append(m)
    return machines


def _is_machine_profile(path: Path) -> bool:
    return is_machine_profile(read_yaml(path, str(path))[0])


def _cell(model: str, machine: MachineProfile, plan: Plan | None, reason: str, plan_file: str | None) -> Cell:
    source = machine.source
    if plan is None:
        label = model_label(model, "model")
        return Cell(label, machine.name, source, False, reason, None, None, None, None, None, None, None, None, None)
    lc = plan.longest_context
    return Cell(model=model_label(plan.model.source, plan.model.model_type), machine=machine.name,
                machine_source=source, feasible=True, reason="", split_k=plan.partition.split_k,
                num_units=plan.partition.num_units, ms_per_token=plan.prediction.ms_per_token,
                tokens_per_s=plan.prediction.tokens_per_s, ttft_ms=plan.prediction.ttft_ms,
                context_tokens=plan.workload.context_tokens,
                longest_context=lc.without_offload_tokens if lc else None,
                longest_context_offload=lc.with_offload_tokens if lc else None, plan_file=plan_file)


def plan_matrix(models: list[str], machines: list[MachineProfile], out_dir: str | Path | None = None,
                progress: Callable[[str], None] | None = None, **plan_options) -> list[Cell]:
    """Plan every model on every machine (`plan_options` as make_plan's); a cell where nothing fits
    says why. Configs are checked first, so a bad path fails before any planning; bad options fail
    the whole matrix (only an infeasible cell is an answer)."""
    labels: dict[str, str] = {}
    for model in models:
        read_config(model)
        label = model_label(str(model), "model")
        if label in labels:
            raise PlanError(f"{labels[label]} and {model} are both named {label!r}: give each model once")
        labels[label] = str(model)
    out = Path(out_dir) if out_dir is not None else None
    if out is not None:
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise PlanError(f"--out-dir {out}: {e.strerror or e}") from None
    cells = []
    for model in models:
        for machine in machines:
            if progress:
                progress(f"planning {model_label(model, 'model')} on {machine.name}")
            try:
                plan = make_plan(model, machine, **plan_options)
            except InfeasibleError as e:
                cells.append(_cell(model, machine, None, e.reason, None))
                continue
            path = None
            if out is not None:
                name = f"{model_label(plan.model.source, plan.model.model_type)}.{machine.name}"
                path = out / (re.sub(r"[^A-Za-z0-9._-]+", "_", name).lstrip(".") + ".yaml")  # never outside out/
                try:
                    path.write_text(plan.to_yaml())
                except OSError as e:
                    raise PlanError(f"--out-dir: cannot write {path}: {e.strerror or e}") from None
            cells.append(_cell(model, machine, plan, "", str(path) if path else None))
    return cells


def _num(x: float | None, fmt: str) -> str:
    return "-" if x is None or not math.isfinite(x) else format(x, fmt)


def format_matrix(cells: list[Cell]) -> str:
    width_model = max([5] + [len(c.model) for c in cells])
    width_machine = max([7] + [len(c.machine) + len(c.machine_source) + 3 for c in cells])
    head = (f"{'model':<{width_model}}  {'machine':<{width_machine}}  {'k':>7}  {'ms/token':>9}  {'tok/s':>7}  "
            f"{'TTFT s':>7}  {'context':>7}  {'longest':>8}  {'offload':>8}  feasible / why not")
    rows = [head, "-" * len(head)]
    for c in cells:
        where = f"{c.machine} [{c.machine_source}]"
        split = f"{c.split_k}/{c.num_units}" if c.feasible else "-"
        rows.append(f"{c.model:<{width_model}}  {where:<{width_machine}}  {split:>7}  {_num(c.ms_per_token, '.1f'):>9}  "
                    f"{_num(c.tokens_per_s, '.2f'):>7}  {_num(c.ttft_ms and c.ttft_ms / 1e3, '.2f'):>7}  "
                    f"{_num(c.context_tokens, 'd'):>7}  {_num(c.longest_context, 'd'):>8}  "
                    f"{_num(c.longest_context_offload, 'd'):>8}  {'yes' if c.feasible else 'no: ' + c.reason}")
    rows.append("k = units on the CPU / all units; ms/token and tok/s at the context shown, batch as planned; "
                "longest = the longest context the split serves (offload: with KV offload)")
    return "\n".join(rows)


def matrix_json(cells: list[Cell]) -> list[dict]:
    return [to_dict(c) for c in cells]


def plot_matrix(cells: list[Cell], out: str | Path) -> None:
    """A heatmap of tok/s (models x machines), each cell annotated with k and the longest context;
    cells where nothing fits are grey with the reason's first words."""
    plt = pyplot("the table above is complete")
    from matplotlib.colors import LogNorm
    models = list(dict.fromkeys(c.model for c in cells))
    machines = list(dict.fromkeys(c.machine for c in cells))
    grid = [[math.nan] * len(machines) for _ in models]
    for c in cells:
        if c.feasible and c.tokens_per_s:
            grid[models.index(c.model)][machines.index(c.machine)] = c.tokens_per_s
    values = [v for row in grid for v in row if not math.isnan(v)]
    fig, ax = plt.subplots(figsize=(2.4 + 2.6 * len(machines), 1.2 + 0.9 * len(models)))
    cmap = plt.get_cmap("viridis").with_extremes(bad="0.85")
    norm = LogNorm(vmin=min(values), vmax=max(values) * (1.0001 if len(set(values)) == 1 else 1)) if values else None
    image = ax.imshow(grid, cmap=cmap, norm=norm, aspect="auto")
    for c in cells:
        i, j = models.index(c.model), machines.index(c.machine)
        if c.feasible and c.tokens_per_s:
            text = f"k={c.split_k}/{c.num_units}\n{c.tokens_per_s:.3g} tok/s\nctx {c.longest_context}"
            r, g, b, _ = cmap(norm(c.tokens_per_s))
            color = "k" if 0.299 * r + 0.587 * g + 0.114 * b > 0.5 else "w"   # readable on the cell's colour
        else:
            text, color = "no split fits\n" + "\n".join(textwrap.wrap(c.reason, 30)[:2]), "k"
        ax.text(j, i, text, ha="center", va="center", fontsize=7, color=color)
    ax.set_xticks(range(len(machines)), [f"{m}\n[{next(c.machine_source for c in cells if c.machine == m)}]"
                                         for m in machines], fontsize=8)
    ax.set_yticks(range(len(models)), models, fontsize=8)
    ax.set_title("predicted decode tok/s (k = units on the CPU; ctx = longest context)", fontsize=9)
    if values:
        fig.colorbar(image, ax=ax, label="tok/s")
    save(fig, out)
