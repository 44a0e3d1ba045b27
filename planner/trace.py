"""Trace a Hugging Face causal LM into a typed IR, grouped into partition units.

The model is built on the `meta` device and run once for a short prefill (which fills its own KV
cache) and once for one decode step. Every aten op of the run is recorded as a node of a
`torch.fx.Graph` whose `meta` carries the output shape and dtype, the FLOPs (torch's flop
formulas), the parameter bytes it reads and the partition unit it belongs to; shapes are
propagated by running the real ops on meta tensors. Per-unit numbers (W_param, W_act, W_kv, F)
are sums over that graph, never per-family formulas: a new architecture works when it traces.
(We record at the dispatcher rather than with make_fx/torch.export, which produce the same aten
graph an order of magnitude slower: Qwen3-32B would no longer plan in seconds.)

Limits: KV bytes and attention FLOPs are taken per context token from one decode step, which is
right for full attention; a sliding-window layer's cache stops growing at its window and is
mis-costed. Mixture-of-experts blocks are costed as reading every expert.

Partition units: 0 = everything before the first block (embedding, rotary tables, masks),
1..L = the transformer blocks, L+1 = everything after the last block (final norm, output
projection). Blocks whose structure is identical to an earlier block (same module types,
parameter shapes and per-layer settings) are traced once; the others appear in the graph as a
`reused_block` node and copy its numbers (`UnitIR.traced_as`). `trace_model(..., dedupe=False)`
traces every block; the tests check both give the same IR.
"""
from __future__ import annotations

import functools
import operator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from planner.config import (architecture_name, build_meta_model, config_digest, config_dtype,
                            read_config)
from planner.errors import PlanError
from planner.ir import ModelIR, SharedWeight, UnitIR

# Prefill length used to fill the cache before the traced decode step. Any length works (meta
# tensors cost nothing per element); a prime keeps it from colliding with model dimensions.
TRACE_CONTEXT_TOKENS = 13

@dataclass
class TraceResult:
    """The IR plus the recorded graphs (decode step and prefill), for inspection and tests."""
    ir: ModelIR
    decode_graph: Any   # torch.fx.Graph
    prefill_graph: Any  # torch.fx.Graph
    prefill_tokens: int


def reused_block(*inputs):
    """Graph node standing for a block whose ops are those of an identical, traced block."""
    raise RuntimeError("reused_block is a marker in the planner's trace graph, not a kernel")


# Ops that read rows of a weight (an embedding lookup reads B·S rows, not the whole table).
def _gather_ops():
    import torch
    aten = torch.ops.aten
    return {aten.embedding.default, aten.index_select.default, aten.index.Tensor}


def _tensor_bytes(x) -> int:
    import torch
    from torch.utils._pytree import tree_flatten
    return sum(t.numel() * t.element_size() for t in tree_flatten(x)[0] if isinstance(t, torch.Tensor))


def _find_blocks(model, num_layers: int | None):
    import torch.nn as nn
    lists = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
    exact = [(n, m) for n, m in lists if num_layers is not None and len(m) == num_layers]
    chosen = exact or sorted(lists, key=lambda nm: -len(nm[1]))
    if not chosen:
        raise PlanError(f"cannot find the transformer blocks of {type(model).__name__}: "
                        f"no nn.ModuleList of {num_layers} modules")
    return chosen[0]


def _block_signature(block, config, index: int, num_layers: int) -> tuple:
    """Everything that could make two blocks trace differently, except their layer index."""
    parts: list = [type(block).__qualname__]
    for name, p in block.named_parameters():
        parts.append(("p", name, tuple(p.shape), str(p.dtype)))
    for name, b in block.named_buffers():
        parts.append(("b", name, tuple(b.shape), str(b.dtype)))
    for name, mod in block.named_modules():
        attrs = []
        for k, v in sorted(vars(mod).items()):
            if k.startswith("_") or k == "layer_idx":
                continue
            if isinstance(v, (bool, int, float, str, type(None))) or (
                    isinstance(v, tuple) and all(isinstance(x, (bool, int, float, str)) for x in v)):
                attrs.append((k, v))
        parts.append(("m", name, type(mod).__qualname__, tuple(attrs)))
    # per-layer settings in the config (layer_types, mlp_only_layers as lists of length L)
    for k, v in sorted(vars(config).items()):
        if isinstance(v, (list, tuple)) and len(v) == num_layers:
            parts.append(("cfg", k, repr(v[index])))
    return tuple(parts)


