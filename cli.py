"""Run from a checkout without installing: `python cli.py gemma4-mtp --tp 2`."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from repro.__main__ import main  # noqa: E402

if __name__ == "__main__":
    main()
