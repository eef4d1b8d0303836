"""Does tritonserver's Python backend lose a response sent from a thread while the stub keeps talking to
the server? A probe of the fused pipeline's hang with no model of ours in it.

The suspect it was written for (docs/triton_runtime.md, the fused pipeline's hang): a response sent
through a request's response sender ends with a handshake on a mutex and condition variable in a
small shared-memory block that the stub frees as soon as it has woken the server's thread, which may
not have left its wait yet; the stub's next small message could take that block. On the H200 host
and on the CPU machine this probe did not hang in 840,000 and 941,000 answers
(bench/results/h200-2026-12-02-eighteenth.md), and the native stacks of the real hang showed it
elsewhere: it stays as the check that rules the handshake out.

This serves one tiny Python model, `sender_race` (written here, in a temporary repository): `execute`
hands each request to a worker thread and returns; the worker answers through the response sender,
optionally asking `is_cancelled()` before each send as our pipeline did, and optionally waiting
`--gap-ms` after each send before anything else. `--concurrency` client threads send tiny requests
for `--seconds`, each with a deadline; the first one missed stops the probe with the native stacks
of the server and its stub (backends/deploy/native_stacks.py).

    python -m tools.sender_race_probe --seconds 300                  # the worker asks is_cancelled()
    python -m tools.sender_race_probe --seconds 300 --no-ask         # it does not
Exit status: 0 no request missed its deadline; 1 one did (the stacks are written).
"""

from __future__ import annotations

import argparse
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import numpy as np

from backends.deploy import native_stacks
from backends.deploy.launcher import Ports, TritonServer

MODEL = "sender_race"

MODEL_PY = textwrap.dedent('''
    import json
    import queue
    import threading
    import time

    import triton_python_backend_utils as pb_utils


    class TritonPythonModel:
        def initialize(self, args):
            params = {k: v["string_value"] for k, v in json.loads(args["model_config"]).get("parameters", {}).items()}
            self.ask = params.get("ask_cancelled", "yes") == "yes"
            self.gap_s = float(params.get("gap_ms", "0")) / 1000
            self.gpu = params.get("gpu_output", "no") == "yes"
            self.jobs = queue.Queue(maxsize=4)  # as the fused pipeline: execute blocks while the worker is behind
            threading.Thread(target=self.work, daemon=True).start()

        def execute(self, requests):
            for request in requests:
                x = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
                self.jobs.put((request.get_response_sender(), x))
            return None

        def work(self):
            while True:
                sender, x = self.jobs.get()
                if self.ask:  # the fused pipeline's worker asked this before each forward
                    sender.is_cancelled()
                if self.gpu:  # a GPU output: the send takes one more handshake round (the stub fills the server's buffer)
                    import torch
                    from torch.utils.dlpack import to_dlpack

                    out = pb_utils.Tensor.from_dlpack("OUT", to_dlpack(torch.from_numpy(x + 1).cuda()))
                else:
                    out = pb_utils.Tensor("OUT", x + 1)
                sender.send(pb_utils.InferenceResponse([out]), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                if self.gap_s:
                    time.sleep(self.gap_s)
''')

CONFIG = textwrap.dedent('''
    name: "{name}"
    backend: "python"
    max_batch_size: 0
    input [ {{ name: "IN", data_type: TYPE_INT32, dims: [ 1 ] }} ]
    output [ {{ name: "OUT", data_type: TYPE_INT32, dims: [ 1 ] }} ]
    instance_group [ {{ kind: {kind}, count: 1 }} ]
    parameters {{ key: "ask_cancelled" value {{ string_value: "{ask}" }} }}
    parameters {{ key: "gap_ms" value {{ string_value: "{gap}" }} }}
    parameters {{ key: "gpu_output" value {{ string_value: "{gpu}" }} }}
''')


def write_repository(root: Path, ask: bool, gap_ms: float, gpu_output: bool = False) -> Path:
    model = root / MODEL
    (model / "1").mkdir(parents=True)
    (model / "1" / "model.py").write_text(MODEL_PY)
    (model / "config.pbtxt").write_text(CONFIG.format(
        name=MODEL, ask="yes" if ask else "no", gap=gap_ms, gpu="yes" if gpu_output else "no",
        kind="KIND_GPU" if gpu_output else "KIND_CPU"))
    return root


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ask", action=argparse.BooleanOptionalAction, default=True,
                    help="the worker asks is_cancelled() before each send (default: yes)")
    ap.add_argument("--gap-ms", type=float, default=0.0, help="the worker's pause after each send")
    ap.add_argument("--gpu-output", action="store_true", help="the answer's tensor on the GPU (a GPU instance)")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=120.0)
    ap.add_argument("--timeout", type=float, default=10.0, help="each request's deadline, seconds")
    ap.add_argument("--out", default="", help="folder for the native stacks and the server's log on a stall")
    args = ap.parse_args(argv)
    import tritonclient.grpc as grpcclient

    with tempfile.TemporaryDirectory(prefix="sender-race-") as tmp:
        repo = write_repository(Path(tmp) / "repository", args.ask, args.gap_ms, args.gpu_output)
        server = TritonServer(repo, ports=Ports.free(), log_path=Path(tmp) / "tritonserver.log")
        with server.start():
            stop = threading.Event()
            answered = [0] * args.concurrency
            failure: list[str] = []
            end = time.monotonic() + args.seconds

            def client(i: int) -> None:
                c = grpcclient.InferenceServerClient(server.grpc_url)
                x = grpcclient.InferInput("IN", [1], "INT32")
                x.set_data_from_numpy(np.array([i], dtype=np.int32))
                try:
                    while not stop.is_set() and time.monotonic() < end:
                        t0 = time.monotonic()
                        try:
                            c.infer(MODEL, [x], client_timeout=args.timeout)
                        except Exception as exc:  # noqa: BLE001 - the finding
                            failure.append(f"after {time.monotonic() - t0:.1f} s: {str(exc)[:200]}")
                            stop.set()
                            return
                        answered[i] += 1
                finally:
                    c.close()

            t0 = time.monotonic()
            threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(args.concurrency)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            took = time.monotonic() - t0
            total = sum(answered)
            print(f"worker asks is_cancelled: {'yes' if args.ask else 'no'}, gap after a send {args.gap_ms:g} ms, "
                  f"{'GPU' if args.gpu_output else 'host'} output, concurrency {args.concurrency}: {total} answered in {took:.0f} s ({total / took:.0f}/s)", flush=True)
            if not failure:
                print("no request missed its deadline", flush=True)
                return 0
            print(f"a request missed its deadline, {failure[0]}", flush=True)
            out = Path(args.out) if args.out else Path(".")
            out.mkdir(parents=True, exist_ok=True)
            native_stacks.dump(native_stacks.server_and_stubs(server.proc.pid), out / "sender_race_stacks.txt")
            print(f"native stacks: {out / 'sender_race_stacks.txt'}", flush=True)
            time.sleep(1)
            (out / "sender_race_server.log").write_text(server.log_path.read_text(errors="replace"))
            return 1


if __name__ == "__main__":
    raise SystemExit(main())
