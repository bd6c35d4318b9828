"""A real node's containerd and CNI configuration files, rendered from its names and paths."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from dsv4_devcluster.realnodes.node import POD_NET, RealNode
from dsv4_devcluster.realnodes.preflight import CNI_BIN_DIR

PAUSE_IMAGE = "dsv4.local/pause:3.10"


def cni_config(node: RealNode, ipam_dir: Path) -> str:
    gateway = f"{POD_NET}.{node.index}.1"
    return json.dumps(
        {
            "cniVersion": "0.4.0",
            "name": f"dsv4-{node.name}",
            "plugins": [
                {
                    "type": "bridge",
                    "bridge": node.cni_bridge,
                    "isGateway": True,
                    "ipMasq": False,
                    "hairpinMode": True,
                    "ipam": {
                        "type": "host-local",
                        "ranges": [[{"subnet": node.pod_subnet, "gateway": gateway}]],
                        "routes": [{"dst": "0.0.0.0/0"}],
                        "dataDir": str(ipam_dir),
                    },
                },
                {"type": "portmap", "capabilities": {"portMappings": True}},
            ],
        },
        indent=1,
    )


def containerd_config(node: RealNode, cni_conf: Path) -> str:
    c = node.dir / "containerd"
    cri = 'plugins."io.containerd.grpc.v1.cri"'
    return f"""version = 2
root = "{node.root}"
state = "{c / "state"}"
disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs",
  "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.aufs"]
[grpc]
  address = "{node.socket}"
[ttrpc]
  address = "{node.socket}.ttrpc"
[debug]
  address = "{c / "debug.sock"}"
[metrics]
  address = ""
[{cri}]
  sandbox_image = "{PAUSE_IMAGE}"
  enable_selinux = false
  # network namespaces under our state dir, not /var/run/netns
  netns_mounts_under_state_dir = true
  # without CAP_SYS_RESOURCE nobody may lower oom_score_adj: clamp to containerd's own
  restrict_oom_score_adj = true
  max_container_log_line_size = 16384
  [{cri}.containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [{cri}.containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [{cri}.containerd.runtimes.runc.options]
        BinaryName = "{shutil.which("runc") or "runc"}"
        SystemdCgroup = false
  [{cri}.cni]
    bin_dir = "{CNI_BIN_DIR}"
    conf_dir = "{cni_conf}"
    max_conf_num = 1
  [{cri}.registry]
    config_path = ""
"""
