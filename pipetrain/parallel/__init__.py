"""The parallel layout: how the world's ranks split into pipeline and data-parallel groups.

layout.py is pure (no torch): degrees, rank <-> (pp, dp_replicate, dp_shard) coordinates,
the rank table. mesh.py builds the one DeviceMesh from a Layout. reduce.py reduces a stage's
gradients over its data-parallel group (own bucketed all-reduce, or FSDP2's reduce-scatter).
"""
