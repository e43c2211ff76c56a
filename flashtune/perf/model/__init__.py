"""The labelled cost model: PREDICTED time of a forward call on a named GPU, and what it
rests on.

``costmodel`` (``predict``, ``rank``) charges a K/V tile per warp and sub-partition, then
schedules the grid; the architecture-specific part of a prediction is one strategy object
(``paths``: the portable mma.sync path, and ``wgmma``: the sm_90a path with its stated,
uncalibrated assumptions), chosen once from the family's declared target arch.
``algorithm`` has the algorithm's own counts and traffic, ``loopcost`` what the executed
main loops cost per tile, ``occupancy`` resident blocks, ``grid`` when a grid's last
block ends, ``gpus`` the datasheet table, ``params`` the model's free parameters and
version, ``calibrate`` / ``correlate`` its fit to and agreement with measurements,
``baselines`` the published FlashAttention figures, ``emulated`` counters from the CPU
emulator, ``default_rule`` the rule that picks the forward's default configs and ``decode``
split-KV decoding's bandwidth- and launch-bound model.

Every time this package returns is a PREDICTION, labelled as such; measurements come only
from a GPU.
"""
