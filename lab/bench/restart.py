"""How long a dead stub takes its model down: the supervisor's reload of that model, timed.

    python -m lab.bench.restart --device gpu --checkpoint /tmp/kimi-random [--kills 2] [--section restart]

Starts the deployment (cold start timed), sends one 1024^2 JPEG request, then for each kill: SIGKILL to
moonvit3d's stub, and times (a) until the supervisor has reloaded moonvit3d alone (the other models serve
on meanwhile; new instances, start-up captures included), (b) until a request is answered again (its
first forward after the reload included). Where the reload fails the supervisor restarts the whole
server; the row then says so. A last kill with reloads off times that whole restart in the same run.
"""

from __future__ import annotations

import argparse
import os
import platform
import signal
import sys
import time

from backends.deploy.launcher import deployment_server, resolve_device
from backends.deploy.repository import Deployment
from backends.deploy.supervisor import model_of, stub_processes
from clients.kimi_client import KimiVisionClient, chat_prompt_ids
from clients.samples import encode, photo_like
from contract import ENCODER
from lab.bench.results_page import report


def _answered(url: str, blob: bytes, deadline: float) -> float:
    """Seconds until a request is answered (retrying while the server is down)."""
    t0 = time.monotonic()
    while time.monotonic() < deadline:
        client = KimiVisionClient(url)
        try:
            client.infer(chat_prompt_ids(1), [blob], timeout_s=60)
            return time.monotonic() - t0
        except Exception:  # noqa: BLE001 - down while it restarts
            time.sleep(0.2)
        finally:
            client.close()
    raise TimeoutError("no answer")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["auto", "cpu", "gpu"], default="auto")
    ap.add_argument("--checkpoint", default=os.environ.get("KIMI_VISION_CHECKPOINT", ""))
    ap.add_argument("--kills", type=int, default=2)
    ap.add_argument("--section", default="")
    args = ap.parse_args(argv)
    device = resolve_device(args.device)
    blob = encode(photo_like(1024, 1024, seed=3), "JPEG", quality=90)
    rows = []
    t0 = time.monotonic()
    server = deployment_server(Deployment(device=device, checkpoint=args.checkpoint), f"restart-{device}")
    with server:
        cold = time.monotonic() - t0
        first = _answered(server.grpc_url, blob, time.monotonic() + 600)
        # The kills, then one more with reloads off: the whole restart it replaces, in the same run.
        for k in range(args.kills + 1):
            if k == args.kills:
                server.reload_models = False
            stubs = {n: p for n, p in stub_processes(server.proc.pid).items() if model_of(n) == ENCODER}
            name, pid = next(iter(stubs.items()))
            reloads, restarts = server.relay.reloads.get(ENCODER, 0), sum(server.relay.restarts.values())
            killed = time.monotonic()
            os.kill(pid, signal.SIGKILL)
            while server.relay.reloads.get(ENCODER, 0) == reloads and sum(server.relay.restarts.values()) == restarts:
                if time.monotonic() - killed > 600:
                    raise SystemExit(f"the supervisor did not heal {name}'s death within 600 s")
                time.sleep(0.02)
            how = "reloaded" if server.relay.reloads.get(ENCODER, 0) > reloads else "whole server restarted"
            how += " (reloads off)" if k == args.kills else ""
            if not server.serving.wait(600):
                raise SystemExit(f"the server did not come back within 600 s of {name}'s death")
            healed = time.monotonic() - killed
            answered = healed + _answered(server.grpc_url, blob, time.monotonic() + 600)
            rows.append((k + 1, how, healed, answered))
    lines = [f"$ python -m lab.bench.restart {' '.join(sys.argv[1:] if argv is None else argv)}",
             f"{platform.node()}, device={device}, checkpoint={args.checkpoint or 'embedded demo'}, "
             f"{time.strftime('%Y-%m-%d %H:%M')}",
             f"cold start to ready: {cold:.1f} s; first 1x1024^2 request: {first:.2f} s", "",
             "| kill of moonvit3d's stub | healed by | healed s | answered again s |",
             "|---|---|---|---|"]
    lines += [f"| {k} | {how} | {b:.1f} | {c:.1f} |" for k, how, b, c in rows]
    report("\n".join(lines), device, args.section)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
