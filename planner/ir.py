"""The planner's picture of a model (DESIGN §3): per partition unit, the bytes and FLOPs of one
decode step, as planner.trace measures them from the model's own graph. What the cost model, the
search and the plan file read; the trace itself (torch, transformers) is only needed to make it.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from operator import attrgetter

from planner.serial import OMIT_IF_NONE


_IDENTITY = ("index", "weights", "num_nodes", "traced_as")  # which unit, not what it costs


@dataclass(frozen=True)
class UnitIR:
    """One partition unit, per sequence (batch 1). Costs scale linearly with batch."""
    index: int
    kind: str                           # "embedding" | "block" | "head"
    weights: tuple[str, ...]            # module paths whose parameters the unit uses
    weight_bytes: int                   # resident bytes of every parameter the unit uses
    read_bytes_per_token: int           # W_param: weight bytes read per decode step (gather reads rows)
    act_bytes_per_token: int            # W_act: bytes crossing the cut after this unit (last: logits)
    kv_bytes_per_token: int             # W_kv / c: KV cache bytes per context token
    proj_flops_per_token: int           # F_proj: FLOPs of ops with a weight operand, per token
    attn_flops_per_context_token: int   # F_attn / c: activation×activation FLOPs per context token
    num_nodes: int                      # aten ops recorded for the unit in the decode graph
    traced_as: int                      # unit whose trace this unit reuses (itself when traced)
    # Activation values live at once at the unit's peak, per prompt token, in the traced prefill
    # (the model's own graph): what its working memory grows with (None: an IR traced before
    # this was recorded).
    work_values_per_token: int | None = field(default=None, metadata=OMIT_IF_NONE)
    # Query heads: attention scores per query token per context token (None: traced before this
    # was recorded)
    attn_heads: int | None = field(default=None, metadata=OMIT_IF_NONE)

    @property
    def cost_key(self) -> tuple:
        """Every field but the unit's identity (its index, parameter names, trace bookkeeping):
        units with the same key cost the same in every formula, so the cost model prices one of
        them for all (planner/cost.py). A field added later is part of it unless in _IDENTITY."""
        return _cost_fields(self)

    def prefill_flops(self, tokens: int) -> int:
        """FLOPs to prefill `tokens` tokens of one sequence (causal attention)."""
        return self.proj_flops_per_token * tokens + self.attn_flops_per_context_token * tokens * (tokens + 1) // 2


_cost_fields = attrgetter(*(f.name for f in fields(UnitIR) if f.name not in _IDENTITY))


@dataclass(frozen=True)
class SharedWeight:
    """A parameter used by more than one unit (tied embedding / output projection)."""
    name: str
    weight_bytes: int
    units: tuple[int, ...]


@dataclass(frozen=True)
class ModelIR:
    """What the planner knows about a model: identity and per-unit costs."""
    architecture: str
    model_type: str
    dtype: str
    config_digest: str
    num_blocks: int
    num_params: int
    weight_bytes: int                   # all unique parameters
    units: tuple[UnitIR, ...]           # num_blocks + 2 units
    shared_weights: tuple[SharedWeight, ...]
    unattributed_weight_bytes: int      # parameters no traced op used (0 for the reference models)
    trace_context_tokens: int

    @property
    def num_units(self) -> int:
        return len(self.units)
