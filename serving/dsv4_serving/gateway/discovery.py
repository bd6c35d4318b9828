"""Where engines are: static URL lists, or the EndpointSlices of the role Services, watched.

EndpointSlices carry the labels of their Service (``serving.dsv4.io/role``); an engine is an
endpoint that is serving and not terminating, and is node rank 0 of its instance (the pod that
serves HTTP). The operator's routing ConfigMap says which instances drain and which revision
each runs (EndpointSlices carry no pod labels). ``ready`` says neither: the role Services publish not-ready addresses (peers must
find each other before they are ready), which makes ``ready`` always true.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from dsv4_serving.gateway.config import GatewayConfig
from dsv4_serving.gateway.instances import InstancePool, Role

log = logging.getLogger("dsv4.gateway")
ROLE_LABEL = "serving.dsv4.io/role"
_ROLES: tuple[Role, ...] = ("prefill", "decode", "both")
# StatefulSet pod "<name>-<role>-<instance>-<node rank>": only rank 0 serves the API
_FOLLOWER = re.compile(r"-\d+-([1-9]\d*)$")


def static_members(cfg: GatewayConfig, pool: InstancePool) -> None:
    pool.set_members("prefill", cfg.prefill_urls)
    pool.set_members("decode", cfg.decode_urls)
    pool.set_members("both", cfg.both_urls)


def routable(conditions: dict[str, Any]) -> bool:
    """Whether new requests may go to an endpoint with these EndpointSlice conditions: its pod
    is ready (``serving``; ``ready`` where an older server sets only that) and not being
    deleted (``terminating``). Unset means unknown, which consumers are to treat as true for
    ``serving``/``ready`` and false for ``terminating``. Requests already sent to an endpoint
    that stops being routable finish: only membership changes."""
    serving = conditions.get("serving")
    if serving is None:
        serving = conditions.get("ready")
    return serving is not False and conditions.get("terminating") is not True


def instance_of(pod: str) -> str:
    """The instance (its StatefulSet's name) of an engine pod ``<instance>-<node rank>``."""
    return pod.rsplit("-", 1)[0]


@dataclass(frozen=True)
class Routing:
    """The operator's routing ConfigMap (``routing.json``)."""

    draining: frozenset[str] = frozenset()
    """Instances being drained: no new requests."""
    revision: str = ""
    """The revision the operator rolls to (preferred while it has a prefill-decode pair)."""
    revisions: Mapping[str, str] = field(default_factory=dict)
    """Each instance's revision (the pairing key)."""


def routing_from_configmap(configmap: dict[str, Any] | None) -> Routing:
    """The routing ConfigMap's ``routing.json``; a missing or unreadable ConfigMap drains
    nothing and knows no revision (routing must not stop on a bad document)."""
    raw = ((configmap or {}).get("data") or {}).get("routing.json")
    if not raw:
        return Routing()
    try:
        doc = json.loads(raw)
        revisions = doc.get("revisions") or {}
        return Routing(
            draining=frozenset(str(x) for x in doc.get("draining") or []),
            revision=str(doc.get("revision") or ""),
            revisions={str(k): str(v) for k, v in revisions.items()},
        )
    except (ValueError, AttributeError, TypeError):
        log.warning('routing ConfigMap: routing.json is not {"draining": [...]}: %.200s', raw)
        return Routing()


def draining_from_configmap(configmap: dict[str, Any] | None) -> frozenset[str]:
    """The instances the routing ConfigMap lists as draining."""
    return routing_from_configmap(configmap).draining


def members_from_slices(
    slices: list[dict[str, Any]],
    draining: frozenset[str] = frozenset(),
    host: str | None = None,
) -> dict[Role, set[str]]:
    """Engine base URLs per role from EndpointSlice objects (as dicts), without the endpoints of
    ``draining`` instances (their requests in flight finish; only membership changes);
    ``host`` replaces every address (``GatewayConfig.endpoint_host``, tests only)."""
    out: dict[Role, set[str]] = {r: set() for r in _ROLES}
    for role, pod, url in _engines(slices, host):
        if instance_of(pod) not in draining:
            out[role].add(url)
    return out


def url_revisions(
    slices: list[dict[str, Any]], revisions: Mapping[str, str], host: str | None = None
) -> dict[str, str]:
    """Each engine URL's revision, from its pod's instance in ``revisions`` (absent: none)."""
    return {
        url: revisions[instance_of(pod)]
        for _, pod, url in _engines(slices, host)
        if instance_of(pod) in revisions
    }


def _engines(slices: list[dict[str, Any]], host: str | None) -> Iterator[tuple[Role, str, str]]:
    """(role, pod, base URL) of every routable node-rank-0 endpoint."""
    for s in slices:
        role = (s.get("metadata", {}).get("labels") or {}).get(ROLE_LABEL)
        if role not in _ROLES:
            continue
        port = next((p.get("port") for p in s.get("ports") or [] if p.get("name") == "http"), None)
        if port is None:
            continue
        for ep in s.get("endpoints") or []:
            if not routable(ep.get("conditions") or {}):
                continue
            pod = (ep.get("targetRef") or {}).get("name", "")
            if _FOLLOWER.search(pod):
                continue
            for addr in ep.get("addresses") or []:
                addr = host or addr
                name = f"[{addr}]" if ":" in addr else addr
                yield role, pod, f"http://{name}:{port}"


class KubernetesDiscovery:
    """Watches EndpointSlices in a thread (the kubernetes client is synchronous) and hands the
    membership to the event loop."""

    def __init__(
        self, cfg: GatewayConfig, pool: InstancePool, loop: asyncio.AbstractEventLoop
    ) -> None:
        self.cfg, self.pool, self.loop = cfg, pool, loop
        self._stop = threading.Event()
        self._slices: dict[str, dict[str, Any]] = {}
        self._routing = Routing()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="endpointslice-watch", daemon=True)
        self._routing_watch = threading.Thread(
            target=self._run_routing, name="routing-configmap-watch", daemon=True
        )
        self.synced = threading.Event()

    def start(self) -> None:
        self._thread.start()
        if self.cfg.routing_configmap:
            self._routing_watch.start()

    def stop(self) -> None:
        self._stop.set()

    def _publish(self) -> None:
        with self._lock:
            slices, routing = list(self._slices.values()), self._routing
        host = self.cfg.endpoint_host
        members = members_from_slices(slices, routing.draining, host)
        revisions = url_revisions(slices, routing.revisions, host)

        def apply() -> None:
            self.pool.newest_revision = routing.revision
            for role, urls in members.items():
                self.pool.set_members(role, urls, revisions=revisions)

        self.loop.call_soon_threadsafe(apply)

    def _api(self) -> Any:
        from kubernetes import client, config

        try:
            if self.cfg.kubeconfig:
                return config.new_client_from_config(config_file=self.cfg.kubeconfig)
            try:
                config.load_incluster_config()
                return client.ApiClient()
            except config.ConfigException:
                return config.new_client_from_config()
        except Exception:
            log.exception("cannot reach the Kubernetes API for discovery")
            return None

    def _run_routing(self) -> None:
        """Watch the one routing ConfigMap (the gateway's Role allows only that name)."""
        from kubernetes import client, watch

        api = self._api()
        if api is None:
            return
        core = client.CoreV1Api(api)
        field = f"metadata.name={self.cfg.routing_configmap}"
        while not self._stop.is_set():
            try:
                lst = core.list_namespaced_config_map(self.cfg.namespace, field_selector=field)
                self._set_routing(
                    routing_from_configmap(
                        api.sanitize_for_serialization(lst.items[0]) if lst.items else None
                    )
                )
                w = watch.Watch()
                for ev in w.stream(
                    core.list_namespaced_config_map,
                    self.cfg.namespace,
                    field_selector=field,
                    resource_version=lst.metadata.resource_version,
                    timeout_seconds=60,
                ):
                    if self._stop.is_set():
                        w.stop()
                        break
                    obj = api.sanitize_for_serialization(ev["object"])
                    self._set_routing(
                        Routing() if ev["type"] == "DELETED" else routing_from_configmap(obj)
                    )
            except Exception as e:  # a broken watch is re-listed, never fatal
                log.warning("routing ConfigMap watch restarting: %s", e)
                self._stop.wait(1.0)

    def _set_routing(self, routing: Routing) -> None:
        with self._lock:
            previous, self._routing = self._routing, routing
        if routing.draining != previous.draining:
            log.info("draining instances: %s", ", ".join(sorted(routing.draining)) or "none")
        if routing.revision != previous.revision:
            log.info("newest revision: %s", routing.revision or "none")
        if routing != previous:
            self._publish()

    def _run(self) -> None:
        from kubernetes import client, watch

        api = self._api()
        if api is None:
            return
        discovery = client.DiscoveryV1Api(api)
        to_dict: Callable[[Any], dict[str, Any]] = api.sanitize_for_serialization
        while not self._stop.is_set():
            try:
                lst = discovery.list_namespaced_endpoint_slice(
                    self.cfg.namespace, label_selector=self.cfg.selector
                )
                slices = {s.metadata.name: to_dict(s) for s in lst.items}
                with self._lock:
                    self._slices = slices
                self._publish()
                self.synced.set()
                w = watch.Watch()
                for ev in w.stream(
                    discovery.list_namespaced_endpoint_slice,
                    self.cfg.namespace,
                    label_selector=self.cfg.selector,
                    resource_version=lst.metadata.resource_version,
                    timeout_seconds=60,
                ):
                    if self._stop.is_set():
                        w.stop()
                        break
                    obj = to_dict(ev["object"])
                    name = obj["metadata"]["name"]
                    with self._lock:
                        if ev["type"] == "DELETED":
                            self._slices.pop(name, None)
                        else:
                            self._slices[name] = obj
                    self._publish()
            except Exception as e:  # a broken watch is re-listed, never fatal
                log.warning("EndpointSlice watch restarting: %s", e)
                self._stop.wait(1.0)
