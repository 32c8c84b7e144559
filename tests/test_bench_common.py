"""The benchmarks' shared timing schedule: every contender once per round, the order rotating."""

from __future__ import annotations

from bench._common import interleaved_medians


def test_contenders_take_turns_first_and_each_measure_is_the_median_of_all_rounds() -> None:
    order: list[str] = []

    def contender(name: str, value: float):
        def measure() -> dict[str, list[float]]:
            order.append(name)
            return {"single": [value, value + 2 * len(order)], "streamed": [value]}

        return measure

    result = interleaved_medians({"a": contender("a", 1.0), "b": contender("b", 10.0)}, rounds=4)
    assert order == ["a", "b", "b", "a", "a", "b", "b", "a"]
    # a's single samples: 1, 3 | 1, 9 | 1, 11 | 1, 17 -> median of eight is (1 + 3) / 2.
    assert result["a"] == {"single": 2.0, "streamed": 1.0}
    assert result["b"] == {"single": 12.0, "streamed": 10.0}  # 10 x4, 14, 16, 22, 24
