"""``kvtether inspect``: the Inspect service as tables, for people without grpcurl.

A daemon with auth tokens answers Inspect only to a token of a read scope: the CLI
sends the one in ``--token-file``, else in ``KVTETHER_INSPECT_TOKEN``."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

import grpc
from google.protobuf import json_format
from google.protobuf.message import Message

from sidecar.api.v1 import inspect_pb2 as pb
from sidecar.api.v1 import inspect_pb2_grpc


def _table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [[str(c) for c in headers]] + [[_cell(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
             for row in cells]
    return "\n".join(lines)


def _cell(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.3f}"
    return str(value) if value != "" else "-"


def _print(message: Message, as_json: bool, text: str) -> None:
    if as_json:
        print(json_format.MessageToJson(message, preserving_proto_field_name=True))
    else:
        print(text)


def _more(next_page_token: str) -> str:
    """The line that tells how to print the next page; none on the last."""
    return f"\nmore: --page-token {next_page_token}" if next_page_token else ""


TOKEN_VARIABLE = "KVTETHER_INSPECT_TOKEN"


def _token(args: argparse.Namespace) -> str:
    """The bearer token to send: ``--token-file``'s, else ``$KVTETHER_INSPECT_TOKEN``;
    "" for none. Raises OSError for a file it cannot read."""
    if args.token_file is not None:
        return str(args.token_file.read_text().strip())
    return os.environ.get(TOKEN_VARIABLE, "").strip()


def run_inspect(args: argparse.Namespace) -> int:
    try:
        token = _token(args)
    except OSError as error:
        print(f"kvtether: error: --token-file {args.token_file}: "
              f"{error.strerror or error}", file=sys.stderr)
        return 2
    metadata = (("authorization", f"Bearer {token}"),) if token else None
    if args.tls_ca or args.tls_cert:
        from sidecar.api.credentials import channel_credentials

        options = ([("grpc.ssl_target_name_override", args.tls_server_name)]
                   if args.tls_server_name else [])
        channel = grpc.secure_channel(
            args.address, channel_credentials(args.tls_ca, args.tls_cert, args.tls_key),
            options=options)
    else:
        channel = grpc.insecure_channel(args.address)
    stub = _WithMetadata(inspect_pb2_grpc.InspectStub(channel), metadata)
    timeout_s = args.timeout_s
    try:
        return _dispatch(stub, args, timeout_s)
    except grpc.RpcError as error:
        code = error.code()
        print(f"kvtether: error: {args.address}: {code.name}: {error.details()}",
              file=sys.stderr)
        return 3 if code == grpc.StatusCode.UNAVAILABLE else 1
    except KeyboardInterrupt:
        return 0
    finally:
        channel.close()


class _WithMetadata:
    """The stub's methods, each sending ``metadata`` (the token) with the call."""

    def __init__(self, stub: inspect_pb2_grpc.InspectStub,
                 metadata: tuple[tuple[str, str], ...] | None) -> None:
        self._stub = stub
        self._metadata = metadata

    def __getattr__(self, name: str) -> object:
        method = getattr(self._stub, name)
        metadata = self._metadata
        return lambda request, **kwargs: method(request, metadata=metadata, **kwargs)


def _prefill_load(cost: pb.EngineStepCost) -> tuple[str, str]:
    """Prompt tokens a second and the share of the engine's time they took, lately;
    '-' for an engine with no session."""
    if not cost.HasField("prefill_tokens_per_s"):
        return "-", "-"
    return f"{cost.prefill_tokens_per_s:.4g}", f"{cost.prefill_time_share:.0%}"


