"""``dsv4 engine`` on node ``n > 0`` of a multi-node instance: this node's ranks, no API server.

The ranks join the instance's rendezvous on node 0 and take their steps from the cores there
(TP followers, DP cores in lockstep), exactly as node 0's own ranks do. This process only
watches them and answers ``/health`` and ``/ready`` (200 while every local rank lives, else
503) and ``/metrics`` (how many of its ranks live), the probes a pod needs; the API is node
0's alone. It exits 0 when the
leader stopped every rank (each exits 0), and 1 as soon as one rank fails (the others are
killed: the instance is broken either way, and node 0 sees its collectives fail).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from dsv4_serving.distributed.launcher import LocalRanks
from dsv4_serving.distributed.placement import Placement
from dsv4_serving.engine.config import EngineConfig

log = logging.getLogger("dsv4.engine")
POLL_S = 0.2
STOP_GRACE_S = 30.0  # after one rank stopped cleanly, the others stop on the same signal


def _handler(ranks: list[int], procs: LocalRanks, node: int) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            alive = sum(p.is_alive() for p in procs.procs)
            if self.path in ("/health", "/ready"):
                ok = alive == len(ranks)
                body = json.dumps({"status": "ok" if ok else "rank exited", "node_rank": node})
                self._send(200 if ok else 503, "application/json", body)
            elif self.path == "/metrics":
                text = (
                    "# HELP dsv4_headless_ranks_alive Local ranks of this headless node alive.\n"
                    "# TYPE dsv4_headless_ranks_alive gauge\n"
                    f'dsv4_headless_ranks_alive{{node_rank="{node}"}} {alive}\n'
                )
                self._send(200, "text/plain; version=0.0.4", text)
            else:
                self._send(404, "application/json", json.dumps({"error": "not found"}))

        def _send(self, code: int, ctype: str, body: str) -> None:
            data = body.encode()
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:
            pass  # probes every few seconds: no access log

    return Handler


def serve_headless(config: EngineConfig, placement: Placement, host: str, port: int) -> int:
    from dsv4_serving.engine.worker.worker import rank_main  # torch: imported by the ranks

    topo = config.topology(placement.nnodes)
    ranks = placement.ranks(topo)
    procs = LocalRanks(
        rank_main, [(config, r, placement, None, None) for r in ranks], "dsv4-rank", ranks[0]
    )
    node = placement.node_rank
    server = ThreadingHTTPServer((host, port), _handler(ranks, procs, node))
    threading.Thread(target=server.serve_forever, name="dsv4-headless-http", daemon=True).start()
    log.info(
        "headless node %d of %d: ranks %s, rendezvous at %s:%d",
        node,
        placement.nnodes,
        ranks,
        placement.master_addr,
        placement.master_port,
    )
    try:
        while (dead := procs.first_dead()) is None:
            time.sleep(POLL_S)
        i, code = dead
        if code == 0:
            procs.join(STOP_GRACE_S)  # the leader stopped the instance: the rest follow
            codes = [p.exitcode for p in procs.procs]
            bad = [(j, c) for j, c in enumerate(codes) if c != 0]
            if not bad:
                log.info("every rank of node %d stopped: the instance ended", node)
                return 0
            i, code = bad[0]
        log.error("rank %d exited with code %s: node %d stops", ranks[i], code, node)
        return 1
    finally:
        procs.kill()
        server.shutdown()
        server.server_close()
