"""``dsv4 operator``: run the DeepSeekV4Deployment operator (kopf) against the current cluster."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import threading
from collections.abc import Callable

log = logging.getLogger("dsv4.operator")


def add_arguments(p: argparse.ArgumentParser) -> None:
    scope = p.add_mutually_exclusive_group()
    scope.add_argument(
        "-n", "--namespace", action="append", default=[], help="watch this namespace (repeatable)"
    )
    scope.add_argument(
        "-A", "--all-namespaces", action="store_true", help="watch every namespace (default)"
    )
    p.add_argument(
        "--kubeconfig", default=None, help="kubeconfig path (default: in-cluster, then $KUBECONFIG)"
    )
    p.add_argument(
        "--health-port", type=int, default=8080, help="liveness endpoint /healthz port (0: off)"
    )
    p.add_argument(
        "--metrics-port", type=int, default=9090, help="Prometheus /metrics port (0: off)"
    )
    p.add_argument(
        "--peering", default="dsv4-operator", help="kopf peering name (replicas elect one active)"
    )
    p.add_argument(
        "--priority",
        type=int,
        default=None,
        help="peering priority of this replica (default: in a pod, one derived from its name, "
        "so the chart's replicas differ: kopf pauses every replica that shares a priority; "
        "else 0)",
    )
    p.add_argument("--standalone", action="store_true", help="no peering (a single replica)")
    p.add_argument("--verbose", action="store_true", help="log at DEBUG level (kopf included)")
    p.add_argument(
        "--allow-host-path-models",
        action="store_true",
        help="render model.path as a hostPath volume (otherwise such a deployment is Degraded)",
    )
    p.add_argument(
        "--allow-privileged",
        action="store_true",
        help="render features.privileged (otherwise such a deployment is Degraded)",
    )
    p.add_argument(
        "--autoscaler-metrics-address",
        default=None,
        metavar="HOST:PORT",
        help="tests only: read every gateway, engine and sidecar /metrics the autoscaler needs "
        "from this one address instead of the pods' IPs (kwok pods have none that answer)",
    )
    p.add_argument(
        "--autoscaler-address-map",
        default=None,
        metavar="FILE",
        help='tests only: a JSON file {"<pod>": {"<port>": "HOST:PORT"}}, re-read on every '
        "lookup, giving the address of each kwok pod's port (its engine runs as a local process)",
    )
    p.add_argument(
        "--autoscaler-blocked-after",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="an instance whose pod is Unschedulable this long blocks further scale-up",
    )


def _port(value: int, flag: str) -> int:
    if not 0 <= value <= 65535:
        raise SystemExit(f"dsv4 operator: error: {flag} must be in 0..65535, got {value}")
    return value


def run(args: argparse.Namespace) -> int:
    if args.kubeconfig:
        # kopf logs in through the kubernetes client, which reads $KUBECONFIG when first imported
        os.environ["KUBECONFIG"] = args.kubeconfig
    import kopf
    from prometheus_client import start_http_server

    from dsv4_operator import handlers
    from dsv4_operator.autoscaling.loop import LoopOptions
    from dsv4_operator.reconcile.host_access import HostAccess

    health, metrics = (
        _port(args.health_port, "--health-port"),
        _port(args.metrics_port, "--metrics-port"),
    )
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if not args.verbose:
        # one line per watched event of every child is noise; failures still log at ERROR
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
        logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    if metrics:
        start_http_server(metrics, addr="0.0.0.0")
    if args.autoscaler_blocked_after <= 0:
        raise SystemExit(
            "dsv4 operator: error: --autoscaler-blocked-after must be a positive number of "
            f"seconds, got {args.autoscaler_blocked_after:g}"
        )
    from dsv4_operator.peers import replica_priority

    priority = replica_priority(args.priority, os.environ.get("POD_ID"))
    stop = threading.Event()
    memo = handlers.OperatorMemo(
        autoscaler_options=LoopOptions(
            metrics_address=args.autoscaler_metrics_address,
            address_map=args.autoscaler_address_map,
            blocked_after_s=args.autoscaler_blocked_after,
            peering=None if args.standalone else args.peering,
            priority=priority,
            clusterwide=not args.namespace,
        ),
        kubeconfig=args.kubeconfig,
        host_access=HostAccess(
            model_path=args.allow_host_path_models, privileged=args.allow_privileged
        ),
    )
    if not args.standalone:
        _forget_dead_peers(args)
    operator = kopf.operator(
        clusterwide=not args.namespace,
        namespaces=list(args.namespace),
        standalone=args.standalone,
        **({} if args.standalone else {"peering_name": args.peering, "priority": priority}),
        liveness_endpoint=f"http://0.0.0.0:{health}/healthz" if health else None,
        stop_flag=stop,
        memo=memo,
    )
    return run_until_stopped(lambda: asyncio.run(operator), stop, memo.idle)


def _forget_dead_peers(args: argparse.Namespace) -> None:
    """In a pod (``POD_ID``, ``POD_NAMESPACE`` from the chart): drop the peering entries of
    replicas whose pods are gone, so this one does not pause for their expiry (``peers.py``).
    Best effort: on any error kopf's expiry still applies."""
    own, pod_ns = os.environ.get("POD_ID"), os.environ.get("POD_NAMESPACE")
    if not own or not pod_ns:
        return
    from dsv4_operator.kube import Kube, load_api_client
    from dsv4_operator.peers import forget_dead_peers

    kube = Kube(load_api_client(args.kubeconfig))
    targets = (
        [("KopfPeering", ns) for ns in args.namespace]
        if args.namespace
        else [("ClusterKopfPeering", "")]
    )
    for kind, ns in targets:
        try:
            forget_dead_peers(kube, kind, ns, args.peering, own, pod_ns)
        except Exception as e:
            logging.getLogger(__name__).warning("peering entries left to expire: %s", e)


EXIT_WITHIN_S = 7.0
"""How long a stop may take before the process exits anyway: kopf's own shutdown (its last
peering write, the syncs in flight) waits on API requests that an unreachable API server never
answers, and a standby replica waits for this one meanwhile (kubelet's SIGKILL comes at 30 s)."""


def run_until_stopped(
    serve: Callable[[], None], stop: threading.Event, idle: Callable[[], bool]
) -> int:
    """Run ``serve`` (which returns once ``stop`` is set) in a thread of its own while this one
    waits for SIGTERM or SIGINT; then give it ``EXIT_WITHIN_S`` to finish. ``idle``: no sync is
    running, so nothing holds the interpreter's exit (it joins the sync threads)."""
    done = threading.Event()
    failure: list[BaseException] = []

    def target() -> None:
        try:
            serve()
        except BaseException as e:  # reported by the main thread
            failure.append(e)
        finally:
            done.set()

    def on_signal(signum: int, _frame: object) -> None:
        log.info("%s received: stopping", signal.Signals(signum).name)
        stop.set()

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, on_signal)
    threading.Thread(target=target, name="kopf", daemon=True).start()
    while not done.wait(0.2) and not stop.is_set():
        pass
    finished = done.wait(EXIT_WITHIN_S)
    if failure:
        raise failure[0]
    if finished and idle():
        return 0
    log.warning(
        "stopped without waiting further for the API server (%.0f s passed); "
        "the next active replica resyncs everything",
        EXIT_WITHIN_S,
    )
    logging.shutdown()
    os._exit(0)
