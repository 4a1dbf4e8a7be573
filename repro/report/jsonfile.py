"""The JSON report (schema repro.report/1): strict JSON that jq, JavaScript and CI tools read."""
from __future__ import annotations

import json
import math
import os
import sys
from typing import Any

from repro.files import write_text_atomic
from repro.outcome import Report, to_jsonable


def strict_json(value: Any) -> Any:
    """NaN/Inf -> "NaN"/"Infinity"/"-Infinity" (the proto3 JSON convention).

    json.dumps would otherwise emit bare NaN tokens, which most JSON readers reject; a
    NONFINITE trial is exactly when such values appear.
    """
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {k: strict_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [strict_json(v) for v in value]
    return value


def report_json(report: Report) -> str:
    return json.dumps(strict_json(to_jsonable(report)), indent=2, ensure_ascii=False, allow_nan=False) + "\n"


def write_json(report: Report, path: str | os.PathLike) -> None:
    """`path` "-" writes the JSON alone to stdout (the human report then goes to stderr)."""
    text = report_json(report)
    if str(path) == "-":
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    write_text_atomic(path, text)
