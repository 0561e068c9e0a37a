#!/usr/bin/env python3
"""Drive vLLM 0.32's real Scheduler in-process: no model, no worker, no GPU.

    python scripts/probe_inprocess_scheduler.py [--blocks N] [--block-size 16]
        [--policy priority|fcfs] [--async] [--model-dir DIR] [--quiet]

Builds ``vllm.v1.core.sched.scheduler.Scheduler`` (or ``AsyncScheduler`` with
``--async``) the way vLLM's own scheduler tests and benchmarks do: a ``VllmConfig`` from
a local model config (``ModelConfig(skip_tokenizer_init=True)``, the tiny Llama of
scripts/make_tiny_model.py, created on the fly when missing), a ``KVCacheConfig`` with
one ``FullAttentionSpec`` group of N blocks, and a fake ``ModelRunnerOutput`` per step
(one sampled token for every request that is not mid-prefill).

It then checks, with asserts, the invariants the kvtether plugin relies on:

1. plain lifecycle: requests run to completion, every block returns to the pool
   (free = N - 1: block 0 is the null block), finished ids leave ``self.requests``;
2. prefix cache: a second request with the same prompt gets a prefix hit;
3. pinning the way the plugin will do it: override ``_free_blocks`` to take the blocks
   with ``kv_cache_manager.pop_blocks_for_free`` and ``del self.requests[...]`` once;
   while pinned the free count stays low, ``reset_prefix_cache`` refuses, and the
   next turn of the same job hits the pinned blocks; releasing with
   ``block_pool.free_blocks(reversed(blocks))`` returns every block;
4. priority re-ranking of a waiting request: remove from the heap, change
   ``Request.priority``, add back; the new order is honoured by ``schedule()``;
5. priority preemption: under block pressure the running request with the largest
   ``(priority, arrival_time)`` is preempted.

Exit status 0 and a final ``ALL CHECKS PASSED`` line when everything holds.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _ensure_model_dir(path: Path | None) -> Path:
    if path is None:
        path = Path(tempfile.gettempdir()) / "kvtether-tiny-model"
    if not (path / "config.json").is_file():
        subprocess.run(
            [sys.executable, str(HERE / "make_tiny_model.py"), str(path)],
            check=True,
            stdout=subprocess.DEVNULL,
        )
    return path


def build_scheduler(
    model_dir: Path,
    num_blocks: int,
    block_size: int,
    policy: str = "priority",
    async_scheduling: bool = False,
    max_model_len: int = 2048,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 2048,
    scheduler_cls: type | None = None,
):
    """Return a real vLLM 0.32 Scheduler with no model executor and no worker."""
    import torch
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
    )
    from vllm.v1.structured_output import StructuredOutputManager

    model_config = ModelConfig(
        model=str(model_dir),
        dtype="float32",
        seed=0,
        skip_tokenizer_init=True,
        max_model_len=max_model_len,
    )
    cache_config = CacheConfig(
        block_size=block_size,
        cache_dtype="auto",
        enable_prefix_caching=True,
    )
    scheduler_config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
        policy=policy,
        async_scheduling=async_scheduling,
    )
    vllm_config = VllmConfig(
        model_config=model_config,
        cache_config=cache_config,
        scheduler_config=scheduler_config,
    )
    # VllmConfig's platform hook may rewrite block size / async flag; the scheduler
    # only reads what we pass below plus cache_config.num_gpu_blocks.
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    vllm_config.scheduler_config.async_scheduling = async_scheduling
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"],
                FullAttentionSpec(
                    block_size=block_size, num_kv_heads=2, head_size=32, dtype=torch.float32
                ),
            )
        ],
    )
    register_all_kvcache_specs(vllm_config)
    if scheduler_cls is None:
        scheduler_cls = AsyncScheduler if async_scheduling else Scheduler
    sched = scheduler_cls(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=block_size,
        hash_block_size=block_size,
        log_stats=True,
    )
    # The V2 model runner path adds PP decode-cadence bookkeeping we don't model.
    sched.use_v2_model_runner = False
    return sched


_HASH_READY = False


def make_request(
    request_id: str,
    prompt: list[int],
    max_tokens: int,
    block_size: int,
    priority: int = 0,
    arrival_time: float | None = None,
    extra_args: dict | None = None,
):
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    global _HASH_READY
    if not _HASH_READY:
        init_none_hash(sha256)
        _HASH_READY = True
    return Request(
        request_id=request_id,
        prompt_token_ids=list(prompt),
        sampling_params=SamplingParams(
            max_tokens=max_tokens, ignore_eos=True, extra_args=extra_args
        ),
        pooling_params=None,
        arrival_time=arrival_time,
        priority=priority,
        block_hasher=get_request_block_hasher(block_size, sha256),
    )


def fake_output(sched, sched_out, token: int = 7):
    from vllm.v1.outputs import ModelRunnerOutput

    ids = list(sched_out.num_scheduled_tokens)
    return ModelRunnerOutput(
        req_ids=ids,
        req_id_to_index={r: i for i, r in enumerate(ids)},
        sampled_token_ids=[[] if sched.requests[r].is_prefill_chunk else [token] for r in ids],
        logprobs=None,
        prompt_logprobs_dict={},
        pooler_output=[],
    )


def step(sched, log=None) -> object:
    out = sched.schedule()
    sched.update_from_output(out, fake_output(sched, out))
    if log is not None:
        log(
            f"  step: scheduled={dict(out.num_scheduled_tokens)} "
            f"new={[r.req_id for r in out.scheduled_new_reqs]} "
            f"preempted={sorted(out.preempted_req_ids)} "
            f"running={[r.request_id for r in sched.running]} "
            f"waiting={len(sched.waiting)} free={free(sched)}"
        )
    return out


def run_until_idle(sched, log=None, max_steps: int = 500) -> int:
    n = 0
    while sched.has_unfinished_requests():
        step(sched, log)
        n += 1
        assert n < max_steps, "scheduler did not drain"
    return n


def free(sched) -> int:
    return sched.kv_cache_manager.block_pool.get_num_free_blocks()


def pinning_subclass(base):
    """The minimal pin mechanism, following vLLM 0.32's own invariants."""

    class PinningScheduler(base):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.pins: dict[str, list] = {}  # request_id -> blocks (allocation order)
            self.pin_enabled = True

        def _free_blocks(self, request):  # Scheduler._free_blocks, scheduler.py:2746
            assert request.is_finished()
            ea = (request.sampling_params.extra_args or {}) if request.sampling_params else {}
            if (
                not self.pin_enabled
                or ea.get("is_last_step", 1)
                or not self._request_blocks_can_be_freed(request)
            ):
                return super()._free_blocks(request)
            blocks = self.kv_cache_manager.pop_blocks_for_free(request)
            del self.requests[request.request_id]
            self.pins[request.request_id] = blocks

        def release_pin(self, request_id: str) -> int:
            blocks = self.pins.pop(request_id)
            # Same order as KVCacheManager.free: tail blocks become evictable first.
            self.kv_cache_manager.block_pool.free_blocks(reversed(blocks))
            return len(blocks)

        def release_all_pins(self) -> None:
            for rid in list(self.pins):
                self.release_pin(rid)

        def reset_prefix_cache(self, *a, **kw):
            self.release_all_pins()  # pins first, or the reset always fails
            return super().reset_prefix_cache(*a, **kw)

    return PinningScheduler


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=64, help="KV blocks incl. null block")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--policy", choices=["priority", "fcfs"], default="priority")
    ap.add_argument("--async", dest="async_", action="store_true", help="AsyncScheduler")
    ap.add_argument("--model-dir", type=Path, default=None)
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

    def log(msg: str) -> None:
        if not args.quiet:
            print(msg)

    import vllm
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.request import RequestStatus

    model_dir = _ensure_model_dir(args.model_dir)
    bs, n = args.block_size, args.blocks
    base = AsyncScheduler if args.async_ else Scheduler
    sched = build_scheduler(
        model_dir, n, bs, args.policy, args.async_, scheduler_cls=pinning_subclass(base)
    )
    print(
        f"vllm {vllm.__version__}: {type(sched).__mro__[1].__name__} policy={sched.policy.value} "
        f"blocks={n} block_size={bs} prefix_caching={sched.cache_config.enable_prefix_caching} "
        f"free_at_start={free(sched)}"
    )
    assert free(sched) == n - 1, "block 0 is the null block"

    # 1. plain lifecycle (is_last_step=1: no pin) --------------------------------------
    sched.pin_enabled = False
    prefix = list(range(100, 100 + 3 * bs))  # 3 full blocks shared
    reqs = [
        make_request("a", prefix + [1] * 5, 4, bs, extra_args={"job_id": "A", "is_last_step": 1}),
        make_request("b", prefix + [2] * 5, 4, bs, extra_args={"job_id": "B", "is_last_step": 1}),
        make_request("c", [3] * (2 * bs + 3), 4, bs),
    ]
    for r in reqs:
        sched.add_request(r)
    before = free(sched)
    log("[1] lifecycle")
    steps = run_until_idle(sched, log)
    after = free(sched)
    print(f"[1] {len(reqs)} requests finished in {steps} steps; free before={before} after={after}")
    assert after == n - 1 and not sched.requests
    assert all(r.status == RequestStatus.FINISHED_LENGTH_CAPPED for r in reqs)
    assert [len(r.output_token_ids) for r in reqs] == [4, 4, 4]

    # 2. prefix cache hit from freed (cached, ref_cnt 0) blocks ------------------------
    r2 = make_request("a2", prefix + [9] * 5, 2, bs)
    sched.add_request(r2)
    out = step(sched, log)
    hit = out.scheduled_new_reqs[0].num_computed_tokens
    print(f"[2] same-prefix request got a prefix hit of {hit} tokens (expect {3 * bs})")
    assert hit == 3 * bs
    run_until_idle(sched, log)
    assert free(sched) == n - 1

    # 3. pinning ------------------------------------------------------------------------
    sched.pin_enabled = True
    job_prompt = list(range(500, 500 + 4 * bs + 5))  # 4 full blocks + 5
    t1 = make_request(
        "job1-turn1", job_prompt, 3, bs, extra_args={"job_id": "J", "is_last_step": 0}
    )
    sched.add_request(t1)
    log("[3] pinning")
    run_until_idle(sched, log)
    pinned = len(sched.pins.get("job1-turn1", []))
    print(
        f"[3] turn 1 finished: pinned {pinned} blocks, free={free(sched)} "
        f"(n-1-pinned={n - 1 - pinned}); in self.requests: {'job1-turn1' in sched.requests}"
    )
    assert pinned == 5 and free(sched) == n - 1 - pinned
    assert "job1-turn1" not in sched.requests
    assert sched.kv_cache_manager.reset_prefix_cache() is False, "reset must fail while pinned"
    # Turn 2 = turn-1 prompt + its output + a tool result; hits the pinned blocks.
    t2_prompt = job_prompt + list(t1.output_token_ids) + [11] * 20
    t2 = make_request("job1-turn2", t2_prompt, 2, bs, extra_args={"job_id": "J", "is_last_step": 1})
    sched.add_request(t2)
    out = step(sched, log)
    hit2 = out.scheduled_new_reqs[0].num_computed_tokens
    print(f"[3] turn 2 prefix hit on pinned blocks: {hit2} tokens (expect {4 * bs})")
    assert hit2 == 4 * bs
    run_until_idle(sched, log)
    released = sched.release_pin("job1-turn1")
    print(f"[3] released {released} pinned blocks; free={free(sched)}")
    assert free(sched) == n - 1 and not sched.pins
    # A pin that is still held is released by reset_prefix_cache (the override above).
    t3 = make_request(
        "job2-turn1",
        list(range(900, 900 + 2 * bs + 1)),
        2,
        bs,
        extra_args={"job_id": "K", "is_last_step": 0},
    )
    sched.add_request(t3)
    run_until_idle(sched)
    assert sched.pins and free(sched) < n - 1
    assert sched.reset_prefix_cache() is True and free(sched) == n - 1
    print("[3] reset_prefix_cache after releasing pins: ok")

    # 4. re-ranking a waiting request under PRIORITY ------------------------------------
    if sched.policy.value == "priority":
        sched.pin_enabled = False
        w = [
            make_request(f"w{i}", [40 + i] * 8, 1, bs, priority=5, arrival_time=1000.0 + i)
            for i in range(3)
        ]
        for r in w:
            sched.add_request(r)
        q = sched.waiting
        late = w[2]
        q.remove_request(late)  # heap list remove + heapify (request_queue.py:174)
        late.priority = -1
        q.add_request(late)  # heappush
        order = [r.request_id for r in q]
        print(f"[4] waiting order after re-rank of w2 to priority -1: {order}")
        assert order == ["w2", "w0", "w1"]
        sched.max_num_active_reqs = 1  # admit one per step to observe the order
        first = step(sched).scheduled_new_reqs[0].req_id
        assert first == "w2", first
        sched.max_num_active_reqs = sched.max_num_running_reqs
        run_until_idle(sched)
        assert free(sched) == n - 1

    # 5. priority preemption under block pressure ---------------------------------------
    if sched.policy.value == "priority":
        sched.pin_enabled = False
        per = (n - 1) // 3  # three requests fill the pool, then decode needs more
        prompt_len = per * bs
        rs = [
            make_request(
                f"p{i}", [60 + i] * prompt_len, bs + 2, bs, priority=pr, arrival_time=2000.0 + i
            )
            for i, pr in enumerate([0, 9, 1])
        ]
        for r in rs:
            sched.add_request(r)
        preempted: list[str] = []
        for _ in range(200):
            if not sched.has_unfinished_requests():
                break
            out = step(sched)
            preempted += sorted(out.preempted_req_ids)
        print(f"[5] preempted under pressure (priorities p0=0, p1=9, p2=1): {preempted[:3]}")
        assert preempted and preempted[0] == "p1", preempted
        assert free(sched) == n - 1 and not sched.requests

    print("ALL CHECKS PASSED")
    return 0


if __name__ == "__main__":
    sys.exit(main())
