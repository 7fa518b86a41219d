"""Per-process GPU usage and its attribution to fractions.

The reporter and the audit need the same picture every interval: which host processes run on which
GPU, how much memory and SM time each uses, and which fraction (pod container) each belongs to. The
picture is built in three steps that each have their own module: a backend reads processes per GPU
(``backend`` for the seam, ``nvml`` REAL, ``simulated`` SIMULATED), ``cgroup`` maps a host PID to its
container id, and ``collect`` joins both with the node's allocation records into one snapshot.
"""
