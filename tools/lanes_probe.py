"""Are kimi_k25_vision_fused's answers under load the bits of one request at a time, at real size?

The GPU test (tests/gpu/test_gpu_server.py) checks the fused model's lanes with the demo model, whose
matrices are too small for cuBLAS to use its workspace; two lanes' graph replays that shared one
workspace would go unseen there. This serves the real-size random checkpoint with the fused model
(pipeline on, `--lanes` encoder lanes), sends each case six times one at a time (each lane captures and
replays its graphs) and compares with the plain ensemble's answer, then `--concurrency` at once for
`--rounds` rounds (the lanes' replays side by side) and compares every answer with the first.

    python -m tools.lanes_probe --checkpoint /tmp/kimi-random [--lanes 2] [--cases 8x448,1024] [--concurrency 16]
    python -m tools.lanes_probe --device cpu --concurrency 8 --rounds 2   # the demo model on the CPU
"""

from __future__ import annotations

import argparse
import os
import signal
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from backends.deploy import native_stacks
from backends.deploy.launcher import deployment_server
from backends.deploy.repository import Deployment
from backends.deploy.supervisor import stub_processes
from clients.kimi_client import KimiVisionClient, chat_prompt_ids
from clients.samples import encode, photo_like
from contract import FUSED

CASES = {
    "1 x 1024^2": [encode(photo_like(1024, 1024, seed=1), "JPEG", quality=90)],
    "8 x 448^2": [encode(photo_like(448, 448, seed=10 + i), "JPEG", quality=90) for i in range(8)],
}


CASES_BY_FLAG = {"1024": "1 x 1024^2", "8x448": "8 x 448^2"}
CASES_BY_NAME = {name: flag for flag, name in CASES_BY_FLAG.items()}


def _once(url: str, model: str, ids, blobs, timeout_s: float) -> np.ndarray | Exception:
    """The answer's embeddings, or what went wrong (a request past its deadline included: a hang shows
    as a count of failed requests and their messages, not as a probe that never returns)."""
    client = KimiVisionClient(url, model=model)
    try:
        return client.infer(ids, blobs, timeout_s=timeout_s).image_embeds
    except Exception as exc:  # noqa: BLE001 - counted and shown below
        return exc
    finally:
        client.close()


def dump_fused_stacks(server_pid: int) -> int:
    """SIGUSR1 to every stub serving the fused model (its adapter registers faulthandler on it)."""
    stubs = [pid for name, pid in stub_processes(server_pid).items() if name.startswith(FUSED + "_")]
    for pid in stubs:
        try:
            os.kill(pid, signal.SIGUSR1)
        except OSError:
            continue
    return len(stubs)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default="", help="default: the embedded demo model")
    ap.add_argument("--device", choices=["cpu", "gpu"], default="gpu",
                    help="cpu: the pipeline's threads and answers without lanes (a smoke run)")
    ap.add_argument("--lanes", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cases", default=",".join(CASES_BY_FLAG),
                    help=f"which, in order: a comma-separated subset of {', '.join(CASES_BY_FLAG)}")
    ap.add_argument("--timeout", type=float, default=20.0,
                    help="each request's deadline, seconds; the first one missed stops the case and has the fused "
                         "model's stub write every thread's stack into the server's log (SIGUSR1)")
    args = ap.parse_args(argv)
    try:
        cases = {CASES_BY_FLAG[c]: CASES[CASES_BY_FLAG[c]] for c in args.cases.split(",")}
    except KeyError as exc:
        raise SystemExit(f"--cases: {exc.args[0]!r} is not one of {', '.join(CASES_BY_FLAG)}") from None
    dep = Deployment(device=args.device, checkpoint=args.checkpoint, fused=True, fused_pipeline=True,
                     fused_lanes=args.lanes)
    lanes = f"{args.lanes} lane(s)" if args.device == "gpu" else "CPU, no lanes"
    bad = 0
    with deployment_server(dep, "lanes-probe") as server:
        for name, blobs in cases.items():
            ids = chat_prompt_ids(len(blobs))
            t = args.timeout
            ensemble = _once(server.grpc_url, "kimi_k25_vision", ids, blobs, t)
            alone = []
            for _ in range(6):  # one at a time; a failure stops the case here
                alone.append(_once(server.grpc_url, FUSED, ids, blobs, t))
                if isinstance(alone[-1], Exception):
                    break
            burst = []
            if not any(isinstance(r, Exception) for r in [ensemble, *alone]):
                with ThreadPoolExecutor(args.concurrency) as pool:
                    burst = list(pool.map(lambda _: _once(server.grpc_url, FUSED, ids, blobs, t),
                                          range(args.concurrency * args.rounds)))
            failed = [r for r in [ensemble, *alone, *burst] if isinstance(r, Exception)]
            if failed:
                dumped = dump_fused_stacks(server.proc.pid)
                print(f"{name}: stacks of {dumped} fused stub(s) written to {server.log_path}", flush=True)
                native = server.log_path.with_name(f"native-stacks-{CASES_BY_NAME[name]}.txt")
                native_stacks.dump(native_stacks.server_and_stubs(server.proc.pid), native)
                print(f"{name}: native stacks of the server and its stubs written to {native}", flush=True)
                print(f"{name}, {lanes}: {len(failed)} of {1 + len(alone) + len(burst)} requests failed, e.g. "
                      f"{'; '.join(sorted({str(e)[:200] for e in failed})[:3])}", flush=True)
                bad += len(failed)
                continue
            same_alone = sum(np.array_equal(a, ensemble) for a in alone)
            same_burst = sum(np.array_equal(b, alone[0]) for b in burst)
            worst = max(float(np.abs(b.astype(np.float64) - alone[0]).max()) for b in burst)
            print(f"{name}, {lanes}: one at a time {same_alone} of {len(alone)} equal to the ensemble's "
                  f"answer; at concurrency {args.concurrency} {same_burst} of {len(burst)} equal to one at a time "
                  f"(largest difference {worst:g})", flush=True)
            bad += (len(alone) - same_alone) + (len(burst) - same_burst)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
