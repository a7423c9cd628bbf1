"""The training job: config, placement (the model and its plan), trainer, checkpoints, the
DLRM builder, the batches' checks, process groups and the rank launcher, and the demo. The
tools that measure machines and compare plans live beside it, in `distcache.tools`; the job
imports none of them."""
