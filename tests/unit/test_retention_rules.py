"""What a retention config means: validation naming the field, overlap matching, block
priorities (decode included), raises vs. lowerings over time, merging, the vllm_xargs
shape, and the ownership rule shared by the store and the engine."""

from __future__ import annotations

import math

import pytest

from sidecar.api.retention_ownership import (
    OwnershipError,
    check_clear,
    check_set,
    owner_after_set,
)
from sidecar.api.retention_ranges import (
    DEFAULT,
    DirectiveError,
    Protection,
    block_protections,
    dominates,
    from_request_directives,
    merge,
    only_raises,
    priority_at,
    validate,
)
from sidecar.api.v1 import retention_pb2 as pb


def ranges(*spec: tuple[int, int | None, int, float | None], decode: tuple[int, float | None]
           | None = None) -> pb.RetentionConfig:
    config = pb.RetentionConfig()
    for start, end, priority, duration in spec:
        token_range = config.token_ranges.add(token_start=start, priority=priority)
        if end is not None:
            token_range.token_end = end
        if duration is not None:
            token_range.duration_s = duration
    if decode is not None:
        config.decode_priority = decode[0]
        if decode[1] is not None:
            config.decode_duration_s = decode[1]
    return config


# --- validation --------------------------------------------------------------------
@pytest.mark.parametrize(
    ("config", "field"),
    [
        (ranges((0, None, 101, None)), "config.token_ranges[0].priority"),
        (ranges((0, 10, 50, None), (10, 10, 40, None)), "config.token_ranges[1].token_end"),
        (ranges((20, 5, 50, None)), "config.token_ranges[0].token_end"),
        (ranges((0, None, 50, -1.0)), "config.token_ranges[0].duration_s"),
        (ranges((0, None, 50, math.nan)), "config.token_ranges[0].duration_s"),
        (ranges(*[(i, i + 1, 50, None) for i in range(17)]), "config.token_ranges"),
        (ranges((0, 100, 20, None), (100, None, 90, None)), "config.token_ranges"),
        (ranges((0, None, 50, None), decode=(101, None)), "config.decode_priority"),
        (ranges((0, None, 50, None), decode=(10, -2.0)), "config.decode_duration_s"),
        (ranges((0, None, 50, None), decode=(60, None)), "config.decode_priority"),
    ],
)
def test_invalid_configs_name_the_field(config: pb.RetentionConfig, field: str) -> None:
    with pytest.raises(DirectiveError) as refused:
        validate(config)
    assert refused.value.field == field
    assert str(refused.value).startswith(field)


@pytest.mark.parametrize(
    "config",
    [
        pb.RetentionConfig(),
        ranges((0, 512, 100, None), (512, None, 80, 45.0), decode=(1, None)),
        ranges((0, None, 100, None), (0, 256, 100, 5.0)),  # overlapping, not rising
        ranges((100, 200, 50, None)),  # tokens before 100: no directive, not "rising"
        ranges(*[(i, i + 1, 50, None) for i in range(16)]),
    ],
)
def test_valid_configs_pass(config: pb.RetentionConfig) -> None:
    validate(config)


# --- overlap matching and block priorities -----------------------------------------
def test_the_strongest_overlapping_range_wins() -> None:
    config = ranges((0, 100, 60, 10.0), (50, 150, 90, None), (0, 100, 60, 30.0))
    assert priority_at(config, 10) == 60
    assert priority_at(config, 60) == 90
    assert priority_at(config, 150) == 35  # end is exclusive: no directive, the default


def test_block_protection_is_the_strongest_range_overlapping_it() -> None:
    config = ranges((0, 20, 100, None), (20, None, 80, 45.0))
    # 16-token blocks: block 1 spans tokens 16-31, overlapping both ranges.
    assert block_protections(config, 4, 16, prompt_tokens=64) == [
        Protection(100), Protection(100), Protection(80, 45.0), Protection(80, 45.0)]


def test_decode_blocks_take_the_decode_priority() -> None:
    config = ranges((0, None, 80, None), decode=(1, 5.0))
    # 40 prompt tokens: block 2 (32-47) holds prompt and decode tokens, block 3 only decode.
    assert block_protections(config, 4, 16, prompt_tokens=40) == [
        Protection(80), Protection(80), Protection(80), Protection(1, 5.0)]


def test_without_a_decode_priority_open_ranges_reach_decode_tokens() -> None:
    config = ranges((0, 32, 100, None), (32, None, 70, None))
    assert block_protections(config, 4, 16, prompt_tokens=40)[3] == Protection(70)
    closed = ranges((0, 32, 100, None))
    assert block_protections(closed, 3, 16, prompt_tokens=40)[2] == DEFAULT


# --- raises and lowerings over time ------------------------------------------------
@pytest.mark.parametrize(
    ("new", "old", "raises"),
    [
        (Protection(90), Protection(80), True),
        (Protection(70), Protection(80), False),
        (Protection(80, 10.0), Protection(80), False),   # expires earlier: a lowering
        (Protection(80), Protection(80, 10.0), True),    # lasts longer: a raise
        (Protection(90, 10.0), Protection(80), False),   # higher now, default later
        (Protection(90, 20.0), Protection(80, 10.0), True),
        (Protection(20), Protection(10, 5.0), False),    # 10 reverts *up* to 35 after 5 s
        (Protection(35), Protection(10), True),
    ],
)
def test_dominates(new: Protection, old: Protection, raises: bool) -> None:
    assert dominates(new, old) is raises


