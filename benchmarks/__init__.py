"""loraserve's benchmarks (`python -m benchmarks.NAME`). Importing the package records the run's start
for the measurement rules (`measure.py`): the load average before anything runs, and `--allow-busy`."""

from benchmarks import measure

measure.start()
