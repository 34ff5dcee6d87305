"""Serve the resilience store of a ``pretrain_gpt.py --hetero-resilience`` run (heartbeats, agreement,
every generation's rendezvous) until killed. It must outlive any training rank, so launchers start it
beside them, not inside one (pretrain_scripts/*.sh and the Slurm job do).

    python -m megatron_het.cli.resilience_store --host 10.0.0.1 --port 29600

It listens on ``--host`` only (unauthenticated store: use the job's private interface).
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="resilience_store", description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1", help="the one address to listen on (default: loopback)")
    p.add_argument("--port", type=int, required=True, help="TCP port (the ranks' --hetero-resilience-store)")
    args = p.parse_args(argv)
    if not 0 < args.port < 65536:
        p.error(f"--port: {args.port} is not in 1..65535")
    from megatron_het.resilience.launch import serve_store

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    store, address = serve_store(args.host, args.port)
    print(f"resilience store listening on {address.host}:{address.port}", flush=True)
    try:
        stop.wait()
    except KeyboardInterrupt:
        pass
    del store
    return 0


if __name__ == "__main__":
    sys.exit(main())
