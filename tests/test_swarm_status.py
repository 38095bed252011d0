"""`pnyx status` shows swarm nodes from their heartbeats: version, local and foreign groups used, peers."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch
from swarm_support import open_test_node, swarm_cfg

from pnyx.store import open_store

torch.set_num_threads(1)
REPO = Path(__file__).resolve().parents[1]


def test_status_command_shows_swarm_nodes(tmp_path):
    from pnyx_harness.models import make_tiny_model_dir

    model = make_tiny_model_dir(tmp_path / "model", vocab=512, seed=0)
    url = str(tmp_path / "swarm")
    store = open_store(url)
    a = open_test_node(store, "alice", swarm_cfg(), model)
    b = open_test_node(store, "bob", swarm_cfg(), model)
    for _ in range(3):
        a.round()
        b.round()
    out = subprocess.run(
        [sys.executable, "-m", "pnyx", "status", "--store", url],
        cwd=REPO, capture_output=True, text=True, timeout=120, env=dict(os.environ, COLUMNS="200"),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "swarm nodes (2)" in text and "waiting for the trainer" not in text
    rows = [[c.strip() for c in line.strip("│ ").split("│")] for line in text.splitlines() if "│" in line]
    for node, peer in ((a, "bob"), (b, "alice")):
        cells = next(r for r in rows if r[0] == node.name)
        assert cells[:7] == [
            node.name, "running", str(node.version), "3", str(node.local_trained), str(node.external_trained),
            f"{node.last_reward:.3f}",
        ]  # fmt: skip
        assert cells[7] == f"{peer} (1 seen)"
    assert b.external_trained >= 1  # the column is not trivially zero


def test_run_view_is_unchanged_without_swarm_nodes(tmp_path):
    from pnyx.cli.status_swarm import with_swarm

    view = object()
    assert with_swarm(view, open_store(str(tmp_path / "run")), None) is view
