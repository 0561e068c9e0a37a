#!/usr/bin/env python3
"""Create a tiny Llama model directory that vLLM can serve with no hub access.

    python scripts/make_tiny_model.py OUT_DIR [--force]

Writes, into OUT_DIR:

- ``config.json``            LlamaForCausalLM, 2 layers, hidden 128, 4 heads, 2 KV heads,
                             head_dim 32, vocab 2048, max_position_embeddings 4096;
- ``tokenizer.json``         a byte-level BPE tokenizer (vocab 2048) trained here with the
                             ``tokenizers`` library on text this script carries;
- ``tokenizer_config.json``  bos/eos/pad tokens and a ChatML ``chat_template``, so
                             ``/v1/chat/completions`` works;
- ``special_tokens_map.json``, ``generation_config.json``;
- ``.kvtether-tiny-model``   a stamp with the spec's hash (what makes reruns a no-op).

There are no weights: serve it with ``--load-format dummy`` (random weights), e.g.

    python -m vllm.entrypoints.openai.api_server --model OUT_DIR --load-format dummy \
        --enforce-eager --max-model-len 2048 --num-gpu-blocks-override 64

Idempotent: when OUT_DIR already holds the files of this exact spec the script does
nothing (``--force`` rebuilds). Only ``tokenizers`` is needed (vLLM depends on it).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import sys
import tempfile
from pathlib import Path

VOCAB_SIZE = 2048
SPEC_VERSION = 1  # bump when anything written below changes

BOS = "<|begin_of_text|>"
EOS = "<|end_of_text|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
PAD = "<|pad|>"
SPECIAL_TOKENS = [BOS, EOS, IM_START, IM_END, PAD]  # ids 0..4, in this order

# ChatML. Content may be a string or a list of OpenAI content parts.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% elif message['content'] is not none %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}"
    "{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "vocab_size": VOCAB_SIZE,
    "max_position_embeddings": 4096,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "attention_bias": False,
    "mlp_bias": False,
    "tie_word_embeddings": False,
    "initializer_range": 0.02,
    "torch_dtype": "bfloat16",
    "bos_token_id": 0,
    "eos_token_id": [1, 3],
    "pad_token_id": 4,
    "use_cache": True,
}

GENERATION_CONFIG = {
    "bos_token_id": 0,
    "eos_token_id": [1, 3],
    "pad_token_id": 4,
    "do_sample": True,
    "temperature": 1.0,
    "top_p": 1.0,
}

TOKENIZER_CONFIG = {
    "tokenizer_class": "PreTrainedTokenizerFast",
    "bos_token": BOS,
    "eos_token": IM_END,
    "pad_token": PAD,
    "unk_token": None,
    "add_bos_token": False,
    "add_eos_token": False,
    "clean_up_tokenization_spaces": False,
    "model_max_length": 4096,
    "chat_template": CHAT_TEMPLATE,
}

SPECIAL_TOKENS_MAP = {
    "bos_token": BOS,
    "eos_token": IM_END,
    "pad_token": PAD,
    "additional_special_tokens": [EOS, IM_START],
}

# --- training text: English prose, code, shell, agent transcripts -----------------------

ENGLISH = """\
The scheduler decides, at every step, which requests run and how many tokens each one
gets. An agent job is a sequence of model calls separated by tool executions: the model
writes a command, the tool runs it, and the output comes back as the next user turn.
Between turns the key-value cache of the conversation can be kept in memory for a short
time, so that the next turn does not have to recompute the whole prompt. Keeping it has
a cost: the blocks it holds cannot be used by other requests while they are pinned.
A good policy pins when the tool is fast and the memory is not needed, and frees at once
when the tool is slow or the cache is under pressure. The time to live of a pin should
depend on what the tool usually takes, on how loaded the server is, and on how much
prefill the pin saves. When the daemon is slow or down, the engine falls back to its own
behaviour and no request fails because of it.
Please summarize the following document in three sentences. What is the capital of
France? Paris is the capital and largest city of France. Explain how a hash table works,
with an example. Write a short poem about the sea at night. Thank you for your help!
I would like to book a table for two people tomorrow evening at seven o'clock.
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a
single step. Knowledge is power, but enthusiasm pulls the switch. It was the best of
times, it was the worst of times; it was the age of wisdom, it was the age of foolishness.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 16 32 64 100 128 256 512 1000 1024 2048 4096 65536.
Dates and times: 2024-01-15 09:30:00, 12:45 PM, Monday, Tuesday, Wednesday, Thursday,
Friday, Saturday, Sunday, January, February, March, April, May, June, July, August,
September, October, November, December. Units: ms, seconds, minutes, hours, GiB, MiB.
"""

CODE = '''\
import os
import sys
import json
from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int] = field(default_factory=list)
    priority: int = 0
    arrival_time: float = 0.0

    def num_tokens(self) -> int:
        return len(self.prompt_token_ids)


def schedule(waiting: list[Request], budget: int) -> list[Request]:
    """Admit requests in priority order until the token budget is spent."""
    scheduled = []
    for request in sorted(waiting, key=lambda r: (r.priority, r.arrival_time)):
        if request.num_tokens() > budget:
            break
        budget -= request.num_tokens()
        scheduled.append(request)
    return scheduled


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        self.free = list(range(num_blocks))
        self.ref_cnt = {i: 0 for i in range(num_blocks)}

    def allocate(self, n: int) -> Optional[list[int]]:
        if n > len(self.free):
            return None
        blocks, self.free = self.free[:n], self.free[n:]
        for b in blocks:
            self.ref_cnt[b] += 1
        return blocks

    def release(self, blocks: list[int]) -> None:
        for b in reversed(blocks):
            self.ref_cnt[b] -= 1
            if self.ref_cnt[b] == 0:
                self.free.append(b)


def main(argv: list[str]) -> int:
    path = argv[1] if len(argv) > 1 else "config.json"
    with open(path, encoding="utf-8") as f:
        config: dict[str, Any] = json.load(f)
    print(f"loaded {len(config)} keys from {path}")
    try:
        value = int(os.environ.get("NUM_BLOCKS", "64"))
    except ValueError as exc:
        raise SystemExit(f"bad NUM_BLOCKS: {exc}")
    pool = BlockPool(value)
    assert pool.allocate(4) == [0, 1, 2, 3]
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
'''

SHELL = """\
$ ls -la
total 48
drwxr-xr-x  6 user user 4096 Jan 15 09:30 .
-rw-r--r--  1 user user 1234 Jan 15 09:30 README.md
-rw-r--r--  1 user user  567 Jan 15 09:30 pyproject.toml
drwxr-xr-x  2 user user 4096 Jan 15 09:30 src
drwxr-xr-x  2 user user 4096 Jan 15 09:30 tests
$ cat src/main.py | head -n 20
$ grep -rn "def schedule" src/ tests/
src/scheduler.py:42:def schedule(waiting, budget):
$ git status
On branch main
Changes not staged for commit:
  modified:   src/scheduler.py
