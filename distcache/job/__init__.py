"""The training job and the tools that train models: config, placement, trainer, checkpoints,
the DLRM builder, the rank launcher, and the planner's measuring tools (measure, calibrate,
compare). The top layer: it may import every other one."""
