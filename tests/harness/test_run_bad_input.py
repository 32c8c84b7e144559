"""Every bad input exits 2 with one line, before anything boots, and writes nothing (no store, no key)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.harness.conftest import refused

CASES = [
    ["--layout", "2304,,9216"],
    ["--layout", "-1"],
    ["--layout", "0"],
    ["--layout", "abc"],
    ["--layout", ""],
    ["--layout", "2304,2304,2304,9216,2304"],
    ["--spec", "mtp:0"],
    ["--spec", "eagle"],
    ["--gpus", "zero", "--launcher", "docker", "--image", "x"],
    ["--timeout", "-1"],
    ["--timeout", "0"],
    ["--timeout", "abc"],
    ["--kda-backend", "bogus"],
    ["--preset", "huge"],
    ["--launcher", "docker"],
    ["--launcher", "docker", "--image", "qualify-engine:does-not-exist"],
    ["--db", "postgresql+psycopg://nobody@127.0.0.1:1/none"],
    ["--db", "mysql://nowhere/x"],
    ["--key", "/nonexistent/operator.key"],
    ["--mem-limit", "2g"],
    ["--gpus", "0,0"],
    ["--launcher", "docker", "--image", "x", "--mem-limit", "lots"],
    ["--image", "qualify-engine:cpu"],
]


@pytest.mark.parametrize("args", CASES, ids=lambda a: " ".join(a) or "empty")
def test_bad_input_exits_2_with_one_line_and_writes_nothing(
    args: list[str], empty_home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    refused(args, empty_home, capsys)


@pytest.mark.parametrize(
    ("content", "mode"), [(b"not a key\n", 0o600), (None, 0o644)], ids=["garbage", "0644"]
)
def test_an_unusable_key_file_exits_2_before_the_store_is_created(
    content: bytes | None, mode: int, tmp_path: Path, empty_home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from receipts import keys

    key = tmp_path / "operator.key"
    if content is None:
        keys.generate().save(key)
    else:
        key.write_bytes(content)
    key.chmod(mode)
    refused(["--key", str(key)], empty_home, capsys)
