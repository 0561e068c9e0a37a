"""vLLM's real scheduler driven in this process, with no model and no worker.

The same trick as vLLM's own scheduler tests: a real ``Scheduler`` (and block pool,
prefix cache, priority queues) over a KV cache config with no tensors, and model
outputs made up by the caller. Used by the plugin's tests, the overhead benchmark
and the digital twin. Needs a model directory only for ``ModelConfig`` to read its
``config.json`` (``scripts/make_tiny_model.py`` writes one; no weights are loaded).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

_hash_ready = False


def build_scheduler(
    model_dir: Path | str,
    num_blocks: int,
    block_size: int = 16,
    scheduler_cls: Any = None,
    async_scheduling: bool = False,
    max_model_len: int = 4096,
    max_num_seqs: int = 256,
    max_num_batched_tokens: int = 4096,
    policy: str = "priority",
    kv_connector: str | None = None,
) -> Any:
    """A real vLLM scheduler with prefix caching on and ``num_blocks`` KV blocks;
    with ``kv_connector`` (``"NixlConnector"``), that connector's scheduler side, both
    roles, as one instance of a P/D pair sees it (no transfer happens: the caller
    says when one finishes, as vLLM's own P/D lifecycle tests do)."""
    import torch
    from vllm.config import (
        CacheConfig,
        KVTransferConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    model_config = ModelConfig(model=str(model_dir), dtype="float32", seed=0,
                               skip_tokenizer_init=True, max_model_len=max_model_len)
    cache_config = CacheConfig(block_size=block_size, cache_dtype="auto",
                               enable_prefix_caching=True)
    scheduler_config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
        policy=policy,
        async_scheduling=async_scheduling,
    )
    kv_transfer_config = (KVTransferConfig(kv_connector=kv_connector, kv_role="kv_both")
                          if kv_connector else None)
    vllm_config = VllmConfig(model_config=model_config, cache_config=cache_config,
                             scheduler_config=scheduler_config,
                             kv_transfer_config=kv_transfer_config)
    # The platform hook may rewrite these (the CPU platform turns async off).
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    vllm_config.scheduler_config.async_scheduling = async_scheduling
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(
            ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"],
            FullAttentionSpec(block_size=block_size, num_kv_heads=2, head_size=32,
                              dtype=torch.float32),
        )],
    )
    register_all_kvcache_specs(vllm_config)
    if scheduler_cls is None:
        scheduler_cls = AsyncScheduler if async_scheduling else Scheduler
    scheduler = scheduler_cls(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=block_size,
        hash_block_size=block_size,
        log_stats=True,
    )
    # The V2 model runner's pipeline bookkeeping has no worker to match here.
    scheduler.use_v2_model_runner = False
    return scheduler


def make_request(
    request_id: str,
    prompt_token_ids: Sequence[int],
    max_tokens: int,
    block_size: int = 16,
    arrival_time: float | None = None,
    extra_args: dict[str, Any] | None = None,
    priority: int = 0,
    kv_transfer_params: dict[str, Any] | None = None,
) -> Any:
    """A vLLM ``Request`` with block hashing on (so prefix caching applies);
    ``kv_transfer_params`` as a P/D proxy sends them (``{"do_remote_decode": True}``:
    this engine prefills and the KV connector sends the KV on)."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    global _hash_ready
    if not _hash_ready:
        init_none_hash(sha256)
        _hash_ready = True
    request = Request(
        request_id=request_id,
        prompt_token_ids=list(prompt_token_ids),
        sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                                       extra_args=extra_args),
        pooling_params=None,
        arrival_time=arrival_time,
        priority=priority,
        block_hasher=get_request_block_hasher(block_size, sha256),
    )
    if kv_transfer_params is not None:
        request.kv_transfer_params = kv_transfer_params
    return request


def model_output(scheduler: Any, scheduler_output: Any, token_id: int = 7) -> Any:
    """What a worker would return: one sampled token per request past its prefill."""
    from vllm.v1.outputs import ModelRunnerOutput

    ids = list(scheduler_output.num_scheduled_tokens)
    fields: dict[str, Any] = {}
    # vLLM 0.34 dropped req_id_to_index (the order of req_ids is the index).
    if "req_id_to_index" in getattr(ModelRunnerOutput, "__dataclass_fields__", {}):
        fields["req_id_to_index"] = {request_id: index for index, request_id in enumerate(ids)}
    return ModelRunnerOutput(
        req_ids=ids,
        sampled_token_ids=[[] if scheduler.requests[r].is_prefill_chunk else [token_id]
                           for r in ids],
        logprobs=None,
        prompt_logprobs_dict={},
        pooler_output=[],
        **fields,
    )


def step(scheduler: Any, token_id: int = 7) -> Any:
    """One engine step: schedule, then feed back a made-up model output."""
    scheduler_output = scheduler.schedule()
    scheduler.update_from_output(scheduler_output,
                                 model_output(scheduler, scheduler_output, token_id))
    return scheduler_output


def free_blocks(scheduler: Any) -> int:
    return int(scheduler.kv_cache_manager.block_pool.get_num_free_blocks())
