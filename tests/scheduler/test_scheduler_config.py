"""The scheduler's configuration file: every setting it accepts is one the scheduler reads."""

from __future__ import annotations

from pathlib import Path

import pydantic
import pytest

from gpufrac.scheduler.config import load_config


def test_a_setting_the_scheduler_does_not_read_is_refused_by_name(tmp_path: Path) -> None:
    # bind_retries was accepted and never read: a failed bind is retried by the scheduling queue's backoff.
    config = tmp_path / "scheduler.yaml"
    config.write_text("bind_concurrency: 8\nbind_retries: 5\n")
    with pytest.raises(pydantic.ValidationError, match="bind_retries"):
        load_config(config)
    config.write_text("bind_concurrency: 8\nbackoff_initial_s: 1.0\n")
    assert load_config(config).bind_concurrency == 8
