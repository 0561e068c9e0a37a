"""vLLM's own tool-call parser, named by ``KVTETHER_PLUGIN_TOOL_PARSER``, read on a
finished request's output to learn which tool the turn ended with.

The parser is resolved exactly as vLLM's ``--tool-call-parser`` resolves it
(``ParserManager.get_parser`` with auto tool choice on, gpt-oss models through the
Harmony parser) and run as vLLM's OpenAI server runs it on a finished, non-streamed
choice (``Parser.parse``), on the decoded tail of the output:

- the text is decoded without skipping special tokens (what every tool parser's
  ``adjust_request`` asks of a request that carries tools: Kimi-K2's and DeepSeek's
  markers are special tokens) and without the stop token that ended the turn (vLLM's
  detokenizer leaves it out of the text);
- ``<think>…</think>`` reasoning is removed first, as kvtether's own parsing does
  (a call drafted while reasoning is not the call);
- of the calls found, the *last* one is the tool, as in ``sidecar.api.toolcalls``: an
  agent's action ends its turn. Its name is keyed by ``sidecar.api.toolcalls.call_key``
  (a shell tool by its command), so the statistics match kvtether's own parsing.

Contracts: called on the engine thread only; never raises (a parser that fails is
logged once, and the caller falls back to kvtether's parsing); the parser class and
one parser instance are built once, on first use, and reused (parsing a finished
output is one call to a parser that holds no state between calls: Harmony's resets at
each end of output). Nothing from vLLM's serving layer is imported until then.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Sequence
from typing import Any

from sidecar.api.toolcalls import call_key, strip_thinking

logger = logging.getLogger("kvtether.plugin")


def registered_tool_parsers() -> list[str]:
    """The names ``--tool-call-parser`` accepts in this vLLM."""
    from vllm.tool_parsers import ToolParserManager

    return list(ToolParserManager.list_registered())


class VllmToolParser:
    """vLLM's tool parser ``name``, built with the model's tokenizer on first use."""

    def __init__(self, name: str, load_tokenizer: Callable[[], Any],
                 model_config: Any = None) -> None:
        self.name = name
        self._load_tokenizer = load_tokenizer
        self._model_config = model_config
        self._parser: Any = None
        self._request: Any = None
        self._tokenizer: Any = None
        # gpt-oss (Harmony) output is parsed from token ids, message by message: the id
        # of <|start|>, where a message after the first begins. None: parsed from text.
        self._message_start_id: int | None = None
        # False once building the parser failed: kvtether's own parsing from then on.
        self._usable = True
        self._warned = False

    def tool(self, token_ids: Sequence[int], stop_token_ids: Collection[int] = (),
             starts_output: bool = True) -> str | None:
        """The tool the last call in ``token_ids`` names, or None: no call found, or the
        parser failed (logged once). ``token_ids`` are the end of a finished output
        (``starts_output``: all of it); ``stop_token_ids`` the request's stop tokens."""
        if not self._usable or not token_ids:
            return None
        try:
            if self._parser is None:
                self._build()
            return self._last_call(list(token_ids), stop_token_ids, starts_output)
        except NotImplementedError as error:  # e.g. "openai" on a model that is not gpt-oss
            self._usable = False
            self._warn_once(error)
        except Exception as error:  # a parser's failure never fails the request
            self._warn_once(error)
        return None

    def _build(self) -> None:
        try:
            from vllm.entrypoints.openai.chat_completion.protocol import (
                ChatCompletionRequest,
            )
            from vllm.parser.parser_manager import ParserManager

            tokenizer = self._load_tokenizer()
            if tokenizer is None:
                raise RuntimeError("the engine has no tokenizer (--skip-tokenizer-init)")
            model_type = getattr(getattr(self._model_config, "hf_config", None),
                                 "model_type", None)
            parser_cls = ParserManager.get_parser(
                tool_parser_name=self.name,
                enable_auto_tools=True,
                model_name=getattr(self._model_config, "model", None),
                is_harmony=model_type == "gpt_oss",
                tokenizer=tokenizer,
            )
            if parser_cls is None:
                raise TypeError(f"vLLM resolved no parser for {self.name!r}")
            self._parser = parser_cls(tokenizer, None, model_config=self._model_config)
            if model_type == "gpt_oss":
                from vllm.entrypoints.openai.parser.harmony_utils import get_encoding

                self._message_start_id = get_encoding().encode(
                    "<|start|>", allowed_special="all")[0]
            self._tokenizer = tokenizer
            # What the server passes for a request with tool_choice "auto". The request's
            # own tools never reach the engine; the parsers name the function from the
            # output (a call only the tools could name, such as Kimi-K2's bare counter
            # id, is left to kvtether's parsing).
            self._request = ChatCompletionRequest(model="", messages=[], tool_choice=None)
        except Exception:
            self._usable = False
            raise

    def _last_call(self, ids: list[int], stop_token_ids: Collection[int],
                   starts_output: bool) -> str | None:
        if self._message_start_id is not None:
            text = ""  # Harmony reads the ids alone
            if not starts_output:
                # A tail that begins inside a message would derail the parser: begin
                # where the first whole message in it does, as after the prompt.
                if self._message_start_id not in ids:
                    return None
                ids = ids[ids.index(self._message_start_id) + 1 :]
        else:
            text_ids = ids[:-1] if ids[-1] in stop_token_ids else ids
            text = strip_thinking(
                str(self._tokenizer.decode(text_ids, skip_special_tokens=False)))
        _, _, calls = self._parser.parse(
            text, self._request, enable_auto_tools=True, model_output_token_ids=ids)
        for call in reversed(calls or ()):
            key = call_key(call.name, call.arguments)
            if key is not None:
                return key
        return None

    def _warn_once(self, error: Exception) -> None:
        if self._warned:
            logger.debug("kvtether: vLLM tool parser %r failed", self.name, exc_info=True)
            return
        self._warned = True
        logger.warning("kvtether: vLLM tool parser %r failed (%s: %s); the tool is read "
                       "by kvtether's own parsing%s", self.name, type(error).__name__,
                       error, "" if self._usable else " from now on")
