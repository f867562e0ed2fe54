"""Where a run's metrics go: console, metrics.jsonl, trace.json, TensorBoard, wandb, behind one
protocol (base.py).

Importing this package loads nothing heavy: their schema is pipetrain/config/logs.py (pure;
the CLI composes it without torch), and wandb is imported only when `logger=[..., wandb]`
asks for it.
"""
