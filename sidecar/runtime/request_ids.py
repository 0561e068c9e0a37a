"""The id an API client got back for a request an engine reports.

vLLM (0.32) schedules a request under the id its API returned (the OpenAI client's
``chatcmpl-…``, or the ``X-Request-Id`` header) followed by ``-`` and 8 random hex
digits (``InputProcessor.assign_request_id``), and each child of a parallel-sampling
request (``n > 1``) as ``<index>_`` followed by that. Inspection finds a request by
either id: :func:`response_ids_of` undoes vLLM's rule.

An engine that reports the API's id itself (vLLM with
``VLLM_DISABLE_REQUEST_ID_RANDOMIZATION``, the twin) is found by that id; an id that
happens to end like vLLM's suffix only gains an alias, since the id as reported is
looked up first.
"""

from __future__ import annotations

import re

_RANDOM_SUFFIX = re.compile(r"(?P<response_id>.+)-[0-9a-f]{8}")
_CHILD_PREFIX = re.compile(r"[0-9]+_(?P<parent_id>.+)")


def response_ids_of(request_id: str) -> tuple[str, ...]:
    """The ids the API client may have got back for the engine's ``request_id``: none
    when it does not have vLLM's form; two when it may be a parallel-sampling child
    (an API id may itself start like ``3_``)."""
    match = _RANDOM_SUFFIX.fullmatch(request_id)
    if match is None:
        return ()
    response_id = match.group("response_id")
    child = _CHILD_PREFIX.fullmatch(response_id)
    return (response_id,) if child is None else (response_id, child.group("parent_id"))
