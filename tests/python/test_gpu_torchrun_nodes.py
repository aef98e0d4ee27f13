"""Processes started by torchrun as two nodes of two ranks on one GPU (two agents, --nnodes 2,
one --node-rank each, a static rendezvous at 127.0.0.1) build an NcclWorld from their
torch.distributed group, and every backend passes against the reference across the nodes
(torchrun_node_rank.py says what each rank checks)."""

import os
import socket
import subprocess
import sys

import epx

HERE = os.path.dirname(os.path.abspath(__file__))
NODES, LOCAL = 2, 2


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_torchrun_nodes_of_two_build_their_world_from_the_group(gpu):
    package = os.path.dirname(os.path.dirname(os.path.abspath(epx.__file__)))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (HERE, package, env.get("PYTHONPATH", "")) if p)
    port = _free_port()
    agents = [
        subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(NODES),
             "--node-rank", str(node), "--nproc-per-node", str(LOCAL), "--master-addr",
             "127.0.0.1", "--master-port", str(port), "--max-restarts", "0",
             os.path.join(HERE, "torchrun_node_rank.py")],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        for node in range(NODES)]
    outs = []
    for p in agents:
        try:
            outs.append(p.communicate(timeout=300)[0])
        except subprocess.TimeoutExpired:
            for q in agents:
                q.kill()
            outs.append(p.communicate()[0])
    text = "\n".join(outs)
    assert [p.returncode for p in agents] == [0] * NODES, text
    for rank in range(NODES * LOCAL):
        assert f"torchrun_nodes: rank {rank} of {NODES * LOCAL} on node {rank // LOCAL} of " \
               f"{NODES}: 13 checks PASS" in text, text
