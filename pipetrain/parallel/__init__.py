"""The parallel layout: how the world's ranks split into pipeline and data-parallel groups.

layout.py is pure (no torch): degrees, rank <-> (pp, dp_replicate, dp_shard) coordinates,
the rank rows; table.py (pure, rich) prints them. mesh.py builds the one DeviceMesh from a
Layout. dp.py and fsdp.py make a rank's stages data parallel and give the executor its
reducer (own bucketed all-reduce in runtime/grad_reduce.py, or FSDP2's reduce-scatter).
"""
