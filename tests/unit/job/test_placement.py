"""Where a job's tables go: the planners' topology (`distcache.job.placement`)."""

import torch

from distcache.job.config import load_job_config
from distcache.job.placement import torchrec_job_topology
from distcache.planner.topology import preset
from distcache.planner.torchrec.planner import torchrec_topology

CPU = torch.device("cpu")


def test_torchrec_plans_for_the_configured_topology():
    config = load_job_config(None, ["--plan.planner=torchrec", "--plan.topology=cpu"])
    ours = torchrec_job_topology(config, 2, CPU)
    expected = torchrec_topology(preset("cpu", world_size=2))
    assert ours.world_size == 2
    assert [d.storage for d in ours.devices] == [d.storage for d in expected.devices]
    unset = load_job_config(None, ["--plan.planner=torchrec"])
    default = torchrec_job_topology(unset, 2, CPU)  # TorchRec's own
    assert [d.storage for d in default.devices] != [d.storage for d in ours.devices]
