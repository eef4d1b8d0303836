import sys
from pathlib import Path

# Tests import `backends` and `clients` from the repo root without installing anything.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
