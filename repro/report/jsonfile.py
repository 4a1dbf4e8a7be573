"""The strict JSON writer every report kind uses (trials: schema repro.report/1; `repro watch`:
repro.watch/1): JSON that jq, JavaScript and CI tools read."""

from __future__ import annotations

import json
import math
import os
from typing import Any

from repro.files import write_text_atomic
from repro.outcome import Report, to_jsonable
from repro.report.fmt import encodable


def strict_json(value: Any) -> Any:
    """NaN/Inf -> "NaN"/"Infinity"/"-Infinity" (the proto3 JSON convention); lone surrogates -> U+FFFD.

    json.dumps would otherwise emit bare NaN tokens, which most JSON readers reject; a
    NONFINITE trial is exactly when such values appear.
    """
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, str):
        return encodable(value)
    if isinstance(value, dict):
        return {strict_json(k): strict_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [strict_json(v) for v in value]
    return value


def json_text(doc: Any) -> str:
    """A report document (plain JSON types) as strict JSON text."""
    return json.dumps(strict_json(doc), indent=2, ensure_ascii=False, allow_nan=False) + "\n"


def report_json(report: Report) -> str:
    return json_text(to_jsonable(report))


def write_json(report: Report, path: str | os.PathLike) -> None:
    """The report to a file. `--json -` (stdout) is the CLI's: output.Output.write_json."""
    write_text_atomic(path, report_json(report))
