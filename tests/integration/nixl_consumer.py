"""A NIXL consumer in a process of its own, as an LLM server would be: for each pair of arguments
(descriptor file, .npy path) it READs the rows the descriptor names and saves them. Run by
test_nixl_pull.py; it knows the server only through the descriptors."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np  # noqa: E402

from clients.nixl_pull import NixlPuller  # noqa: E402

with NixlPuller() as puller:
    for descriptor, out in zip(sys.argv[1::2], sys.argv[2::2]):
        np.save(out, puller.pull(Path(descriptor).read_bytes()))
