"""What every benchmark script shares: its JSON goes to stdout and, if asked, to a file."""

import json
import sys
from pathlib import Path


def emit(doc, path: str | None) -> None:
    text = json.dumps(doc, indent=2)
    sys.stdout.write(text + "\n")
    if path:
        Path(path).write_text(text)