def test_only_raises_compares_every_token_and_decode() -> None:
    old = ranges((0, 512, 100, None), (512, None, 80, 45.0))
    assert only_raises(old, ranges((0, None, 100, None)))
    assert not only_raises(old, ranges((0, 512, 100, None)))  # drops the 80 after 512
    assert not only_raises(old, ranges((0, 512, 100, None), (512, None, 80, 5.0)))
    assert not only_raises(ranges((0, None, 50, None), decode=(60, None)),
                           ranges((0, None, 50, None)))


def test_merge_keeps_the_strongest_per_token() -> None:
    pushed = ranges((0, 512, 100, None), (512, None, 80, 45.0))
    own = ranges((0, 1024, 90, None), decode=(1, None))
    merged = merge([pushed, own])
    assert [(r.token_start, r.token_end if r.HasField("token_end") else None, r.priority,
             r.duration_s if r.HasField("duration_s") else None)
            for r in merged.token_ranges] == [
        (0, 512, 100, None), (512, 1024, 90, None), (1024, None, 80, 45.0)]
    assert merged.decode_priority == 1
    assert merge([pushed]) == pushed


# --- the per-request shape (vllm_xargs) --------------------------------------------
def test_request_directives_in_the_prs_shape() -> None:
    config = from_request_directives([
        {"start": 0, "end": 512, "priority": 100},
        {"token_start": 512, "priority": 80, "duration": 45},
    ])
    assert config == ranges((0, 512, 100, None), (512, None, 80, 45.0))


@pytest.mark.parametrize(
    ("items", "field"),
    [
        ([{"start": 0}], "retention_directives[0].priority"),
        ([{"priority": -1}], "retention_directives[0].priority"),
        ([{"priority": 50, "start": "zero"}], "retention_directives[0].token_start"),
        ([{"priority": 50, "end": 2.5}], "retention_directives[0].token_end"),
        ([{"priority": 50}, {"priority": 40, "duration": "long"}],
         "retention_directives[1].duration"),
        ([{"priority": 50, "ttl": 3}], "retention_directives[0].ttl"),
        ([{"priority": True}], "retention_directives[0].priority"),
        ([{"priority": 50, "duration": 10**400}], "retention_directives[0].duration"),
    ],
)
def test_malformed_request_directives_name_the_field(items: list[dict[str, object]],
                                                     field: str) -> None:
    with pytest.raises(DirectiveError) as refused:
        from_request_directives(items)
    assert refused.value.field == field


# --- ownership (one rule for the store and for the engine's blocks) ---------------
@pytest.mark.parametrize(
    ("owner", "caller", "raises", "after"),
    [
        (None, "a", False, "a"),        # first claim
        (None, "", False, ""),          # anonymous may set what nobody set
        ("a", "a", False, "a"),         # the owner lowers, refreshes
        ("a", "b", True, "a"),          # anyone raises; the owner stays
        ("a", "b", False, None),        # another scope cannot lower
        ("a", "", True, "a"),
        ("a", "", False, None),         # anonymous lowers nothing
        ("", "b", False, "b"),          # a named scope claims an anonymous directive
        ("", "", False, None),
    ],
)
def test_owner_after_set(owner: str | None, caller: str, raises: bool,
                         after: str | None) -> None:
    assert owner_after_set(owner, caller, raises) == after
    if after is None:
        with pytest.raises(OwnershipError):
            check_set(owner, caller, raises)


@pytest.mark.parametrize(("owner", "caller", "allowed"),
                         [("a", "a", True), ("a", "b", False), ("a", "", False),
                          ("", "", False), ("", "b", True)])
def test_check_clear(owner: str, caller: str, allowed: bool) -> None:
    if allowed:
        check_clear(owner, caller)
    else:
        with pytest.raises(OwnershipError):
            check_clear(owner, caller)


@pytest.mark.parametrize(
    "value",
    [
        '[{"start": 0, "end": 512, "priority": 100}, {"start": 512, "priority": 80}]',
        ['{"start": 0, "end": 512, "priority": 100}', '{"start": 512, "priority": 80}'],
        [{"start": 0, "end": 512, "priority": 100}, {"start": 512, "priority": 80}],
    ],
)
def test_request_directives_arrive_as_vllm_xargs_carry_them(value: object) -> None:
    """The OpenAI API's vllm_xargs carry strings, numbers and lists of them: a JSON
    string, or a list of JSON strings; in process, the list itself."""
    from types import SimpleNamespace

    from vllm_plugin.metadata import read_metadata

    request = SimpleNamespace(request_id="r", session_id=None, sampling_params=SimpleNamespace(
        extra_args={"retention_directives": value, "retention_scope": "dynamo"}))
    meta = read_metadata(request)
    assert meta.retention_scope == "dynamo"
    assert from_request_directives(meta.retention_directives) == ranges(
        (0, 512, 100, None), (512, None, 80, None))