def _dispatch(stub: inspect_pb2_grpc.InspectStub, args: argparse.Namespace,
              timeout_s: float) -> int:
    if args.what in ("job", "explain") and not args.id:
        print(f"kvtether: error: inspect {args.what} needs an id", file=sys.stderr)
        return 2
    if args.what == "policy":
        policy = stub.GetPolicy(pb.GetPolicyRequest(), timeout=timeout_s)
        rows = [(k, v) for k, v in sorted(policy.parameters.items())]
        costs = ""
        if policy.engine_costs:  # what the daemon learned a step costs, per engine
            costs = "\n\n" + _table(
                ("engine", "prefill s/token", "step s", "decode s/request", "steps",
                 "prompt tokens/s", "prefill share"),
                [(c.engine_id, f"{c.prefill_s_per_token:.3g}", f"{c.step_s:.3g}",
                  f"{c.decode_s_per_seq:.3g}", c.steps, *_prefill_load(c))
                 for c in policy.engine_costs])
        _print(policy, args.json,
               f"policy {policy.name}  store {policy.store_backend}  version {policy.version}\n"
               f"engines: {', '.join(policy.engines) or '-'}\n"
               + _table(("parameter", "value"), rows) + costs)
    elif args.what == "jobs":
        jobs = stub.ListJobs(pb.ListJobsRequest(limit=args.limit, page_token=args.page_token,
                                                include_anonymous=args.anonymous),
                             timeout=timeout_s)
        _print(jobs, args.json, _table(
            ("job", "engine", "turns", "in flight", "last tool", "pinned blocks"),
            [(j.job_id, j.engine_id, j.turns_finished, j.requests_in_flight, j.last_tool,
              j.pinned_blocks) for j in jobs.jobs]) + _more(jobs.next_page_token))
    elif args.what == "job":
        job = stub.GetJob(pb.GetJobRequest(job_id=args.id), timeout=timeout_s)
        if not job.found:
            print(f"job {args.id}: not found", file=sys.stderr)
            return 1
        _print(job, args.json, "\n\n".join([
            _table(("request", "arrival s", "departure s", "prompt tokens", "output tokens",
                    "tool", "tool time s"),
                   [(t.request_id, t.arrival_s, t.departure_s, t.prompt_tokens,
                     t.output_tokens, t.tool, t.tool_time_s) for t in job.turns]),
            _table(("pinned request", "blocks", "expires at s"),
                   [(p.request_id, p.blocks, p.expires_at_s) for p in job.pins]),
            _table(("decision", "request", "reason"),
                   [(d.kind, d.request_id, d.reason) for d in job.last_decisions]),
        ]))
    elif args.what == "pins":
        pins = stub.ListPins(pb.ListPinsRequest(limit=args.limit, page_token=args.page_token),
                             timeout=timeout_s)
        _print(pins, args.json, _table(
            ("engine", "request", "job", "blocks", "pinned at s", "expires at s", "tool"),
            [(p.engine_id, p.request_id, p.job_id, p.blocks, p.pinned_at_s, p.expires_at_s,
              p.tool) for p in pins.pins]) + f"\n{pins.pinned_blocks} blocks pinned"
               + _more(pins.next_page_token))
    elif args.what == "tools":
        tools = stub.GetToolStats(pb.GetToolStatsRequest(limit=args.limit,
                                                         page_token=args.page_token),
                                  timeout=timeout_s)
        _print(tools, args.json, _table(
            ("tool", "samples", "mean s", "p50 s", "p90 s", "p99 s"),
            [(t.tool, t.count, t.mean_s, t.p50_s, t.p90_s, t.p99_s) for t in tools.tools])
               + _more(tools.next_page_token))
    elif args.what == "explain":
        answer = stub.Explain(pb.ExplainRequest(request_id=args.id, limit=args.limit,
                                                page_token=args.page_token),
                              timeout=timeout_s)
        if not answer.found:
            print(f"request {args.id}: no decision recorded", file=sys.stderr)
            return 1
        # Newest first: the latest decision leads.
        _print(answer, args.json, "\n\n".join(
            f"{d.kind} for {d.request_id} (job {d.job_id}, engine {d.engine_id}, "
            f"seq {d.seq}, policy {d.policy}, at {d.at_s:.3f} s)\nwhy: {d.reason}\n"
            + _table(("input", "value"), sorted(d.inputs.items()))
            for d in reversed(answer.decisions or [answer.decision]))
            + _more(answer.next_page_token))
    elif args.what == "watch":
        for record in stub.WatchDecisions(pb.WatchDecisionsRequest()):
            _print(record, args.json,
                   f"{record.at_s:.3f}  {record.engine_id}  {record.kind:<11} "
                   f"{record.request_id}  {record.reason}")
    return 0
