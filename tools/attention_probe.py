"""Which attention kernel does torch's SDPA run here, and how fast is each one? (GPU machine.)

Why: the encoder's GPU time per 1024^2 image was ~20% longer inside the tritonserver stub than in a
process of its own (bench/results/h200-2026-12-01.md, "Stage breakdown"), and the stub's profile showed
torch's own flash kernel where the per-media path (backends.encoder.attention, `cudnn_loop`) was
chosen for cuDNN's. torch decides between its SDPA kernels by a priority order that it sets up lazily,
so two processes can differ. This prints, for the encoder's shapes (16 heads of 72, bf16, one media of
L tokens), the priority order, the kernel each way of calling runs, and its time:

    python -m tools.attention_probe              # this process
    python -m tools.attention_probe --stub-env   # also under the tritonserver stub's interpreter and env
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

SEQ_LENS = (1024, 5329, 16384)  # a 448^2 image, a 1024^2 image, the largest single image (max_patches)


def _kernel_name(fn) -> str:
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = [e.key for e in prof.key_averages() if e.device_type.name == "CUDA" and "memcpy" not in e.key.lower()
             and "memset" not in e.key.lower()]
    return (max(names, key=len) if names else "?")[:70]


def _ms(fn, iters: int = 20) -> float:
    import torch

    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def probe(label: str) -> None:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from backends.encoder.attention import _cudnn_sdpa

    env = {k: v for k, v in os.environ.items() if k.startswith(("TORCH_CUDNN", "CUDNN", "TORCH_SDP"))}
    try:
        cudnn = torch.backends.cudnn.version()
    except RuntimeError as exc:  # torch refuses a cuDNN other than the one it was built with
        cudnn = f"ERR {str(exc)[:110]}"
    print(f"ATTN {label} python={sys.executable} torch={torch.__version__} cudnn={cudnn} env={env} "
          f"LD_LIBRARY_PATH={os.environ.get('LD_LIBRARY_PATH', '')} "
          f"priority_before_first_call={torch._C._get_sdp_priority_order()}", flush=True)

    def only(backend):
        def run(q, k, v):
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(q, k, v)
        return run

    ways = {"default": F.scaled_dot_product_attention, "ours(cudnn_loop)": _cudnn_sdpa,
            "cudnn_only": only(SDPBackend.CUDNN_ATTENTION), "flash_only": only(SDPBackend.FLASH_ATTENTION)}
    for n in SEQ_LENS:
        q, k, v = (torch.randn(1, 16, n, 72, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        for name, fn in ways.items():
            try:
                call = lambda: fn(q, k, v)  # noqa: E731
                print(f"ATTN {label} L={n} {name}: {_ms(call):.3f} ms kernel={_kernel_name(call)}", flush=True)
            except Exception as exc:  # noqa: BLE001 - report and go on
                print(f"ATTN {label} L={n} {name}: ERR {str(exc)[:120]}", flush=True)
    with open("/proc/self/maps") as maps:
        libs = sorted({line.split()[-1] for line in maps if "libcudnn.so" in line})
    print(f"ATTN {label} priority_after={torch._C._get_sdp_priority_order()} cudnn_loaded={libs}", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stub-env", action="store_true", help="also run under the tritonserver stub's interpreter")
    ap.add_argument("--label", default="host")
    args = ap.parse_args(argv)
    probe(args.label)
    if args.stub_env:
        from backends.deploy.launcher import STUB_ENV, TritonInstall, server_env
        from backends.deploy.stub_env import prepare_stub_env

        bin_dir = prepare_stub_env(STUB_ENV)
        env = server_env(TritonInstall.find(), bin_dir)
        # -E as the stub embeds Python: PYTHONPATH ignored, the env's .pth lists what it sees.
        subprocess.run([str(bin_dir / "python3"), "-E", "-m", "tools.attention_probe", "--label", "stub-env"],
                       env=env, check=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
