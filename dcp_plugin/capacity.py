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
    num_layers: int  # layers that hold a KV cache (a hybrid model's full-attention layers)
    dtype: str = "bfloat16"
    linear_layers: int = 0  # a hybrid model's layers with a per-request state instead (linear attention, Mamba)
    draft_layers: int = 0  # multi-token-prediction (MTP) layers the checkpoint ships for speculative decoding

    def __post_init__(self) -> None:
        for name in ("num_q_heads", "num_kv_heads", "head_dim", "num_layers", "linear_layers", "draft_layers"):
            value, low = getattr(self, name), 0 if name in ("linear_layers", "draft_layers") else 1
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
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
    fields["num_layers"], fields["linear_layers"] = layer_kinds(cfg)
    draft = cfg.get("num_nextn_predict_layers") or cfg.get("mtp_num_hidden_layers")
    fields["draft_layers"] = draft if isinstance(draft, int) and not isinstance(draft, bool) and draft > 0 else 0
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


def layer_kinds(cfg: dict) -> tuple[object, int]:
    """A config's layers that hold a KV cache and its layers that hold a per-request state instead (a hybrid
    model's linear-attention or Mamba layers), read from ``layer_types`` (Qwen3-Next, Qwen3.5, Granite 4, LFM2),
    ``full_attention_interval``, ``hybrid_override_pattern`` (Nemotron-H: ``*`` attention, ``M`` Mamba) or
    ``attn_layer_period`` / ``attn_layer_offset`` (Jamba); otherwise every layer of ``num_hidden_layers``
    (unchecked: ``ModelShape`` checks it)."""
    layers = cfg.get("num_hidden_layers")
    kinds = cfg.get("layer_types")
    if isinstance(kinds, list) and kinds and all(isinstance(kind, str) for kind in kinds):
        kv = sum(kind == "attention" or (kind.endswith("_attention") and not kind.startswith("linear"))
                 for kind in kinds)
        return kv, len(kinds) - kv
    pattern = cfg.get("hybrid_override_pattern")
    if isinstance(pattern, str) and pattern:
        return pattern.count("*"), pattern.count("M")
    if not isinstance(layers, int) or isinstance(layers, bool) or layers < 1:
        return layers, 0
    interval = cfg.get("full_attention_interval")
    if isinstance(interval, int) and interval > 0:
        return layers // interval, layers - layers // interval
    period, offset = cfg.get("attn_layer_period"), cfg.get("attn_layer_offset")
    if isinstance(period, int) and isinstance(offset, int) and period > 0:
        kv = sum(i % period == offset for i in range(layers))
        return kv, layers - kv
    return layers, 0


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
    from dcp_plugin.kernels.checks import check_int
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
        parallel = ParallelState.from_tp(tp_rank=tp_rank, tp_size=tp_size, dcp_size=dcp_size)
        heads = HeadLayout.create(
            total_q_heads=model.num_q_heads, total_kv_heads=model.num_kv_heads, parallel=parallel, kv_replication=layout
        )
        stored = heads.num_kv_heads * per_head_token
        per_context = stored / dcp_size
        budget = None if kv_budget_gib is None else int(kv_budget_gib * 2**30 // per_context)
        ranks.append(
            RankCapacity(
                tp_rank=tp_rank,
                dcp_rank=parallel.dcp_rank,
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
    from dcp_plugin.kernels.chunk_attention import SUPPORTED_HEAD_DIMS

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