$ git diff --stat && git log --oneline -5
$ python -m pytest -q tests/test_scheduler.py -x
....F.
FAILED tests/test_scheduler.py::test_priority_order - AssertionError: assert 3 == 2
1 failed, 5 passed in 0.42s
$ pip install -e . && make build
$ find . -name "*.py" -type f | xargs wc -l | sort -n | tail -5
$ sed -n '10,40p' src/scheduler.py
$ echo "export PATH=$HOME/.local/bin:$PATH" >> ~/.bashrc
$ docker build -t app:latest . && docker run --rm -p 8000:8000 app:latest
$ curl -s http://localhost:8000/v1/models | python -m json.tool
$ mkdir -p build && cd build && cmake .. && make -j4
$ cp config.yaml /tmp/ && chmod 644 /tmp/config.yaml && rm -rf build/
$ ps aux | grep python | awk '{print $2}'
$ tar -czf backup.tar.gz data/ && du -sh backup.tar.gz
"""

AGENT = """\
<think>The test fails because the queue is sorted by arrival time only. I should look at
the comparison function first.</think>
I will inspect the scheduler to find the ordering bug.
```bash
grep -n "sorted" src/scheduler.py
```
{"name": "bash", "arguments": {"command": "python -m pytest -q tests/"}}
<tool_call>{"name": "read_file", "arguments": {"path": "src/scheduler.py"}}</tool_call>
The fix is to sort by (priority, arrival_time). All tests pass now.
"""


def _words(text: str) -> list[str]:
    return text.split()


_NOUNS = _words(
    "request block cache queue token prompt model server engine worker policy daemon "
    "client session job turn tool pin memory budget step batch prefix victim priority "
    "config file path test build output input error value result state event metric "
    "table index key list dict string number time user system message answer question"
)
_VERBS = _words(
    "run read write free pin schedule admit preempt release extend load save parse "
    "check update reset start stop send receive compute return open close build test"
)
_ADJ = _words(
    "fast slow new old last first free busy long short small large local remote "
    "pinned waiting running finished cached empty full valid default"
)


def _synthetic_lines(n: int) -> list[str]:
    """Deterministic extra text, so BPE has enough material for all 2048 merges."""
    rng = random.Random(20240115)
    lines: list[str] = []
    for i in range(n):
        a, b = rng.choice(_ADJ), rng.choice(_NOUNS)
        v, c = rng.choice(_VERBS), rng.choice(_NOUNS)
        k = rng.randint(0, 4096)
        lines.append(f"The {a} {b} will {v} the {c} after {k} ms.")
        lines.append(f"def {v}_{b}({c}: int = {k % 97}) -> {a.title()}{c.title()}:")
        lines.append(f"    self.{b}_{c}[{i % 31}] = {v}({c}, {k}) + {a}_{b}")
        lines.append(f"$ {v} --{b}={k} ./{c}/{a}_{b}.py > /tmp/{c}.{i % 7}.log 2>&1")
    return lines


def training_corpus() -> list[str]:
    paragraphs = [ENGLISH, CODE, SHELL, AGENT]
    lines: list[str] = []
    for p in paragraphs:
        lines.extend(p.splitlines())
    lines.extend(_synthetic_lines(600))
    return lines


# --- build ------------------------------------------------------------------------------


def spec_hash() -> str:
    blob = json.dumps(
        {
            "v": SPEC_VERSION,
            "config": CONFIG,
            "gen": GENERATION_CONFIG,
            "tok": TOKENIZER_CONFIG,
            "special": SPECIAL_TOKENS,
            "vocab": VOCAB_SIZE,
            "corpus": hashlib.sha256("\n".join(training_corpus()).encode()).hexdigest(),
        },
        sort_keys=True,
    ).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


STAMP = ".kvtether-tiny-model"
FILES = [
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
]


def is_current(out: Path) -> bool:
    stamp = out / STAMP
    if not stamp.is_file() or stamp.read_text().strip() != spec_hash():
        return False
    return all((out / f).is_file() for f in FILES)


def train_tokenizer():  # -> tokenizers.Tokenizer
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise SystemExit(
            "make_tiny_model.py needs the 'tokenizers' package "
            "(run it with the engine venv's python, or: pip install tokenizers)"
        ) from exc

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=1,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(training_corpus(), trainer=trainer)
    size = tok.get_vocab_size()
    if size != VOCAB_SIZE:
        raise SystemExit(
            f"tokenizer training produced {size} tokens, expected {VOCAB_SIZE}: "
            "the built-in corpus is too small"
        )
    for i, t in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(t) != i:
            raise SystemExit(f"special token {t!r} got id {tok.token_to_id(t)}, want {i}")
    return tok


def _write_json(path: Path, obj: object) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def build(out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer()
    # Write into a sibling temp dir, then move files in: a half-written model
    # directory is never left behind with a valid stamp.
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}.tmp") as tmp:
        t = Path(tmp)
        tok.save(str(t / "tokenizer.json"))
        _write_json(t / "config.json", CONFIG)
        _write_json(t / "generation_config.json", GENERATION_CONFIG)
        _write_json(t / "tokenizer_config.json", TOKENIZER_CONFIG)
        _write_json(t / "special_tokens_map.json", SPECIAL_TOKENS_MAP)
        out.mkdir(exist_ok=True)
        (out / STAMP).unlink(missing_ok=True)
        for f in FILES:
            os.replace(t / f, out / f)
        (out / STAMP).write_text(spec_hash() + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir", type=Path, help="model directory to create")
    ap.add_argument("--force", action="store_true", help="rebuild even if up to date")
    args = ap.parse_args(argv)
    out: Path = args.out_dir.resolve()
    if out.exists() and not out.is_dir():
        print(f"error: {out} exists and is not a directory", file=sys.stderr)
        return 2
    if not args.force and is_current(out):
        print(f"tiny model already present: {out}")
        return 0
    build(out)
    print(f"tiny model written: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
