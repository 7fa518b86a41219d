"""Quantities become whole MiB by ceiling: a user never gets less memory than they wrote."""

from __future__ import annotations

from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpufrac.contract.errors import (
    MAX_QUANTITY_CHARS,
    BelowMinimum,
    NotAQuantity,
    NotPositive,
    QuantityTooLong,
    RuleViolation,
    TooLarge,
    UnknownQuantitySuffix,
)
from gpufrac.contract.quantities import MIB, bytes_to_mib, format_mib, parse_bytes, parse_mib


@pytest.mark.parametrize(
    ("text", "mib"),
    [
        ("1000M", 954),
        ("40Gi", 40960),
        ("60Gi", 61440),
        ("1Mi", 1),
        ("1.5Gi", 1536),
        (".5Gi", 512),
        ("1.Gi", 1024),
        ("+2Mi", 2),
        ("1048577", 2),  # one byte over 1 MiB still needs a second MiB
        ("1e9", 954),
        ("1E9", 954),
        ("1G", 954),
        ("2048Ki", 2),
        ("1Ti", 1 << 20),
        (" 8Gi ", 8192),
        ("1048576000m", 1),  # milli-bytes: exactly 1 MiB
    ],
)
def test_quantity_to_mib(text: str, mib: int) -> None:
    assert parse_mib(text, key="k") == mib


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("", NotAQuantity),
        ("   ", NotAQuantity),
        ("NaN", NotAQuantity),
        ("nan", NotAQuantity),
        ("Gi", NotAQuantity),
        ("1.5.5Gi", NotAQuantity),
        ("1 Gi", NotAQuantity),
        ("1GB", UnknownQuantitySuffix),
        ("1gi", UnknownQuantitySuffix),
        ("1K", UnknownQuantitySuffix),
        ("-1Gi", NotPositive),
        ("0", NotPositive),
        ("0Gi", NotPositive),
        ("-0", NotPositive),
        ("4096", BelowMinimum),
        ("1023Ki", BelowMinimum),
        ("1e-50", BelowMinimum),
        ("10Ei", TooLarge),
        ("1e40", TooLarge),
        ("1e999999", TooLarge),
    ],
)
def test_rejected_quantities(text: str, error: type[RuleViolation]) -> None:
    with pytest.raises(error) as raised:
        parse_mib(text, key="nvidia.com/container.app.gpu-memory.request")
    assert raised.value.key == "nvidia.com/container.app.gpu-memory.request"
    assert raised.value.value == text


def test_a_bare_number_below_one_mib_suggests_the_unit() -> None:
    with pytest.raises(BelowMinimum) as raised:
        parse_mib("4096", key="k")
    assert "write 4096Mi for 4096 MiB" in raised.value.message


@given(st.integers(min_value=1, max_value=1 << 62), st.integers(min_value=1, max_value=1 << 62))
def test_mib_conversion_is_monotone(a: int, b: int) -> None:
    low, high = sorted((a, b))
    assert bytes_to_mib(low) <= bytes_to_mib(high)


@given(st.integers(min_value=1, max_value=1 << 62))
def test_mib_conversion_never_rounds_down_and_is_tight(amount: int) -> None:
    mib = bytes_to_mib(amount)
    assert mib * MIB >= amount
    assert mib == 1 or (mib - 1) * MIB < amount


@given(st.fractions(min_value=Fraction(1, 10**6), max_value=Fraction(1 << 50)))
def test_fractional_bytes_round_up_too(amount: Fraction) -> None:
    mib = bytes_to_mib(amount)
    assert mib * MIB >= amount
    assert mib >= 1


@given(st.integers(min_value=MIB, max_value=(1 << 63) - 1))
def test_parsed_byte_counts_never_lose_memory(amount: int) -> None:
    assert parse_mib(str(amount), key="k") * MIB >= amount
    assert parse_bytes(str(amount), key="k") == amount


@given(st.integers(min_value=1, max_value=1 << 40))
def test_formatted_mib_parses_back(mib: int) -> None:
    assert parse_mib(format_mib(mib), key="k") == mib


@given(
    st.sampled_from(["", "k", "M", "G", "Ki", "Mi", "Gi", "Ti"]),
    st.decimals(min_value=0, max_value=10**6, places=3, allow_nan=False),
    st.decimals(min_value=0, max_value=10**6, places=3, allow_nan=False),
)
def test_quantity_order_is_kept(suffix: str, a: object, b: object) -> None:
    low, high = sorted((a, b))  # type: ignore[type-var]
    try:
        low_mib = parse_mib(f"{low}{suffix}", key="k")
    except RuleViolation:
        return  # zero or below 1 MiB: rejected, nothing to order
    assert low_mib <= parse_mib(f"{high}{suffix}", key="k")


@pytest.mark.parametrize("digits", [4301, 10_000])
def test_a_quantity_of_thousands_of_digits_is_a_rule_violation_not_a_crash(digits: int) -> None:
    key = "nvidia.com/container.app.gpu-memory.request"
    text = "1" * digits + "Mi"  # past Python's 4,300-digit limit on int conversion: ValueError before
    with pytest.raises(QuantityTooLong) as raised:
        parse_mib(text, key=key)
    message = raised.value.message
    assert message.startswith(f'{key}="{"1" * 80}..." is invalid: ')
    assert f"a quantity must be at most {MAX_QUANTITY_CHARS} characters long (it has {digits + 2})" in message


def test_the_longest_accepted_quantity_parses() -> None:
    text = "0" * (MAX_QUANTITY_CHARS - 3) + "1Gi"
    assert len(text) == MAX_QUANTITY_CHARS
    assert parse_mib(text, key="k") == 1024


@pytest.mark.parametrize("text", ["\u0661\u0660Gi", "\u0660.\u0665Gi", "1\u0660Gi", "\uff11Gi", "1e\u0663"])
def test_unicode_digits_are_not_digits(text: str) -> None:
    with pytest.raises(NotAQuantity) as raised:
        parse_mib(text, key="k")
    assert "only the ASCII digits 0-9 are digits in a quantity" in raised.value.message


def test_the_upper_bound_is_what_the_message_says() -> None:
    most = (1 << 63) - 1
    assert parse_bytes(str(most), key="k") == most
    for text in ("8Ei", "8192Pi", str(most + 1)):
        with pytest.raises(TooLarge) as raised:
            parse_bytes(text, key="k")
        assert "the amount must be less than 8Ei" in raised.value.message
    assert parse_mib("7Ei", key="k") == 7 << 40
