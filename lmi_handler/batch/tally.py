"""The progress count of a Ray batch (cluster.py): lines done per running shard, as the replicas report them.

Its own module, importing nothing: its Ray actor's process loads only this (not torch and the engine).
"""


class Tally:
    """Lines done per running shard, reported by the replicas, read by the driver's progress bar."""

    def __init__(self):
        self.done: dict[str, int] = {}

    def report(self, shard_name: str, num_lines: int) -> None:
        self.done[shard_name] = num_lines

    def counts(self) -> dict[str, int]:
        return dict(self.done)
