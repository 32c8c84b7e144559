"""EngineConfig fails closed at construction."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from qualify.engine.config import EngineConfig


def test_defaults_resolve_for_cpu():
    cfg = EngineConfig(device="cpu")
    assert cfg.cudagraph_mode == "none" and cfg.dtype == "float32"
    assert cfg.capture_sizes == [1, 2, 4, 8] and cfg.graph_max_batch == 8
    assert cfg.num_state_slots == 1 + 8


def test_capture_sizes_are_counted_in_tokens_of_one_plus_num_spec():
    cfg = EngineConfig(device="cpu", num_spec=3, max_num_seqs=4, max_num_batched_tokens=64)
    assert cfg.capture_sizes == [4, 8, 16] and cfg.graph_max_batch == 4
    assert cfg.num_state_slots == 1 + 4 * 4


@pytest.mark.parametrize(
    "fields,needle",
    [
        ({"kda_decode_backend": "cutlass"}, "unknown kda_decode_backend"),
        ({"layer_pattern": "KKXA"}, "layer_pattern"),
        ({"layer_pattern": "KKKA", "group_size": 2}, "do not split into groups"),
        ({"block_size": 0}, "greater than"),
        ({"block_size": 10, "interleave": 4}, "multiple of interleave"),
        ({"capture_sizes": [3], "num_spec": 1}, "multiples of 1 + num_spec"),
        ({"cudagraph_mode": "full"}, "needs a CUDA device"),
        ({"max_num_batched_tokens": 4, "max_num_seqs": 8}, "largest capture size"),
        ({"num_spec": -1}, "greater than or equal"),
        ({"surprise": 1}, "Extra inputs"),
        ({"device": "tpu"}, "device"),
    ],
)
def test_invalid_configs_are_refused_with_a_message(fields, needle):
    fields.setdefault("device", "cpu")
    with pytest.raises(ValidationError) as exc:
        EngineConfig(**fields)
    assert needle in str(exc.value)


def test_config_digest_changes_with_the_config():
    assert EngineConfig(device="cpu").digest() != EngineConfig(device="cpu", seed=1).digest()
    assert EngineConfig(device="cpu").digest() == EngineConfig(device="cpu").digest()
