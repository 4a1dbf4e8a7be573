"""The strict JSON writer every report kind uses (trials: schema repro.report/1; `repro watch`:
repro.watch/1): JSON that jq, JavaScript and CI tools read."""

from __future__ import annotations

import json
import math
import os
import sys
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


def write_document(doc: Any, path: str | os.PathLike) -> None:
    """`path` "-" writes the JSON alone to stdout, after whatever the command printed there
    (the human report then goes to stderr)."""
    text = json_text(doc)
    if str(path) == "-":
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    write_text_atomic(path, text)


def report_json(report: Report) -> str:
    return json_text(to_jsonable(report))


def write_json(report: Report, path: str | os.PathLike) -> None:
    write_document(to_jsonable(report), path)
