"""How long the runner's steps take: the prefill chunk a step may take (`chunking.py`) and the
pace the engine tells the hang watchdog (`pace.py`). Pure policy."""
