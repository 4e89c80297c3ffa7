"""Which Python-backend stub died: the supervisor's answer to upstream defect `dead-stub`.

Upstream: server #8604; python_backend #423, core #461, #473 (defects.py: first release with the fix).
Symptom: Triton does not restart a Python-backend stub that died: its model fails every request with HTTP
500 / gRPC INTERNAL "Stub process '<instance>' is not healthy.", and before the fix it even stays READY,
so no health endpoint shows it. Reloading the model through the model-control API (2.51) leaves the dead
instance unloadable, blocking shutdown until the exit timeout.
What the kit does: the supervisor follows every stub process (one per model instance) and restarts the
whole server when one is gone that no swap accounts for (`StubWatch.dead`).
Reproduced by: tests/test_reliability_faults.py (a stub SIGKILLed: the model still READY, every request
failing; under `serve`, restarted within seconds).
"""
from __future__ import annotations

import re
from typing import Callable

from resnet18_kit.observe.processes import process_alive


class StubWatch:
    """The stubs of one server, read by `stub_pids` (() -> [(instance name, pid)], e.g.
    EmbeddedTritonServer.stub_pids) at each check. served_config: model -> the config it serves now (an
    object with `instance_group`), or None when unknown; given only where swaps can replace stubs (model
    control on). on_change: called after a check that found other stubs (the supervisor reads the configs
    serving then)."""

    def __init__(self, stub_pids: Callable[[], list[tuple[str, int]]],
                 served_config: Callable[[str], object | None] | None = None,
                 on_change: Callable[[], None] = lambda: None):
        self._stub_pids, self._served_config, self._on_change = stub_pids, served_config, on_change
        #: pid -> instance name of the stubs last seen, and the check round each pid was first seen in.
        self.stubs: dict[int, str] = {}
        self._first_seen: dict[int, int] = {}
        self._round = 0

    @property
    def instances(self) -> set[str]:
        """The instance names of the stubs last seen."""
        return set(self.stubs.values())

    def follow(self) -> bool:
        """Read the stubs now running (and note when each pid was first seen); True when they changed."""
        self._round += 1
        current = {pid: name for name, pid in self._stub_pids()}
        # A SIGKILLed stub leaves the listing (its argv is gone) a moment before it is a zombie: one that left
        # but has not finished exiting stays followed, so that its death shows at a later check.
        current.update({pid: name for pid, name in self.stubs.items() if pid not in current and process_alive(pid)})
        self._first_seen = {pid: self._first_seen.get(pid, self._round) for pid in current}  # only live pids
        changed = set(current) != set(self.stubs)
        self.stubs = current
        if changed:
            self._on_change()
        return changed

    def dead(self) -> str | None:
        """Why the server must restart when a stub is gone that no swap accounts for, else None.

        A swap (model_control) starts the new config's stubs beside the old ones and the old ones exit once
        it serves, seconds later (the load, the warm-up and the ensemble's reload lie between). So a stub
        that is gone is a swap's when another stub of the same instance name was already running at an
        earlier check, or when the config now serving has no such instance; otherwise it died."""
        before = dict(self.stubs)
        if not self.follow():
            return None
        for pid, name in before.items():
            if pid in self.stubs or self._replaced(pid, name):
                continue
            return f"Python-backend stub of instance '{name}' (pid {pid}) died"
        return None

    def _replaced(self, pid: int, name: str) -> bool:
        """True when the stub `pid` of instance `name` left because a swap replaced or dropped it."""
        if any(other != pid and other_name == name and self._first_seen[other] < self._round
               for other, other_name in self.stubs.items()):
            return True
        return self._served_config is not None and not self._instance_served(name)

    def _instance_served(self, name: str) -> bool:
        """True when the config its model serves now has instance `name` (or it cannot tell)."""
        model = re.sub(r"_\d+_\d+$", "", name)  # "<model>_<group>_<instance>", Triton's default names
        config = self._served_config(model)
        if config is None:
            return True
        groups = [(group.name or f"{model}_{i}", group.count) for i, group in enumerate(config.instance_group)]
        return any(name == f"{group}_{j}" for group, count in groups for j in range(count))
