"""One two-node Ray cluster on loopback for the whole test session (tests/cluster/).

Both nodes are processes of this machine (``ray.cluster_utils.Cluster``), each with its own
raylet and object store, so actors on them talk over the network stack as on two hosts.
``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` keeps every Ray server on 127.0.0.1 (advertised and
bound; see agentgym/cluster/ray_runtime.py): no test sends traffic to any other address.
Each node offers 3 logical CPUs (the machine has 2 cores: the tests' actors are mostly idle) and
a resource naming it, ``agentgym_node0`` / ``agentgym_node1``, to pin actors in tests.
"""

from __future__ import annotations

import os

# before anything imports ray (the test modules do): Ray reads the switch once, at import
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"

import pytest  # noqa: E402

from agentgym.cluster.ray_runtime import pin_to_loopback  # noqa: E402

NODE_CPUS = 3


@pytest.fixture(scope="session")
def ray_cluster():
    """The shared cluster, with this process connected as its driver."""
    pin_to_loopback()
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": NODE_CPUS, "resources": {"agentgym_node0": 1}, "include_dashboard": False,
        "node_ip_address": "127.0.0.1"})
    cluster.add_node(num_cpus=NODE_CPUS, resources={"agentgym_node1": 1}, node_ip_address="127.0.0.1")
    ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
    cluster.wait_for_nodes()
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


@pytest.fixture
def ray_address(ray_cluster) -> str:
    """The shared cluster's address, for ``ray.address`` in a config."""
    return ray_cluster.address
