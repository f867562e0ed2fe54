"""Step metrics: what each rank measured (records.py) and what rank 0 makes of it (measure.py)."""
