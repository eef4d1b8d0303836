"""Does this host's tritonserver Python stub pass tensors intact? A one-model repository, no torch.

The `echo` model reports, for a BYTES input, each element's length and first byte, and returns a FP32
output built from numpy - the two things the 2.51 stub was seen to get wrong on the H200 host (BYTES
inputs read as filler bytes, numpy outputs arriving empty). It also reports the numpy the stub
imported. Run it with the stub's extra path given by KIMI_STUB_SITE (e.g. a folder holding numpy<2):

    KIMI_STUB_SITE=/tmp/np1 python -m tools.stub_probe
"""

from __future__ import annotations

import argparse
import shutil
import textwrap

import numpy as np
import tritonclient.grpc as grpcclient

from backends.deploy.launcher import BUILD, Ports, TritonServer

CONFIG = """
name: "echo"
backend: "python"
max_batch_size: 0
input [ { name: "IN" data_type: TYPE_STRING dims: [ -1 ] } ]
output [
  { name: "LENS" data_type: TYPE_INT64 dims: [ -1 ] },
  { name: "FIRST" data_type: TYPE_INT64 dims: [ -1 ] },
  { name: "NUMPY_OUT" data_type: TYPE_FP32 dims: [ 3 ] },
  { name: "NUMPY_VERSION" data_type: TYPE_STRING dims: [ 1 ] }
]
instance_group [ { kind: KIND_CPU count: 1 } ]
"""

MODEL = textwrap.dedent('''
    import numpy as np
    import triton_python_backend_utils as pb_utils

    class TritonPythonModel:
        def execute(self, requests):
            out = []
            for r in requests:
                items = [bytes(x) for x in pb_utils.get_input_tensor_by_name(r, "IN").as_numpy().reshape(-1)]
                out.append(pb_utils.InferenceResponse(output_tensors=[
                    pb_utils.Tensor("LENS", np.array([len(x) for x in items], np.int64)),
                    pb_utils.Tensor("FIRST", np.array([x[0] if x else -1 for x in items], np.int64)),
                    pb_utils.Tensor("NUMPY_OUT", np.array([1.0, 2.0, 3.0], np.float32)),
                    pb_utils.Tensor("NUMPY_VERSION", np.array([np.__version__ + " " + np.__file__], np.object_)),
                ]))
            return out
''')


def probe(server: TritonServer, blobs: list[bytes]) -> str:
    c = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        x = grpcclient.InferInput("IN", [len(blobs)], "BYTES")
        x.set_data_from_numpy(np.array(blobs, dtype=np.object_))
        r = c.infer("echo", [x])
        lens, first = r.as_numpy("LENS").tolist(), r.as_numpy("FIRST").tolist()
        ok = lens == [len(b) for b in blobs] and first == [b[0] for b in blobs] \
            and r.as_numpy("NUMPY_OUT").tolist() == [1.0, 2.0, 3.0]
        return (f"{'ok' if ok else 'WRONG'} lens={lens} first={first} numpy_out={r.as_numpy('NUMPY_OUT').tolist()} "
                f"stub_numpy={r.as_numpy('NUMPY_VERSION')[0].decode()}")
    except Exception as exc:  # noqa: BLE001 - report, do not stop
        return f"ERR {str(exc)[:160]}"
    finally:
        c.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--label", default="")
    ap.add_argument("--allow-numpy2", action="store_true",
                    help="start the server even if the stub would import numpy >= 2 (to show what goes wrong)")
    args = ap.parse_args(argv)
    repo = BUILD / "stub-probe"
    shutil.rmtree(repo, ignore_errors=True)
    (repo / "echo" / "1").mkdir(parents=True)
    (repo / "echo" / "config.pbtxt").write_text(CONFIG)
    (repo / "echo" / "1" / "model.py").write_text(MODEL)
    rng = np.random.default_rng(0)
    cases = {"small": [b"\x07abc", b"\x09" * 10], "2MB": [bytes([5]) + rng.bytes(2_000_000)]}
    for name, blobs in cases.items():
        # A fresh server per case: a stub that crashed on one case would fail the next for that reason.
        server = TritonServer(repo, ports=Ports.free(), log_path=BUILD / f"tritonserver-stub-probe-{name}.log",
                              allow_numpy2=args.allow_numpy2)
        with server:
            print(f"STUB_PROBE {args.label} case={name} {probe(server, blobs)}", flush=True)
        if "terminate called" in server.log_tail(20000):
            print(f"STUB_PROBE {args.label} case={name} stub crashed: "
                  f"{server.log_tail(20000).split('terminate called', 1)[1][:200]!r}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
