"""The wire's general rules (:mod:`sidecar.api.messages`) applied to a request as a
service receives it: a request that breaks one ends with ``INVALID_ARGUMENT`` naming
the field, before the service reads it."""

from __future__ import annotations

import grpc
from google.protobuf.message import Message

from sidecar.api.bounds import FieldError
from sidecar.api.messages import check_message


async def check_request(request: Message, context: grpc.aio.ServicerContext) -> None:
    try:
        check_message(request)
    except FieldError as error:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
