"""What each rank of a TP x DCP topology holds, and what DCP buys in KV capacity: the reports behind the
`dcp-triton plan` command.

Importing this module does not import torch (the command's ``--help`` stays fast); building a report does.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dcp_plugin.layout import KvReplication

DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4, "fp8": 1}
# ModelShape's fields and the Hugging Face config.json keys they are read from.
HF_CONFIG_KEYS = {"num_q_heads": "num_attention_heads", "num_kv_heads": "num_key_value_heads", "head_dim": "head_dim",
                  "num_layers": "num_hidden_layers"}


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelShape:
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    num_layers: int
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        for name in ("num_q_heads", "num_kv_heads", "head_dim", "num_layers"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {self.dtype!r}")

    @classmethod
    def from_hf_config(cls, path: str | Path, dtype: str | None = None, **overrides: int | None) -> ModelShape:
        """Read the attention shape from a Hugging Face ``config.json``; ``overrides`` (``num_q_heads``,
        ``num_kv_heads``, ``head_dim``, ``num_layers``; None: not given) replace what it says or supply what it
        lacks."""
        fields, missing = hf_config_fields(path, dtype=dtype, **overrides)
        if missing:
            keys = ", ".join(HF_CONFIG_KEYS[f] + (" or hidden_size" if f == "head_dim" else "") for f in missing)
            raise ValueError(f"{path}: config has no {keys}; pass {', '.join(f + '=' for f in missing)} to give it")
        return cls(**fields)


def hf_config_fields(path: str | Path, *, dtype: str | None = None, **overrides: int | None) -> tuple[dict, list[str]]:
    """ModelShape's fields from a Hugging Face ``config.json`` (its ``text_config`` if it has one), the non-None
    ``overrides`` replacing them, and the fields that neither gives (None in the dict). ``num_kv_heads`` defaults
    to ``num_q_heads``, ``head_dim`` to ``hidden_size // num_q_heads``; ``dtype`` to the config's float16 or
    float32, else bfloat16. Values are not checked: ``ModelShape`` does that."""
    unknown = sorted(set(overrides) - set(HF_CONFIG_KEYS))
    if unknown:
        raise TypeError(f"unknown overrides {unknown}; the fields are {list(HF_CONFIG_KEYS)}")
    cfg = _read_json_object(path)
    text = cfg.get("text_config")
    cfg = text if isinstance(text, dict) else cfg  # a multimodal config's language model; null or junk: ignored
    fields = {field: cfg.get(key) for field, key in HF_CONFIG_KEYS.items()}
    for field in ("num_kv_heads", "head_dim"):  # null or 0 in a config: absent, so derived below
        fields[field] = fields[field] or None
    fields.update({field: value for field, value in overrides.items() if value is not None})
    q_heads, hidden = fields["num_q_heads"], cfg.get("hidden_size")
    if fields["num_kv_heads"] is None:
        fields["num_kv_heads"] = q_heads  # multi-head attention: a KV head per Q head
    if fields["head_dim"] is None and isinstance(hidden, int) and isinstance(q_heads, int) and q_heads > 0:
        fields["head_dim"] = hidden // q_heads
    saved = cfg.get("torch_dtype") or cfg.get("dtype") or ""  # transformers 5 writes "dtype"
    fields["dtype"] = dtype or {"float16": "float16", "float32": "float32"}.get(str(saved), "bfloat16")
    # num_kv_heads follows num_q_heads, and so does head_dim where the config has hidden_size.
    missing = [f for f in ("num_q_heads", "head_dim", "num_layers")
               if fields[f] is None and not (f == "head_dim" and isinstance(hidden, int))]
    return fields, missing


def _read_json_object(path: str | Path) -> dict:
    try:
        cfg = json.loads(Path(path).read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: not a JSON file ({err})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{path}: a config.json holds a JSON object, this one holds a {type(cfg).__name__}")
    return cfg


@dataclass(frozen=True, slots=True, kw_only=True)
class RankCapacity:
    tp_rank: int
    dcp_rank: int
    q_heads: tuple[int, int]  # global [start, stop)
    stored_kv_heads: tuple[int, int]  # global [start, stop)
    current_chunk_kv: tuple[int, int]  # index range into the stored KV heads
    bytes_per_stored_token: int  # K + V, all layers, for one token this rank stores
    bytes_per_context_token: float  # average over context tokens (a rank stores 1 / dcp of them)
    max_context_tokens: int | None  # tokens of context the budget holds (None without a budget)


@dataclass(frozen=True, slots=True, kw_only=True)
class CapacityReport:
    model: ModelShape
    tp_size: int
    dcp_size: int
    interleave: int
    layout: KvReplication
    kv_budget_gib: float | None
    ranks: list[RankCapacity]
    capacity_gain: float  # KV tokens held vs the same TP with dcp_size=1 and vLLM's layout
    capacity_ceiling: float  # max(1, tp / kv_heads): TP's duplication, the most DCP can remove
    notes: list[str]

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


def capacity_report(
    model: ModelShape,
    *,
    tp_size: int,
    dcp_size: int,
    interleave: int = 1,
    layout: KvReplication = "tp",
    block_size: int = 16,
    kv_budget_gib: float | None = None,
) -> CapacityReport:
    """Per-rank heads and KV bytes for ``model`` on ``tp_size`` ranks with DCP groups of ``dcp_size``."""
    from dcp_plugin.checks import check_int
    from dcp_plugin.layout import HeadLayout, TokenLayout
    from dcp_plugin.parallel_state import ParallelState

    for name, value in (("tp_size", tp_size), ("dcp_size", dcp_size), ("interleave", interleave),
                        ("block_size", block_size)):
        check_int(name, value, low=1)
    if tp_size % dcp_size:
        raise ValueError(f"dcp_size={dcp_size} must divide tp_size={tp_size} (DCP groups are carved out of the TP "
                         f"ranks); allowed: {[d for d in range(1, tp_size + 1) if tp_size % d == 0]}")
    if kv_budget_gib is not None and not (math.isfinite(kv_budget_gib) and kv_budget_gib > 0):
        raise ValueError(f"kv_budget_gib must be a finite number > 0, got {kv_budget_gib}")
    TokenLayout(dcp_size=dcp_size, dcp_rank=0, interleave=interleave, block_size=block_size)  # validates
    per_head_token = 2 * model.head_dim * DTYPE_BYTES[model.dtype] * model.num_layers
    ranks = []
    for tp_rank in range(tp_size):
        ps = ParallelState.from_tp(tp_rank=tp_rank, tp_size=tp_size, dcp_size=dcp_size)
        heads = HeadLayout.create(
            total_q_heads=model.num_q_heads, total_kv_heads=model.num_kv_heads, ps=ps, kv_replication=layout
        )
        stored = heads.num_kv_heads * per_head_token
        per_context = stored / dcp_size
        budget = None if kv_budget_gib is None else int(kv_budget_gib * 2**30 // per_context)
        ranks.append(
            RankCapacity(
                tp_rank=tp_rank,
                dcp_rank=ps.attn_dcp_rank,
                q_heads=(heads.q_head_start, heads.q_head_start + heads.num_q_heads),
                stored_kv_heads=(heads.kv_head_start, heads.kv_head_start + heads.num_kv_heads),
                current_chunk_kv=heads.current_chunk_kv,
                bytes_per_stored_token=stored,
                bytes_per_context_token=per_context,
                max_context_tokens=budget,
            )
        )
    baseline_heads = max(1, model.num_kv_heads // tp_size)  # what each rank stores per token at dcp_size=1
    worst = max(r.bytes_per_context_token for r in ranks)
    gain = baseline_heads * per_head_token / worst
    ceiling = max(1.0, tp_size / model.num_kv_heads)
    notes = [
        f"DCP can remove at most TP's KV duplication: capacity gain <= max(1, tp / kv_heads) = {ceiling:g}x."
    ]
    if gain <= 1.0 + 1e-9 and dcp_size > 1:
        notes.append(
            f"dcp_size={dcp_size} buys no KV capacity here (gain {gain:g}x): every rank already stores distinct KV. "
            "DCP then only adds communication."
        )
    elif dcp_size > 1:
        notes.append(f"KV capacity gain over dcp_size=1: {gain:g}x.")
    return CapacityReport(
        model=model,
        tp_size=tp_size,
        dcp_size=dcp_size,
        interleave=interleave,
        layout=layout,
        kv_budget_gib=kv_budget_gib,
        ranks=ranks,
        capacity_gain=gain,
        capacity_ceiling=ceiling,
        notes=notes,
    )


def format_capacity_report(report: CapacityReport) -> str:
    m = report.model
    lines = [
        f"model: {m.num_q_heads} Q heads, {m.num_kv_heads} KV heads, head_dim {m.head_dim}, {m.num_layers} layers, "
        f"{m.dtype}",
        f"topology: tp={report.tp_size} dcp={report.dcp_size} interleave={report.interleave} layout={report.layout}",
        "",
    ]
    header = ("tp", "dcp", "Q heads", "stored KV heads", "cur-chunk KV", "B/stored tok", "B/ctx tok", "max ctx tok")
    rows = [header]
    for r in report.ranks:
        rows.append((
            str(r.tp_rank),
            str(r.dcp_rank),
            f"{r.q_heads[0]}-{r.q_heads[1] - 1}",
            f"{r.stored_kv_heads[0]}-{r.stored_kv_heads[1] - 1}",
            f"[{r.current_chunk_kv[0]}, {r.current_chunk_kv[1]})",
            f"{r.bytes_per_stored_token:,}",
            f"{r.bytes_per_context_token:,.0f}",
            "-" if r.max_context_tokens is None else f"{r.max_context_tokens:,}",
        ))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines += ["  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in rows]
    lines.append("")
    lines += report.notes
    return "\n".join(lines)


# What the vLLM backend refuses that a config.json shows (the backend's own check is per layer, at startup).
def config_refusals(path: str | Path, *, head_dim: int) -> list[str]:
    """Each reason dcp-triton's vLLM backend would refuse the model of this ``config.json`` (its ``text_config`` if
    it has one), as ``"<key>=<value>: <why>"``; ``head_dim`` is the head size the report uses (the config's or a
    flag's). Empty when nothing in the config is refused."""
    from dcp_plugin.kernels.extend_attention import SUPPORTED_HEAD_DIMS

    cfg = _read_json_object(path)
    text = cfg.get("text_config")
    cfg = text if isinstance(text, dict) else cfg
    problems = []
    if cfg.get("kv_lora_rank") is not None:  # vLLM's test for DeepSeek-style multi-head latent attention
        return [f"kv_lora_rank={cfg['kv_lora_rank']}: multi-head latent attention (MLA) is not supported (its "
                "latent KV cache has neither the config's KV heads nor its head size); vLLM's MLA backends run DCP "
                "for it"]
    if head_dim not in SUPPORTED_HEAD_DIMS:
        problems.append(f"head_dim={head_dim}: supported head sizes are {', '.join(map(str, SUPPORTED_HEAD_DIMS))}")
    window = cfg.get("sliding_window")
    if window and cfg.get("use_sliding_window", True) is not False:
        problems.append(f"sliding_window={window}: sliding-window attention is not supported")
    if "sliding_attention" in (cfg.get("layer_types") or []):
        problems.append("layer_types has sliding_attention layers: sliding-window attention is not supported")
    if cfg.get("attention_chunk_size"):
        problems.append(f"attention_chunk_size={cfg['attention_chunk_size']}: chunked local attention is not "
                        "supported")
    return problems


def vllm_tp_refusal(*, num_q_heads: int, num_kv_heads: int, tp_size: int) -> str | None:
    """Why vLLM cannot split these heads over ``tp_size`` ranks, with the sizes that work; None when it can.
    Each rank holds whole KV heads (one KV head may sit on several ranks) and the same number of Q heads."""
    divisors = [d for d in range(1, num_q_heads + 1) if num_q_heads % d == 0]
    if num_q_heads % num_kv_heads:
        return f"{num_q_heads} Q heads are not a multiple of {num_kv_heads} KV heads"
    if num_q_heads % tp_size:
        return f"it must divide the {num_q_heads} Q heads; use one of {divisors}"
    if tp_size % num_kv_heads if tp_size >= num_kv_heads else num_kv_heads % tp_size:
        good = [t for t in divisors if t % num_kv_heads == 0 or num_kv_heads % t == 0]
        return (f"vLLM gives each rank whole KV heads, so it must divide the {num_kv_heads} KV heads or be a multiple "
                f"of them; use one of {good}")
    return None


def vllm_dcp_refusal(*, num_q_heads: int, num_kv_heads: int, tp_size: int, dcp_size: int) -> str | None:
    """Why vLLM (its engine config) or dcp-triton (whose DCP group must share one KV head) refuses ``dcp_size`` for
    these heads at ``tp_size``, in the flags' words; None when it runs. DCP groups are consecutive TP ranks."""
    if tp_size % dcp_size:
        return f"does not divide tp {tp_size}"
    if dcp_size == 1:
        return None
    if tp_size <= num_kv_heads:
        return (f"tp {tp_size} is not more than the {num_kv_heads} KV heads: every rank already stores KV heads of "
                "its own, so there is no duplicate to remove")
    if (tp_size // num_kv_heads) % dcp_size:
        return (f"tp / KV heads = {tp_size // num_kv_heads} ranks share each KV head, which is not a multiple of "
                f"{dcp_size}")
    if (num_q_heads // num_kv_heads) % dcp_size:
        return f"Q heads per KV head = {num_q_heads // num_kv_heads}, which is not a multiple of {dcp_size}"
    return None


@dataclass(frozen=True, slots=True, kw_only=True)
class DcpOption:
    """One DCP size at a fixed TP size, as vLLM lays the heads out (every rank alike)."""

    dcp_size: int
    kv_heads_per_rank: int  # KV heads each rank stores (TP's split; DCP does not change it)
    prefix_q_heads: int  # Q heads each rank attends to its KV shard with (its own, gathered over the DCP group)
    kv_bytes_per_token: float  # K + V bytes, all layers, that one context token costs a rank on average
    capacity: float  # KV tokens held relative to dcp_size=1
    max_context_tokens: int | None  # KV tokens (all requests together) a per-rank budget holds; None without one


def compare_dcp_sizes(model: ModelShape, *, tp_size: int, kv_budget_gib: float | None = None
                      ) -> tuple[list[DcpOption], dict[int, str]]:
    """Every DCP size that divides ``tp_size``: the ones vLLM runs, compared, and the others with the reason."""
    per_head_token = 2 * model.head_dim * DTYPE_BYTES[model.dtype] * model.num_layers
    kv_per_rank = max(1, model.num_kv_heads // tp_size)
    options, refused = [], {}
    for dcp in (d for d in range(1, tp_size + 1) if tp_size % d == 0):
        reason = vllm_dcp_refusal(num_q_heads=model.num_q_heads, num_kv_heads=model.num_kv_heads, tp_size=tp_size,
                                  dcp_size=dcp)
        if reason is not None:
            refused[dcp] = reason
            continue
        per_token = kv_per_rank * per_head_token / dcp
        options.append(DcpOption(
            dcp_size=dcp, kv_heads_per_rank=kv_per_rank, prefix_q_heads=model.num_q_heads // tp_size * dcp,
            kv_bytes_per_token=per_token, capacity=float(dcp),
            max_context_tokens=None if kv_budget_gib is None else int(kv_budget_gib * 2**30 // per_token)))
    return options, refused


COMPARISON_LEGEND = (
    "dcp: ranks that split each request's KV cache along tokens (--decode-context-parallel-size)",
    "KV heads/rank: KV heads each rank stores (vLLM's tensor-parallel split; DCP does not change it)",
    "prefix Q heads: query heads each rank attends its KV shard with (its own, all-gathered over the DCP group)",
    "KV B/token: K + V bytes over all layers that one token of context costs a rank (it stores 1/dcp of them)",
    "capacity: KV tokens the cache holds, relative to dcp 1",
    "max tokens: KV tokens (all requests together) that --kv-budget-gib per rank holds",
    "per layer: what each step adds at dcp > 1 (a Q all-gather and an LSE combine over the DCP group)",
)


def format_comparison(model: ModelShape, options: list[DcpOption], refused: dict[int, str], *, tp_size: int,
                      chosen: int | None = None, kv_budget_gib: float | None = None) -> str:
    ceiling = max(1.0, tp_size / model.num_kv_heads)
    lines = [f"model: {model.num_q_heads} Q heads, {model.num_kv_heads} KV heads, head_dim {model.head_dim}, "
             f"{model.num_layers} layers, {model.dtype} KV cache",
             f"vLLM at tp {tp_size}: {model.num_q_heads // tp_size} Q heads and {options[0].kv_heads_per_rank} KV "
             f"head(s) per rank; DCP can gain at most max(1, tp / KV heads) = {ceiling:g}x KV capacity", ""]
    budget = "-" if kv_budget_gib is None else f"{kv_budget_gib:g} GiB"
    rows = [("", "dcp", "KV heads/rank", "prefix Q heads", "KV B/token", "capacity", f"max tokens ({budget})",
             "per layer")]
    for o in options:
        rows.append(("*" if o.dcp_size == chosen else "", str(o.dcp_size), str(o.kv_heads_per_rank),
                     str(o.prefix_q_heads), f"{o.kv_bytes_per_token:,.0f}", f"{o.capacity:g}x",
                     "-" if o.max_context_tokens is None else f"{o.max_context_tokens:,}",
                     "Q all-gather + LSE combine" if o.dcp_size > 1 else "no collectives"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines += ["  ".join(cell.ljust(w) if i == len(widths) - 1 else cell.rjust(w)
                        for i, (cell, w) in enumerate(zip(row, widths))).rstrip() for row in rows]
    notes = []
    if len(options) == 1:
        notes.append(f"DCP buys nothing at tp {tp_size} for this model: run it without --decode-context-parallel-size.")
    by_reason: dict[str, list[int]] = {}
    for dcp, reason in refused.items():
        by_reason.setdefault(reason, []).append(dcp)
    notes += [f"dcp {', '.join(map(str, sizes))}: not runnable ({reason})" for reason, sizes in by_reason.items()]
    lines += ["", *notes] if notes else []
    lines += ["", "legend:", *(f"  {line}" for line in COMPARISON_LEGEND)]
    return "\n".join(lines)
