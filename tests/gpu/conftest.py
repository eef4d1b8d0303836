"""GPU tests: run on the GPU machine (bash lab/gpu.sh tests), skipped cleanly elsewhere."""

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (bash lab/gpu.sh tests on the GPU machine)")
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(skip)
