"""What a prompt token costs on vLLM's CPU build as a function of the context it is
computed after: one request at a time, a cached prefix of P tokens and n new ones.

    .venv/bin/python -m benchmarks.engine.attention [--reps 7] [--out F.json]

The daemon learns a step's cost as linear in the prompt tokens it computes
(``sidecar/runtime/steptime.py``), and the twin's CPU setup (``python -m
benchmarks.twin cpu``) charges the same. That is an average over the contexts the
tokens were computed after. Here each cell's time is fitted to

    time_s = fixed_s + prefill_s_per_token * n + attention_s_per_pair * pairs,
    pairs = n * P + n * (n + 1) / 2     (causal attention's query-key pairs)

by least squares (numpy's), and the two per-token figures are what ``python -m
benchmarks.twin cpu --prefill-s-per-token A --attention-s-per-pair C`` takes.

The engine is the engine benchmark's (``tests.support.launch``): the tiny model (or
``KVTETHER_TINY_MODEL_DIR``), dummy weights, float32, eager, max-model-len 2,048,
prefix caching, vLLM's own scheduler, in this process (``vllm.LLM``). A cell's prefix
is cached by a request of the prefix alone first; every prompt is fresh random
tokens, so nothing else hits. Cells are taken in a new random order each repetition
and the median kept: a shared machine's speed drifts within a minute.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

# The twin's count, so that the fitted figure is the one its step model multiplies.
from benchmarks.common.results import write_result
from benchmarks.twin.steptime import attention_pairs

MAX_MODEL_LEN = 2048
PREFIXES = (0, 256, 512, 1024, 1536)
NEW_TOKENS = (32, 128, 256, 512)
# Cold prompts as long as the benchmark's longest contexts.
LONG_COLD = (1024, 1536, 2000)
VOCAB_LOW, VOCAB_HIGH = 10, 2000  # inside the tiny model's 2,048


@dataclass(frozen=True, slots=True)
class Cell:
    prefix_tokens: int
    new_tokens: int
    seconds: float  # median over the repetitions

    @property
    def pairs(self) -> int:
        return attention_pairs(self.prefix_tokens, self.new_tokens)


@dataclass(frozen=True, slots=True)
class Fit:
    fixed_s: float
    prefill_s_per_token: float
    attention_s_per_pair: float

    def seconds(self, prefix_tokens: int, new_tokens: int) -> float:
        return (self.fixed_s + self.prefill_s_per_token * new_tokens
                + self.attention_s_per_pair * attention_pairs(prefix_tokens, new_tokens))

    def token_s_after(self, prefix_tokens: int, new_tokens: int) -> float:
        """The average cost of one of ``new_tokens`` computed after ``prefix_tokens``."""
        return (self.seconds(prefix_tokens, new_tokens) - self.fixed_s) / new_tokens


def grid() -> list[tuple[int, int]]:
    cells = [(prefix, new) for prefix in PREFIXES for new in NEW_TOKENS
             if prefix + new < MAX_MODEL_LEN]
    return cells + [(0, length) for length in LONG_COLD]


def fit(cells: Sequence[Cell]) -> Fit:
    """Least squares of the cells' seconds on (1, n, pairs); every coefficient must
    come out positive, or the measurement says nothing about it."""
    import numpy as np

    if len(cells) < 4:
        raise ValueError(f"{len(cells)} cells: at least 4 are needed for 3 coefficients")
    design = np.array([[1.0, c.new_tokens, c.pairs] for c in cells])
    seconds = np.array([c.seconds for c in cells])
    # Columns differ by 6 orders of magnitude: solve with each scaled to unit norm.
    norms = np.linalg.norm(design, axis=0)
    coefficients, *_ = np.linalg.lstsq(design / norms, seconds, rcond=None)
    fixed_s, per_token_s, per_pair_s = (float(v) for v in coefficients / norms)
    if min(fixed_s, per_token_s, per_pair_s) <= 0.0:
        raise ValueError(f"a non-positive coefficient ({fixed_s:.3g} s, {per_token_s:.3g} "
                         f"s a token, {per_pair_s:.3g} s a pair): too noisy to fit")
    return Fit(fixed_s, per_token_s, per_pair_s)


def measure(model_dir: Path, reps: int, seed: int = 0) -> list[Cell]:
    from vllm import LLM, SamplingParams

    llm = LLM(model=str(model_dir), load_format="dummy", enforce_eager=True,
              dtype="float32", max_model_len=MAX_MODEL_LEN, num_gpu_blocks_override=64,
              gpu_memory_utilization=0.3, enable_prefix_caching=True)
    one_token = SamplingParams(max_tokens=1, temperature=0.0)
    rng = random.Random(seed)

    def tokens(count: int) -> list[int]:
        return [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(count)]

    def timed(prompt: list[int]) -> float:
        started = time.perf_counter()
        llm.generate([{"prompt_token_ids": prompt}], one_token, use_tqdm=False)
        return time.perf_counter() - started

    for _ in range(5):  # warm up: the first requests compile and allocate
        timed(tokens(128))
    cells = grid()
    samples: dict[tuple[int, int], list[float]] = {cell: [] for cell in cells}
    for _ in range(reps):
        rng.shuffle(cells)
        for prefix_tokens, new_tokens in cells:
            prefix = tokens(prefix_tokens)
            if prefix:
                timed(prefix + tokens(1))  # caches the prefix's full blocks
            samples[(prefix_tokens, new_tokens)].append(timed(prefix + tokens(new_tokens)))
    return [Cell(prefix, new, statistics.median(times))
            for (prefix, new), times in sorted(samples.items())]


def report(cells: Sequence[Cell], model: Fit) -> str:
    lines = [f"{'cached prefix':>13}{'new tokens':>12}{'measured ms':>13}{'fitted ms':>11}"
             f"{'a new token us':>16}"]
    for cell in cells:
        lines.append(f"{cell.prefix_tokens:>13}{cell.new_tokens:>12}"
                     f"{cell.seconds * 1e3:>13.1f}"
                     f"{model.seconds(cell.prefix_tokens, cell.new_tokens) * 1e3:>11.1f}"
                     f"{model.token_s_after(cell.prefix_tokens, cell.new_tokens) * 1e6:>16.1f}")
    after_none = model.token_s_after(0, 128)
    after_long = model.token_s_after(1536, 128)
    lines += [
        f"fit: {model.fixed_s * 1e3:.2f} ms a request + {model.prefill_s_per_token:.2e} s "
        f"a prompt token + {model.attention_s_per_pair:.2e} s an attention pair",
        f"128 new tokens after 1,536 cached cost {after_long / after_none:.1f}x as much "
        f"a token as after none ({after_long * 1e6:.0f} us against {after_none * 1e6:.0f})",
        f"a 2,000-token prompt computed cold: {model.token_s_after(0, 2000) * 1e6:.0f} us "
        f"a token on average",
        "the twin with it: python -m benchmarks.twin cpu --like RUN.json "
        f"--prefill-s-per-token {model.prefill_s_per_token:.2e} "
        f"--attention-s-per-pair {model.attention_s_per_pair:.2e}",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.engine.attention",
        description="Prompt-token cost on vLLM's CPU build against the cached context")
    parser.add_argument("--reps", type=int, default=7, help="repetitions of every cell")
    parser.add_argument("--out", type=Path, help="write the cells and the fit here (JSON)")
    args = parser.parse_args(argv)
    if args.reps < 1:
        parser.error(f"--reps: {args.reps} must be >= 1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from tests.support.launch import tiny_model_dir

    model_dir = tiny_model_dir()
    cells = measure(model_dir, args.reps)
    model = fit(cells)
    print(report(cells, model))
    if args.out is not None:
        result: dict[str, Any] = {"model_dir": str(model_dir), "reps": args.reps,
                                  "cells": [asdict(c) for c in cells], "fit": asdict(model)}
        write_result(args.out, result)
    return 0


if __name__ == "__main__":  # vLLM's engine core is a spawned process: needs the guard
    raise SystemExit(main())
