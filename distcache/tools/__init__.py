"""What measures machines and compares plans, beside the training job: `calibrate` (with its
timed kernels in `microbench`, `densebench`, `network` and `framework_costs`), `measure` (plans
run for real), `compare` (plans side by side) and `plan_cli` (`python -m distcache plan` and
`compare`). The top layer with `distcache.job`, whose pieces they use; nothing in the package
below them imports them."""