class _Recorder:
    """Records every aten op of a forward pass into a torch.fx.Graph (see module docstring)."""

    def __init__(self, model, blocks, stubs: dict[int, int]):
        self.model = model
        self.blocks = blocks
        self.num_blocks = len(blocks)
        self.block_index = {id(b): i for i, b in enumerate(blocks)}
        self.module_name = {id(m): n for n, m in model.named_modules()}
        self.param_name = {id(p): n for n, p in model.named_parameters()}
        self.param_bytes = {n: _tensor_bytes(p) for n, p in model.named_parameters()}
        self.buffer_name = {id(b): n for n, b in model.named_buffers()}
        self.stubs = stubs  # block index -> representative block index

    # -- unit bookkeeping -------------------------------------------------------------------
    def _current_unit(self) -> int:
        for mod in reversed(self.stack):
            i = self.block_index.get(id(mod))
            if i is not None:
                return 1 + i
        if self.last_block_done < 0:
            return 0
        if self.last_block_done == self.num_blocks - 1:
            return self.num_blocks + 1
        return 1 + self.last_block_done

    def _current_module(self) -> str:
        return self.module_name.get(id(self.stack[-1]), "") if self.stack else ""

    # -- graph building ---------------------------------------------------------------------
    def _node_for(self, t):
        node = self.env.get(id(t))
        if node is not None:
            return node
        if id(t) in self.param_name:
            name = self.param_name[id(t)]
            node = self.graph.get_attr(name)
            node.meta.update(kind="param", param_bytes=_tensor_bytes(t), roots=frozenset([name]))
        elif id(t) in self.buffer_name:
            node = self.graph.get_attr(self.buffer_name[id(t)])
            node.meta.update(kind="buffer", param_bytes=0, roots=frozenset())
        elif id(t) in self.kv_ids:
            node = self.graph.placeholder(f"kv_{len(self.env)}")
            node.meta.update(kind="kv", param_bytes=0, roots=frozenset())
        else:
            node = self.graph.placeholder(f"const_{len(self.env)}")
            node.meta.update(kind="const", param_bytes=0, roots=frozenset())
        node.meta.update(shape=tuple(t.shape), dtype=str(t.dtype).replace("torch.", ""),
                         bytes=_tensor_bytes(t), tainted=False, unit=None, flops=0)
        self._bind(t, node)
        return node

    def _bind(self, t, node):
        self.keep.append(t)  # keep alive so ids are not reused while recording
        self.env[id(t)] = node

    def _add_node(self, target, args, kwargs, out, flops: int):
        import torch
        from torch.utils._pytree import tree_flatten, tree_map

        def arg(x):
            return self._node_for(x) if isinstance(x, torch.Tensor) else x

        fx_args = tree_map(arg, args)
        fx_kwargs = tree_map(arg, kwargs)
        node = self.graph.call_function(target, tuple(fx_args), dict(fx_kwargs))
        inputs = [self.env[id(t)] for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        derived = [n for n in inputs if n.meta["roots"]]
        # a node is weight-derived (a view/cast of a parameter) when all its inputs are
        is_derived = bool(inputs) and len(derived) == len(inputs)
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        node.meta.update(
            kind="op", unit=self._current_unit(), module=self._current_module(),
            shape=tuple(tuple(t.shape) for t in outs) if len(outs) != 1 else tuple(outs[0].shape),
            dtype=",".join(str(t.dtype).replace("torch.", "") for t in outs),
            bytes=sum(_tensor_bytes(t) for t in outs), numel=sum(t.numel() for t in outs), flops=int(flops),
            tainted=any(n.meta["tainted"] for n in inputs),
            roots=frozenset().union(*(n.meta["roots"] for n in derived)) if is_derived else frozenset(),
            weight_op=bool(derived) and not is_derived,
            param_bytes=0,
        )
        if derived and not is_derived:
            # the op consumes weights with activations: record how each weight is read. A gather
            # (embedding lookup) reads its output's bytes; anything else reads the whole weight.
            gather = target in self.gather_ops and derived[0] is inputs[0]
            roots = frozenset().union(*(n.meta["roots"] for n in derived))
            uses = self.uses.setdefault(node.meta["unit"], {})
            for root in roots:
                prev = uses.get(root, 0)
                uses[root] = prev + node.meta["bytes"] if gather and prev is not None else None
            node.meta["param_bytes"] = (node.meta["bytes"] if gather
                                        else sum(self.param_bytes[r] for r in roots))
        if len(outs) == 1:
            self._bind(outs[0], node)
        else:
            for i, t in enumerate(outs):
                item = self.graph.call_function(operator.getitem, (node, i))
                item.meta.update({k: node.meta[k] for k in ("kind", "unit", "module", "tainted", "roots")},
                                 shape=tuple(t.shape), dtype=str(t.dtype).replace("torch.", ""),
                                 bytes=_tensor_bytes(t), flops=0, weight_op=False, param_bytes=0)
                self._bind(t, item)
        return node

    # -- the recording run --------------------------------------------------------------------
    def record(self, run, inputs: dict, tainted: set[str], kv_ids: set[int] = frozenset()):
        """Run `run()` under the recorder; `inputs` name the graph's placeholders."""
        import torch
        import torch.fx
        from torch.nn.modules.module import (register_module_forward_hook,
                                             register_module_forward_pre_hook)
        from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
        from torch.utils._pytree import tree_flatten, tree_map
        from torch.utils.flop_counter import flop_registry

        self.graph = torch.fx.Graph()
        self.env, self.keep, self.uses = {}, [], {}
        self.stack, self.last_block_done = [], -1
        self.kv_ids = kv_ids
        self.gather_ops = _gather_ops()
        self.block_outputs: dict[int, Any] = {}
        for name, t in inputs.items():
            node = self.graph.placeholder(name)
            node.meta.update(kind="input", unit=0, module="", shape=tuple(t.shape),
                             dtype=str(t.dtype).replace("torch.", ""), bytes=_tensor_bytes(t),
                             tainted=name in tainted, roots=frozenset(), flops=0, param_bytes=0)
            self._bind(t, node)
        recorder = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                out = func(*args, **kwargs)
                flops = 0
                formula = flop_registry.get(func.overloadpacket)
                if formula is not None:
                    flops = formula(*args, **kwargs, out_val=out)
                recorder._add_node(func, args, kwargs, out, flops)
                return out

        def pre(mod, args):
            recorder.stack.append(mod)

        def post(mod, args, out):
            recorder.stack.pop()
            i = recorder.block_index.get(id(mod))
            if i is not None:
                recorder.last_block_done = i
                recorder.block_outputs[i] = out

        def make_stub(i: int, rep: int):
            def stub(*args, **kwargs):
                rep_out = recorder.block_outputs[rep]
                with _disable_current_modes():
                    out = tree_map(lambda t: torch.empty_like(t) if isinstance(t, torch.Tensor) else t, rep_out)
                tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
                node = recorder._add_node(reused_block, tuple(tensors), {}, out, 0)
                node.meta["reuses"] = 1 + rep
                return out
            return stub

        originals = {}
        for i, rep in self.stubs.items():
            originals[i] = self.blocks[i].forward
            self.blocks[i].forward = make_stub(i, rep)
        h_pre = register_module_forward_pre_hook(pre)
        h_post = register_module_forward_hook(post)
        try:
            with torch.no_grad(), Mode():
                result = run()
        finally:
            h_pre.remove()
            h_post.remove()
            for i, fwd in originals.items():
                self.blocks[i].forward = fwd
        outputs = [self.env[id(t)] for t in tree_flatten(result)[0]
                   if isinstance(t, torch.Tensor) and id(t) in self.env]
        self.graph.output(tuple(outputs))
        return result


def _aliases(target) -> bool:
    """Whether an op's output is (a view of, or written into) an input rather than new memory.
    _unsafe_view, which reshapes a matmul's fresh output, says no alias in its schema but keeps
    its input's storage."""
    import torch
    schema = getattr(target, "_schema", None)
    return (target is operator.getitem or target is torch.ops.aten._unsafe_view.default
            or (schema is not None and any(r.alias_info is not None for r in schema.returns)))


def _peak_live_values(graph, num_units: int) -> list[int]:
    """Per unit, the most activation values alive at once while its ops run: every op output that
    is new memory computed from the input tokens (not a view, not an in-place write, not a cast of
    a weight, not the masks and rotary tables made from positions alone) lives from its op to the
    last op that reads it or a view of it; what a unit receives from the units before it (the
    residual stream) counts while it is still read. Values, not bytes: the graph keeps some in
    the model's dtype and some (its norms) in fp32, the executor all of them in fp32."""
    nodes = list(graph.nodes)
    owner: dict = {}
    born, dies = {}, {}
    for i, node in enumerate(nodes):
        if node.op != "call_function":
            continue
        if _aliases(node.target):
            base = next((a for a in node.all_input_nodes if a in owner), None)
            owner[node] = owner[base] if base is not None else None
        elif node.meta["tainted"] and not node.meta["roots"] and node.meta.get("numel"):
            owner[node] = node
            born[node] = dies[node] = i
        else:
            owner[node] = None
        for a in node.all_input_nodes:
            o = owner.get(a)
            if o is not None:
                dies[o] = i
    out_node = next(n for n in nodes if n.op == "output")
    for a in out_node.all_input_nodes:  # what the forward returns (the logits) lives to its end
        if owner.get(a) is not None:
            dies[owner[a]] = len(nodes)
    delta = [0] * (len(nodes) + 2)
    for node, start in born.items():
        delta[start] += node.meta["numel"]
        delta[dies[node] + 1] -= node.meta["numel"]
    peak, live = [0] * num_units, 0
    for i, node in enumerate(nodes):
        live += delta[i]
        if node.op == "call_function":
            u = node.meta["unit"]
            peak[u] = max(peak[u], live)
    return peak


# transformers 5.24 renamed the KV cache `past_key_values` → `cache` (forward keyword and output
# field) and drops the old names in 5.40; the trace passes the cache back under the name the
# model returned it by.
def _returned_cache(out) -> tuple[str, Any]:
    for name in ("cache", "past_key_values"):
        cache = getattr(out, name, None)
        if cache is not None:
            return name, cache
    return "", None


def _kv_tensor_ids(cache) -> set[int]:
    """ids of every tensor held by a cache object (DynamicCache layers, lists, dicts)."""
    import torch
    found, seen = set(), set()

    def walk(x, depth=0):
        if depth > 6 or id(x) in seen:
            return
        seen.add(id(x))
        if isinstance(x, torch.Tensor):
            found.add(id(x))
        elif isinstance(x, (list, tuple)):
            for y in x:
                walk(y, depth + 1)
        elif isinstance(x, dict):
            for y in x.values():
                walk(y, depth + 1)
        elif hasattr(x, "__dict__") and not isinstance(x, type):
            for y in vars(x).values():
                walk(y, depth + 1)

    walk(cache)
    return found


def _module_cover(used: set[str], all_params: list[str]) -> tuple[str, ...]:
    """The fewest module paths whose parameters are exactly covered by `used`."""
    under: dict[str, set[str]] = {}
    for name in all_params:
        parts = name.split(".")
        for i in range(1, len(parts)):
            under.setdefault(".".join(parts[:i]), set()).add(name)
    cover = set()
    for name in used:
        parts = name.split(".")
        best = name
        for i in range(len(parts) - 1, 0, -1):
            prefix = ".".join(parts[:i])
            if under.get(prefix, set()) <= used:
                best = prefix
            else:
                break
        cover.add(best)
    return tuple(sorted(cover))


def _trace(data: dict, dtype: str, digest: str, dedupe: bool) -> TraceResult:
    import torch

    model = build_meta_model(data, dtype)
    cfg = model.config
    num_layers = getattr(cfg, "num_hidden_layers", None)
    blocks_name, blocks = _find_blocks(model, num_layers)
    L = len(blocks)

    stubs: dict[int, int] = {}
    if dedupe:
        seen: dict[tuple, int] = {}
        for i, block in enumerate(blocks):
            sig = _block_signature(block, cfg, i, L)
            if sig in seen:
                stubs[i] = seen[sig]
            else:
                seen[sig] = i

    S = TRACE_CONTEXT_TOKENS
    rec = _Recorder(model, blocks, stubs)
    ids = torch.zeros(1, S, dtype=torch.long, device="meta")
    try:
        out = rec.record(lambda: model(input_ids=ids, use_cache=True), {"input_ids": ids}, {"input_ids"})
        prefill_graph = rec.graph
        cache_name, cache = _returned_cache(out)
        if cache is None:
            raise PlanError(f"{architecture_name(data)} returned no KV cache (use_cache=True)")
        kv_ids = _kv_tensor_ids(cache)
        step_ids = torch.zeros(1, 1, dtype=torch.long, device="meta")
        rec.record(lambda: model(input_ids=step_ids, use_cache=True, **{cache_name: cache}),
                   {"input_ids": step_ids}, {"input_ids"}, kv_ids)
    except PlanError:
        raise
    except Exception as e:  # noqa: BLE001 — a model that does not trace is bad input, not a crash
        raise PlanError(f"tracing {architecture_name(data)} on the meta device failed: "
                        f"{type(e).__name__}: {e}") from None
    graph = rec.graph
    num_units = L + 2

    # ---- per-unit sums over the decode graph ---------------------------------------------
    proj = [0] * num_units
    attn = [0] * num_units
    kv = [0] * num_units
    nodes = [0] * num_units
    kv_seen: list[set] = [set() for _ in range(num_units)]
    cut_sets: list[set] = [set() for _ in range(num_units)]
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        u = node.meta["unit"]
        nodes[u] += 1
        if node.meta["flops"]:
            if node.meta["weight_op"]:
                proj[u] += node.meta["flops"]
            else:
                attn[u] += node.meta["flops"]
        for inp in node.all_input_nodes:
            if inp.meta.get("kind") == "kv" and inp not in kv_seen[u]:
                kv_seen[u].add(inp)
                kv[u] += inp.meta["bytes"]
            # activation crossing: a tainted value made in unit a and used in unit b > a
            a = inp.meta.get("unit")
            if inp.meta.get("tainted") and a is not None and a < u:
                for cut in range(a, u):
                    cut_sets[cut].add(inp)
    if not any(kv[1:L + 1]):  # a forward that swallowed the cache keyword ran without one
        raise PlanError(f"tracing {architecture_name(data)}: its decode step read no KV cache")
    act = [sum(n.meta["bytes"] for n in s) for s in cut_sets]
    out_node = next(n for n in graph.nodes if n.op == "output")
    act[-1] = sum(n.meta["bytes"] for n in out_node.all_input_nodes if n.meta.get("tainted"))
    kv_len = S + 1  # the decode step attends over the cache plus itself
    work = _peak_live_values(prefill_graph, num_units)
    # query heads: attention's FLOPs per context token are 4·H_q·D (scores and values), D the
    # last dimension of the unit's cached keys
    heads = [attn[u] // kv_len // (4 * next(iter(kv_seen[u])).meta["shape"][-1]) if kv_seen[u] else 0
             for u in range(num_units)]

    # ---- weights per unit -----------------------------------------------------------------
    param_bytes = {n: p.numel() * p.element_size() for n, p in model.named_parameters()}
    all_params = list(param_bytes)
    block_prefix = [f"{blocks_name}.{i}" for i in range(L)]
    used: dict[int, dict[str, int | None]] = {u: dict(rec.uses.get(u, {})) for u in range(num_units)}
    for i, rep in stubs.items():
        src, dst = block_prefix[rep] + ".", block_prefix[i] + "."
        used[1 + i] = {(dst + n[len(src):] if n.startswith(src) else n): v for n, v in used[1 + rep].items()}
        for arr in (proj, attn, kv, nodes, work, heads):
            arr[1 + i] = arr[1 + rep]
    units = []
    for u in range(num_units):
        uses = used[u]
        missing = [n for n in uses if n not in param_bytes]
        if missing:
            raise PlanError(f"trace of {architecture_name(data)}: unit {u} uses unknown parameters {missing[:3]}")
        kind = "embedding" if u == 0 else "head" if u == num_units - 1 else "block"
        traced_as = 1 + stubs[u - 1] if kind == "block" and (u - 1) in stubs else u
        units.append(UnitIR(
            index=u, kind=kind, weights=_module_cover(set(uses), all_params),
            weight_bytes=sum(param_bytes[n] for n in uses),
            read_bytes_per_token=sum(param_bytes[n] if v is None else min(v, param_bytes[n])
                                     for n, v in uses.items()),
            act_bytes_per_token=act[u],
            kv_bytes_per_token=kv[u] // S,
            proj_flops_per_token=proj[u],
            attn_flops_per_context_token=attn[u] // kv_len,
            num_nodes=nodes[u], traced_as=traced_as, work_values_per_token=-(-work[u] // S),
            attn_heads=heads[u]))
    owners: dict[str, list[int]] = {}
    for u in range(num_units):
        for n in used[u]:
            owners.setdefault(n, []).append(u)
    shared = tuple(SharedWeight(n, param_bytes[n], tuple(us)) for n, us in sorted(owners.items()) if len(us) > 1)
    unattributed = sum(b for n, b in param_bytes.items() if n not in owners)
    ir = ModelIR(
        architecture=architecture_name(data), model_type=str(data.get("model_type")), dtype=dtype,
        config_digest=digest, num_blocks=L,
        num_params=sum(p.numel() for p in model.parameters()),
        weight_bytes=sum(param_bytes.values()), units=tuple(units), shared_weights=shared,
        unattributed_weight_bytes=unattributed, trace_context_tokens=S)
    return TraceResult(ir=ir, decode_graph=graph, prefill_graph=prefill_graph, prefill_tokens=S)


@functools.lru_cache(maxsize=32)
def _trace_cached(canon: str, dtype: str, digest: str, dedupe: bool) -> TraceResult:
    import json
    return _trace(json.loads(canon), dtype, digest, dedupe)


def trace(model: str | Path | dict, dtype: str | None = None, dedupe: bool = True) -> TraceResult:
    """Trace a config (path, checkpoint directory or dict); cached per config and dtype."""
    import json
    data, _ = read_config(model)
    dtype = config_dtype(data, dtype)
    canon = json.dumps(data, sort_keys=True, default=str)
    return _trace_cached(canon, dtype, config_digest(data), dedupe)


def trace_model(model: str | Path | dict, dtype: str | None = None, dedupe: bool = True) -> ModelIR:
    """The IR of a model config: per-unit bytes and FLOPs (see `UnitIR`)."""
    return trace(model, dtype, dedupe).ir
