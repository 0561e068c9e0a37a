"""How long one engine step takes on a real GPU: a roofline-derived linear model.

    t_step = fixed_s + prefill_s_per_token * prefill_tokens
                     + decode_s_per_seq * decode_seqs
                     + kv_read_s_per_token * kv_tokens_read
                     + attention_s_per_pair * attention_pairs

- ``fixed_s``: every step reads all weights once (memory bound) and pays the engine's
  per-step CPU/launch overhead: ``weight_bytes / (bandwidth * bandwidth_efficiency)
  + step_overhead_s``.
- ``prefill_s_per_token``: a prompt token is compute bound, ``2 * matmul_params``
  FLOPs (no LM head: vLLM computes logits only for sampled positions):
  ``2 * body_params / (peak_flops * mfu)``.
- ``decode_s_per_seq``: a decoding sequence computes one token through the body and the
  LM head, plus the engine's per-sequence CPU cost (input preparation, sampling,
  output processing): ``2 * (body_params + lm_head_params) / (peak_flops * mfu)
  + per_seq_overhead_s``.
- ``kv_read_s_per_token``: attention reads the K and V of every context token of every
  scheduled sequence once per step: ``kv_bytes_per_token / (bandwidth *
  bandwidth_efficiency)``.

- ``attention_s_per_pair``: attention's compute, per (query token, key token) pair a
  step multiplies out. 0 on the GPU, where attention is bound by reading the KV (the
  term above) and a step's matmuls dwarf its FLOPs. Not so on vLLM's CPU build with the
  tiny test model: there a prompt token attending over 1,500 cached tokens costs
  about ten times one attending over none (``benchmarks/engine/attention.py``), so a
  turn's prefill after a long cached prefix is far dearer per token than the prompt
  tokens' average, and a re-computation grows with the square of the context.

The GPU and model give the physics; four efficiencies (``Efficiency``) are the only
free parameters, calibrated once against FCFS on the real GPU (``python -m
benchmarks.twin calibrate``) and never against any other policy.

What a step is made of is read from vLLM's own ``SchedulerOutput``: a request with more
than one scheduled token is a prefill chunk (its tokens count as prefill tokens), a
request with one is a decoding sequence (a one-token prefill remainder costs the same as
a decode); every scheduled request attends over its whole computed context.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class GpuSpec:
    name: str
    memory_bandwidth_bytes_per_s: float
    dense_bf16_flops: float  # tensor-core dense bf16, FP32 accumulate


@dataclass(frozen=True, slots=True)
class ModelSpec:
    name: str
    layers: int
    hidden_size: int
    intermediate_size: int
    attention_heads: int
    kv_heads: int
    head_dim: int
    vocab_size: int
    dtype_bytes: int = 2

    @property
    def body_params(self) -> int:
        """Matmul parameters of the transformer body (attention + MLP, all layers)."""
        q_and_o = 2 * self.hidden_size * self.attention_heads * self.head_dim
        k_and_v = 2 * self.hidden_size * self.kv_heads * self.head_dim
        mlp = 3 * self.hidden_size * self.intermediate_size
        return self.layers * (q_and_o + k_and_v + mlp)

    @property
    def lm_head_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def total_params(self) -> int:
        """Body + LM head + input embedding (untied), ignoring norms."""
        return self.body_params + 2 * self.lm_head_params

    @property
    def weight_bytes(self) -> int:
        return self.total_params * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token in every layer: 2 * layers * kv_heads * head_dim * dtype."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes


# NVIDIA's RTX 5090 (GB202) specification: 1,792 GB/s GDDR7; 209.5 TFLOPS dense
# FP16/BF16 tensor with FP32 accumulate.
RTX_5090 = GpuSpec("NVIDIA GeForce RTX 5090", 1.792e12, 209.5e12)

# meta-llama/Llama-3.1-8B-Instruct config.json (also benchmarks/twin/model/llama-3.1-8b).
LLAMA_31_8B = ModelSpec(
    name="Llama-3.1-8B-Instruct",
    layers=32,
    hidden_size=4096,
    intermediate_size=14336,
    attention_heads=32,
    kv_heads=8,
    head_dim=128,
    vocab_size=128256,
)


@dataclass(frozen=True, slots=True)
class Efficiency:
    """The calibrated part: fractions of peak and the engine's CPU costs."""

    bandwidth_efficiency: float = 0.9  # achieved / peak DRAM bandwidth
    mfu: float = 0.6  # achieved / peak bf16 tensor FLOPs
    step_overhead_s: float = 0.001  # scheduler + launch + sync per step
    per_seq_overhead_s: float = 20e-6  # input prep + sampling + detokenize per sequence

    def __post_init__(self) -> None:
        for name in ("bandwidth_efficiency", "mfu"):
            value = getattr(self, name)
            if not 0.0 < value <= 1.0:
                raise ValueError(f"{name} must be in (0, 1], got {value!r}")
        for name in ("step_overhead_s", "per_seq_overhead_s"):
            if getattr(self, name) < 0.0:
                raise ValueError(f"{name} must be >= 0")


