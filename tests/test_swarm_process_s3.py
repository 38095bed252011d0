"""A swarm of 3 real `pnyx swarm` processes on the S3 server (moto, loopback): every node's version advances.

Same processes and checks as `test_swarm_process.py` (whose helpers and fixture this file reuses), in a
separate file so that each file stays well inside the per-file time budget on a loaded machine.
"""

from __future__ import annotations

import pytest
from swarm_support import check_swarm, make_swarm_env, run_swarm


@pytest.fixture(scope="module")
def swarm_env(tmp_path_factory):
    return make_swarm_env(tmp_path_factory)


@pytest.mark.slow
@pytest.mark.s3
def test_three_process_swarm_on_s3(swarm_env, s3_url):
    model, env = swarm_env
    check_swarm(s3_url, run_swarm(s3_url, model, env))
