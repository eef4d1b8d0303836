"""lab/bench/gpu_clocks.py's pure parts (the sampler itself needs nvidia-smi: it runs on the GPU machine)."""

from lab.bench import gpu_clocks


def test_median_clock_reads_the_middle_sample_of_each():
    assert gpu_clocks.median_clock([(1980, 300), (1755, 690), (1830, 650)]) == "1830 MHz, 650 W"
    assert gpu_clocks.median_clock([]) == "-"


def test_without_a_cuda_context_the_gpu_is_named_by_its_visible_index(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
    assert gpu_clocks.gpu_id() == "3"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert gpu_clocks.gpu_id() == "0"