@dataclass(frozen=True, slots=True)
class StepShape:
    """What one step computes, read off a ``SchedulerOutput``."""

    prefill_tokens: int = 0
    decode_seqs: int = 0
    kv_tokens_read: int = 0
    # Causal attention's (query, key) pairs: a request scheduling n tokens after P
    # computed ones multiplies n * P + n * (n + 1) / 2 of them.
    attention_pairs: int = 0

    @property
    def empty(self) -> bool:
        return not (self.prefill_tokens or self.decode_seqs)


@dataclass(frozen=True, slots=True)
class StepTimeModel:
    fixed_s: float
    prefill_s_per_token: float
    decode_s_per_seq: float
    kv_read_s_per_token: float
    attention_s_per_pair: float = 0.0

    @classmethod
    def derive(cls, gpu: GpuSpec = RTX_5090, model: ModelSpec = LLAMA_31_8B,
               efficiency: Efficiency | None = None) -> StepTimeModel:
        eff = efficiency or Efficiency()
        bandwidth = gpu.memory_bandwidth_bytes_per_s * eff.bandwidth_efficiency
        flops = gpu.dense_bf16_flops * eff.mfu
        return cls(
            fixed_s=model.weight_bytes / bandwidth + eff.step_overhead_s,
            prefill_s_per_token=2.0 * model.body_params / flops,
            decode_s_per_seq=2.0 * (model.body_params + model.lm_head_params) / flops
            + eff.per_seq_overhead_s,
            kv_read_s_per_token=model.kv_bytes_per_token / bandwidth,
        )

    def step_s(self, shape: StepShape) -> float:
        """Seconds the GPU takes for one step of this shape (0 for an empty step)."""
        if shape.empty:
            return 0.0
        return (self.fixed_s
                + self.prefill_s_per_token * shape.prefill_tokens
                + self.decode_s_per_seq * shape.decode_seqs
                + self.kv_read_s_per_token * shape.kv_tokens_read
                + self.attention_s_per_pair * shape.attention_pairs)

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


def attention_pairs(prefix_tokens: int, new_tokens: int) -> int:
    """Query-key pairs of causal attention when ``new_tokens`` are computed after
    ``prefix_tokens``: each new token attends over the prefix and the new tokens up to
    itself, ``n * P + n * (n + 1) / 2``."""
    return new_tokens * prefix_tokens + new_tokens * (new_tokens + 1) // 2


def shape_of(scheduler: Any, scheduler_output: Any) -> StepShape:
    """The step's shape. Call right after ``schedule()``: vLLM has already advanced
    ``num_computed_tokens`` by the scheduled tokens, so it is the attended context."""
    prefill = decode = kv = pairs = 0
    requests = scheduler.requests
    for request_id, tokens in scheduler_output.num_scheduled_tokens.items():
        if tokens > 1:
            prefill += tokens
        else:
            decode += 1
        context = requests[request_id].num_computed_tokens
        kv += context
        pairs += attention_pairs(context - tokens, tokens)
    return StepShape(prefill_tokens=prefill, decode_seqs=decode, kv_tokens_read=kv,
                     attention_pairs=pairs)
