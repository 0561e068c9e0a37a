"""benchmarks/engine/attention.py: the fit of a prompt token's cost against its cached
context (the measurement itself needs vLLM and minutes; its arithmetic does not)."""

from __future__ import annotations

import pytest

from benchmarks.engine.attention import (
    MAX_MODEL_LEN,
    Cell,
    Fit,
    fit,
    grid,
    report,
)
from benchmarks.twin.steptime import StepShape, StepTimeModel, attention_pairs


def test_pairs_are_causal_attentions_query_key_products() -> None:
    assert attention_pairs(0, 1) == 1  # one token attends to itself
    assert attention_pairs(0, 4) == 1 + 2 + 3 + 4
    assert attention_pairs(1000, 2) == 1001 + 1002


def test_the_fit_recovers_the_constants_the_cells_were_made_with() -> None:
    truth = Fit(fixed_s=9e-3, prefill_s_per_token=1.5e-5, attention_s_per_pair=9.5e-8)
    cells = [Cell(prefix, new, truth.seconds(prefix, new)) for prefix, new in grid()]
    fitted = fit(cells)
    assert fitted.fixed_s == pytest.approx(truth.fixed_s, rel=1e-6)
    assert fitted.prefill_s_per_token == pytest.approx(truth.prefill_s_per_token, rel=1e-6)
    assert fitted.attention_s_per_pair == pytest.approx(truth.attention_s_per_pair, rel=1e-6)


def test_the_fit_prices_a_step_as_the_twin_does() -> None:
    # The figures go to `twin cpu --prefill-s-per-token --attention-s-per-pair`: a cell
    # is a one-request step of the twin's model with the same pairs.
    model = Fit(fixed_s=0.0, prefill_s_per_token=1.5e-5, attention_s_per_pair=9.5e-8)
    twin = StepTimeModel(fixed_s=0.0, prefill_s_per_token=1.5e-5, decode_s_per_seq=0.0,
                         kv_read_s_per_token=0.0, attention_s_per_pair=9.5e-8)
    shape = StepShape(prefill_tokens=256, attention_pairs=attention_pairs(1536, 256))
    assert twin.step_s(shape) == pytest.approx(model.seconds(1536, 256))


def test_a_fit_with_no_growth_in_the_context_is_refused() -> None:
    # Flat in the context, falling with the tokens: no positive attention cost.
    cells = [Cell(prefix, new, 0.02 - 1e-6 * new) for prefix, new in grid()]
    with pytest.raises(ValueError, match="non-positive coefficient"):
        fit(cells)
    with pytest.raises(ValueError, match="at least 4"):
        fit(cells[:3])


def test_the_grid_stays_inside_the_model_length() -> None:
    assert all(prefix + new < MAX_MODEL_LEN for prefix, new in grid())
    assert (0, 2000) in grid()  # the cold end of a long context


def test_the_report_names_the_ratio_and_the_twins_flags() -> None:
    truth = Fit(fixed_s=9e-3, prefill_s_per_token=1.5e-5, attention_s_per_pair=9.5e-8)
    cells = [Cell(prefix, new, truth.seconds(prefix, new)) for prefix, new in grid()]
    text = report(cells, truth)
    # (1.5e-5 + 9.5e-8 * (1536 + 64.5)) / (1.5e-5 + 9.5e-8 * 64.5) = 7.9
    assert "1,536 cached cost 7.9x as much a token as after none" in text
    assert "--prefill-s-per-token 1.50e-05 --attention-s-per-pair 9.50e-08" in text
